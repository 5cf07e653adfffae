"""The same resolver, store and lock against a real S3 protocol server (moto, loopback only)."""

import hashlib
import json
import os
import time

import pytest
from lock_race import race_for_lock
from loopback_s3 import loopback_s3

from raytrain.checkpoint import store as store_module
from raytrain.checkpoint.store import CheckpointStore
from raytrain.errors import RaytrainError
from raytrain.runlock import LockInfo, LockLostError, RunLock
from raytrain.storage import resolve, run_root

pytest.importorskip("moto.server")
boto3 = pytest.importorskip("boto3")


@pytest.fixture(scope="module")
def endpoint():
    with loopback_s3() as url:
        yield url


@pytest.fixture
def s3(endpoint, request):
    """(boto3 client, a fresh bucket name): boto3 is the independent view of what landed in the bucket."""
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    bucket = request.node.name.lower().replace("_", "-")[:50]
    client.create_bucket(Bucket=bucket)
    return client, bucket


def _keys(client, bucket, prefix=""):
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for page in pages for o in page.get("Contents", []))


def _stage(store, step, rank_files, tmp_path):
    """Two ranks on two 'nodes' (different local dirs), each uploading only its own files."""
    for rank, files in enumerate(rank_files):
        local = str(tmp_path / f"node{rank}" / f"step{step}")
        for rel, data in files.items():
            os.makedirs(os.path.dirname(os.path.join(local, rel)), exist_ok=True)
            with open(os.path.join(local, rel), "wb") as f:
                f.write(data)
        store.upload(step, local)


def _rank_files(step):
    return [
        {f"global_step{step}/layer_00-model_states.pt": os.urandom(3000), "global_step{step}/zero.pt": b"r0"},
        {f"global_step{step}/layer_01-model_states.pt": os.urandom(2000 + step)},
    ]


def test_helpers_and_endpoint_from_env(s3, endpoint, monkeypatch):
    client, bucket = s3
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    loc = resolve(f"s3://{bucket}/a")
    assert loc.s3_endpoint == endpoint and not loc.exists()
    loc.join("x/p.txt").write_atomic("hello")
    with loc.join("b.bin").open_output() as f:
        f.write(b"\x01\x02")
    assert client.get_object(Bucket=bucket, Key="a/x/p.txt")["Body"].read() == b"hello"
    assert loc.join("x/p.txt").read_text() == "hello"
    assert loc.listdir() == ["b.bin", "x"] and loc.list_files() == {"x/p.txt": 5, "b.bin": 2}
    loc.delete_dir()
    assert _keys(client, bucket, "a/x/") == [] and not loc.join("x/p.txt").exists()


def test_commit_latest_download(s3, endpoint, tmp_path, monkeypatch):
    client, bucket = s3
    run = run_root(resolve(f"s3://{bucket}", s3_endpoint=endpoint), "alice", "proj", "run1")
    store = CheckpointStore(run, local_staging_root=str(tmp_path / "local"))
    staging = store.staging_dir(10)
    assert staging.startswith(str(tmp_path / "local")) and os.path.isdir(staging)
    files = _rank_files(10)
    _stage(store, 10, files, tmp_path)

    def no_read_back(loc, fsync):
        raise AssertionError(f"commit read {loc.uri} back; the upload sidecars should have its hash")

    with monkeypatch.context() as m:
        m.setattr(store_module, "_hash_file", no_read_back)
        uri = store.commit(10, {"metrics": {"loss": 2.0}, "data_position": {"rows": 80}})
    assert uri == f"s3://{bucket}/alice/proj/run1/checkpoints/step_00000010"
    prefix = "alice/proj/run1/checkpoints/"
    keys = _keys(client, bucket, prefix)
    assert prefix + "step_00000010/manifest.json" in keys and prefix + "latest" in keys
    assert not [k for k in keys if ".raytrain-upload-" in k]  # sidecars are gone after commit
    all_files = {**files[0], **files[1]}
    manifest = json.loads(client.get_object(Bucket=bucket, Key=prefix + "step_00000010/manifest.json")["Body"].read())
    assert manifest["files"] == {
        r: {"size": len(d), "sha256": hashlib.sha256(d).hexdigest()} for r, d in all_files.items()
    }
    ckpt = store.latest()
    assert ckpt.step == 10 and ckpt.local_path is None and store.verify(ckpt) is ckpt
    out = store.download(ckpt, str(tmp_path / "dl"))
    for rel, data in all_files.items():
        assert open(os.path.join(out, rel), "rb").read() == data


def test_uncommitted_upload_is_partial_and_cleaned(s3, endpoint, tmp_path):
    client, bucket = s3
    run = run_root(resolve(f"s3://{bucket}", s3_endpoint=endpoint), "u", "p", "r")
    store = CheckpointStore(run, local_staging_root=str(tmp_path / "local"))
    _stage(store, 10, _rank_files(10), tmp_path)
    store.commit(10, {})
    _stage(store, 20, _rank_files(20), tmp_path)  # uploaded, never committed (job died)
    assert store.latest().step == 10
    removed = store.cleanup_partials()
    assert removed == [f"s3://{bucket}/u/p/r/checkpoints/step_00000020"]
    assert _keys(client, bucket, "u/p/r/checkpoints/step_00000020") == []
    assert store.latest().step == 10


def test_corruption_and_retention_on_s3(s3, endpoint, tmp_path):
    client, bucket = s3
    run = run_root(resolve(f"s3://{bucket}", s3_endpoint=endpoint), "u", "p", "r")
    store = CheckpointStore(run, keep_last=2, local_staging_root=str(tmp_path / "local"))
    for step in (10, 20, 30):
        _stage(store, step, _rank_files(step), tmp_path)
        store.commit(step, {})
    assert [c.step for c in store.committed()] == [20, 30]
    assert _keys(client, bucket, "u/p/r/checkpoints/step_00000010") == []
    key = "u/p/r/checkpoints/step_00000030/global_step30/layer_01-model_states.pt"
    body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    client.put_object(Bucket=bucket, Key=key, Body=bytes([body[0] ^ 1]) + body[1:])
    with pytest.raises(RaytrainError, match="layer_01-model_states.pt"):
        store.verify(store.latest())
    lenient = CheckpointStore(run, on_corrupt="fallback")
    assert lenient.verify(lenient.latest()).step == 20


def test_runlock_on_s3(s3, endpoint):
    _, bucket = s3
    run = run_root(resolve(f"s3://{bucket}", s3_endpoint=endpoint), "u", "p", "r")
    with RunLock(run, heartbeat_interval_s=None):
        with pytest.raises(RaytrainError, match=f"pid {os.getpid()}"):
            RunLock(run, heartbeat_interval_s=None).acquire()
    assert not run.join(".lock").exists()


def test_staging_dir_is_removed_after_upload_and_rerun_uncommits(s3, endpoint, tmp_path):
    client, bucket = s3
    run = run_root(resolve(f"s3://{bucket}", s3_endpoint=endpoint), "u", "p", "r")
    store = CheckpointStore(run, local_staging_root=str(tmp_path / "local"))
    staging = store.staging_dir(10)
    with open(os.path.join(staging, "w.bin"), "wb") as f:
        f.write(b"first")
    store.upload(10, staging)
    assert not os.path.exists(staging)  # node-local temp space is freed once the bytes are on S3
    store.commit(10, {})
    assert store.latest().step == 10
    # A re-run of step 10 (resumed from an earlier step) uncommits the old prefix before writing into it.
    staging = store.staging_dir(10)
    with open(os.path.join(staging, "w.bin"), "wb") as f:
        f.write(b"second")
    store.upload(10, staging)
    assert store.get(10) is None
    store.commit(10, {})
    assert client.get_object(Bucket=bucket, Key="u/p/r/checkpoints/step_00000010/w.bin")["Body"].read() == b"second"
    assert store.verify(store.latest()).manifest["files"]["w.bin"]["size"] == 6


def test_s3_lock_create_race_has_one_winner_in_20_tries(s3, endpoint):
    """Eight contenders released by one barrier create the same lock object: If-None-Match: * lets exactly one
    win, every time (the loopback moto server answers 412 PreconditionFailed to the others)."""
    _, bucket = s3
    for attempt in range(20):
        run = run_root(resolve(f"s3://{bucket}", s3_endpoint=endpoint), "u", "p", f"race{attempt}")
        winners, outcomes = race_for_lock(run, 8)
        assert len(winners) == 1, (attempt, outcomes)
        assert json.loads(run.join(".lock").read_text())["token"] == winners[0]
        assert all(f"pid {os.getpid()}" in o for o in outcomes if o.startswith("REFUSED"))


def test_s3_heartbeat_and_takeover_use_if_match(s3, endpoint):
    """A takeover replaces the stale lock only if it is unchanged since read (If-Match), with the next generation;
    the old holder's next heartbeat (If-Match on its own ETag) fails, so it learns it lost and never overwrites."""
    client, bucket = s3
    run = run_root(resolve(f"s3://{bucket}", s3_endpoint=endpoint), "u", "p", "r")
    key = "u/p/r/.lock"
    a = RunLock(run, heartbeat_interval_s=None)
    first = a.acquire()
    assert first.generation == 1
    assert a._beat(first)  # a heartbeat on an unchanged lock goes through
    beat = json.loads(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    assert beat["token"] == first.token and beat["heartbeat"] >= first.heartbeat
    # Make A's lock look like a dead host's: an old heartbeat from elsewhere (written behind A's back).
    stale = LockInfo("node-gone", 1, 0.0, "alice", 0.0, first.token, first.generation)
    client.put_object(Bucket=bucket, Key=key, Body=stale.to_json().encode())
    time.sleep(2.1)  # S3's Last-Modified (seconds) also counts as a sign of life: let it age past stale_after_s
    b = RunLock(run, heartbeat_interval_s=None, stale_after_s=1)
    second = b.acquire()
    assert second.generation == 2 and json.loads(run.join(".lock").read_text())["token"] == second.token
    assert not a._beat(first) and a.lost  # If-Match on A's ETag: 412, A has lost
    assert json.loads(run.join(".lock").read_text())["token"] == second.token
    with pytest.raises(LockLostError, match="generation 2"):
        a.check("commit checkpoint step 5")
    b.check("commit checkpoint step 5")
    b.release()
