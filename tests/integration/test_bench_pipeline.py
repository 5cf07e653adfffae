"""benchmarks/bench_pipeline.py keeps running (a benchmark nobody can start is a defect too): both modes, shrunk to
a few small steps, in a subprocess with its own embedded Ray. The figures themselves are not asserted (they are
timings); what is asserted is what must hold whatever the machine: the feeds give the same losses, pp=2's first
loss equals pp=1's bit for bit (same seed, weights and batch), and every ratio line is printed."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["--steps", "2", "--warmup", "1", "--grad-accum", "2", "--seq-len", "64", "--quiet-timeout", "3"]


def _run(*args: str) -> str:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_pipeline.py"), *SMALL, *args],
                          capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_interleaved_mode_steps_every_contender_and_prints_the_ratios():
    out = _run("--interleaved")
    for name in ("pp1-1thread", "pp2-memory", "pp2-raydata", "pp1-pair"):
        assert len(re.findall(rf"{name} \d+\.\d+s", out)) == 2, out  # one line per timed step
    assert "pp=2 over pp1-1thread: median of per-step ratios" in out
    assert "pp=2 over pp1-pair: median of per-step ratios" in out
    assert re.search(r"Ray Data feed over in-memory feed \(pp=2\): .*same losses: True", out), out
    assert "abs difference 0.0e+00 at step 0" in out, out


def test_launch_mode_runs_torchtrainer_contenders_and_compares_the_feeds():
    out = _run("--rounds", "1", "--only", "pp2-memory,pp2-raydata")
    assert "pp2-memory    round 0" in out and "pp2-raydata   round 0" in out, out
    assert "same losses step by step with both feeds (same micro-batches, same order): True" in out, out
    assert re.search(r"pp2-raydata: the slowest-fed stage waits \d+\.\d ms per step", out), out
