"""Reading checkpoints with bounded disk and under a lease: CheckpointStore.local_copy / lease and runner.export_latest
against a real POSIX directory and the loopback S3 server (moto), a lease holder SIGKILLed in a real subprocess."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from loopback_s3 import loopback_s3

from raytrain.checkpoint.layout import lease_file_name, live_leased_steps, parse_lease_file_name
from raytrain.checkpoint.store import CheckpointStore
from raytrain.config import load_job_config
from raytrain.errors import CorruptCheckpointError, RaytrainError
from raytrain.runner import export_latest, open_run
from raytrain.storage import resolve, run_root

pytest.importorskip("moto.server")
boto3 = pytest.importorskip("boto3")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
# What a pp=2 DeepSpeed save leaves under our step dir's ds/ tag (names as DeepSpeed writes them).
FILES = ("ds/layer_00-model_states.pt", "ds/layer_01-model_states.pt", "ds/layer_02-model_states.pt",
         "ds/mp_rank_00_model_states.pt", "ds/mp_rank_01_model_states.pt")


@pytest.fixture(scope="module")
def endpoint():
    with loopback_s3() as url:
        yield url


@pytest.fixture(params=["posix", "s3"])
def root(request, tmp_path):
    """A storage root URI on a local directory or in a fresh bucket of the loopback S3 server, and its endpoint."""
    if request.param == "posix":
        return str(tmp_path / "root"), None
    url = request.getfixturevalue("endpoint")
    bucket = request.node.name.lower().replace("_", "-").replace("[", "-").replace("]", "")[:50]
    boto3.client("s3", endpoint_url=url, region_name="us-east-1").create_bucket(Bucket=bucket)
    return f"s3://{bucket}", url


def _store(root, tmp_path, **kwargs) -> CheckpointStore:
    uri, endpoint = root
    run = run_root(resolve(uri, s3_endpoint=endpoint), "ci", "demo", "reads")
    return CheckpointStore(run, local_staging_root=str(tmp_path / "node-local"), **kwargs)


def _save(store, step):
    staging = store.staging_dir(step)
    for i, rel in enumerate(FILES):
        os.makedirs(os.path.dirname(os.path.join(staging, rel)), exist_ok=True)
        with open(os.path.join(staging, rel), "wb") as f:
            f.write(os.urandom(2000 + 100 * i + step))
    store.upload(step, staging)
    store.hash_share(step, 0, 1)
    store.commit(step, {"metrics": {}})


def _flip_byte(store, step, rel):
    loc = store.root.join(f"step_{step:08d}", rel)
    data = bytearray(loc.read_bytes())
    data[len(data) // 2] ^= 0x01  # same size: only the sha256 can tell
    with loc.open_output() as f:
        f.write(bytes(data))


def _leftovers(tmp_path) -> list[str]:
    base = tmp_path / "node-local" / "raytrain-local-copies"
    return [os.path.join(d, f) for d, _, files in os.walk(base) for f in files] if base.exists() else []


def test_local_copy_holds_only_the_asked_files_and_is_removed(root, tmp_path):
    store = _store(root, tmp_path)
    _save(store, 10)
    ckpt = store.latest()
    with store.local_copy(ckpt, [FILES[1], FILES[4]], label="resume-rank1") as local:
        held = sorted(os.path.relpath(os.path.join(d, f), local) for d, _, fs in os.walk(local) for f in fs)
        if ckpt.local_path is None:  # s3: a private temp copy of just those files (and the manifest)
            assert held == sorted([FILES[1], FILES[4], "manifest.json"])
            with open(os.path.join(local, FILES[4]), "rb") as f:
                assert f.read() == store.root.join("step_00000010", FILES[4]).read_bytes()
        else:  # POSIX: the step dir itself, nothing copied
            assert local == ckpt.local_path
    assert os.path.isdir(local) == (ckpt.local_path is not None) and _leftovers(tmp_path) == []
    # a corrupt file fails the copy naming it, and the partial copy is removed all the same
    _flip_byte(store, 10, FILES[2])
    if ckpt.local_path is None:
        with pytest.raises(CorruptCheckpointError, match=FILES[2]):
            with store.local_copy(ckpt, [FILES[0], FILES[2]]):
                pass
        assert _leftovers(tmp_path) == []
    with pytest.raises(CorruptCheckpointError, match=FILES[2]):
        store.verify(store.latest())


def test_retention_keeps_a_leased_step_until_release(root, tmp_path):
    store = _store(root, tmp_path, keep_last=1)
    _save(store, 10)
    with store.lease(10, purpose="export") as uri:
        lease = json.loads(resolve(uri, s3_endpoint=root[1]).read_text())
        assert lease["step"] == 10 and lease["purpose"] == "export" and str(os.getpid()) in lease["holder"]
        _save(store, 20)
        _save(store, 30)  # retention ran twice while the lease was held
        assert [c.step for c in store.committed()] == [10, 30]
        assert store.verify(store.get(10)).step == 10  # and the leased step is whole
    assert store.leases() == []  # released
    _save(store, 40)
    assert [c.step for c in store.committed()] == [40]


HOLDER = """
import sys, time
from raytrain.checkpoint.store import CheckpointStore
from raytrain.storage import resolve
store = CheckpointStore(resolve(sys.argv[1]))
with store.lease(10, purpose="export", ttl_s=float(sys.argv[2])):
    print("held", flush=True)
    time.sleep(600)
"""


def test_lease_of_a_killed_holder_expires(tmp_path):
    """A holder renews its lease while it lives (retention keeps the step past one TTL) and, SIGKILLed, stops: the
    lease expires and the next retention deletes the step."""
    store = _store((str(tmp_path / "root"), None), tmp_path, keep_last=1)
    _save(store, 10)
    ttl = 1.0
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, store.run_root.uri, str(ttl)], stdout=subprocess.PIPE,
                            text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})
    try:
        assert proc.stdout.readline().strip() == "held"
        [written] = store.leases()
        # A renewal that writes an expiry a TTL past the first one ran after the first expiry had passed: from
        # there only renewal keeps the lease live. Seen in the file, not assumed after a sleep.
        deadline = time.monotonic() + 30
        while store.leases()[0]["expires_unix_s"] < written["expires_unix_s"] + ttl:
            assert time.monotonic() < deadline, "the holder never renewed its lease"
            time.sleep(0.02)
        assert time.time() >= written["expires_unix_s"] - 1e-3  # past the first expiry (written to the ms)
        _save(store, 20)
        assert [c.step for c in store.committed()] == [10, 20]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    [lease] = store.leases()  # the killed holder could not release it
    assert parse_lease_file_name(lease["name"]) == 10
    time.sleep(max(0.0, lease["expires_unix_s"] - time.time()) + 0.1)
    _save(store, 30)
    assert [c.step for c in store.committed()] == [30]


def _export_job(root):
    uri, endpoint = root
    overrides = [f"storage.root={uri}", "storage.user=ci", "storage.run_name=reads"]
    if endpoint:
        overrides.append(f"storage.s3_endpoint={endpoint}")
    return load_job_config(os.path.join(REPO, "configs", "demo.yaml"), overrides)


def test_export_of_a_checkpoint_with_one_flipped_byte_names_the_file(root, tmp_path):
    job = _export_job(root)
    store = CheckpointStore(open_run(job).root, local_staging_root=str(tmp_path / "node-local"))
    _save(store, 10)
    _flip_byte(store, 10, FILES[3])  # not a layer file export reads: every hash is checked all the same
    with pytest.raises(CorruptCheckpointError, match=FILES[3]) as info:
        export_latest(job, str(tmp_path / "hf"))
    assert "step_00000010" in str(info.value)
    assert store.leases() == []  # the lease is released on the error path too
    assert not (tmp_path / "hf").exists() or not os.listdir(tmp_path / "hf")  # nothing exported


def test_lease_names_and_liveness_rules():
    assert lease_file_name(10, "ab12") == "step_00000010.ab12.json"
    assert parse_lease_file_name("step_00000010.ab12.json") == 10
    for name in ("step_00000010.json", "step_10.ab.json", "step_00000010.ab12.json.tmp", "latest"):
        assert parse_lease_file_name(name) is None, name
    with pytest.raises(RaytrainError, match="lease id"):
        lease_file_name(10, "../x")
    leases = [{"step": 1, "expires_unix_s": 101.0}, {"step": 2, "expires_unix_s": 99.0},
              {"step": 3, "expires_unix_s": float("nan")}, {"step": "4", "expires_unix_s": 1e9},
              {"step": True, "expires_unix_s": 1e9}, {"step": 5}]
    assert live_leased_steps(leases, now_unix_s=100.0) == {1}
