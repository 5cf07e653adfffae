"""Trackers.close() with W&B offline: the record log is complete when close() returns.

W&B writes an offline run from its service process (wandb-core), a child of the process that logs, and flushes the
file when that process closes the run's stream, after `run.finish()` has returned. Ray kills a worker's child
processes when the worker exits, right after the training function returns: a service still closing the stream
then leaves a file without the last steps (seen once under load: a 4-step run's file held step 1 only)."""

import psutil
import pytest
from wandb_offline import wandb_offline_history

from raytrain.config import load_job_config


def _wandb_children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if "wandb" in " ".join(p.cmdline())]


def test_close_waits_for_the_wandb_service_and_the_offline_file_holds_every_step(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    pytest.importorskip("ray.air.integrations.wandb")
    from raytrain.trainer.tracking import Trackers

    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")  # Trackers sets it for the process: restored after the test
    job = load_job_config("configs/demo.yaml", ["train.tracking=[wandb]", "storage.run_name=tracking"])
    trackers = Trackers(job, str(tmp_path), world_rank=0)
    for step in range(1, 5):
        trackers.log({"loss": 10.0 - step, "note": "not a number"}, step=step)
    service = _wandb_children()
    assert service, "W&B runs its service as a child process"
    trackers.close()
    # nothing of W&B is left for the worker's exit to kill: the file is complete
    assert not [p for p in service if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert wandb_offline_history(str(tmp_path / "wandb"), "loss") == {1: 9.0, 2: 8.0, 3: 7.0, 4: 6.0}
