"""One writer per run: `<run>/.lock` names the job that owns a run directory, so two jobs never interleave
checkpoints or reports under the same run name.

POSIX (Lustre, GPFS, WekaFS, local): the lock is created with O_CREAT|O_EXCL, which these filesystems make atomic
across clients. A stale lock is taken over under a second O_EXCL file (`.lock.takeover`), so of several processes
that find the same stale lock exactly one replaces it; each re-reads the lock afterwards to confirm ownership. The
heartbeat refreshes the lock under the same marker, so its read-check-write cannot interleave with a takeover (it
would otherwise overwrite the new holder's lock with its own); while a takeover holds the marker, a beat is skipped.

S3 / HDFS (best effort): pyarrow offers no exclusive create there, so acquire is read → write → wait `settle_s` →
re-read. Two jobs starting within `settle_s` of each other can both believe they hold the lock; the lock still
stops the common case (a second job started on a run that is in use) with a clear message.

Staleness: a lock from this host is stale when its process is gone (pid dead, a zombie, or reused by a process
started after the lock). A lock from another host is stale when its heartbeat (or the file's mtime, whichever is
newer) is older than `stale_after_s`; run the heartbeat thread (default) so long jobs stay fresh.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass

from raytrain.errors import RaytrainError
from raytrain.storage import StorageLocation, default_user, fsync_dir

LOCK_NAME = ".lock"
TAKEOVER_NAME = ".lock.takeover"
# A takeover holds its marker for milliseconds; one older than this was left by a process killed mid-takeover.
TAKEOVER_STALE_S = 30.0

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LockInfo:
    """Content of `<run>/.lock` (JSON)."""

    host: str
    """Hostname of the holder (socket.gethostname())."""
    pid: int
    """Process id of the holder on `host`."""
    start_time: float
    """Epoch seconds when the lock was taken."""
    user: str
    """User name of the holder."""
    heartbeat: float
    """Epoch seconds of the holder's last heartbeat (= start_time without a heartbeat thread)."""
    token: str
    """Random id of this acquisition; ownership is checked by token, never by pid alone."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True) + "\n"

    @staticmethod
    def from_json(text: str) -> LockInfo | None:
        """Parse a lock file; None when it is empty or not a lock (torn write, foreign file)."""
        try:
            raw = json.loads(text)
            return LockInfo(
                host=str(raw["host"]),
                pid=int(raw["pid"]),
                start_time=float(raw["start_time"]),
                user=str(raw.get("user", "?")),
                heartbeat=float(raw.get("heartbeat", raw["start_time"])),
                token=str(raw.get("token", "")),
            )
        except (ValueError, KeyError, TypeError):
            return None


def stale_reason(
    info: LockInfo,
    *,
    this_host: str,
    now_s: float,
    stale_after_s: float,
    process_alive: Callable[[int, float], bool],
    mtime_s: float | None = None,
) -> str | None:
    """Why `info` no longer protects a live job, or None when its holder must be presumed alive.

    `process_alive(pid, lock_start_time)` is consulted for locks from `this_host` only; other hosts are judged by
    the newest of heartbeat and file mtime (mtime comes from the storage server's clock, heartbeat from theirs).
    """
    if info.host == this_host:
        if not process_alive(info.pid, info.start_time):
            return f"its process {info.pid} on this host ({this_host}) is no longer running"
        return None
    last_s = max(info.heartbeat, mtime_s or 0.0)
    age_s = now_s - last_s
    if age_s > stale_after_s:
        return f"no heartbeat from {info.host} for {age_s:.0f}s (more than stale_after_s={stale_after_s:g})"
    return None


def process_alive(pid: int, not_started_after_s: float | None = None) -> bool:
    """True when `pid` runs on this host and is not a zombie; on Linux also False when the pid was reused by a
    process that started after `not_started_after_s` (the lock's start time)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by another user
    stat = _proc_stat(pid)
    if stat is None:
        return True
    state, start_epoch_s = stat
    if state == "Z":
        return False
    # +2 s: the start time is derived from clock ticks and boot time, both rounded.
    return not (not_started_after_s is not None and start_epoch_s > not_started_after_s + 2.0)


class RunLock:
    """Exclusive ownership of a run directory. Use as `with RunLock(run_root): ...` or acquire()/release()."""

    def __init__(
        self,
        run_root: StorageLocation,
        *,
        stale_after_s: float = 600.0,
        heartbeat_interval_s: float | None = 60.0,
        settle_s: float = 1.0,
        user: str | None = None,
    ):
        """`stale_after_s`: heartbeat age after which another host's lock is taken over.
        `heartbeat_interval_s`: period of the heartbeat thread (None = no thread; keep it well under
        stale_after_s). `settle_s`: wait before the confirming re-read on S3/HDFS. `user`: recorded holder name."""
        if stale_after_s <= 0:
            raise RaytrainError(f"stale_after_s={stale_after_s} must be > 0 (seconds)")
        if heartbeat_interval_s is not None and not 0 < heartbeat_interval_s < stale_after_s:
            raise RaytrainError(
                f"heartbeat_interval_s={heartbeat_interval_s} must be > 0 and < stale_after_s={stale_after_s}"
            )
        self.run_root = run_root
        self.lock_loc = run_root.join(LOCK_NAME)
        self.stale_after_s = stale_after_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self.settle_s = settle_s
        self._user = user
        self._info: LockInfo | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost = False
        """Set when the heartbeat found the lock taken by someone else (this job should stop writing)."""

    # ---- public -------------------------------------------------------------------------------------------
    @property
    def owned(self) -> bool:
        """True between a successful acquire() and release()."""
        return self._info is not None

    def holder(self) -> LockInfo | None:
        """The current lock content, or None when unlocked/unreadable."""
        raw = self._read_raw()
        return None if raw is None else LockInfo.from_json(raw)

    def acquire(self) -> LockInfo:
        """Take the lock; returns what was written. Raises RaytrainError naming the live holder."""
        if self._info is not None:
            return self._info
        self.run_root.mkdirs()
        now = time.time()
        user = self._user or _safe_user()
        info = LockInfo(socket.gethostname(), os.getpid(), now, user, now, uuid.uuid4().hex)
        for _ in range(5):  # retries only when the lock vanished or changed under us
            if self.run_root.is_posix:
                if self._posix_create(info):
                    return self._owned(info)
            elif self._read_raw() is None:
                self.lock_loc.write_atomic(info.to_json())
                return self._confirm(info, took_over=None)
            raw = self._read_raw()
            if raw is None:
                continue  # released between our create and read
            reason = self._judge(raw)
            if self.run_root.is_posix:
                if self._posix_take_over(raw, info):
                    return self._confirm(info, took_over=(raw, reason))
            else:
                self.lock_loc.write_atomic(info.to_json())
                return self._confirm(info, took_over=(raw, reason))
        raise RaytrainError(f"could not acquire {self.lock_loc.uri}: it kept changing under us; retry")

    def release(self) -> None:
        """Stop the heartbeat and remove the lock if (and only if) it is still ours."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        info, self._info = self._info, None
        if info is None:
            return
        current = self.holder()
        if current is None or current.token != info.token:
            log.warning("run lock %s is no longer ours (holder now %s); leaving it", self.lock_loc.uri, current)
            return
        self.lock_loc.delete_file()

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    # ---- internals ----------------------------------------------------------------------------------------
    def _judge(self, raw: str) -> str:
        """Return why the lock in `raw` is stale, or raise the 'held by' error."""
        existing = LockInfo.from_json(raw)
        mtime_s = self.lock_loc.mtime_s()
        if existing is None:
            age_s = time.time() - (mtime_s or time.time())
            if age_s > self.stale_after_s:
                return f"its content is unreadable and it is {age_s:.0f}s old"
            raise RaytrainError(
                f"run lock {self.lock_loc.uri} exists but is unreadable (being written?); retry in a few seconds, "
                f"or delete it if no job uses run {self.run_root.uri}"
            )
        reason = stale_reason(
            existing,
            this_host=socket.gethostname(),
            now_s=time.time(),
            stale_after_s=self.stale_after_s,
            process_alive=process_alive,
            mtime_s=mtime_s,
        )
        if reason is None:
            raise self._held_error(existing)
        return reason

    def _held_error(self, holder: LockInfo) -> RaytrainError:
        started = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(holder.start_time))
        beat_age_s = time.time() - holder.heartbeat
        return RaytrainError(
            f"run {self.run_root.uri} is in use: locked by {holder.user}@{holder.host} pid {holder.pid}, "
            f"started {started} (last heartbeat {beat_age_s:.0f}s ago). Wait for that job to finish, choose "
            f"another run name, or, only if that process is gone, delete {self.lock_loc.uri}. A lock is taken "
            f"over automatically once its process has exited ({holder.host}) or its heartbeat is older than "
            f"{self.stale_after_s:g}s (other hosts)."
        )

    def _posix_create(self, info: LockInfo) -> bool:
        path = self.lock_loc.path
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        try:
            os.write(fd, info.to_json().encode("utf-8"))
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_dir(os.path.dirname(path))
        return True

    def _posix_take_over(self, stale_raw: str, info: LockInfo) -> bool:
        """Replace the stale lock `stale_raw` by ours under the takeover marker; False when it changed meanwhile."""
        marker = self._take_marker(info.token, wait_s=5.0)
        if marker is None:
            raise RaytrainError(
                f"another process is taking over {self.lock_loc.uri} right now; retry, or delete "
                f"{self.run_root.join(TAKEOVER_NAME).path} if it stays"
            )
        try:
            if self._read_raw() != stale_raw:
                return False  # someone took it over (or released it) before we got the marker: judge again
            self.lock_loc.write_atomic(info.to_json())
            return True
        finally:
            _unlink_quiet(marker)

    def _confirm(self, info: LockInfo, took_over: tuple[str, str] | None) -> LockInfo:
        if not self.run_root.is_posix:
            time.sleep(self.settle_s)  # let a concurrent writer's PUT land before we check who won
        current = self.holder()
        if current is None or current.token != info.token:
            if current is None:
                raise RaytrainError(f"run lock {self.lock_loc.uri} vanished while we took it; retry")
            raise self._held_error(current)
        if took_over is not None:
            old = LockInfo.from_json(took_over[0])
            who = f"{old.user}@{old.host} pid {old.pid}" if old else "an unreadable lock"
            log.warning("took over stale run lock %s from %s: %s", self.lock_loc.uri, who, took_over[1])
        return self._owned(info)

    def _owned(self, info: LockInfo) -> LockInfo:
        self._info = info
        self.lost = False
        if self.heartbeat_interval_s is not None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._heartbeat_loop, name="raytrain-runlock", daemon=True)
            self._thread.start()
        return info

    def _heartbeat_loop(self) -> None:
        assert self.heartbeat_interval_s is not None
        while not self._stop.wait(self.heartbeat_interval_s):
            info = self._info
            if info is None:
                return
            try:
                if not self._beat(info):
                    return
            except OSError as exc:  # a storage hiccup must not kill the job; the next beat retries
                log.warning("run lock heartbeat on %s failed: %s", self.lock_loc, exc)

    def _beat(self, info: LockInfo) -> bool:
        """One heartbeat: refresh the lock if it is still ours. False when it was taken (sets `lost`)."""
        marker = None
        if self.run_root.is_posix:
            marker = self._take_marker(info.token, wait_s=0.0)
            if marker is None:
                return True  # a takeover is deciding right now; the next beat sees its outcome
        try:
            current = self.holder()
            if current is None or current.token != info.token:
                self.lost = True
                log.error("run lock %s was taken by %s; this job no longer owns the run", self.lock_loc, current)
                return False
            beat = LockInfo(**{**asdict(info), "heartbeat": time.time()})
            self.lock_loc.write_atomic(beat.to_json())
            return True
        finally:
            if marker is not None:
                _unlink_quiet(marker)

    def _take_marker(self, token: str, wait_s: float) -> str | None:
        """Create the takeover marker (POSIX, O_EXCL) and return its path; None if another process still holds it
        after `wait_s`. A marker older than TAKEOVER_STALE_S was left by a killed process and is removed."""
        marker = self.run_root.join(TAKEOVER_NAME).path
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                try:
                    age_s = time.time() - os.stat(marker).st_mtime
                except FileNotFoundError:
                    continue
                if age_s > TAKEOVER_STALE_S:
                    log.warning("removing takeover marker %s left %.0fs ago by a killed process", marker, age_s)
                    _unlink_quiet(marker)
                    continue
                if time.monotonic() >= deadline:
                    return None
                time.sleep(0.05)
                continue
            try:
                os.write(fd, token.encode())
            finally:
                os.close(fd)
            return marker

    def _read_raw(self) -> str | None:
        try:
            return self.lock_loc.read_text()
        except FileNotFoundError:
            return None


def _safe_user() -> str:
    try:
        return default_user()
    except RaytrainError:
        return "unknown"


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _proc_stat(pid: int) -> tuple[str, float] | None:
    """(state letter, start time in epoch seconds) from Linux /proc, or None elsewhere."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # comm may contain spaces: split after its ')'
        with open("/proc/stat") as f:
            boot_s = next(float(line.split()[1]) for line in f if line.startswith("btime "))
    except (OSError, StopIteration, IndexError, ValueError):
        return None
    # fields[0] is field 3 (state); field 22 (starttime, clock ticks since boot) is fields[19].
    return fields[0], boot_s + int(fields[19]) / os.sysconf("SC_CLK_TCK")
