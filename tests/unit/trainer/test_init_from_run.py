"""storage.init_from_run on the worker side: a new run starts from another run's latest checkpoint through the real
_resume (world of one gloo rank, a stand-in stage that records what it was asked to load); the other run is only
read, this run's own leftovers are cleaned, and once this run has a checkpoint of its own that one wins."""

import hashlib
import os

from raytrain.checkpoint.store import CheckpointStore
from raytrain.config import load_job_config
from raytrain.storage import resolve, run_root
from raytrain.trainer.loop import _resume, _resume_source
from raytrain.trainer.schedule import Topology, data_position


class _Stage:
    """What _resume needs of a StageEngine: load(dir) -> client_state; records the directory it loaded."""

    def __init__(self, dp: int, grad_accum_steps: int):
        self.loaded, self.dp, self.gas = None, dp, grad_accum_steps

    def load(self, local: str) -> dict:
        self.loaded = local
        step = int(open(os.path.join(local, "step.txt")).read())
        return {"step": step, "data_position": data_position(step, self.dp, self.gas)}


def _commit(store, step):
    staging = store.staging_dir(step)
    with open(os.path.join(staging, "step.txt"), "w") as f:
        f.write(str(step))
    store.commit(step, {"metrics": {"loss": 1.0 / step}})


def _hashes(path):
    out = {}
    for dirpath, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                out[os.path.join(dirpath, name)] = hashlib.sha256(f.read()).hexdigest()
    return out


def test_new_run_starts_from_another_runs_checkpoint_read_only(world_of_one, tmp_path):
    root = resolve(str(tmp_path / "runs"))
    alice = run_root(root, "alice", "p", "base")
    _commit(CheckpointStore(alice), 7)
    os.makedirs(os.path.join(alice.path, "checkpoints", "step_00000009.partial"))  # alice's save in progress
    bob = run_root(root, "bob", "p", "ft")
    leftover = os.path.join(bob.path, "checkpoints", "step_00000002.partial")
    os.makedirs(leftover)
    job = load_job_config("configs/demo.yaml", [f"storage.root={root.path}", "storage.user=bob",
                                                "storage.run_name=ft", f"storage.init_from_run={alice.uri}"])
    before = _hashes(alice.path)
    own = CheckpointStore(bob)
    source = _resume_source(own, job)
    assert source.read_only and source.run_root == alice
    assert not os.path.exists(leftover)  # bob's own leftovers are cleaned
    tc = job.train
    stage = _Stage(tc.dp, tc.grad_accum_steps)
    step, metrics = _resume(stage, source, Topology(pp=1, dp=1, stage=0, dp_rank=0, world_rank=0), tc,
                            bob.join("reports"))
    assert step == 7 and metrics == {"loss": 1.0 / 7}
    assert stage.loaded == os.path.join(alice.path, "checkpoints", "step_00000007")
    assert _hashes(alice.path) == before  # read only: nothing of alice's changed
    assert os.path.isdir(os.path.join(alice.path, "checkpoints", "step_00000009.partial"))  # nor deleted
    _commit(own, 8)
    assert _resume_source(own, job) is own  # bob's run has its own checkpoint now: it resumes from that
    no_source = load_job_config("configs/demo.yaml", [f"storage.root={root.path}", "storage.user=bob"])
    fresh = CheckpointStore(run_root(root, "bob", "p", "other"))
    assert _resume_source(fresh, no_source) is fresh


def _commit_with_config(store, step, job, base=None):
    staging = store.staging_dir(step)
    with open(os.path.join(staging, "step.txt"), "w") as f:
        f.write(str(step))
    store.commit(step, {"config": job.to_dict(), **({"base": base} if base else {})})


def test_preference_training_takes_only_the_weights_of_the_checkpoint_it_started_from(tmp_path):
    """DPO from another run: no resume from that run (step 0, its own data); the starting checkpoint is that run's
    latest, then pinned by this run's checkpoints while the other run goes on; what cannot start is refused."""
    import pytest

    from raytrain.errors import RaytrainError
    from raytrain.trainer.launch import source_weights
    from raytrain.trainer.preference import reference_key

    root = resolve(str(tmp_path / "runs"))
    sft = run_root(root, "alice", "p", "sft")
    sft_job = load_job_config("configs/demo.yaml", [f"storage.root={root.path}", "storage.user=alice"])
    sft_store = CheckpointStore(sft)
    _commit_with_config(sft_store, 7, sft_job)
    dpo = CheckpointStore(run_root(root, "alice", "p", "dpo"))
    job = load_job_config("configs/demo-dpo.yaml", [f"storage.root={root.path}", "storage.user=alice",
                                                    "storage.run_name=dpo", f"storage.init_from_run={sft.uri}"])
    assert _resume_source(dpo, job) is dpo  # the other run's step, data position and optimizer are not taken
    start = source_weights(job, None)
    assert start["init_from_run"] == sft.uri and start["step"] == 7
    assert start["checkpoint"] == sft_store.get(7).uri and len(start["manifest_sha256"]) == 64
    packed = "file:///packed"
    assert reference_key(job, packed, start) != reference_key(job, packed, {})  # other starting weights

    _commit_with_config(dpo, 2, job, base=start)  # this run trained from step 7 ...
    _commit_with_config(sft_store, 9, sft_job)  # ... while the fine-tune went on
    assert source_weights(job, dpo.latest()) == start  # a resumed run keeps the weights it began with
    without = load_job_config("configs/demo-dpo.yaml", [f"storage.root={root.path}", "storage.user=alice",
                                                        "storage.run_name=dpo"])
    with pytest.raises(RaytrainError, match="started from .*step_00000007.*set storage.init_from_run="):
        source_weights(without, dpo.latest())
    import shutil

    shutil.rmtree(sft_store.get(7).local_path)
    with pytest.raises(RaytrainError, match="no checkpoint .*step_00000007"):
        source_weights(job, dpo.latest())

    lora_run = run_root(root, "alice", "p", "lora")
    lora_job = load_job_config("configs/demo.yaml", [f"storage.root={root.path}", "model.lora.rank=4"])
    _commit_with_config(CheckpointStore(lora_run), 3, lora_job)
    from_lora = load_job_config("configs/demo-dpo.yaml", [f"storage.root={root.path}", "storage.user=alice",
                                                          f"storage.init_from_run={lora_run.uri}"])
    with pytest.raises(RaytrainError, match="holds LoRA adapters, not a whole model"):
        source_weights(from_lora, None)
    lora_dpo = load_job_config("configs/demo-dpo.yaml", [f"storage.root={root.path}", "storage.user=alice",
                                                         "storage.run_name=lora-dpo", "model.lora.rank=4",
                                                         f"storage.init_from_run={sft.uri}"])
    assert source_weights(lora_dpo, None)["step"] == 9  # LoRA adapters on the fine-tune's latest weights
