"""resolve / StorageLocation / run_root against pyarrow's and pathlib's own URI handling."""

import os
import pathlib
import re
import threading

import pyarrow.fs as pafs
import pytest

from raytrain.enrich.spark import S3A_CREDENTIALS_PROVIDER, S3A_RETRY_CONF, spark_conf, spark_uri
from raytrain.errors import RaytrainError
from raytrain.storage import default_user, parquet_names, resolve, run_root


@pytest.mark.parametrize("given", ["/mnt/lustre/team", "/tmp/x/../y", "file:///mnt/gpfs/a/"])
def test_posix_paths_match_pyarrow_and_pathlib(given):
    loc = resolve(given)
    assert loc.scheme == "file"
    # References: pyarrow's own URI parser and pathlib's URI writer.
    if given.startswith("file:"):
        _, ref_path = pafs.FileSystem.from_uri(given)
        assert loc.path == os.path.normpath(ref_path)
    else:
        assert loc.path == os.path.abspath(given)
    assert loc.uri == pathlib.PurePosixPath(loc.path).as_uri()
    assert spark_uri(loc) == loc.uri  # explicit file://, so an HDFS fs.defaultFS cannot redirect it
    assert loc.local_path == loc.path
    assert isinstance(loc.filesystem, pafs.LocalFileSystem)


def test_file_localhost_uri_is_local():
    # RFC 8089 allows "localhost" as the host of a local file URI (pyarrow refuses it; we accept it).
    assert resolve("file://localhost/srv/w") == resolve("/srv/w")


def test_relative_path_becomes_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    loc = resolve("runs/a")
    assert loc.path == str(tmp_path / "runs" / "a")
    assert spark_uri(loc) == (tmp_path / "runs" / "a").as_uri()


def test_s3_views(monkeypatch):
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    loc = resolve("s3://bucket/runs/x/")
    assert (loc.scheme, loc.path, loc.uri, spark_uri(loc)) == (
        "s3",
        "bucket/runs/x",
        "s3://bucket/runs/x",
        "s3a://bucket/runs/x",
    )
    assert loc.s3_endpoint is None and loc.local_path is None
    assert spark_conf(loc) == {"spark.hadoop.fs.s3a.aws.credentials.provider": S3A_CREDENTIALS_PROVIDER,
                               **S3A_RETRY_CONF}  # no endpoint override without one
    assert resolve(spark_uri(loc)) == loc  # s3a:// resolves back to the same place


def test_s3_endpoint_argument_and_env(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    assert resolve("s3://b/k").s3_endpoint == "http://127.0.0.1:9000"
    assert resolve("s3://b/k", s3_endpoint="http://127.0.0.1:9999").s3_endpoint == "http://127.0.0.1:9999"
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:7000")  # the service-specific variable wins
    loc = resolve("s3://b/k")
    assert loc.s3_endpoint == "http://127.0.0.1:7000"
    assert loc.join("c").s3_endpoint == loc.s3_endpoint  # children keep the endpoint
    assert spark_conf(loc)["spark.hadoop.fs.s3a.endpoint"] == "http://127.0.0.1:7000"
    assert spark_conf(loc)["spark.hadoop.fs.s3a.connection.ssl.enabled"] == "false"  # http:// endpoint
    fs = loc.filesystem
    assert isinstance(fs, pafs.S3FileSystem)
    options = fs.__reduce__()[1][0]  # pyarrow's own record of how it was built
    assert (options["endpoint_override"], options["scheme"]) == ("127.0.0.1:7000", "http")


def test_s3_spark_conf_never_carries_credentials(monkeypatch):
    """Spark copies its conf into JVM command lines and event logs: the driver's keys must not be in it; S3A takes
    them from the AWS SDK's default chain on each executor's node instead."""
    canaries = {"AWS_ACCESS_KEY_ID": "AKIACANARY0000000001", "AWS_SECRET_ACCESS_KEY": "canary-secret-7f3a9c",
                "AWS_SESSION_TOKEN": "canary-session-token-51be"}
    for k, v in canaries.items():
        monkeypatch.setenv(k, v)
    for loc in (resolve("s3://b/k", s3_endpoint="https://s3.internal:443"), resolve("s3://b/k")):
        conf = spark_conf(loc)
        assert not [v for v in canaries.values() if any(v in c for c in (*conf, *conf.values()))], conf
        assert not [k for k in conf if k.endswith((".access.key", ".secret.key", ".session.token"))]
        assert conf["spark.hadoop.fs.s3a.aws.credentials.provider"] == "com.amazonaws.auth.DefaultAWSCredentialsProviderChain"
    assert "spark.hadoop.fs.s3a.connection.ssl.enabled" not in spark_conf(
        resolve("s3://b/k", s3_endpoint="https://s3.internal:443"))  # https endpoint keeps TLS
    assert spark_conf(resolve("/tmp/x")) == {}  # never leaked into non-S3 locations


def test_s3a_retries_and_timeouts_for_throttling():
    """A 503 SlowDown is retried with backoff, not failed: S3A's throttle and general retry settings, and the
    timeouts, in the forms hadoop-aws 3.3.1 parses (integer milliseconds for the connection ones)."""
    conf = spark_conf(resolve("s3://b/k"))
    assert int(conf["spark.hadoop.fs.s3a.retry.throttle.limit"]) >= 20
    assert int(conf["spark.hadoop.fs.s3a.retry.limit"]) >= 7
    for key in ("retry.interval", "retry.throttle.interval"):
        assert re.fullmatch(r"\d+ms", conf[f"spark.hadoop.fs.s3a.{key}"]), key
    assert 1 <= int(conf["spark.hadoop.fs.s3a.attempts.maximum"]) <= 10  # SDK retries multiply with S3A's
    assert int(conf["spark.hadoop.fs.s3a.connection.establish.timeout"]) > 0
    assert int(conf["spark.hadoop.fs.s3a.connection.timeout"]) >= 60_000


def test_hdfs_views_without_connecting():
    loc = resolve("hdfs://nn.example:8020/user/a/")
    assert (loc.scheme, loc.path, loc.authority, loc.uri) == (
        "hdfs",
        "/user/a",
        "nn.example:8020",
        "hdfs://nn.example:8020/user/a",
    )
    assert spark_uri(loc) == loc.uri
    assert resolve("hdfs:///user/a").uri == "hdfs:///user/a"


@pytest.mark.parametrize(
    "bad, needle",
    [
        ("", "empty"),
        ("   ", "empty"),
        ("gs://b/k", "unknown scheme 'gs'"),
        ("s3:bucket/key", "s3://bucket/key"),
        ("file:relative/x", "file:///absolute/path"),
        ("s3:///key", "no bucket"),
        ("file://host/x", "no host"),
        ("s3://b/a/../c", "'..'"),
        ("file:///a/../../etc", "'..'"),
        ("hdfs://nn:8020", "names no path"),
        ("s3://b/k?x=1", "query"),
    ],
)
def test_bad_uris_name_the_problem(bad, needle):
    with pytest.raises(RaytrainError) as info:
        resolve(bad)
    assert needle in str(info.value)


@pytest.mark.parametrize("part", ["..", "a/../b", "", "/abs", ".", "a//b"])
def test_join_refuses_escapes(tmp_path, part):
    with pytest.raises(RaytrainError, match="join"):
        resolve(str(tmp_path)).join(part)


def test_join_and_run_root(tmp_path):
    root = resolve(str(tmp_path))
    rr = run_root(root, "alice", "proj", "run-01")
    assert rr.path == str(tmp_path / "alice" / "proj" / "run-01")
    assert rr.join("checkpoints/step_1").path == str(tmp_path / "alice/proj/run-01/checkpoints/step_1")
    assert rr.parent.name == "proj"
    s3 = run_root(resolve("s3://b", s3_endpoint="http://127.0.0.1:1"), "alice", "proj", "r")
    assert s3.uri == "s3://b/alice/proj/r"


@pytest.mark.parametrize(
    "field, args", [("user", ("a b", "p", "r")), ("project", ("u", "p/q", "r")), ("run", ("u", "p", ".."))]
)
def test_run_root_names_bad_field(tmp_path, field, args):
    with pytest.raises(RaytrainError, match=f"^{field}="):
        run_root(resolve(str(tmp_path)), *args)


def test_default_user_precedence(monkeypatch):
    monkeypatch.setenv("RAYTRAIN_USER", "ray-user")
    monkeypatch.setenv("USER", "unix")
    assert default_user("cfg.user") == "cfg.user"
    assert default_user() == "ray-user"
    monkeypatch.delenv("RAYTRAIN_USER")
    assert default_user() == "unix"
    monkeypatch.delenv("USER")
    monkeypatch.setenv("LOGNAME", "login")
    assert default_user() == "login"
    monkeypatch.setenv("RAYTRAIN_USER", "bad/name")
    with pytest.raises(RaytrainError, match="RAYTRAIN_USER"):
        default_user()


def test_io_helpers_against_os(tmp_path):
    loc = resolve(str(tmp_path)).join("a")
    assert not loc.exists() and loc.listdir() == [] and loc.list_files() == {}
    with loc.join("x/y.bin").open_output() as f:
        f.write(b"\x00\x01")
    with loc.join("t.txt").open_output(text=True) as f:
        f.write("héllo")
    assert loc.is_dir() and loc.join("t.txt").is_file()
    assert loc.listdir() == sorted(os.listdir(tmp_path / "a"))
    assert loc.list_files() == {"x/y.bin": 2, "t.txt": os.path.getsize(tmp_path / "a" / "t.txt")}
    with loc.join("t.txt").open_input(text=True) as f:
        assert f.read() == (tmp_path / "a" / "t.txt").read_text(encoding="utf-8")
    loc.join("p").write_atomic("v1")
    loc.join("p").write_atomic(b"v2")
    assert (tmp_path / "a" / "p").read_bytes() == b"v2"
    assert not [n for n in os.listdir(tmp_path / "a") if ".tmp-" in n]  # no temp files left behind
    loc.delete_dir()
    assert not (tmp_path / "a").exists()


def test_write_atomic_readers_never_see_torn_content(tmp_path):
    loc = resolve(str(tmp_path)).join("latest")
    payloads = [bytes([i]) * 200_000 for i in range(1, 6)]
    loc.write_atomic(payloads[0])
    seen, stop = set(), threading.Event()

    def read_loop():
        while not stop.is_set():
            seen.add((tmp_path / "latest").read_bytes())

    reader = threading.Thread(target=read_loop)
    reader.start()
    for _ in range(20):
        for p in payloads:
            loc.write_atomic(p)
    stop.set()
    reader.join()
    assert seen <= set(payloads) and seen


def test_parquet_names_flat_or_wave_by_wave(tmp_path):
    for name in ("part-1.parquet", "part-0.parquet", "_SUCCESS", ".part-0.parquet.crc", "validation/part-0.parquet"):
        (tmp_path / "flat" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "flat" / name).write_bytes(b"")
    assert parquet_names(resolve(str(tmp_path / "flat"))) == ["part-0.parquet", "part-1.parquet"]
    for name in ("wave-00001/part-0.parquet", "wave-00000/part-1.parquet", "wave-00000/part-0.parquet",
                 "wave-00000/_SUCCESS", "wave-00000/x/part-0.parquet"):
        (tmp_path / "waves" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "waves" / name).write_bytes(b"")
    assert parquet_names(resolve(str(tmp_path / "waves"))) == [
        "wave-00000/part-0.parquet", "wave-00000/part-1.parquet", "wave-00001/part-0.parquet"]
    assert parquet_names(resolve(str(tmp_path / "missing"))) == []
