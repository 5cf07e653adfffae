"""Training against s3:// for real: moto's S3 server on loopback, packed data, checkpoints, reports and Ray Train's own
storage all through raytrain.storage.resolve; a second launch resumes from the checkpoints on S3 and ends with the
same weights as an uninterrupted run on a POSIX root.

The module's Ray is the embedded one raytrain.runner.connect_ray starts for a user: token authentication and the
dashboard on. The AWS credentials are canaries (moto accepts any): the last test checks that none of them reached
the Ray session's logs, the dashboard's job/actor APIs, any process's arguments (sampled during the whole module),
the run's files or the console.

Enrichment on S3 (Spark through s3a://, input and run root in the bucket) is tested in test_storage_forms.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import urllib.error
import urllib.request
from contextlib import contextmanager

import pyarrow.fs as pafs
import pytest
import torch
from loopback_s3 import fault_proxy, loopback_s3
from synthetic_data import synthetic_conversations, write_enriched

from raytrain.checkpoint.store import CheckpointStore
from raytrain.config import load_job_config
from raytrain.runner import connect_ray, open_run, run_train
from raytrain.storage import resolve

pytest.importorskip("moto.server")
boto3 = pytest.importorskip("boto3")

BUCKET = "raytrain-it"
MAX_STEPS = 6
CHECKPOINT_EVERY = 2
FIRST_LAUNCH_STOP = 4


# Credentials no one could mistake for anything else: moto accepts them, and any copy of them outside this process's
# memory and environment is a leak.
CANARY = {"AWS_ACCESS_KEY_ID": f"AKIACANARY{secrets.token_hex(5).upper()}",
          "AWS_SECRET_ACCESS_KEY": f"canary-secret-{secrets.token_hex(12)}",
          "AWS_SESSION_TOKEN": f"canary-session-{secrets.token_hex(12)}"}


@pytest.fixture(scope="module")
def s3_endpoint():
    """A loopback S3 server for this module, with the CANARY credentials in os.environ (restored afterwards)."""
    saved = {k: os.environ.get(k) for k in CANARY}
    with loopback_s3() as endpoint:
        os.environ.update(CANARY)
        try:
            boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=BUCKET)
            yield endpoint
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


class ProcessArgs:
    """Every distinct command line on the machine (`ps -eww -o args`), sampled every 0.2 s from start() to stop()."""

    def __init__(self) -> None:
        self.seen: set[str] = set()
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            out = subprocess.run(["ps", "-eww", "-o", "args"], capture_output=True, text=True).stdout
            self.seen.update(out.splitlines())
            self.samples += 1
            self._stop.wait(0.2)

    def start(self) -> ProcessArgs:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture(scope="module")
def ray_s3(s3_endpoint, tmp_path_factory):
    """The module's Ray, started by connect_ray as `raytrain run` starts it: token auth (the token file in a temporary
    folder instead of ~/.ray) and the dashboard. No credentials are passed to it: workers inherit the driver's
    environment through the raylet, as on any embedded cluster. Yields the token, the dashboard URL and the ps
    sampler, which runs until the module ends."""
    import ray
    from ray._raylet import AuthenticationTokenLoader, Config

    from raytrain import runner

    if ray.is_initialized():
        ray.shutdown()
    saved = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN")}
    token_path = str(tmp_path_factory.mktemp("ray-auth") / "auth_token")
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=token_path)
    os.environ.pop("RAY_AUTH_TOKEN", None)
    ps = ProcessArgs().start()
    try:
        assert connect_ray(_job(f"s3://{BUCKET}/raytrain", "s3run", s3_endpoint))
        with open(token_path) as f:
            token = f.read().strip()
        yield {"ray": ray, "token": token, "token_path": token_path, "dashboard": runner.DASHBOARD_URL, "ps": ps,
               "session_dir": ray._private.worker._global_node.get_session_dir_path()}
    finally:
        ps.stop()
        ray.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        # Later modules' Ray must see the restored RAY_AUTH_MODE: the config, and the token Ray's C++ side cached
        # (as ray._private.authentication_test_utils resets them). Without the cache reset, the next module's first
        # actor (RayDP's Spark master) was cancelled before it started, in every module after this one.
        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()


@contextmanager
def console_to(path: str):
    """This process's console (descriptors 1 and 2 and sys.stdout/stderr, where Ray prints the lines it forwards
    from workers) appended to ``path`` for the block."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved_fds, saved_streams = (os.dup(1), os.dup(2)), (sys.stdout, sys.stderr)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    stream = open(path, "a", buffering=1)  # noqa: SIM115 - closed below
    sys.stdout = sys.stderr = stream
    try:
        yield
    finally:
        stream.close()
        sys.stdout, sys.stderr = saved_streams
        os.dup2(saved_fds[0], 1)
        os.dup2(saved_fds[1], 2)
        for fd in saved_fds:
            os.close(fd)


@pytest.fixture
def s3(s3_endpoint):
    return boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")


def _keys(client, prefix: str) -> dict[str, int]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return {o["Key"]: o["Size"] for page in pages for o in page.get("Contents", [])}


def _job(root: str, run_name: str, endpoint: str, *extra: str):
    # 128-token packs of the synthetic conversations (the demo packs 1,024), split where one is longer: enough
    # sequences for MAX_STEPS steps
    return load_job_config("configs/demo.yaml", [
        f"storage.root={root}", f"storage.s3_endpoint={endpoint}", "storage.user=ci", f"storage.run_name={run_name}",
        "dataset.seq_len=128", "dataset.length_policy=split", "enrich.wave_rows=0", f"train.max_steps={MAX_STEPS}",
        f"train.checkpoint_every={CHECKPOINT_EVERY}", *extra])


@pytest.fixture(scope="module")
def s3_run(ray_s3, s3_endpoint, tmp_path_factory):
    """Pack synthetic data into the S3 run root (Ray Data writes through the resolver's filesystem), then train a
    first launch that stops at FIRST_LAUNCH_STOP, as a preempted allocation would."""
    from raytrain.dataset.stream import pack_enriched

    local = tmp_path_factory.mktemp("s3-src")
    job = _job(f"s3://{BUCKET}/raytrain", "s3run", s3_endpoint, f"train.stop_at_step={FIRST_LAUNCH_STOP}")
    write_enriched(local, synthetic_conversations(120, seed=1, uuid_prefix="s3conv"), job.dataset.tokenizer)
    run = open_run(job)
    assert run.root.scheme == "s3" and run.root.uri == f"s3://{BUCKET}/raytrain/ci/demo/s3run"
    console = str(tmp_path_factory.mktemp("s3-console") / "console.txt")
    with console_to(console):
        packed = pack_enriched(resolve(str(local)), run.paths.packed, job.dataset, run.data_hash)
        first = run_train(job)
    return {"job": job, "run": run, "packed": packed, "first": first, "local": local, "console": console}


def test_packed_data_lives_on_s3(s3_run, s3):
    keys = _keys(s3, "raytrain/ci/demo/s3run/data/packed/")
    manifest = json.loads(s3.get_object(Bucket=BUCKET, Key="raytrain/ci/demo/s3run/data/packed/_manifest.json")
                          ["Body"].read())
    assert manifest["num_packs"] == s3_run["packed"].num_packs > 0
    prefix = "raytrain/ci/demo/s3run/data/packed/"
    parquet = [k.removeprefix(prefix) for k in keys if k.endswith(".parquet")]
    assert sorted(k for k in parquet if "/" not in k) == sorted(manifest["files"])
    # the demo's held-out rows, packed next to the training ones (listing the prefix is recursive on S3)
    held_out = manifest["validation"]
    assert held_out["rows"] > 0 and held_out["num_packs"] == s3_run["packed"].validation.num_packs
    assert sorted(k for k in parquet if "/" in k) == sorted(f"validation/{name}" for name in held_out["files"])


def test_first_launch_commits_checkpoints_to_s3(s3_run, s3):
    prefix = "raytrain/ci/demo/s3run/checkpoints/"
    keys = _keys(s3, prefix)
    assert s3.get_object(Bucket=BUCKET, Key=prefix + "latest")["Body"].read().decode().strip() == "step_00000004"
    for step in (2, 4):
        manifest = json.loads(s3.get_object(Bucket=BUCKET, Key=f"{prefix}step_{step:08d}/manifest.json")["Body"].read())
        assert manifest["step"] == step and manifest["metadata"]["data_position"] == step * 2
        # every file the manifest lists is on S3 with its size and sha256, as boto3 (not our code) reads it
        for rel, entry in manifest["files"].items():
            key = f"{prefix}step_{step:08d}/{rel}"
            assert keys[key] == entry["size"]
            assert hashlib.sha256(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()).hexdigest() == entry["sha256"]
        assert any("layer_00-model_states.pt" in rel for rel in manifest["files"])
        assert any("layer_04-model_states.pt" in rel for rel in manifest["files"])
    assert not [k for k in keys if ".partial" in k or ".raytrain-upload-" in k]  # no staging leftovers on the bucket
    # Ray Train kept its own run state on S3 too (RunConfig storage_path + storage_filesystem from the resolver)
    assert _keys(s3, "raytrain/ci/demo/s3run/ray/")
    assert s3_run["first"]["final"]["step"] == FIRST_LAUNCH_STOP


@pytest.fixture(scope="module")
def resumed(s3_run, s3_endpoint):
    """Second launch of the same run name without stop_at_step: resumes from S3 and finishes MAX_STEPS, through a
    proxy that answers 503 SlowDown (S3 throttling) to the launch's first 5 requests and then to every 7th request
    while it runs: the driver's, Ray Data's and the trainer workers' S3 clients all retry."""
    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    prefix = "raytrain/ci/demo/s3run/checkpoints/"
    before = {step: client.get_object(Bucket=BUCKET, Key=f"{prefix}step_{step:08d}/manifest.json")["Body"].read()
              for step in (2, 4)}
    job = _job(f"s3://{BUCKET}/raytrain", "s3run", s3_endpoint)
    with fault_proxy(s3_endpoint) as proxy, console_to(s3_run["console"]):
        proxy.fail_next(5)
        proxy.fail_every(7)
        summary = run_train(_job(f"s3://{BUCKET}/raytrain", "s3run", proxy.url))
        throttled = proxy.failed
    return {"job": job, "summary": summary, "manifests_before": before, "throttled": throttled}


def test_second_launch_resumes_from_s3(resumed, s3):
    prefix = "raytrain/ci/demo/s3run/checkpoints/"
    assert resumed["summary"]["final"]["step"] == MAX_STEPS
    assert resumed["throttled"] >= 10  # SlowDowns answered during the launch, every one retried
    assert s3.get_object(Bucket=BUCKET, Key=prefix + "latest")["Body"].read().decode().strip() == "step_00000006"
    # resumed, not restarted: the checkpoints of the first launch were never re-committed (byte-identical manifests)
    for step, data in resumed["manifests_before"].items():
        assert s3.get_object(Bucket=BUCKET, Key=f"{prefix}step_{step:08d}/manifest.json")["Body"].read() == data
    store = CheckpointStore(open_run(resumed["job"]).root)
    assert [c.step for c in store.committed()] == [2, 4, 6]
    assert store.verify(store.latest()).step == MAX_STEPS
    summary = json.loads(s3.get_object(Bucket=BUCKET, Key="raytrain/ci/demo/s3run/reports/run_summary.json")
                         ["Body"].read())
    assert summary["final"]["step"] == MAX_STEPS and summary["run"] == f"s3://{BUCKET}/raytrain/ci/demo/s3run"
    # the S3 run lock (conditional writes): two launches, two generations; released at the end; the owner recorded
    run_prefix = "raytrain/ci/demo/s3run/"
    assert s3.get_object(Bucket=BUCKET, Key=run_prefix + ".lock.generation")["Body"].read().strip() == b"2"
    assert run_prefix + ".lock" not in _keys(s3, run_prefix)
    assert json.loads(s3.get_object(Bucket=BUCKET, Key=run_prefix + "owner.json")["Body"].read())["user"] == "ci"


def test_s3_resume_fetches_each_ranks_own_files_and_frees_them(resumed, s3):
    """Each rank downloaded only the files its stage loads (its layers, mp_rank model states) into a temp dir
    gone after the load; the load succeeding from that partial copy (and the weights matching an uninterrupted run,
    below) shows those files are all DeepSpeed opens."""
    prefix = "raytrain/ci/demo/s3run/"
    manifest = json.loads(s3.get_object(Bucket=BUCKET, Key=f"{prefix}checkpoints/step_00000004/manifest.json")
                          ["Body"].read())
    files = manifest["files"]
    records = [json.loads(s3.get_object(Bucket=BUCKET, Key=f"{prefix}reports/resume/step_00000004-rank{rank}.json")
                          ["Body"].read()) for rank in (0, 1)]
    layers = [sorted(f for f in r["files"] if "/layer_" in f) for r in records]
    assert layers[0] and layers[1] and not set(layers[0]) & set(layers[1])
    assert sorted(layers[0] + layers[1]) == sorted(f for f in files if "/layer_" in f)
    assert max(layers[0]) < min(layers[1])  # stage 0 holds the first layers
    for rank, record in enumerate(records):
        # only its own mp_rank model states; the other rank's as a stand-in (DeepSpeed counts them and reads
        # mp_world_size from the first)
        mp_files = [f"ds/mp_rank_{r:02d}_model_states.pt" for r in (0, 1)]
        assert sorted(f for f in record["files"] if "/layer_" not in f) == [mp_files[rank]]
        assert record["stand_ins"] == [mp_files[1 - rank]]
        manifest_bytes = len(json.dumps(manifest, indent=1, sort_keys=True).encode())
        assert record["fetched_bytes"] == sum(files[f]["size"] for f in record["files"]) + manifest_bytes
        assert record["checkpoint_bytes"] == sum(e["size"] for e in files.values()) > record["fetched_bytes"]
        assert record["local_dir_removed"] and not os.path.exists(record["local_dir"])
        print(f"S3 resume rank {rank}: temp disk {record['fetched_bytes']:,} B of a {record['checkpoint_bytes']:,} B "
              f"checkpoint ({len(record['files'])} of {len(files)} files), removed after the load")
    copies = os.path.dirname(records[0]["local_dir"])
    assert not os.path.exists(copies) or os.listdir(copies) == []


def test_export_from_s3_uses_a_removed_temp_copy_and_no_lease_is_left(resumed, s3, tmp_path):
    """export_latest on the S3 run: the safetensors hold the checkpoint's layer tensors as boto3 reads them; its
    temp copy and its lease are gone afterwards."""
    from safetensors.torch import load_file

    from raytrain.pipeline.model import MistralConfig, hf_prefix
    from raytrain.runner import export_latest

    out = export_latest(resumed["job"], str(tmp_path / "hf"))
    exported = load_file(os.path.join(out, "model.safetensors"))
    prefix = "raytrain/ci/demo/s3run/checkpoints/"
    cfg = MistralConfig.preset(resumed["job"].model.preset)
    for index in range(cfg.num_pipeline_layers):
        key = f"{prefix}step_{MAX_STEPS:08d}/ds/layer_{index:02d}-model_states.pt"
        local = tmp_path / f"layer_{index:02d}.pt"
        local.write_bytes(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read())
        for name, tensor in torch.load(local, map_location="cpu", weights_only=True).items():
            assert torch.equal(exported[hf_prefix(index, cfg) + name], tensor), (index, name)
    # released: no lease object left (pyarrow may keep an empty "leases/" folder marker)
    assert [k for k in _keys(s3, prefix + "leases/") if not k.endswith("/")] == []
    assert CheckpointStore(open_run(resumed["job"]).root).leases() == []
    copies = os.path.join(tempfile.gettempdir(), "raytrain-local-copies")  # the store's default node-local root
    assert not [f for _, _, fs in os.walk(copies) for f in fs]


def test_resumed_s3_run_matches_uninterrupted_posix_run(resumed, s3_run, s3_endpoint, tmp_path_factory):
    """An uninterrupted run on a POSIX root, same packed data (copied down from S3 with pyarrow): same weights."""
    root = tmp_path_factory.mktemp("posix-ref")
    s3_run["posix_root"] = str(root)
    job = _job(str(root), "s3run", s3_endpoint)  # same run name: same data hash and config apart from the root
    run = open_run(job)
    src = s3_run["run"].root.join("data", "packed")
    os.makedirs(run.paths.packed.path)
    pafs.copy_files(src.path, run.paths.packed.path, source_filesystem=src.filesystem,
                    destination_filesystem=pafs.LocalFileSystem())
    os.makedirs(run.root.join("reports").path, exist_ok=True)  # the train loop appends metrics there
    run_train(job)
    posix_ckpt = CheckpointStore(run.root).latest()
    s3_store = CheckpointStore(open_run(resumed["job"]).root)
    s3_ckpt = s3_store.latest()
    assert posix_ckpt.step == s3_ckpt.step == MAX_STEPS
    assert s3_ckpt.metadata["metrics"]["loss"] == posix_ckpt.metadata["metrics"]["loss"]
    layer_files = sorted(f for f in s3_ckpt.manifest["files"] if "layer_" in f)
    assert layer_files == sorted(f for f in posix_ckpt.manifest["files"] if "layer_" in f) and layer_files
    with tempfile.TemporaryDirectory() as tmp:
        s3_store.download(s3_ckpt, tmp)  # checks every sha256 on the way down
        for rel in layer_files:
            a = torch.load(os.path.join(tmp, rel), map_location="cpu", weights_only=True)
            b = torch.load(os.path.join(posix_ckpt.local_path, rel), map_location="cpu", weights_only=True)
            assert a.keys() == b.keys()
            for k in a:
                assert torch.equal(a[k], b[k]), f"{rel}:{k} differs between the S3-resumed and the POSIX run"


def _dashboard_get(ray_s3, path: str, token: str | None) -> tuple[int, str]:
    request = urllib.request.Request(ray_s3["dashboard"] + path)
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def test_embedded_ray_requires_its_token(ray_s3):
    """The embedded Ray raytrain starts keeps token auth: the job API refuses a request without the token or with a
    wrong one, and answers the right one. The token file is private to its owner."""
    assert ray_s3["dashboard"].startswith("http://127.0.0.1:"), "the dashboard must be up for this test"
    assert os.stat(ray_s3["token_path"]).st_mode & 0o777 == 0o600
    assert _dashboard_get(ray_s3, "/api/jobs/", None)[0] == 401
    assert _dashboard_get(ray_s3, "/api/jobs/", "0" * 64)[0] == 403
    status, body = _dashboard_get(ray_s3, "/api/jobs/", ray_s3["token"])
    assert status == 200 and isinstance(json.loads(body), list)


def count_canaries(data: bytes | str, values=None) -> int:
    values = CANARY.values() if values is None else values
    text = data.decode(errors="replace") if isinstance(data, bytes) else data
    return sum(text.count(v) for v in values)


def _files_under(folder: str) -> list[str]:
    return [os.path.join(d, name) for d, _, names in os.walk(folder) for name in names]


def test_no_credential_reaches_logs_dashboard_ps_run_files_or_console(ray_s3, resumed, s3_run, s3):
    """After both launches (and the POSIX reference run, when it ran): zero copies of any canary credential, and of
    the Ray token, outside this process."""
    found: dict[str, int] = {}
    for path in _files_under(os.path.join(ray_s3["session_dir"], "logs")):  # every node's logs on one machine
        with open(path, "rb") as f:
            n = count_canaries(f.read(), [*CANARY.values(), ray_s3["token"]])
        if n:
            found[path] = n
    for api in ("/api/jobs/", "/api/v0/actors?detail=1&limit=10000", "/api/v0/tasks?detail=1&limit=10000"):
        status, body = _dashboard_get(ray_s3, api, ray_s3["token"])
        assert status == 200, (api, body[:300])
        if count_canaries(body):
            found[api] = count_canaries(body)
    ray_s3["ps"].stop()  # what every local user could read: sampled for the whole module so far
    assert ray_s3["ps"].samples > 10
    if count_canaries("\n".join(ray_s3["ps"].seen)):
        found["ps"] = count_canaries("\n".join(ray_s3["ps"].seen))
    keys = _keys(s3, "raytrain/ci/demo/s3run/")
    assert any(k.endswith("run_summary.json") for k in keys) and any("/checkpoints/" in k for k in keys)
    for key in keys:
        n = count_canaries(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read())
        if n:
            found[f"s3://{BUCKET}/{key}"] = n
    for path in _files_under(s3_run.get("posix_root", "")) if s3_run.get("posix_root") else []:
        with open(path, "rb") as f:
            n = count_canaries(f.read())
        if n:
            found[path] = n
    with open(s3_run["console"], "rb") as f:
        console = f.read()
    assert b"[raytrain] step" in console  # the capture did see the run's console
    if count_canaries(console):
        found["console"] = count_canaries(console)
    assert found == {}, found
