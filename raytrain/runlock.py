"""One writer per run: `<run>/.lock` names the job that owns a run directory, so two jobs never interleave
checkpoints or reports under the same run name.

Every change of the lock is a compare-and-swap, so of several processes racing exactly one wins, on every backend:
- create: POSIX O_CREAT|O_EXCL, S3 `If-None-Match: *`, HDFS the namenode's create without overwrite
  (StorageLocation.create_exclusive);
- replace (takeover of a stale lock, heartbeat): S3 `If-Match: <etag of what was read>`; POSIX and HDFS under a
  second exclusively created file (`.lock.takeover`), re-reading the lock under it. HDFS replaces by delete +
  exclusive create: a job that slips into that gap wins, and the replacing job finds it has lost.

Fencing: each acquisition (fresh or takeover) gets a generation one higher than any before it in this run
(`.lock.generation` remembers the last across releases). Writers carry `Fence(token, generation)` and call
`check_fence` right before a commit or a delete: a job whose lock was taken over is refused (LockLostError)
instead of writing next to the new owner.

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
from dataclasses import asdict, dataclass, replace

from raytrain import s3
from raytrain.errors import RaytrainError
from raytrain.storage import StorageLocation, default_user

LOCK_NAME = ".lock"
TAKEOVER_NAME = ".lock.takeover"
GENERATION_NAME = ".lock.generation"
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
    generation: int = 0
    """Acquisition number in this run: one more than the lock this one created or took over (0: an older lock)."""

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
                generation=int(raw.get("generation", 0)),
            )
        except (ValueError, KeyError, TypeError):
            return None


@dataclass(frozen=True)
class Fence:
    """What a job's writers (the driver, Ray Train rank 0) carry to prove they still own the run."""

    token: str
    """LockInfo.token of the job's acquisition."""
    generation: int
    """LockInfo.generation of it."""


class LockLostError(RaytrainError):
    """This job's run lock was taken over: it must stop and write nothing more."""


def check_fence(run_root: StorageLocation, fence: Fence, action: str) -> None:
    """Return when `<run_root>/.lock` still holds `fence`; else raise LockLostError naming the new holder and what
    was refused (`action`, e.g. "commit checkpoint step 40"). One small read: call it right before a write that
    another owner must not see."""
    try:
        raw = run_root.join(LOCK_NAME).read_text()
    except FileNotFoundError:
        raw = ""
    current = LockInfo.from_json(raw) if raw else None
    if current is not None and (current.token, current.generation) == (fence.token, fence.generation):
        return
    now = (f"held by {current.user}@{current.host} pid {current.pid} (generation {current.generation})"
           if current is not None else "not held by anyone")
    raise LockLostError(
        f"run {run_root.uri}: this job lost its run lock (generation {fence.generation}); the lock is now {now}. "
        f"Refused to {action}: this job stops and writes nothing more to the run. Another job took the run over "
        f"(this job's heartbeat looked stale to it). See `raytrain status {run_root.uri}`; to go on training, "
        "stop the other job and run this one again (it resumes from the latest checkpoint)."
    )


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


class _MarkerBusy(Exception):
    """Another process holds the takeover marker (POSIX/HDFS) longer than we may wait."""


class _LockFile:
    """Compare-and-swap on the lock file, per backend. A `version` names what was read: the S3 ETag, else the
    text itself (POSIX and HDFS compare content under the takeover marker)."""

    def __init__(self, run_root: StorageLocation):
        self.loc = run_root.join(LOCK_NAME)
        self.marker = run_root.join(TAKEOVER_NAME)
        self.s3 = run_root.scheme == "s3"

    def read(self) -> tuple[str, str] | None:
        """(text, version) of the lock, None when there is none."""
        if self.s3:

            got = s3.read(self.loc.uri, self.loc.path, self.loc.s3_endpoint)
            return None if got is None else (got[0].decode("utf-8", "replace"), got[1])
        try:
            raw = self.loc.read_text()
        except FileNotFoundError:
            return None
        return raw, raw

    def create(self, text: str) -> str | None:
        """Create the lock holding `text` when there is none; its version, or None when one exists."""
        if self.s3:

            return s3.create(self.loc.uri, self.loc.path, text.encode("utf-8"), self.loc.s3_endpoint)
        return text if self.loc.create_exclusive(text) else None

    def replace(self, version: str, text: str, wait_s: float) -> str | None:
        """Replace the lock by `text` only while it is still `version`; the new version, or None when it changed.
        Raises _MarkerBusy when another process holds the takeover marker for more than `wait_s`."""
        if self.s3:

            return s3.replace(self.loc.uri, self.loc.path, text.encode("utf-8"), version, self.loc.s3_endpoint)
        if not self._take_marker(wait_s):
            raise _MarkerBusy
        try:
            current = self.read()
            if current is None or current[1] != version:
                return None
            if self.loc.is_posix:
                self.loc.write_atomic(text)
            else:  # HDFS: no atomic overwrite; whoever creates in the gap wins and we have lost
                self.loc.delete_file()
                if not self.loc.create_exclusive(text):
                    return None
            return text
        finally:
            self.marker.delete_file()

    def _take_marker(self, wait_s: float) -> bool:
        """Create the takeover marker; False when another process still holds it after `wait_s`. A marker older
        than TAKEOVER_STALE_S was left by a killed process and is removed."""
        deadline = time.monotonic() + wait_s
        while not self.marker.create_exclusive(uuid.uuid4().hex):
            mtime_s = self.marker.mtime_s()
            if mtime_s is not None and time.time() - mtime_s > TAKEOVER_STALE_S:
                log.warning("removing takeover marker %s left %.0fs ago by a killed process", self.marker.uri,
                            time.time() - mtime_s)
                self.marker.delete_file()
                continue
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True


class RunLock:
    """Exclusive ownership of a run directory. Use as `with RunLock(run_root): ...` or acquire()/release()."""

    def __init__(
        self,
        run_root: StorageLocation,
        *,
        stale_after_s: float = 600.0,
        heartbeat_interval_s: float | None = 60.0,
        user: str | None = None,
    ):
        """`stale_after_s`: heartbeat age after which another host's lock is taken over.
        `heartbeat_interval_s`: period of the heartbeat thread (None = no thread; keep it well under
        stale_after_s). `user`: recorded holder name (the submitting user)."""
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
        self._user = user
        self._file = _LockFile(run_root)
        self._info: LockInfo | None = None
        self._version = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost = False
        """Set when the heartbeat found the lock taken by someone else (this job must stop writing: check())."""
        self.beats = threading.Semaphore(0)
        """Released once per heartbeat attempt that finished (written, skipped or lost): tests wait on it."""

    # ---- public -------------------------------------------------------------------------------------------
    @property
    def owned(self) -> bool:
        """True between a successful acquire() and release()."""
        return self._info is not None

    @property
    def fence(self) -> Fence:
        """This acquisition's token and generation, for writers to pass to check_fence."""
        if self._info is None:
            raise RaytrainError(f"run lock {self.lock_loc.uri} is not held by this job")
        return Fence(self._info.token, self._info.generation)

    def check(self, action: str) -> None:
        """Raise LockLostError when this job no longer holds the lock: the file holds another acquisition (or
        none), or the heartbeat saw it taken even if it has since been given back."""
        check_fence(self.run_root, self.fence, action)
        if self.lost:
            raise LockLostError(f"run {self.run_root.uri}: this job's heartbeat found its run lock taken by another "
                                f"job; refused to {action}. This job stops and writes nothing more to the run.")

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
        last = self._last_generation()
        info = LockInfo(socket.gethostname(), os.getpid(), now, self._user or _safe_user(), now,
                        uuid.uuid4().hex, last + 1)
        for _ in range(5):  # retries only when the lock vanished or changed under us
            version = self._file.create(info.to_json())
            if version is not None:
                return self._owned(info, version)
            current = self._file.read()
            if current is None:
                continue  # released between our create and read
            raw, seen = current
            reason = self._judge(raw)
            old = LockInfo.from_json(raw)
            info = replace(info, generation=max(last, old.generation if old else 0) + 1)
            try:
                version = self._file.replace(seen, info.to_json(), wait_s=5.0)
            except _MarkerBusy:
                raise RaytrainError(
                    f"another process is taking over {self.lock_loc.uri} right now; retry, or delete "
                    f"{self.run_root.join(TAKEOVER_NAME).uri} if it stays"
                ) from None
            if version is not None:
                who = f"{old.user}@{old.host} pid {old.pid}" if old else "an unreadable lock"
                log.warning("took over stale run lock %s from %s: %s", self.lock_loc.uri, who, reason)
                return self._owned(info, version)
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

    def _last_generation(self) -> int:
        """The generation of the last acquisition of this run (0 for a new run)."""
        try:
            return int(self.run_root.join(GENERATION_NAME).read_text().strip() or 0)
        except (FileNotFoundError, ValueError):
            return 0

    def _owned(self, info: LockInfo, version: str) -> LockInfo:
        self._info, self._version = info, version
        self.lost = False
        # Remembered beside the lock so the next acquisition counts on after a release deleted the lock.
        self.run_root.join(GENERATION_NAME).write_atomic(f"{info.generation}\n")
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
            finally:
                self.beats.release()

    def _beat(self, info: LockInfo) -> bool:
        """One heartbeat: refresh the lock if it is still ours. False when it was taken (sets `lost`)."""
        beat = replace(info, heartbeat=time.time())
        try:
            version = self._file.replace(self._version, beat.to_json(), wait_s=0.0)
        except _MarkerBusy:
            return True  # a takeover is deciding right now; the next beat sees its outcome
        if version is None:
            self.lost = True
            log.error("run lock %s was taken by %s; this job no longer owns the run", self.lock_loc, self.holder())
            return False
        self._version = version
        return True

    def _read_raw(self) -> str | None:
        got = self._file.read()
        return None if got is None else got[0]


def _safe_user() -> str:
    try:
        return default_user()
    except RaytrainError:
        return "unknown"


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
