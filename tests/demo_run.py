"""The quick start's run, shared by the integration tests (tests/integration/conftest.py: the `demo_run` fixture).

`raytrain run configs/demo.yaml` as a user runs it: a subprocess with its own embedded Ray and Ray's token
authentication, without a terminal. It generates the sample dataset, enriches it with Spark on Ray, packs it with
Ray Data and trains a few steps. test_console_run asserts what it printed; the modules that need the demo's
enriched or packed data (enrichment checks, the fine-tune and its resume, the Spark fault test's undisturbed
reference) read its run folder instead of enriching the same sample again. They only read it: a test that writes
copies what it needs first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

from raytrain.config import JobConfig, load_job_config
from raytrain.storage import StorageLocation, resolve

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "configs/demo.yaml"
STEPS = 4
"""Steps of the shared run (checkpoint and eval every 2); test_console_run resumes it to STEPS + 2."""
RUN_NAME = "console"
USER = "ci"
OVERRIDES = (f"train.max_steps={STEPS}", "train.checkpoint_every=2", "train.eval_every=2", f"storage.user={USER}",
             f"storage.run_name={RUN_NAME}", "enrich.wave_rows=0")
"""enrich.wave_rows=0: the sample in one wave, the reference test_streamed and test_enrich_spark compare the demo's
waves with (the demo as shipped streams in three waves; test_streamed streams the same config and checks a
streamed `raytrain run`'s console)."""


@dataclass(frozen=True)
class DemoRun:
    storage_root: str
    """storage.root of the run (the module's temporary folder)."""
    process: subprocess.CompletedProcess
    """The CLI's exit code and everything it printed (stdout, stderr)."""
    seconds: float

    @property
    def run_dir(self) -> str:
        return os.path.join(self.storage_root, USER, "demo", RUN_NAME)

    @property
    def root(self) -> StorageLocation:
        return resolve(self.run_dir)

    @property
    def token_path(self) -> str:
        """Where the embedded Ray's auth token goes (instead of ~/.ray)."""
        return os.path.join(self.storage_root, ".ray-auth", "auth_token")

    def job(self, *extra: str) -> JobConfig:
        """The run's job config (plus `extra` overrides): its data_hash is the one the run's data was made with."""
        return load_job_config(os.path.join(REPO, CONFIG), [f"storage.root={self.storage_root}", *OVERRIDES, *extra])

    def env(self) -> dict[str, str]:
        """The CLI's environment: the quick start as a user gets it, with Ray's token authentication on."""
        env = dict(os.environ, HF_HUB_OFFLINE="1", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=self.token_path,
                   PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.pop("RAY_ADDRESS", None)
        env.pop("RAY_AUTH_TOKEN", None)
        return env

    def save(self, path: str) -> None:
        """Its record, for the other pytest-xdist workers of the session (tests/integration/conftest.py)."""
        out = self.process
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"storage_root": self.storage_root, "seconds": self.seconds, "args": out.args,
                       "returncode": out.returncode, "stdout": out.stdout, "stderr": out.stderr}, f)

    @staticmethod
    def load(path: str) -> DemoRun:
        with open(path, encoding="utf-8") as f:
            r = json.load(f)
        return DemoRun(r["storage_root"], subprocess.CompletedProcess(r["args"], r["returncode"], r["stdout"],
                                                                      r["stderr"]), r["seconds"])

    def command(self, *extra: str) -> list[str]:
        return [sys.executable, "-m", "raytrain.cli", "run", CONFIG, f"storage.root={self.storage_root}",
                *OVERRIDES, *extra]


def run_demo(storage_root: str) -> DemoRun:
    """Run the demo once under `storage_root`; the exit code is the caller's to check (test_console_run shows the
    console of a failed run, the other modules fail their setup with it)."""
    t0 = time.monotonic()
    demo = DemoRun(storage_root, subprocess.CompletedProcess([], 0), 0.0)
    out = subprocess.run(demo.command(), cwd=REPO, env=demo.env(), capture_output=True, text=True, timeout=1800)
    seconds = time.monotonic() - t0
    print(f"demo run without a terminal: {seconds:.0f}s, {len((out.stdout + out.stderr).splitlines())} console "
          "lines")
    return DemoRun(storage_root, out, seconds)
