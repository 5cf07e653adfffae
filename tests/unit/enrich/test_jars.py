"""Which jars a Spark session gets (raytrain.enrich.jars): pure logic on temp folders, no JVM, no download."""

import pytest

from raytrain.enrich.jars import S3A_JARS, find_s3a_jars, spark_jar_configs
from raytrain.errors import RaytrainError
from raytrain.storage import resolve


@pytest.fixture()
def jars_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYTRAIN_JARS_DIR", str(tmp_path / "jars"))
    return tmp_path / "jars"


def test_no_jars_needed_for_posix(jars_dir, tmp_path):
    assert spark_jar_configs((), [resolve(str(tmp_path))]) == {}


def test_s3_without_jars_is_a_clear_error(jars_dir):
    with pytest.raises(RaytrainError, match=r"raytrain fetch-jars.*enrich\.spark_jars"):
        spark_jar_configs((), [resolve("/tmp/in"), resolve("s3://bucket/runs")])


def test_s3_uses_cached_jars_only_when_complete(jars_dir):
    jars_dir.mkdir()
    (jars_dir / S3A_JARS[0]).write_bytes(b"PK")
    assert find_s3a_jars() is None  # one of two is not enough
    (jars_dir / S3A_JARS[1]).write_bytes(b"")
    assert find_s3a_jars() is None  # an empty (truncated) jar does not count
    (jars_dir / S3A_JARS[1]).write_bytes(b"PK")
    conf = spark_jar_configs((), [resolve("s3://bucket/runs")])
    assert conf == {"spark.jars": ",".join(str(jars_dir / n) for n in S3A_JARS)}


def test_explicit_jars_win_and_must_exist(jars_dir, tmp_path):
    jar = tmp_path / "my-hadoop-aws.jar"
    jar.write_bytes(b"PK")
    assert spark_jar_configs((str(jar),), [resolve("s3://bucket/runs")]) == {"spark.jars": str(jar)}
    with pytest.raises(RaytrainError, match=r"enrich\.spark_jars\[1\]: .*missing\.jar is not a file"):
        spark_jar_configs((str(jar), str(tmp_path / "missing.jar")), [])
