"""raytrain.console without Ray: a subprocess captures its output the way `raytrain run` does, and its console
(a pipe, or a pseudo-terminal) shows raytrain's lines only while the log file gets every other writer: Python
prints and loggers, warnings, C-level writes to descriptor 2, child processes."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

from pty_console import run_in_pty

from raytrain import console
from raytrain.console import WORKER_MARK, worker_console_lines

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = textwrap.dedent("""
    import logging, os, subprocess, sys, warnings
    from raytrain import console
    console.configure_logging(False)
    with console.capture(sys.argv[1]) as con:
        con.line("raytrain: framework output -> " + sys.argv[1])
        logging.getLogger("raytrain.runner").info("stage line one")
        logging.getLogger("raytrain.enrich.job").info("summary screens", extra={console.QUIET: False})
        logging.getLogger("raytrain.trainer").warning("a raytrain warning")
        logging.getLogger("py4j.clientserver").info("py4j noise")
        logging.getLogger("ray.data").warning("ray data noise")
        print("python print noise")
        os.write(2, b"fd2 noise gcs_client.cc\\n")
        subprocess.run(["sh", "-c", "echo child process noise >&2; echo child stdout noise"], check=True)
        warnings.warn("library warning noise")
        console._print_worker_lines({"pid": 42, "actor_name": "RayTrainWorker", "is_err": False,
                                     "lines": ["[raytrain] step 1/2 loss 10.0", "DeepSpeed info noise"]})
    print("after capture")
""")

NOISE = ("py4j noise", "ray data noise", "python print noise", "fd2 noise", "child process noise",
         "child stdout noise", "library warning noise", "summary screens")


def _run(tmp_path, use_pty: bool) -> tuple[str, str]:
    log_path = str(tmp_path / "logs" / "run.log")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    args = [sys.executable, "-c", SCRIPT, log_path]
    if not use_pty:
        out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        console_text = out.stdout + out.stderr
    else:
        code, console_text = run_in_pty(args, env=env, timeout_s=120)
        assert code == 0, console_text
    with open(log_path, encoding="utf-8") as f:
        return console_text, f.read()


def _check(console_text: str, log_text: str, log_path_in_console: bool = True) -> None:
    assert "stage line one" in console_text
    assert "a raytrain warning" in console_text
    assert "(RayTrainWorker pid=42) [raytrain] step 1/2 loss 10.0" in console_text
    assert "after capture" in console_text
    for noise in NOISE:
        assert noise not in console_text, noise
        assert noise in log_text, noise
    # Ray's own handler writes every forwarded worker line to the log file; ours drops the unmarked ones
    assert "DeepSpeed info noise" not in console_text
    assert "stage line one" in log_text  # raytrain's records are in the log file as well
    if log_path_in_console:
        assert "run.log" in console_text


def test_capture_without_a_terminal_prints_plain_lines(tmp_path):
    console_text, log_text = _run(tmp_path, use_pty=False)
    _check(console_text, log_text)
    assert "\x1b" not in console_text and "\r" not in console_text


def test_capture_under_a_terminal(tmp_path):
    console_text, log_text = _run(tmp_path, use_pty=True)
    _check(console_text.replace("\r\n", "\n"), log_text)
    assert "\x1b[" in console_text  # rich styles the warning on a terminal


def test_worker_console_lines_keep_only_raytrain_lines():
    data = {"pid": 7, "actor_name": "RayTrainWorker", "lines": [f"{WORKER_MARK} step 3/10 loss 9.1", "[2026] noise"]}
    assert worker_console_lines(data) == [f"(RayTrainWorker pid=7) {WORKER_MARK} step 3/10 loss 9.1"]
    assert worker_console_lines({"pid": 8, "task_name": "read", "lines": ["x"]}) == []
    assert worker_console_lines({"pid": 9, "lines": [f"{WORKER_MARK} a"]}) == [f"(pid=9) {WORKER_MARK} a"]


def test_configure_logging_leaves_an_embedding_process_handlers_alone(caplog):
    """In a process that already logs (pytest, a notebook, a service calling cli.main) configure_logging adds its
    console handler to raytrain's logger and does not filter the root handlers it finds: an in-process `main()` once
    hid every later raytrain record from pytest's caplog."""
    ours = logging.getLogger("raytrain")
    before = (ours.level, list(ours.handlers))
    try:
        console.configure_logging(False)
        with caplog.at_level(logging.WARNING):
            logging.getLogger("raytrain.storage").warning("still seen by the host's handlers")
        assert "still seen by the host's handlers" in caplog.text
        assert all(not f for f in (h.filters for h in logging.getLogger().handlers))
    finally:
        for h in list(ours.handlers):
            if h not in before[1]:
                ours.removeHandler(h)
        ours.setLevel(before[0])
