"""Shared entrypoint plumbing for jobs/*.py (what `ray job submit` runs): parse, log the resolved config, run."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

# `ray job submit --working-dir .` ships the repo; make its raytrain/ importable even when not pip-installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(description: str, stage: Callable[..., Any], takes_failures: bool = True) -> int:
    from raytrain.config import load_job_config
    from raytrain.errors import ConfigError, RaytrainError

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", default="configs/demo.yaml", help="job YAML")
    if takes_failures:
        parser.add_argument("--max-failures", type=int, default=0, help="worker failures to recover from")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.max_steps=20")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="every program's output in the job log (default: Spark, Ray, DeepSpeed and the JVMs "
                             "write to the run's reports/logs/ file, raytrain's own lines to the job log)")
    args = parser.parse_args()
    from raytrain import console
    from raytrain.runner import command_log, finish_command_log

    console.configure_logging(args.verbose)
    try:
        job = load_job_config(args.config, args.overrides)
        logging.info("resolved config: %s", json.dumps(job.to_dict(), sort_keys=True))
        if args.verbose:
            result = _call(stage, job, args, takes_failures)
            print(json.dumps(result, indent=2, default=str) if isinstance(result, dict) else result)
            return 0
        log_path = command_log(job, os.path.splitext(os.path.basename(sys.argv[0]))[0])
        try:
            # `ray job submit` has no terminal: the console lines come plain (raytrain.console)
            with console.capture(log_path) as con:
                con.line(f"raytrain: framework output (Spark, Ray, DeepSpeed) -> {log_path} (--verbose shows it "
                         "here)")
                result = _call(stage, job, args, takes_failures)
                con.line(json.dumps(result, indent=2, default=str) if isinstance(result, dict) else str(result))
        finally:
            finish_command_log(job, log_path)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except RaytrainError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def _call(stage: Callable[..., Any], job: Any, args: argparse.Namespace, takes_failures: bool) -> Any:
    return stage(job, max_failures=args.max_failures) if takes_failures else stage(job)
