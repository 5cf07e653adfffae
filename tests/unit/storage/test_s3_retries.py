"""S3 through a throttling server: raytrain.storage's clients retry 503 SlowDown with backoff, keep their retries
when pickled (as Ray ships filesystems to tasks and workers), and abandon a request whose server stops answering.
The server is the loopback moto S3 behind tests/loopback_s3.FaultProxy; boto3 straight to moto is the independent
view of what landed."""

import os
import pickle
import time

import pyarrow.fs as pafs
import pytest
from loopback_s3 import fault_proxy, loopback_s3

from raytrain.errors import RaytrainError
from raytrain.s3 import RetryingS3FileSystem, S3RetrySettings, s3_client_config, s3_retry_settings
from raytrain.storage import resolve

pytest.importorskip("moto.server")
boto3 = pytest.importorskip("boto3")

BUCKET = "retries"
ENV_VARS = ("RAYTRAIN_S3_MAX_ATTEMPTS", "RAYTRAIN_S3_CONNECT_TIMEOUT_S", "RAYTRAIN_S3_REQUEST_TIMEOUT_S")


@pytest.fixture(scope="module")
def servers():
    """(moto endpoint, FaultProxy in front of it), one bucket."""
    with loopback_s3() as endpoint, fault_proxy(endpoint) as proxy:
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=BUCKET)
        yield endpoint, proxy


@pytest.fixture
def proxy(servers, monkeypatch):
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    _, proxy = servers
    proxy.fail_next(0)
    proxy.stall_next(0, 0)
    return proxy


@pytest.fixture
def moto(servers):
    return boto3.client("s3", endpoint_url=servers[0], region_name="us-east-1")


def _through(proxy, key):
    return resolve(f"s3://{BUCKET}/{key}", s3_endpoint=proxy.url)


def _throttled(proxy, n, op):
    """Run op() with the next n requests answered 503 SlowDown; assert all n were spent; return op's result."""
    before = proxy.failed
    proxy.fail_next(n)
    out = op()
    assert proxy.failed - before == n
    return out


def test_writes_reads_and_listings_survive_slowdowns(proxy, moto):
    loc = _through(proxy, "run1")
    payload = os.urandom(5000)
    _throttled(proxy, 3, lambda: loc.join("ckpt/w.bin").write_atomic(payload))
    assert moto.get_object(Bucket=BUCKET, Key="run1/ckpt/w.bin")["Body"].read() == payload
    assert _throttled(proxy, 3, loc.join("ckpt/w.bin").read_bytes) == payload
    assert _throttled(proxy, 3, loc.list_files) == {"ckpt/w.bin": 5000}


def test_a_throttled_read_of_a_small_object_is_retried(proxy, moto):
    """A SlowDown answer longer than the bytes asked for overflows the buffer pyarrow gives the AWS SDK, which then
    reports INTERNAL_FAILURE and does not retry (the control below): `latest`, owner.json and a lock are that
    small, and so is the last chunk of a streamed file. raytrain's reads retry it."""
    for size in (3, 100):
        moto.put_object(Bucket=BUCKET, Key=f"small/{size}", Body=b"s" * size)
        loc = _through(proxy, f"small/{size}")
        proxy.fail_next(3, method="GET")
        assert loc.read_bytes() == b"s" * size and proxy.to_fail == 0
        proxy.fail_next(1, method="GET")
        with pytest.raises(OSError, match="Failed to flush response stream"):
            loc.filesystem.open_input_stream(loc.path).read()
    tail = os.urandom(5 * 2**20 + 10)  # streamed in 1 MiB reads: the last GET asks for 10 bytes
    moto.put_object(Bucket=BUCKET, Key="small/tail", Body=tail)
    with _through(proxy, "small/tail").open_input() as f:
        chunks = [f.read(2**20) for _ in range(5)]
        proxy.fail_next(2, method="GET")
        chunks.append(f.read())
    assert b"".join(chunks) == tail and proxy.to_fail == 0


def test_a_multipart_upload_survives_slowdowns_between_its_parts(proxy, moto):
    """Checkpoint files are multipart uploads: SlowDowns after the first part still end in the whole object."""
    big = os.urandom(12 * 2**20)
    with _through(proxy, "run1/ckpt/big.bin").open_output() as f:
        f.write(big[: 6 * 2**20])
        before = proxy.failed
        proxy.fail_next(3)
        f.write(big[6 * 2**20 :])
    assert proxy.failed - before == 3
    assert moto.get_object(Bucket=BUCKET, Key="run1/ckpt/big.bin")["Body"].read() == big


def test_without_retries_one_slowdown_fails(proxy, moto, monkeypatch):
    """The control: the same proxy ends the call at once when retries are off, so the test above did retry."""
    monkeypatch.setenv("RAYTRAIN_S3_MAX_ATTEMPTS", "1")
    loc = _through(proxy, "run2")
    proxy.fail_next(1)
    with pytest.raises(OSError, match="SLOW_DOWN|503"):
        loc.join("w.bin").write_atomic(b"x")
    assert moto.list_objects_v2(Bucket=BUCKET, Prefix="run2/")["KeyCount"] == 0
    # max_attempts counts the first try: 2 attempts outlast 1 SlowDown, not 2
    monkeypatch.setenv("RAYTRAIN_S3_MAX_ATTEMPTS", "2")
    _throttled(proxy, 1, lambda: loc.join("w.bin").write_atomic(b"y"))
    proxy.fail_next(2)
    with pytest.raises(OSError, match="SLOW_DOWN|503"):
        loc.join("w.bin").read_bytes()


def test_a_pickled_filesystem_keeps_its_retries(proxy, moto):
    """Ray pickles the filesystem it hands to tasks and Train workers; pyarrow's own pickling drops the retry
    strategy (its copy falls back to 3 attempts), ours rebuilds it."""
    moto.put_object(Bucket=BUCKET, Key="run3/a.txt", Body=b"abc")
    copy = pickle.loads(pickle.dumps(_through(proxy, "run3").filesystem))
    assert isinstance(copy, RetryingS3FileSystem)
    info = _throttled(proxy, 3, lambda: copy.get_file_info(f"{BUCKET}/run3/a.txt"))
    assert info.size == 3
    plain = pafs.S3FileSystem(endpoint_override=proxy.url.split("://")[1], scheme="http", region="us-east-1",
                              retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=10))
    plain_copy = pickle.loads(pickle.dumps(plain))
    proxy.fail_next(3)
    with pytest.raises(OSError, match="503"):
        plain_copy.get_file_info(f"{BUCKET}/run3/a.txt")


def test_boto3_with_the_shared_client_config_retries(proxy, moto):
    pytest.importorskip("botocore")
    config = s3_client_config()
    assert config.retries == {"mode": "standard", "total_max_attempts": 10}
    assert (config.connect_timeout, config.read_timeout) == (10.0, 60.0)
    client = boto3.client("s3", endpoint_url=proxy.url, region_name="us-east-1", config=config)
    _throttled(proxy, 3, lambda: client.put_object(Bucket=BUCKET, Key="run4/k", Body=b"v"))
    assert moto.get_object(Bucket=BUCKET, Key="run4/k")["Body"].read() == b"v"


def test_a_stalled_request_times_out_and_is_retried(proxy, moto, monkeypatch):
    monkeypatch.setenv("RAYTRAIN_S3_REQUEST_TIMEOUT_S", "1")
    moto.put_object(Bucket=BUCKET, Key="run5/a.txt", Body=b"late")
    loc = _through(proxy, "run5/a.txt")
    proxy.stall_next(1, 30)
    t0 = time.monotonic()
    assert loc.read_bytes() == b"late"
    assert proxy.stalled == 1 and time.monotonic() - t0 < 15


def test_settings_come_from_the_environment_and_are_checked(monkeypatch):
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    assert s3_retry_settings() == S3RetrySettings(max_attempts=10, connect_timeout_s=10.0, request_timeout_s=60.0)
    monkeypatch.setenv("RAYTRAIN_S3_MAX_ATTEMPTS", "4")
    monkeypatch.setenv("RAYTRAIN_S3_REQUEST_TIMEOUT_S", "2.5")
    assert s3_retry_settings() == S3RetrySettings(max_attempts=4, connect_timeout_s=10.0, request_timeout_s=2.5)
    for var, bad in (("RAYTRAIN_S3_MAX_ATTEMPTS", "0"), ("RAYTRAIN_S3_MAX_ATTEMPTS", "2.5"),
                     ("RAYTRAIN_S3_CONNECT_TIMEOUT_S", "nan"), ("RAYTRAIN_S3_REQUEST_TIMEOUT_S", "-1")):
        monkeypatch.setenv(var, bad)
        with pytest.raises(RaytrainError, match=var):
            s3_retry_settings()
        monkeypatch.delenv(var)


def test_the_pickled_state_stays_pyarrows_constructor_dict(proxy):
    """Ray Data reads ``fs.__reduce__()[1][0]`` as pyarrow's constructor arguments (its obstore download path)."""
    fs = _through(proxy, "x").filesystem
    state = fs.__reduce__()[1][0]
    assert state["endpoint_override"] == proxy.url.split("://")[1] and state["scheme"] == "http"
    assert (state["connect_timeout"], state["request_timeout"]) == (10.0, 60.0)
    copy = pickle.loads(pickle.dumps(fs))
    assert copy.__reduce__()[1][0] == state and copy.equals(fs)
