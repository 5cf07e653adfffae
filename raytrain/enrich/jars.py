"""The Java jars Spark needs for s3a:// (hadoop-aws + the AWS SDK bundle): where to find them and how to get them.

pyspark 3.5 ships Hadoop's client (3.3.4) but not its S3 connector. On a cluster with Maven access one would set
``spark.jars.packages=org.apache.hadoop:hadoop-aws:3.3.4``; here only package registries are reachable, so the jars
come from PyPI: the ``sagemaker_pyspark==1.4.5`` sdist carries ``hadoop-aws-3.3.1.jar`` and
``aws-java-sdk-bundle-1.11.901.jar`` (the SDK that hadoop-aws 3.3.1 was built against). The wheel cannot be installed
beside pyspark 3.5 (it pins pyspark==3.3.0), so ``fetch_s3a_jars`` downloads the sdist without dependencies and
extracts only the two jars (about 190 MB) into a cache folder. hadoop-aws 3.3.1 on Hadoop client 3.3.4 was checked
here by writing and reading Parquet on a loopback S3 server (tests/integration/test_storage_forms.py).

Which jars a run uses: ``enrich.spark_jars`` when set, else (only when a Spark path is s3://) the two jars found in
``$RAYTRAIN_JARS_DIR`` or ``~/.cache/raytrain/jars``; missing jars are an error that says how to get them.
"""

from __future__ import annotations

import glob
import logging
import os
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterable

from raytrain.errors import RaytrainError
from raytrain.storage import StorageLocation

log = logging.getLogger(__name__)

S3A_JARS = ("hadoop-aws-3.3.1.jar", "aws-java-sdk-bundle-1.11.901.jar")
JARS_SDIST = "sagemaker_pyspark==1.4.5"
"""The PyPI source distribution the jars are taken from (deps/jars/ inside it)."""


def default_jars_dir() -> str:
    return os.environ.get("RAYTRAIN_JARS_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "raytrain", "jars")


def find_s3a_jars(jars_dir: str | None = None) -> list[str] | None:
    """Paths of the S3A_JARS in ``jars_dir`` (default: default_jars_dir()), or None when any is missing."""
    folder = jars_dir or default_jars_dir()
    paths = [os.path.join(folder, name) for name in S3A_JARS]
    return paths if all(os.path.isfile(p) and os.path.getsize(p) > 0 for p in paths) else None


def fetch_s3a_jars(jars_dir: str | None = None) -> list[str]:
    """Download JARS_SDIST from the package index (pip, no dependencies) and extract S3A_JARS into ``jars_dir``.

    Idempotent: returns at once when the jars are already there. Each jar is extracted to a temporary name and
    renamed into place, so a crash never leaves a truncated jar that find_s3a_jars would accept."""
    folder = jars_dir or default_jars_dir()
    found = find_s3a_jars(folder)
    if found:
        return found
    os.makedirs(folder, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="raytrain-jars-") as tmp:
        log.info("fetching %s from the package index for %s (about 190 MB)", JARS_SDIST, ", ".join(S3A_JARS))
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q", "-d", tmp,
               JARS_SDIST]
        done = subprocess.run(cmd, capture_output=True, text=True)
        archives = glob.glob(os.path.join(tmp, "sagemaker_pyspark-*.tar.gz"))
        if done.returncode != 0 or not archives:
            raise RaytrainError(f"could not download {JARS_SDIST} ({' '.join(cmd)}): "
                                f"{(done.stderr or done.stdout).strip()[-500:]}. Fix: allow pip to reach the package "
                                f"index, or put {' and '.join(S3A_JARS)} into {folder} yourself.")
        with tarfile.open(archives[0], "r:gz") as archive:
            members = {os.path.basename(m.name): m for m in archive.getmembers() if m.name.endswith(".jar")}
            for name in S3A_JARS:
                if name not in members:
                    raise RaytrainError(f"{archives[0]} has no {name}; put the jar into {folder} yourself.")
                source = archive.extractfile(members[name])
                partial = os.path.join(folder, f".{name}.partial")
                with open(partial, "wb") as f:
                    while chunk := source.read(1 << 20):
                        f.write(chunk)
                os.replace(partial, os.path.join(folder, name))
    found = find_s3a_jars(folder)
    assert found, f"extracted {S3A_JARS} into {folder} but cannot find them"
    return found


def spark_jar_configs(spark_jars: Iterable[str], locations: Iterable[StorageLocation]) -> dict[str, str]:
    """``spark.jars`` for a Spark session reading/writing ``locations``.

    ``spark_jars`` (enrich.spark_jars) wins when given: every path must exist. Otherwise, when a location is s3://,
    the s3a jars from the cache folder; {} when no jar is needed. Raises RaytrainError naming the fix."""
    jars = list(spark_jars)
    for i, path in enumerate(jars):
        if not os.path.isfile(path):
            raise RaytrainError(f"enrich.spark_jars[{i}]: {path} is not a file. Fix the path or drop it.")
    if not jars and any(loc.scheme == "s3" for loc in locations):
        found = find_s3a_jars()
        if not found:
            raise RaytrainError(
                f"Spark needs {' and '.join(S3A_JARS)} for s3:// paths and they are not in {default_jars_dir()}. "
                "Fix: run `raytrain fetch-jars` once (downloads them from PyPI), or set enrich.spark_jars to your "
                "own hadoop-aws + aws-java-sdk-bundle jars.")
        jars = found
    return {"spark.jars": ",".join(jars)} if jars else {}
