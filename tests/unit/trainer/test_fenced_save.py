"""The trainer's checkpoint save under the run lock's fence, through the real _save_checkpoint (world of one gloo
rank, a stand-in stage writing a file as DeepSpeed's save does): the holder's save commits; after another job took
the run over, the old job's save stops before writing anything and B's files stay as they were."""

import os

import pytest

from raytrain.checkpoint.store import CheckpointStore
from raytrain.config import load_job_config
from raytrain.runlock import LockInfo, LockLostError, RunLock
from raytrain.storage import resolve, run_root
from raytrain.trainer.evaluation import PackedFiles
from raytrain.trainer.loop import LoopConfig, _save_checkpoint


class _Stage:
    def __init__(self):
        self.saves = []

    def save(self, directory: str, client_state: dict) -> None:
        self.saves.append(client_state["step"])
        with open(os.path.join(directory, "layer_00-model_states.pt"), "wb") as f:
            f.write(os.urandom(256))


def test_save_after_takeover_is_refused_before_writing(world_of_one, tmp_path):
    run = run_root(resolve(str(tmp_path / "runs")), "ci", "p", "r")
    job = load_job_config("configs/demo.yaml", [f"storage.root={tmp_path / 'runs'}", "storage.user=ci"])
    cfg = LoopConfig(job=job, run_uri=run.uri, ds_config={}, packed=PackedFiles("unused", (), 0))
    lock_a = RunLock(run, heartbeat_interval_s=None)
    lock_a.acquire()
    store_a, stage = CheckpointStore(run, fence=lock_a.fence), _Stage()
    _save_checkpoint(store_a, stage, 2, cfg, {"loss": 1.0})
    assert store_a.latest().step == 2
    lock_path = os.path.join(run.path, ".lock")
    with open(lock_path, "w") as f:  # A's host went quiet long ago, as B sees it
        f.write(LockInfo("node-a", 1, 0.0, "ci", 0.0, lock_a.fence.token, lock_a.fence.generation).to_json())
    os.utime(lock_path, (1.0, 1.0))
    lock_b = RunLock(run, heartbeat_interval_s=None, stale_after_s=60)
    lock_b.acquire()
    listing = sorted(os.listdir(os.path.join(run.path, "checkpoints")))
    with pytest.raises(LockLostError, match="Refused to save checkpoint step 4"):
        _save_checkpoint(store_a, stage, 4, cfg, {"loss": 0.5})
    assert stage.saves == [2]  # DeepSpeed was never asked to write step 4
    assert sorted(os.listdir(os.path.join(run.path, "checkpoints"))) == listing
    store_b = CheckpointStore(run, fence=lock_b.fence)
    _save_checkpoint(store_b, stage, 4, cfg, {"loss": 0.5})
    assert [c.step for c in store_b.committed()] == [2, 4]
    lock_b.release()
