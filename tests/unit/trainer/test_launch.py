"""What the launcher hands Ray Train for the run's storage (raytrain.trainer.launch.ray_storage)."""

import pyarrow.fs as pafs

from raytrain.storage import resolve
from raytrain.trainer.launch import ray_storage


def test_posix_storage_goes_as_a_path(tmp_path):
    loc = resolve(str(tmp_path / "run")).join("ray")
    assert ray_storage(loc) == (str(tmp_path / "run" / "ray"), None)


def test_object_store_storage_carries_the_resolvers_filesystem():
    loc = resolve("s3://bucket/runs/x", s3_endpoint="http://127.0.0.1:1").join("ray")
    path, filesystem = ray_storage(loc)
    assert path == "bucket/runs/x/ray"  # pyarrow paths have no scheme
    assert isinstance(filesystem, pafs.S3FileSystem) and filesystem is loc.filesystem
