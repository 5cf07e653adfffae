"""The run lock's HDFS path, against a fake: no HDFS can run here. What is faked is only the namenode's two
behaviours the lock relies on: `hdfs dfs -put -d - <uri>` creates a file without overwrite (refusing with
"File exists"), and the pyarrow filesystem (a local folder standing in for the namespace). The lock logic on top
(exclusive create, takeover and heartbeat by delete + exclusive create under the marker, generations, fences) is
the real code."""

import json
import os
import stat
import sys
import time

import pyarrow.fs as pafs
import pytest
from lock_race import race_for_lock

from raytrain import storage
from raytrain.runlock import LockInfo, LockLostError, RunLock
from raytrain.storage import resolve

FAKE_HDFS = """#!{python}
import os, sys
from urllib.parse import urlsplit
args = sys.argv[1:]
assert args[:4] == ["dfs", "-put", "-d", "-"], args
path = os.environ["FAKE_HDFS_ROOT"] + urlsplit(args[4]).path
try:
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o640)
except FileExistsError:
    sys.stderr.write("put: `%s': File exists\\n" % urlsplit(args[4]).path)
    sys.exit(1)
os.write(fd, sys.stdin.buffer.read())
os.close(fd)
"""


@pytest.fixture
def hdfs_run(tmp_path, monkeypatch):
    namespace = tmp_path / "namespace"
    namespace.mkdir()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    cli = bin_dir / "hdfs"
    cli.write_text(FAKE_HDFS.format(python=sys.executable))
    cli.chmod(cli.stat().st_mode | stat.S_IXUSR)
    monkeypatch.delenv("HADOOP_HOME", raising=False)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_HDFS_ROOT", str(namespace))
    real = storage._filesystem
    local = pafs.SubTreeFileSystem(str(namespace), pafs.LocalFileSystem())
    monkeypatch.setattr(storage, "_filesystem", lambda scheme, *a: local if scheme == "hdfs" else real(scheme, *a))
    return resolve("hdfs://nn:8020/runs/alice/p/r"), namespace


def test_exclusive_create_goes_through_the_namenode(hdfs_run):
    run, namespace = hdfs_run
    loc = run.join("x")
    assert loc.create_exclusive("first") and not loc.create_exclusive("second")
    assert (namespace / "runs/alice/p/r/x").read_text() == "first"


def test_hdfs_lock_race_takeover_heartbeat_and_fence(hdfs_run):
    run, namespace = hdfs_run
    winners, outcomes = race_for_lock(run, 6)
    assert len(winners) == 1, outcomes
    lock_file = namespace / "runs/alice/p/r/.lock"
    held = LockInfo.from_json(lock_file.read_text())
    assert held.token == winners[0] and held.generation == 1

    a = RunLock(run, heartbeat_interval_s=None)
    a._info, a._version = held, lock_file.read_text()  # the winner, as its own RunLock saw it
    assert a._beat(held) and json.loads(lock_file.read_text())["token"] == held.token  # delete + create
    # The winner's host goes quiet; another job takes over with the next generation.
    lock_file.write_text(LockInfo("node-a", 1, 0.0, "alice", 0.0, held.token, 1).to_json())
    os.utime(lock_file, (time.time() - 3600, time.time() - 3600))
    a._version = lock_file.read_text()
    b = RunLock(run, heartbeat_interval_s=None, stale_after_s=60)
    assert b.acquire().generation == 2
    assert not a._beat(held) and a.lost  # its heartbeat finds another lock and leaves it alone
    assert LockInfo.from_json(lock_file.read_text()).token == b.fence.token
    with pytest.raises(LockLostError, match="generation 2"):
        a.check("commit checkpoint step 4")
    assert not (namespace / "runs/alice/p/r/.lock.takeover").exists()
    b.release()
    assert not lock_file.exists()
