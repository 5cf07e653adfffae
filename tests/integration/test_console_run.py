"""What a user sees from `raytrain run`: the CLI as a subprocess, once without a terminal (the whole demo: Spark
enrichment, packing, training) and once under a pseudo-terminal (the same run resumed for two more steps, which
skips the data stages). The console holds raytrain's stage lines and the Ray dashboard URL and none of the
frameworks' noise; the run's reports/logs/ file holds that noise; the charts are PNGs.

The run without a terminal is the session's shared demo run (tests/demo_run.py; about 4-5 minutes on a 2-core
machine), whose data other modules read too."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
from demo_run import REPO, STEPS
from pty_console import run_in_pty

MORE_STEPS = STEPS + 2

# Lines that reached the console before raytrain.console (issue 17), by the program that writes them.
NOISE = {
    "Ray Train's placement-group cleaner": r"PlacementGroupCleaner|State API may be temporarily unavailable",
    "Spark / log4j": r"WARN Utils|NativeCodeLoader|StatusConsoleListener|WARN SparkStringUtils|log4j",
    "Spark's progress bar": r"\[Stage \d+",
    "Ray core (C++)": r"gcs_client\.cc|core_worker\.cc|raylet\.cc",
    "py4j": r"py4j",
    "Ray Data": r"streaming_executor|logging_progress|ListFiles|Execution plan",
    "DeepSpeed": r"\[(WARNING|INFO)\] +\[\w+\.py|ds_accelerator|real_accelerator",
    "tracebacks": r"Traceback|InterruptedError",
    "Ray's own banner": r"Started a local Ray instance|worker\.py:\d+",
}
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@pytest.fixture(scope="module")
def plain(demo_run):
    """The demo without a terminal (as under a pipe or `ray job submit`): the session's shared run."""
    return demo_run


@pytest.fixture(scope="module")
def terminal(plain):
    """The same run resumed for two more steps under a pseudo-terminal."""
    out = plain.process
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    t0 = time.monotonic()
    code, text = run_in_pty(plain.command(f"train.max_steps={MORE_STEPS}"), env=plain.env(), cwd=REPO,
                            timeout_s=1200)
    print(f"resumed run under a terminal: {time.monotonic() - t0:.0f}s, {len(text.splitlines())} console lines")
    return code, text


def _log_path(console_text: str) -> str:
    m = re.search(r"framework output \(Spark, Ray, DeepSpeed\) -> (\S+\.log)", console_text)
    assert m, console_text[:2000]
    return m.group(1)


def _assert_no_noise(text: str) -> None:
    for what, pattern in NOISE.items():
        found = re.search(pattern, text)
        assert found is None, f"{what} on the console: {text[max(0, found.start() - 300):found.end() + 300]}"


def test_console_tells_the_stages_without_a_terminal(plain):
    text = plain.process.stdout + plain.process.stderr
    assert plain.process.returncode == 0, text[-4000:]
    assert "\x1b" not in text and "\r" not in text, "control characters on a console that is not a terminal"
    assert re.search(r"raytrain: Ray dashboard: http://127\.0\.0\.1:\d+", text), text[:3000]
    assert "raytrain: starting Spark on Ray" in text
    for step in ("derive", "license", "exact_dedup", "near_dedup", "decontaminate", "select_context",
                 "tokenize_check"):
        assert re.search(rf"raytrain: enrich step {step} +\d+ in -> +\d+ kept, \d+ quarantined", text), step
    assert re.search(r"raytrain: enrich: \d+ rows in -> \d+ kept, \d+ quarantined .* summary in ", text)
    assert re.search(r"raytrain: dataset: \d+ conversations -> \d+ packed sequences", text)
    steps = [int(s) for s in re.findall(rf"\[raytrain\] step (\d+)/{STEPS} loss [0-9.]+ lr .* tok/s .* eta", text)]
    assert sorted(set(steps)) == list(range(1, STEPS + 1)), text[-3000:]
    assert re.search(rf"\[raytrain\] step {STEPS}/{STEPS} validation loss [0-9.]+", text)
    assert f"[raytrain] checkpoint step {STEPS} -> " in text
    assert re.search(rf"raytrain: trained to step {STEPS} \(loss [0-9.]+, validation loss [0-9.]+", text)
    assert "raytrain: charts in " in text
    _assert_no_noise(text)


def test_log_file_holds_what_the_console_does_not(plain):
    log_path = _log_path(plain.process.stdout)
    assert log_path.startswith(os.path.join(plain.run_dir, "reports", "logs") + os.sep)
    with open(log_path, encoding="utf-8", errors="replace") as f:
        log_text = ANSI.sub("", f.read())  # Ray colors its worker prefixes even in a file
    for what in ("py4j", "Spark / log4j", "Ray's own banner", "Ray Data"):
        assert re.search(NOISE[what], log_text), f"no {what} lines in {log_path}"
    # worker output: Ray forwards every line into the log; the [raytrain] ones also reached the console
    assert re.search(rf"\(RayTrainWorker pid=\d+\) .*\[raytrain\] step {STEPS}/{STEPS} loss", log_text)
    assert "enrich summary:" in log_text and "dedup ratio" in log_text  # the full summary: the log only
    assert "dedup ratio" not in plain.process.stdout


def test_session_records_dashboard_and_log(plain):
    with open(os.path.join(plain.run_dir, "reports", "session.json")) as f:
        session = json.load(f)
    assert session["log_file"] == _log_path(plain.process.stdout)
    assert f"Ray dashboard: {session['dashboard_url']}" in plain.process.stdout


def test_quick_start_ran_with_token_auth(plain):
    """raytrain wrote the token (0600, not Ray's umask default) and told where it is; the token itself is on
    neither the console nor the log file nor anywhere in the run's folder."""
    path = plain.token_path
    assert os.stat(path).st_mode & 0o777 == 0o600
    with open(path) as f:
        token = f.read().strip()
    assert len(token) >= 32
    assert f"(token authentication: paste the token `ray get-auth-token` prints, from {path})" in plain.process.stdout
    assert token not in plain.process.stdout + plain.process.stderr
    for folder, _, files in os.walk(plain.run_dir):
        for name in files:
            with open(os.path.join(folder, name), "rb") as f:
                assert token.encode() not in f.read(), os.path.join(folder, name)


def test_charts_and_status_of_the_run(plain):
    charts = os.path.join(plain.run_dir, "reports", "charts")
    assert sorted(os.listdir(charts)) == ["loss.png", "lr.png", "similarity.png", "token_lengths.png"]
    for name in os.listdir(charts):
        with open(os.path.join(charts, name), "rb") as f:
            data = f.read()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name
    out = subprocess.run([sys.executable, "-m", "raytrain.cli", "status", plain.run_dir], cwd=REPO,
                         env=plain.env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"training     step {STEPS}, loss" in out.stdout and "validation loss" in out.stdout
    assert "running      no" in out.stdout and "loss.png" in out.stdout and "logs " in out.stdout


def test_console_under_a_terminal(terminal):
    code, raw = terminal
    text = ANSI.sub("", raw).replace("\r\n", "\n")
    assert code == 0, text[-4000:]
    assert re.search(r"raytrain: Ray dashboard: http://127\.0\.0\.1:\d+", text), text[:3000]
    assert f"resumed from checkpoint step {STEPS}" in text
    steps = [int(s) for s in re.findall(rf"\[raytrain\] step (\d+)/{MORE_STEPS} loss [0-9.]+", text)]
    assert sorted(set(steps)) == list(range(STEPS + 1, MORE_STEPS + 1)), text[-3000:]
    assert re.search(rf"raytrain: trained to step {MORE_STEPS} \(loss", text)
    _assert_no_noise(text)
