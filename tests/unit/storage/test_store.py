"""CheckpointStore on a real POSIX directory, including a writer SIGKILLed mid-save."""

import hashlib
import json
import logging
import os
import signal
import subprocess
import sys

import pytest

from raytrain.checkpoint.store import CheckpointStore
from raytrain.errors import RaytrainError
from raytrain.storage import resolve, run_root

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.fixture
def run(tmp_path):
    return run_root(resolve(str(tmp_path / "root")), "alice", "proj", "run1")


def _write_rank_files(directory, step, ranks=2):
    """What each pipeline rank's DeepSpeed save leaves: its own files, distinct names. Returns {relpath: bytes}."""
    written = {}
    for rank in range(ranks):
        for rel, data in (
            (f"global_step{step}/layer_{rank:02d}-model_states.pt", os.urandom(1000 + 37 * rank + step)),
            (f"global_step{step}/mp_rank_{rank:02d}_model_states.pt", f"rank {rank} step {step}".encode()),
        ):
            path = os.path.join(directory, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)
            written[rel] = data
    return written


def _save(store, step, metrics=None, **commit_kwargs):
    written = _write_rank_files(store.staging_dir(step), step)
    store.upload(step, store.staging_dir(step))  # a no-op on POSIX; the protocol is the same everywhere
    meta = {"data_position": {"epoch": 0, "rows": step * 8}, "metrics": metrics or {}}
    uri = store.commit(step, meta, **commit_kwargs)
    return uri, written


def test_commit_layout_manifest_and_latest(run):
    store = CheckpointStore(run)
    staging = store.staging_dir(10)
    assert staging == os.path.join(run.path, "checkpoints", "step_00000010.partial")
    assert store.latest() is None
    uri, written = _save(store, 10, {"loss": 1.5})
    final = os.path.join(run.path, "checkpoints", "step_00000010")
    assert uri == resolve(final).uri and not os.path.exists(staging)
    assert open(os.path.join(run.path, "checkpoints", "latest")).read().strip() == "step_00000010"
    manifest = json.load(open(os.path.join(final, "manifest.json")))
    # Reference: sizes and digests computed here with hashlib on the bytes each "rank" wrote.
    assert manifest["files"] == {
        rel: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()} for rel, data in written.items()
    }
    assert manifest["step"] == 10 and manifest["metadata"]["data_position"] == {"epoch": 0, "rows": 80}
    ckpt = store.latest()
    assert (ckpt.step, ckpt.local_path, ckpt.metadata["metrics"]) == (10, final, {"loss": 1.5})
    assert store.verify(ckpt) is ckpt
    out = store.download(ckpt, os.path.join(run.path, "..", "dl"))
    for rel, data in written.items():
        assert open(os.path.join(out, rel), "rb").read() == data


def test_a_sidecar_another_rank_is_writing_is_not_hashed_as_a_checkpoint_file(run, monkeypatch):
    """Ranks hash their shares of the staged files at once; a fast rank's sidecar, mid-write, sits in the folder under
    the atomic writer's temporary name and is renamed away a moment later. A slower rank whose listing caught it
    must not take it for a checkpoint file (seen on CI: 'no file here'). The temporary name is the one storage's
    atomic write really uses (captured from its os.replace); the listing that still holds it is replayed."""
    from raytrain.storage import StorageLocation, _posix_write_atomic

    store = CheckpointStore(run)
    staging = store.staging_dir(3)
    written = _write_rank_files(staging, 3)
    sidecar = os.path.join(staging, ".raytrain-upload-rank1-abcd1234.json")
    names = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda tmp, dst: names.append(os.path.basename(tmp)) or real_replace(tmp, dst))
    _posix_write_atomic(sidecar, b"{}")
    monkeypatch.undo()
    os.remove(sidecar)  # this world is rank 0 alone: rank 1's sidecar only passed through
    real_list = StorageLocation.list_files
    monkeypatch.setattr(StorageLocation, "list_files", lambda loc: {**real_list(loc), names[0]: 1})
    store.hash_share(3, rank=0, world=1)  # raised 'no file here' on the vanished temporary file
    monkeypatch.undo()
    store.commit(3, {"metrics": {}})
    assert set(store.latest().manifest["files"]) == set(written)


def test_commit_with_nothing_staged_is_an_error(run):
    store = CheckpointStore(run)
    store.staging_dir(5)
    with pytest.raises(RaytrainError, match="nothing staged"):
        store.commit(5, {})
    with pytest.raises(RaytrainError, match="JSON"):
        _write_rank_files(store.staging_dir(5), 5)
        store.commit(5, {"bad": object()})


def test_latest_moves_and_old_partial_is_ignored(run):
    store = CheckpointStore(run, keep_last=None)
    _save(store, 10)
    _write_rank_files(store.staging_dir(20), 20)  # ranks wrote, nobody committed (crash before the barrier)
    assert store.latest().step == 10
    _save(store, 30)
    assert store.latest().step == 30
    assert [c.step for c in store.committed()] == [10, 30]
    removed = store.cleanup_partials()
    assert removed == [resolve(os.path.join(run.path, "checkpoints", "step_00000020.partial")).uri]
    assert sorted(os.listdir(os.path.join(run.path, "checkpoints"))) == ["latest", "step_00000010", "step_00000030"]


def test_missing_or_broken_latest_pointer_falls_back_to_scan(run, caplog):
    store = CheckpointStore(run, keep_last=None)
    _save(store, 10)
    _save(store, 20)
    pointer = os.path.join(run.path, "checkpoints", "latest")
    os.unlink(pointer)
    assert store.latest().step == 20
    with open(pointer, "w") as f:
        f.write("step_00000099\n")  # names a dir that is not there
    with caplog.at_level(logging.WARNING):
        assert store.latest().step == 20
    assert "step_00000099" in caplog.text


def test_resume_from_earlier_step_follows_pointer_not_highest_step(run):
    store = CheckpointStore(run, keep_last=None)
    for step in (10, 20, 30):
        _save(store, step)
    resumed = CheckpointStore(run, keep_last=2, protect=[20])  # resumed from 20; 30 is an abandoned timeline
    _save(resumed, 25)
    assert resumed.latest().step == 25
    assert [c.step for c in resumed.committed()] == [20, 25, 30]  # 10 aged out; 20 protected; 30 among last 2
    os.unlink(os.path.join(run.path, "checkpoints", "step_00000025", "manifest.json"))
    assert resumed.latest().step == 20  # broken pointer target: newest at or below it, not the abandoned 30


def test_corrupt_file_is_named_or_falls_back(run, caplog):
    _save(CheckpointStore(run, keep_last=None), 10)
    _, written = _save(CheckpointStore(run, keep_last=None), 20)
    rel = sorted(written)[0]
    path = os.path.join(run.path, "checkpoints", "step_00000020", rel)
    data = bytearray(open(path, "rb").read())
    data[7] ^= 0xFF  # same size, different bytes: only the sha256 can tell
    open(path, "wb").write(bytes(data))
    strict = CheckpointStore(run, keep_last=None)
    with pytest.raises(RaytrainError, match=rel) as info:
        strict.verify(strict.latest())
    assert "sha256" in str(info.value) and "step_00000020" in str(info.value)
    lenient = CheckpointStore(run, keep_last=None, on_corrupt="fallback")
    with caplog.at_level(logging.WARNING):
        good = lenient.verify(lenient.latest())
    assert good.step == 10 and "falling back from step 20 to step 10" in caplog.text
    os.truncate(os.path.join(run.path, "checkpoints", "step_00000010", sorted(written)[1].replace("20", "10")), 3)
    with pytest.raises(RaytrainError, match="no earlier checkpoint is intact"):
        lenient.verify(lenient.latest())


def test_missing_file_and_bad_manifest(run):
    _, written = _save(CheckpointStore(run), 10)
    victim = sorted(written)[-1]
    os.unlink(os.path.join(run.path, "checkpoints", "step_00000010", victim))
    store = CheckpointStore(run)
    with pytest.raises(RaytrainError, match=f"{victim!r} is missing"):
        store.verify(store.latest())
    with open(os.path.join(run.path, "checkpoints", "step_00000010", "manifest.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(RaytrainError, match="manifest.json is unreadable"):
        store.latest()
    assert CheckpointStore(run, on_corrupt="fallback").latest() is None


def test_retention_keeps_last_k_best_and_protected(run):
    store = CheckpointStore(run, keep_last=2, keep_best="val_loss", mode="min", protect=[10])
    losses = {10: 5.0, 20: 1.0, 30: 3.0, 40: 4.0, 50: 2.5, 60: 6.0}
    for step, loss in losses.items():
        _save(store, step, {"val_loss": loss})
    kept = sorted(c.step for c in store.committed())
    # last 2 (50, 60) + best val_loss (20) + protected resume point (10)
    assert kept == [10, 20, 50, 60]
    assert sorted(os.listdir(os.path.join(run.path, "checkpoints"))) == [
        "latest",
        "step_00000010",
        "step_00000020",
        "step_00000050",
        "step_00000060",
    ]
    maxed = CheckpointStore(run, keep_last=1, keep_best="val_loss", mode="max")
    _save(maxed, 70, {"val_loss": 0.1})
    assert sorted(c.step for c in maxed.committed()) == [60, 70]  # 60 has the max; 10 is no longer protected here


def test_rerun_of_a_committed_step_replaces_it_whole(run):
    store = CheckpointStore(run, keep_last=None)
    _save(store, 10)
    old_files = set(store.latest().manifest["files"])
    staging = store.staging_dir(10)
    with open(os.path.join(staging, "only_new.bin"), "wb") as f:
        f.write(b"new")
    store.commit(10, {})
    assert set(store.latest().manifest["files"]) == {"only_new.bin"} != old_files
    assert sorted(os.listdir(os.path.join(run.path, "checkpoints", "step_00000010"))) == [
        "manifest.json",
        "only_new.bin",
    ]
    store.verify(store.latest())


KILLED_WRITER = """
import os, sys, time
from raytrain.checkpoint.store import CheckpointStore
from raytrain.storage import resolve
store = CheckpointStore(resolve(sys.argv[1]))
phase = sys.argv[2]
d = store.staging_dir(20)
with open(os.path.join(d, "big.bin"), "wb") as f:
    f.write(b"x" * 4096)
    f.flush()
with open(os.path.join(d, "other.bin"), "wb") as f:
    f.write(b"y" * 100)
    if phase == "payload":
        print("writing", flush=True)
        time.sleep(600)
if phase == "hashing":
    # Stop while the ranks hash their shares: one sidecar may be written, the manifest is not.
    import raytrain.checkpoint.store as module
    def slow(loc, fsync):
        print("writing", flush=True)
        time.sleep(600)
    store.hash_share(20, 0, 2)  # rank 0's share done
    module._hash_file = slow
    store.hash_share(20, 1, 2)
if phase == "commit":
    # Stop inside commit: manifest written into the partial, not yet renamed into place.
    def hang(step):
        print("writing", flush=True)
        time.sleep(600)
    store._publish_by_rename = hang
    store.commit(20, {"metrics": {}})
"""


@pytest.mark.parametrize("phase", ["payload", "hashing", "commit"])
def test_sigkill_mid_save_keeps_previous_checkpoint(run, phase):
    store = CheckpointStore(run)
    _, written = _save(store, 10)
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_WRITER, run.uri, phase],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": REPO},
    )
    assert proc.stdout.readline().strip() == "writing"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    partial = os.path.join(run.path, "checkpoints", "step_00000020.partial")
    assert os.path.isdir(partial)
    assert os.path.exists(os.path.join(partial, "manifest.json")) == (phase == "commit")
    fresh = CheckpointStore(run)
    ckpt = fresh.latest()
    assert ckpt.step == 10 and fresh.verify(ckpt) is ckpt
    for rel, data in written.items():
        assert open(os.path.join(ckpt.local_path, rel), "rb").read() == data
    assert fresh.cleanup_partials() == [resolve(partial).uri] and not os.path.exists(partial)
    _save(fresh, 20)  # the run continues normally
    assert fresh.latest().step == 20


def test_settings_validated(run):
    with pytest.raises(RaytrainError, match="on_corrupt="):
        CheckpointStore(run, on_corrupt="ignore")
    with pytest.raises(RaytrainError, match="keep_last="):
        CheckpointStore(run, keep_last=0)
    with pytest.raises(RaytrainError, match="mode="):
        CheckpointStore(run, mode="best")


def test_ranks_hash_their_shares_in_parallel_and_commit_reads_them(run, monkeypatch):
    """Each of 3 ranks hashes (and fsyncs) its share of the staged files; commit builds the manifest from their
    sidecars without hashing anything itself; the manifest equals hashlib's digests of the files."""
    import raytrain.checkpoint.store as module

    store = CheckpointStore(run)
    written = _write_rank_files(store.staging_dir(30), 30, ranks=3)  # 6 files
    hashed_by = {}
    real = module._hash_file
    for rank in range(3):
        def counting(loc, fsync, rank=rank):
            hashed_by.setdefault(rank, []).append((loc.name, fsync))
            return real(loc, fsync)
        monkeypatch.setattr(module, "_hash_file", counting)
        assert store.hash_share(30, rank, 3) > 0
    assert sorted(len(v) for v in hashed_by.values()) == [2, 2, 2]  # a third each
    assert all(fsync for v in hashed_by.values() for _, fsync in v)  # each share flushed by its rank

    def forbidden(loc, fsync):
        raise AssertionError(f"commit hashed {loc.name} itself")
    monkeypatch.setattr(module, "_hash_file", forbidden)
    store.commit(30, {"metrics": {}})
    files = store.latest().manifest["files"]
    assert files == {rel: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
                     for rel, data in written.items()}
    assert not [n for n in os.listdir(store.latest().local_path) if n.startswith(".raytrain-upload-")]


def test_ranks_verify_their_shares_and_a_corrupt_file_is_named_by_its_owner(run):
    store = CheckpointStore(run)
    written = _save(store, 40)[1]
    ckpt = store.latest()
    assert [store.find_problem(ckpt, rank, 2) for rank in range(2)] == [None, None]
    victim = sorted(written)[3]  # in rank 1's share (file i belongs to rank i % 2)
    with open(os.path.join(ckpt.local_path, victim), "r+b") as f:
        f.write(b"\0")  # same size, other content: only the hash can tell
    problems = [store.find_problem(ckpt, rank, 2) for rank in range(2)]
    assert problems[0] is None and victim in problems[1] and "sha256" in problems[1]
    with pytest.raises(RaytrainError, match=victim):
        store.verify(ckpt, problem=problems[1])


def _tree_hashes(root):
    """{relpath: sha256} of every file below `root`: what a refused job must leave exactly as it was."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def test_takeover_fences_the_old_jobs_commit_and_cleanup(run):
    """Job B takes A's run over (A looked dead to it). A, unaware, stages and commits: the commit and A's cleanup
    are refused with LockLostError, and nothing of B's (its committed and in-progress checkpoints, the lock)
    changes. B's own commit goes through under its fence."""
    from raytrain.runlock import LockInfo, LockLostError, RunLock

    lock_a = RunLock(run, heartbeat_interval_s=None, user="alice")
    lock_a.acquire()
    store_a = CheckpointStore(run, keep_last=1, fence=lock_a.fence)
    _save(store_a, 1)
    # A's host stops heartbeating (as B sees it): its lock ages past stale_after_s.
    lock_path = os.path.join(run.path, ".lock")
    with open(lock_path, "w") as f:
        f.write(LockInfo("node-a", 1, 0.0, "alice", 0.0, lock_a.fence.token, lock_a.fence.generation).to_json())
    os.utime(lock_path, (1.0, 1.0))
    lock_b = RunLock(run, heartbeat_interval_s=None, stale_after_s=60, user="alice")
    assert lock_b.acquire().generation == lock_a.fence.generation + 1
    store_b = CheckpointStore(run, keep_last=1, fence=lock_b.fence)
    assert store_b.cleanup_partials() == []
    _write_rank_files(store_b.staging_dir(3), 3)  # B's save of step 3, in progress
    _write_rank_files(store_a.staging_dir(2), 2)  # A goes on: its ranks stage step 2
    before = _tree_hashes(run.path)
    with pytest.raises(LockLostError, match=r"lost its run lock.*Refused to commit checkpoint step 2"):
        store_a.commit(2, {"metrics": {}})
    with pytest.raises(LockLostError, match="delete unfinished checkpoints"):
        store_a.cleanup_partials()
    assert _tree_hashes(run.path) == before  # no manifest, no rename, no `latest`, nothing deleted
    assert store_b.latest().step == 1
    assert store_b.commit(3, {"metrics": {}}).endswith("step_00000003")
    assert [c.step for c in store_b.committed()] == [3]
    lock_b.release()


def test_read_only_store_never_writes(run):
    store = CheckpointStore(run)
    _save(store, 4)
    reader = CheckpointStore(run, read_only=True)
    _write_rank_files(store.staging_dir(5), 5)
    before = _tree_hashes(run.path)
    assert reader.cleanup_partials() == []
    with pytest.raises(RaytrainError, match="read-only"):
        reader.commit(5, {})
    assert _tree_hashes(run.path) == before and reader.latest().step == 4
