"""The `raytrain` command line as a user runs it: a subprocess of `python -m raytrain.cli`, exit codes 0 (ok),
1 (failed) and 2 (bad usage or config), messages without tracebacks, and the `status` table. No Ray is started:
every failing case here must fail in preflight, before any cluster work."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
from cli_runs import cli, commit_checkpoint

from raytrain.checkpoint.store import CheckpointStore
from raytrain.runlock import RunLock
from raytrain.storage import resolve

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMMANDS = ("run", "enrich", "train", "export", "status")


def assert_no_ray_and_no_traceback(out: subprocess.CompletedProcess) -> None:
    text = out.stdout + out.stderr
    assert "Traceback" not in text, text
    # runner.connect_ray logs one of these before ray.init: preflight must have stopped the command earlier
    assert "embedded local Ray" not in text and "joining Ray cluster" not in text, text


@pytest.mark.parametrize("args", [("--help",), *((c, "--help") for c in COMMANDS)], ids=lambda a: " ".join(a))
def test_help_exits_0(args):
    out = cli(*args)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: raytrain")
    if args[0] != "--help":
        assert f"usage: raytrain {args[0]}" in out.stdout
    else:
        assert all(c in out.stdout for c in COMMANDS)
        assert "exit codes" in out.stdout


def test_no_command_is_usage_error():
    out = cli()
    assert out.returncode == 2
    assert "COMMAND is required" in out.stderr


def test_unknown_command_is_usage_error():
    out = cli("fly")
    assert out.returncode == 2
    assert "invalid choice: 'fly'" in out.stderr


def test_unknown_config_key_exits_2_naming_the_key(tmp_path):
    out = cli("run", "configs/demo.yaml", "train.max_step=3", f"storage.root={tmp_path}")
    assert out.returncode == 2, out.stdout + out.stderr
    assert "unknown config key 'train.max_step'" in out.stderr
    assert "Did you mean train.max_steps?" in out.stderr
    assert_no_ray_and_no_traceback(out)


@pytest.mark.parametrize("front", [("-m", "raytrain.cli", "train"), ("jobs/train.py",)], ids=("cli", "job"))
def test_config_option_spelling_and_job_scripts_share_the_cli_error_path(front, tmp_path):
    """`--config PATH` (the jobs/*.py spelling) reads the same YAML as the first argument, and a job script ends
    through the CLI's handlers: a config error is exit code 2 with its one-line message."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", RAY_AUTH_MODE="disabled")
    env.pop("RAY_ADDRESS", None)
    out = subprocess.run([sys.executable, *front, "--config", "configs/demo.yaml", "train.max_step=3",
                          f"storage.root={tmp_path}"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "raytrain: config error: unknown config key 'train.max_step'" in out.stderr
    assert_no_ray_and_no_traceback(out)


@pytest.mark.parametrize("args,message", [
    (("run", "--max-failures", "-1"), "argument --max-failures: -1: give a whole number >= 0; -1 (Ray's 'retry "
                                      "forever') is not accepted"),
    (("train", "--max-failures", "-5"), "argument --max-failures: -5: give a whole number >= 0"),
    (("run", "--max-failures", "2.5"), "argument --max-failures: expected a whole number in decimal digits"),
    (("run", "storage.run_name=.hidden"), "config error: storage.run_name: '.hidden' is not a valid name"),
    (("train", "train.lr=nan"), "config error: train.lr: must be a finite number, got 'nan'"),
], ids=("max-failures -1", "max-failures -5", "max-failures 2.5", "hidden run name", "lr nan"))
def test_out_of_range_flags_and_values_exit_2_before_starting_ray(args, message, tmp_path):
    out = cli(*args, f"storage.root={tmp_path}")
    assert out.returncode == 2, out.stdout + out.stderr
    assert message in out.stderr
    assert_no_ray_and_no_traceback(out)


def test_config_given_twice_is_a_config_error(tmp_path):
    out = cli("train", "--config", "configs/demo.yaml", "configs/demo.yaml", f"storage.root={tmp_path}")
    assert out.returncode == 2, out.stdout + out.stderr
    assert "two job configs" in out.stderr


def test_more_stages_than_decoder_layers_exits_2_before_starting_ray(tmp_path):
    """The tiny preset has 2 decoder layers: train.pp=3 is refused in preflight by the rule the workers'
    build_pipeline_module applies (not at L + 3 pipeline layers, after Ray has started)."""
    out = cli("train", "configs/demo.yaml", "model.preset=tiny", "train.pp=3", f"storage.root={tmp_path}")
    assert out.returncode == 2, out.stdout + out.stderr
    assert "num_stages (3) is larger than num_hidden_layers (2)" in out.stderr and "(train.pp)" in out.stderr
    assert_no_ray_and_no_traceback(out)


def test_missing_input_path_exits_1_before_starting_ray(tmp_path):
    missing = tmp_path / "no-such-dataset"
    root = tmp_path / "runs"
    out = cli("run", "configs/demo.yaml", f"input.path={missing}", f"storage.root={root}", "storage.user=ci")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "input.path" in out.stderr and str(missing) in out.stderr
    assert_no_ray_and_no_traceback(out)
    assert not (root / "ci").exists(), "the run folder was created: the command got past preflight"


def test_input_folder_without_dataset_files_exits_1_before_starting_ray(tmp_path):
    """A folder that holds none of the accepted layouts: the error names what it found and the layouts it takes,
    before Ray or Spark start."""
    folder = tmp_path / "downloads"
    (folder / "data").mkdir(parents=True)
    (folder / "README.md").write_text("not data")
    (folder / "data" / "train-00000-of-00001.parquet").write_bytes(b"PAR1")
    root = tmp_path / "runs"
    out = cli("run", "configs/demo.yaml", f"input.path={folder}", f"storage.root={root}", "storage.user=ci")
    assert out.returncode == 1, out.stdout + out.stderr
    assert str(folder) in out.stderr and "README.md" in out.stderr and "train-00000-of-00001.parquet" in out.stderr
    assert "Accepted layouts" in out.stderr and "tool" in out.stderr
    assert_no_ray_and_no_traceback(out)
    assert not (root / "ci").exists(), "the run folder was created: the command got past preflight"


def test_corpus_without_its_text_field_exits_1_before_starting_ray(tmp_path):
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text(json.dumps({"id": "d1", "body": "A sentence about leases."}) + "\n")
    root = tmp_path / "runs"
    out = cli("run", "configs/demo.yaml", f"enrich.context_corpus=[{corpus}]", f"storage.root={root}",
              "storage.user=ci")
    assert out.returncode == 1, out.stdout + out.stderr
    assert str(corpus) in out.stderr and "['text'] missing" in out.stderr and "enrich.corpus_text_field" in out.stderr
    assert_no_ray_and_no_traceback(out)


def test_ds_config_batch_mismatch_exits_2(tmp_path):
    with open(os.path.join(REPO, "configs", "ds_config.json")) as f:
        ds = json.load(f)
    ds["train_micro_batch_size_per_gpu"] = 4
    ds_path = tmp_path / "ds_config.json"
    ds_path.write_text(json.dumps(ds))
    out = cli("train", "configs/demo.yaml", "train.micro_batch_size=2", f"train.ds_config={ds_path}",
              f"storage.root={tmp_path / 'runs'}")
    assert out.returncode == 2, out.stdout + out.stderr
    assert "train_micro_batch_size_per_gpu = 4 disagrees with train.micro_batch_size = 2" in out.stderr
    assert_no_ray_and_no_traceback(out)


def test_export_without_checkpoint_exits_1(tmp_path):
    out = cli("export", "configs/demo.yaml", f"storage.root={tmp_path}", "storage.user=ci")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "no committed checkpoint" in out.stderr
    assert_no_ray_and_no_traceback(out)


# ---------------------------------------------------------------------------------------------------------------------
# status


def table_rows(stdout: str) -> dict[str, list[str]]:
    """rich's box table -> {run name: cells}; the header row is keyed 'run'."""
    rows = {}
    for line in stdout.splitlines():
        line = line.replace("┃", "│")  # the header row uses heavy bars
        if line.count("│") >= 2:
            cells = [c.strip() for c in line.strip().strip("│").split("│")]
            rows[cells[2]] = cells
    return rows


def test_status_lists_runs_with_their_checkpoints(tmp_path):
    root = tmp_path / "runs"
    commit_checkpoint(root / "ci" / "demo" / "run-a", 3, 2.5)
    commit_checkpoint(root / "ci" / "demo" / "run-a", 6, 1.25)
    (root / "ci" / "demo" / "run-b" / "data" / "packed").mkdir(parents=True)  # packed data, no checkpoint yet
    (root / "ci" / "demo" / "notes").mkdir()  # neither data/ nor checkpoints/: not a run
    commit_checkpoint(root / "bob" / "other" / "run-c", 1, 9.0)
    store_a = CheckpointStore(resolve(str(root / "ci" / "demo" / "run-a")))
    saved_at = store_a.latest().manifest["created_at"]

    lock = RunLock(resolve(str(root / "bob" / "other" / "run-c")), heartbeat_interval_s=None)
    with lock:  # a job holding run-c
        out = cli("status", "--root", str(root))
    assert out.returncode == 0, out.stderr
    rows = table_rows(out.stdout)
    assert rows["run"] == ["user", "project", "run", "latest step", "checkpoints", "loss", "saved at",
                           "running (host:pid)"]
    assert set(rows) == {"run", "run-a", "run-b", "run-c"}, out.stdout
    assert rows["run-a"] == ["ci", "demo", "run-a", "6", "2", "1.2500", saved_at, "-"]
    assert rows["run-b"] == ["ci", "demo", "run-b", "-", "0", "-", "-", "-"]
    assert rows["run-c"][:6] == ["bob", "other", "run-c", "1", "1", "9.0000"]
    assert rows["run-c"][7] == f"{socket.gethostname()}:{os.getpid()}"


def test_status_of_empty_root_says_so(tmp_path):
    out = cli("status", "--root", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "no runs under" in out.stdout


def test_status_of_missing_root_exits_1(tmp_path):
    out = cli("status", "--root", str(tmp_path / "typo"))
    assert out.returncode == 1
    assert "does not exist" in out.stderr and "typo" in out.stderr
    assert "Traceback" not in out.stderr


def test_status_of_a_run_counts_its_committed_waves(tmp_path):
    from raytrain.status import run_summary_lines

    waves = tmp_path / "run" / "data" / "waves"
    waves.mkdir(parents=True)
    for i, (rows_in, kept) in enumerate(((64, 50), (32, 30))):
        (waves / f"wave-{i:05d}.json").write_text(json.dumps({"rows_in": rows_in, "kept": kept,
                                                              "quarantined": rows_in - kept}))
    (waves / "dedup").mkdir()
    lines = run_summary_lines(str(tmp_path / "run"))
    assert "  waves        2 enriched and committed: 96 rows in -> 80 kept, 16 quarantined" in lines, lines
