"""RunLock with real processes: a live holder is named, a SIGKILLed one is taken over, a race has one winner."""

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from raytrain.errors import RaytrainError
from raytrain.runlock import LockInfo, LockLostError, RunLock, check_fence, stale_reason
from raytrain.storage import resolve, run_root

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

HOLDER = """
import sys, time
from raytrain.runlock import RunLock
from raytrain.storage import resolve
lock = RunLock(resolve(sys.argv[1]), heartbeat_interval_s=None)
lock.acquire()
print("locked", flush=True)
time.sleep(600)
"""

CONTENDER = """
import os, sys, time
from raytrain.errors import RaytrainError
from raytrain.runlock import RunLock
from raytrain.storage import resolve
go, done = sys.argv[2], sys.argv[3]
print("ready", flush=True)
while not os.path.exists(go):
    time.sleep(0.005)
try:
    RunLock(resolve(sys.argv[1]), heartbeat_interval_s=None, stale_after_s=60).acquire()
    print("OK", flush=True)
    while not os.path.exists(done):  # hold the lock until every other contender has decided and exited
        time.sleep(0.005)
except RaytrainError as exc:
    print("REFUSED", exc, flush=True)
"""


def _read_lock(run):
    with open(os.path.join(run.path, ".lock")) as f:
        return json.load(f)


def _spawn(code, *args):
    env = {**os.environ, "PYTHONPATH": REPO}
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True, env=env)


@pytest.fixture
def run(tmp_path):
    return run_root(resolve(str(tmp_path)), "alice", "proj", "run1")


def test_second_process_is_refused_then_takes_over_after_sigkill(run, caplog):
    holder = _spawn(HOLDER, run.uri)
    try:
        assert holder.stdout.readline().strip() == "locked"
        lock_json = _read_lock(run)
        assert lock_json["pid"] == holder.pid and lock_json["host"] == socket.gethostname()
        with pytest.raises(RaytrainError) as info:
            RunLock(run, heartbeat_interval_s=None).acquire()
        msg = str(info.value)
        assert f"pid {holder.pid}" in msg and socket.gethostname() in msg
        assert time.strftime("%Y-%m-%d %H:%M", time.localtime(lock_json["start_time"])) in msg
        assert ".lock" in msg and "another run name" in msg
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with caplog.at_level(logging.WARNING, logger="raytrain.runlock"):
        with RunLock(run, heartbeat_interval_s=None) as lock:
            held = _read_lock(run)
            assert held["pid"] == os.getpid() and held["token"] == lock._info.token
    assert not os.path.exists(os.path.join(run.path, ".lock"))  # released
    assert any("took over stale run lock" in r.message and str(holder.pid) in r.message for r in caplog.records)


def test_concurrent_takeover_has_exactly_one_winner(run, tmp_path):
    os.makedirs(run.path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = LockInfo(socket.gethostname(), dead.pid, time.time(), "bob", time.time(), "old")
    with open(os.path.join(run.path, ".lock"), "w") as f:
        f.write(stale.to_json())
    go, done = str(tmp_path / "go"), str(tmp_path / "done")
    procs = [_spawn(CONTENDER, run.uri, go, done) for _ in range(5)]
    try:
        # every interpreter has imported raytrain and spins on the go file: one release starts the race
        assert [p.stdout.readline().strip() for p in procs] == ["ready"] * len(procs)
        open(go, "w").close()
        # the losers answer and exit while the winner still holds the lock, however slowly each one decides (a
        # winner that let go early would hand a late contender a dead holder's lock to take over)
        _wait_for(lambda: sum(p.poll() is not None for p in procs) >= len(procs) - 1, timeout_s=60)
    finally:
        for path in (go, done):  # also on a failure above: no contender is left spinning
            open(path, "a").close()
    outs = [p.communicate(timeout=60)[0].strip() for p in procs]
    winners = [p.pid for p, o in zip(procs, outs, strict=True) if o == "OK"]
    assert len(winners) == 1, outs
    refused = [o for o in outs if o.startswith("REFUSED")]
    assert len(refused) == 4 and all(f"pid {winners[0]}" in o or "taking over" in o for o in refused), outs


def test_other_host_lock_judged_by_heartbeat(run):
    os.makedirs(run.path)
    path = os.path.join(run.path, ".lock")
    now = time.time()
    fresh = LockInfo("node-17", 4242, now - 50, "carol", now - 5, "t1")
    with open(path, "w") as f:
        f.write(fresh.to_json())
    with pytest.raises(RaytrainError, match="carol@node-17 pid 4242"):
        RunLock(run, stale_after_s=30, heartbeat_interval_s=None).acquire()
    old = LockInfo("node-17", 4242, now - 500, "carol", now - 400, "t1")
    with open(path, "w") as f:
        f.write(old.to_json())
    past = now - 400
    os.utime(path, (past, past))  # mtime also counts as a sign of life
    lock = RunLock(run, stale_after_s=30, heartbeat_interval_s=None)
    assert lock.acquire().pid == os.getpid()
    lock.release()


def test_stale_reason_rules():
    alive = {1: True, 2: False}
    info = LockInfo("h", 1, 100.0, "u", 100.0, "t")
    judge = lambda i, now=200.0, mtime=None: stale_reason(  # noqa: E731
        i, this_host="h", now_s=now, stale_after_s=50, process_alive=lambda pid, _: alive[pid], mtime_s=mtime
    )
    assert judge(info) is None  # same host, alive: never stale, however old
    assert "no longer running" in judge(LockInfo("h", 2, 100.0, "u", 100.0, "t"))
    other = LockInfo("x", 2, 100.0, "u", 100.0, "t")
    assert "no heartbeat from x" in judge(other)
    assert judge(other, mtime=190.0) is None  # a recent mtime keeps it alive


def test_reused_pid_is_stale(run):
    os.makedirs(run.path)
    # Our own (alive) pid, but the lock predates this process: the pid was reused, the holder is gone.
    reused = LockInfo(socket.gethostname(), os.getpid(), time.time() - 10**6, "dan", time.time() - 10**6, "t")
    with open(os.path.join(run.path, ".lock"), "w") as f:
        f.write(reused.to_json())
    lock = RunLock(run, heartbeat_interval_s=None)
    assert lock.acquire().token != "t"
    lock.release()


def test_release_leaves_a_lock_that_is_not_ours(run):
    lock = RunLock(run, heartbeat_interval_s=None)
    lock.acquire()
    path = os.path.join(run.path, ".lock")
    other = LockInfo("node-2", 7, time.time(), "eve", time.time(), "theirs")
    with open(path, "w") as f:
        f.write(other.to_json())
    lock.release()
    assert _read_lock(run)["token"] == "theirs"


def _wait_for(predicate, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _hold_marker(run) -> str:
    """Hold the takeover marker as a taking-over process does (O_EXCL create)."""
    marker = os.path.join(run.path, ".lock.takeover")
    assert _wait_for(lambda: _try_create(marker)), "the heartbeat never let go of the takeover marker"
    return marker


def _try_create(path: str) -> bool:
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        return True
    except FileExistsError:
        return False


def test_heartbeat_refreshes_and_detects_loss(run):
    """Another process takes the lock over (under the takeover marker, as RunLock does): the heartbeat notices at
    its next beat and leaves the new holder's lock alone (it never writes its own over it)."""
    lock = RunLock(run, stale_after_s=5, heartbeat_interval_s=0.05)
    first = lock.acquire()
    path = os.path.join(run.path, ".lock")
    assert _wait_for(lambda: _read_lock(run)["heartbeat"] > first.heartbeat)
    marker = _hold_marker(run)
    other = LockInfo("node-2", 7, time.time(), "eve", time.time(), "theirs")
    with open(path + ".tmp", "w") as f:
        f.write(other.to_json())
    os.replace(path + ".tmp", path)
    os.unlink(marker)
    assert _wait_for(lambda: lock.lost)
    lock._thread.join(timeout=20)  # the heartbeat stops at the loss: nothing can rewrite its own token later
    assert not lock._thread.is_alive()
    assert _read_lock(run)["token"] == "theirs"
    lock.release()
    assert _read_lock(run)["token"] == "theirs"


def test_heartbeat_skips_while_a_takeover_holds_the_marker(run):
    lock = RunLock(run, stale_after_s=5, heartbeat_interval_s=0.05)
    lock.acquire()
    marker = _hold_marker(run)
    held = _read_lock(run)["heartbeat"]
    for _ in range(6):  # six beats attempted, each skipped: the lock is not written under a takeover's feet
        assert lock.beats.acquire(timeout=20)
    assert _read_lock(run)["heartbeat"] == held and not lock.lost
    os.unlink(marker)
    assert _wait_for(lambda: _read_lock(run)["heartbeat"] > held)
    assert not lock.lost and os.path.exists(os.path.join(run.path, ".lock"))
    lock.release()
    assert not os.path.exists(marker) and not os.path.exists(os.path.join(run.path, ".lock"))


def test_unreadable_fresh_lock_is_refused(run):
    os.makedirs(run.path)
    open(os.path.join(run.path, ".lock"), "w").close()
    with pytest.raises(RaytrainError, match="unreadable"):
        RunLock(run, heartbeat_interval_s=None).acquire()


def test_bad_settings_named():
    with pytest.raises(RaytrainError, match="heartbeat_interval_s"):
        RunLock(resolve("/tmp/x"), stale_after_s=10, heartbeat_interval_s=20)


def test_generation_counts_every_acquisition_and_fences_the_previous_holder(run):
    """Fresh acquisitions after a release and takeovers of a stale lock each get the next generation; the fence of
    an earlier acquisition is refused, naming the new holder, while the current one passes."""
    with RunLock(run, heartbeat_interval_s=None) as first:
        assert first.fence.generation == 1
    second = RunLock(run, heartbeat_interval_s=None)
    assert second.acquire().generation == 2  # counted on from .lock.generation although the lock was deleted
    old_fence = second.fence
    # The holder's process looks dead to the next job (another host, heartbeat long ago): it is taken over.
    stale = LockInfo("node-gone", 1, 0.0, "alice", 0.0, old_fence.token, old_fence.generation)
    path = os.path.join(run.path, ".lock")
    with open(path, "w") as f:
        f.write(stale.to_json())
    os.utime(path, (1.0, 1.0))
    third = RunLock(run, heartbeat_interval_s=None, stale_after_s=60, user="bob")
    assert third.acquire().generation == 3
    third.check("commit checkpoint step 9")
    with pytest.raises(LockLostError) as info:
        check_fence(run, old_fence, "commit checkpoint step 9")
    msg = str(info.value)
    assert "generation 2" in msg and "bob@" in msg and "generation 3" in msg and "commit checkpoint step 9" in msg
    third.release()
    with pytest.raises(LockLostError, match="not held by anyone"):
        check_fence(run, old_fence, "delete partial checkpoints")


def test_check_refuses_once_the_heartbeat_saw_the_lock_go(run):
    lock = RunLock(run, heartbeat_interval_s=None)
    lock.acquire()
    lock.check("commit checkpoint step 1")
    lock.lost = True  # what _beat sets when it finds another token, even if that job has released since
    with pytest.raises(LockLostError, match="heartbeat found its run lock taken.*commit checkpoint step 2"):
        lock.check("commit checkpoint step 2")
    lock.release()
