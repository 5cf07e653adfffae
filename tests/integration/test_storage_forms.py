"""One resolver, every framework, the same files: for each storage form that runs here (a plain POSIX path, a file://
URI, s3:// on a loopback moto server) pyarrow, Ray Data, Ray Train and Spark (RayDP) write and read each other's files
through raytrain.storage.resolve. A Spark session whose fs.defaultFS points elsewhere still writes to the resolved
path, because Spark is always handed `spark_uri` (explicit scheme), never a bare path.

Spark covers the POSIX and file:// forms only: s3a:// needs the hadoop-aws + AWS SDK jars, which pyspark does not ship
and this offline machine cannot fetch (the s3 case asserts that they are missing and skips Spark's part).
"""

from __future__ import annotations

import glob
import os
import sys
import tempfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
from loopback_s3 import loopback_s3

from raytrain.config import load_job_config
from raytrain.storage import StorageLocation, resolve

pytest.importorskip("moto.server")
boto3 = pytest.importorskip("boto3")

BUCKET = "raytrain-forms"
TABLE = pa.table({"uuid": [f"id-{i:03d}" for i in range(40)], "value": list(range(40))})
FORMS = ("posix", "file_uri", "s3")


def _has_s3a_jars() -> bool:
    import pyspark

    return bool(glob.glob(os.path.join(os.path.dirname(pyspark.__file__), "jars", "hadoop-aws-*.jar")))


@pytest.fixture(scope="module")
def s3_endpoint():
    with loopback_s3() as endpoint:
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=BUCKET)
        yield endpoint


@pytest.fixture(scope="module")
def roots(s3_endpoint, tmp_path_factory) -> dict[str, StorageLocation]:
    base = tmp_path_factory.mktemp("forms")
    return {
        "posix": resolve(str(base / "posix")),
        "file_uri": resolve(f"file://{base / 'file_uri'}"),
        "s3": resolve(f"s3://{BUCKET}/forms", s3_endpoint=s3_endpoint),
    }


@pytest.fixture(scope="module")
def spark(s3_endpoint, ray_local):
    from raytrain.enrich.spark import spark_session

    job = load_job_config("configs/demo.yaml", ["enrich.num_partitions=2"])
    with spark_session(job.enrich, app_name="raytrain-storage-forms") as session:
        yield session


def _pyarrow_write(loc: StorageLocation) -> None:
    target = loc.join("pyarrow", "part-00000.parquet")
    target.parent.mkdirs()
    with target.filesystem.open_output_stream(target.path) as f:
        pq.write_table(TABLE, f)


def _read_ids(table: pa.Table) -> list[str]:
    return sorted(table.column("uuid").to_pylist())


def test_resolved_views_agree(roots):
    posix, file_uri, s3 = roots["posix"], roots["file_uri"], roots["s3"]
    assert posix.scheme == file_uri.scheme == "file"
    assert posix.spark_uri == posix.uri == f"file://{posix.path}"  # never a bare path for Spark
    assert file_uri.spark_uri.startswith("file:///") and resolve(file_uri.spark_uri) == file_uri
    assert s3.spark_uri == f"s3a://{BUCKET}/forms" and resolve(s3.spark_uri, s3_endpoint=s3.s3_endpoint) == s3
    assert posix.ray_storage_filesystem is None and s3.ray_storage_filesystem is s3.filesystem


@pytest.mark.parametrize("form", FORMS)
def test_pyarrow_and_ray_data_share_files(form, roots, ray_local, s3_endpoint):
    loc = roots[form]
    _pyarrow_write(loc)
    # boto3 / os (not our code) see the object where the resolver says it is
    if loc.scheme == "s3":
        client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
        assert client.head_object(Bucket=BUCKET, Key="forms/pyarrow/part-00000.parquet")["ContentLength"] > 0
    else:
        assert os.path.getsize(os.path.join(loc.path, "pyarrow", "part-00000.parquet")) > 0
    ds = ray.data.read_parquet(loc.join("pyarrow").path, filesystem=loc.filesystem)
    assert sorted(r["uuid"] for r in ds.take_all()) == _read_ids(TABLE)
    ds.write_parquet(loc.join("raydata").path, filesystem=loc.filesystem)
    files = [loc.join("raydata", n) for n in loc.join("raydata").listdir() if n.endswith(".parquet")]
    assert files
    back = pa.concat_tables([pq.read_table(f.path, filesystem=f.filesystem) for f in files])
    assert _read_ids(back) == _read_ids(TABLE)


def _train_loop(config: dict) -> None:
    """Ray Train worker: read the pyarrow-written file through the resolver, report a checkpoint holding a count."""
    import ray.train

    from raytrain.storage import resolve as resolve_in_worker

    loc = resolve_in_worker(config["uri"], s3_endpoint=config["endpoint"])
    table = pq.read_table(loc.join("pyarrow", "part-00000.parquet").path, filesystem=loc.filesystem)
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "rows.txt"), "w") as f:
            f.write(str(table.num_rows))
        ray.train.report({"rows": table.num_rows}, checkpoint=ray.train.Checkpoint.from_directory(d))


@pytest.mark.parametrize("form", FORMS)
def test_ray_train_storage_and_workers_share_files(form, roots, ray_local):
    from ray import cloudpickle
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this test module
    loc = roots[form]
    if not loc.join("pyarrow", "part-00000.parquet").exists():
        _pyarrow_write(loc)
    ray_root = loc.join("ray")
    trainer = TorchTrainer(
        _train_loop, train_loop_config={"uri": loc.uri, "endpoint": loc.s3_endpoint},
        scaling_config=ScalingConfig(num_workers=1, use_gpu=False),
        run_config=RunConfig(name="forms", storage_path=ray_root.ray_storage_path,
                             storage_filesystem=ray_root.ray_storage_filesystem))
    result = trainer.fit()
    assert result.metrics["rows"] == TABLE.num_rows
    # the checkpoint Ray Train persisted is under the resolved location, readable with the resolver's filesystem
    ckpt_path = result.checkpoint.path
    assert ckpt_path.startswith(ray_root.join("forms").path), (ckpt_path, ray_root.uri)
    with loc.filesystem.open_input_stream(ckpt_path.rstrip("/") + "/rows.txt") as f:
        assert f.read().decode() == str(TABLE.num_rows)
    assert any(name.startswith("checkpoint") for name in ray_root.join("forms").listdir())


@pytest.mark.parametrize("form", FORMS)
def test_spark_and_pyarrow_share_files(form, roots, spark):
    loc = roots[form]
    if loc.scheme == "s3":
        assert not _has_s3a_jars()
        pytest.skip("Spark cannot open s3a:// here: no hadoop-aws / AWS SDK jars offline (pyarrow, Ray Data and Ray "
                    "Train cover s3 in this module)")
    if not loc.join("pyarrow", "part-00000.parquet").exists():
        _pyarrow_write(loc)
    # Spark reads what pyarrow wrote
    df = spark.read.parquet(loc.join("pyarrow").spark_uri)
    assert sorted(r["uuid"] for r in df.select("uuid").collect()) == _read_ids(TABLE)
    # pyarrow reads what Spark wrote, at the resolved path
    df.repartition(2).write.mode("overwrite").parquet(loc.join("spark").spark_uri)
    assert os.path.exists(os.path.join(loc.path, "spark", "_SUCCESS"))
    assert _read_ids(pq.read_table(loc.join("spark").path, filesystem=loc.filesystem)) == _read_ids(TABLE)


def test_spark_with_foreign_default_fs_still_writes_to_resolved_path(roots, spark, tmp_path):
    """A cluster whose fs.defaultFS is HDFS would take a bare '/mnt/x' as hdfs://nn/mnt/x; spark_uri prevents it."""
    hconf = spark.sparkContext._jsc.hadoopConfiguration()
    jvm = spark.sparkContext._jvm
    previous = hconf.get("fs.defaultFS")
    hconf.set("fs.defaultFS", "hdfs://no-such-namenode.invalid:8020")
    try:
        # Hadoop itself (not our code) now qualifies a bare path against the foreign default
        default_uri = jvm.org.apache.hadoop.fs.FileSystem.getDefaultUri(hconf).toString()
        assert default_uri == "hdfs://no-such-namenode.invalid:8020"
        loc = resolve(str(tmp_path / "bare" / "out"))
        assert loc.spark_uri == f"file://{loc.path}"
        spark.createDataFrame(TABLE.to_pandas()).coalesce(1).write.mode("overwrite").parquet(loc.spark_uri)
        assert os.path.exists(os.path.join(loc.path, "_SUCCESS"))
        assert _read_ids(pq.read_table(loc.path)) == _read_ids(TABLE)
    finally:
        hconf.set("fs.defaultFS", previous)
