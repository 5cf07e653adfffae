"""The `raytrain` command line as a user runs it, and a committed checkpoint for `raytrain status` to show (shared
test helpers)."""

from __future__ import annotations

import os
import subprocess
import sys

from raytrain.checkpoint.store import CheckpointStore
from raytrain.storage import resolve

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    """`python -m raytrain.cli *args` from the repository root: offline, no token auth, no cluster to join, a wide
    console; stdout and stderr captured as text."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", RAY_AUTH_MODE="disabled", COLUMNS="200")
    env.pop("RAY_ADDRESS", None)
    return subprocess.run([sys.executable, "-m", "raytrain.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout_s)


def commit_checkpoint(run_dir, step: int, loss: float) -> None:
    """A committed checkpoint of `step` under the run folder `run_dir` (one small layer file), its metrics `loss`."""
    store = CheckpointStore(resolve(str(run_dir)), keep_last=None)
    staging = store.staging_dir(step)
    with open(os.path.join(staging, "layer_00-model_states.pt"), "wb") as f:
        f.write(os.urandom(64))
    store.commit(step, {"metrics": {"loss": loss, "step": step}})
