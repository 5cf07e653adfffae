"""Crash-safe checkpoints on a shared filesystem or an object store, with self-describing manifests.

Protocol (each training rank writes its own files; DeepSpeed needs a local POSIX directory):

    d = store.staging_dir(step)        # every rank, no communication: same name from the step
    engine.save_checkpoint(d, tag=...)  # each rank writes its files into d
    store.upload(step, d)              # s3/hdfs only (a no-op on POSIX, where d is already on shared storage)
    barrier()
    store.commit(step, metadata)       # one rank: manifest.json last, then publish, then `latest`, then retention

What is visible when:
- POSIX and HDFS: ranks write into `checkpoints/step_X.partial/`; commit writes the manifest into it, renames it
  to `step_X/` (atomic) and atomically replaces `checkpoints/latest`. A crash at any point leaves the previous
  checkpoint and `latest` intact; the partial dir is ignored and removed by `cleanup_partials()`.
- S3 (no rename): ranks upload into `checkpoints/step_X/` and the manifest, written after every payload file, is
  the commit marker; a step prefix without a manifest is a partial. `latest` is written after the manifest.

Call `cleanup_partials()` once when a job starts (before any rank stages), never while ranks are writing.

Fencing: a store given the job's run-lock `fence` re-reads `<run>/.lock` before each step of a commit that others
can see (the manifest, the rename, `latest`, retention) and before cleanup_partials(); once another job holds the
run it raises LockLostError and writes nothing.

Reading: on POSIX a rank loads a step dir in place; on s3/hdfs `local_copy(ckpt, files)` downloads only the files
that rank opens (checking each sha256) into a node-local temp dir removed when the block ends. A reader that needs a
step for a while (export) holds a `lease(step)`: retention never deletes a step with a live lease, and a lease
expires unless renewed, so a killed reader does not pin a step forever.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import getpass
import hashlib
import json
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from raytrain import __version__
from raytrain.checkpoint.layout import (
    LATEST_NAME,
    LEASES_DIR,
    MANIFEST_NAME,
    SIDECAR_PREFIX,
    TRASH_PREFIX,
    best_step,
    committed_steps,
    is_payload_file,
    lease_file_name,
    live_leased_steps,
    parse_lease_file_name,
    parse_step_dir_name,
    partial_dir_name,
    partial_names,
    plan_retention,
    step_dir_name,
)
from raytrain.errors import CorruptCheckpointError, RaytrainError
from raytrain.runlock import Fence, check_fence
from raytrain.storage import RunPaths, StorageLocation, fsync_dir

MANIFEST_FORMAT = 1
_CHUNK_BYTES = 8 << 20
LEASE_TTL_S = 900.0
"""How long a lease holds a step without renewal; `lease()` renews it every third of that while its block runs."""

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CommittedCheckpoint:
    """A checkpoint whose manifest was written (not yet verified: see CheckpointStore.verify)."""

    step: int
    """Training step the checkpoint was taken at."""
    location: StorageLocation
    """The step directory `checkpoints/step_XXXXXXXX`."""
    manifest: dict[str, Any]
    """Parsed manifest.json: step, files {relpath: {size, sha256}}, metadata, created_at."""

    @property
    def uri(self) -> str:
        """Canonical URI of the step directory."""
        return self.location.uri

    @property
    def local_path(self) -> str | None:
        """POSIX path of the step directory (load it in place), None on object stores (use download())."""
        return self.location.local_path

    @property
    def metadata(self) -> dict[str, Any]:
        """What the trainer passed to commit(): data position, config, versions, metrics."""
        return self.manifest.get("metadata", {})


class CheckpointStore:
    """Checkpoints of one run under `<run_root>/checkpoints/`."""

    def __init__(
        self,
        run_root: StorageLocation,
        keep_last: int | None = 3,
        keep_best: str | None = None,
        mode: str = "min",
        on_corrupt: str = "error",
        *,
        protect: Iterable[int] = (),
        local_staging_root: str | None = None,
        fence: Fence | None = None,
        read_only: bool = False,
    ):
        """`keep_last`: newest checkpoints kept (None = all). `keep_best`: name of a metric in
        metadata["metrics"] whose best checkpoint is also kept; `mode`: "min" or "max" for it. `on_corrupt`:
        "error" raises on a bad checkpoint, "fallback" makes verify() return the newest earlier good one.
        `protect`: steps never deleted (the one resumed from). `local_staging_root`: node-local directory for
        staging on s3/hdfs (default: the system temp dir). `fence`: the run lock's token and generation of the job
        that writes; commit() and cleanup_partials() refuse (LockLostError) once the run's lock holds another.
        `read_only`: a store this job only reads (another run's, storage.init_from_run): it never writes or
        deletes."""
        if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
            raise RaytrainError(f"keep_last={keep_last!r} must be an int >= 1, or None to keep every checkpoint")
        if mode not in ("min", "max"):
            raise RaytrainError(f"mode={mode!r} must be 'min' or 'max'")
        if on_corrupt not in ("error", "fallback"):
            raise RaytrainError(f"on_corrupt={on_corrupt!r} must be 'error' or 'fallback'")
        if keep_best is not None and not keep_best:
            raise RaytrainError("keep_best='' names no metric; pass a metric name or None")
        self.run_root = run_root
        self.root = RunPaths(run_root).checkpoints
        self.keep_last = keep_last
        self.keep_best = keep_best
        self.mode = mode
        self.on_corrupt = on_corrupt
        self._protected = set(protect)
        self._local_staging_root = local_staging_root or tempfile.gettempdir()
        self._fence = fence
        self.read_only = read_only

    # ---- writing (every rank) -----------------------------------------------------------------------------
    def staging_dir(self, step: int) -> str:
        """Local POSIX directory where this rank writes its files for `step` (created).

        POSIX root: `checkpoints/step_X.partial/` on the shared filesystem itself. s3/hdfs: a node-local dir
        unique to this process (ranks sharing a node must not upload each other's half-written files); pass it to
        upload()."""
        if self.root.is_posix:
            path = self._partial(step).path
        else:
            run_key = hashlib.sha1(self.root.uri.encode()).hexdigest()[:12]
            proc = f"{socket.gethostname()}-{os.getpid()}"
            path = os.path.join(self._local_staging_root, "raytrain-staging", run_key, partial_dir_name(step), proc)
        os.makedirs(path, exist_ok=True)
        return path

    def upload(self, step: int, local_dir: str) -> None:
        """Copy every file below `local_dir` into the step's partial location, recording sizes and sha256 in a
        sidecar so commit() need not read them back. No-op when `local_dir` is already the POSIX partial dir.
        Removes `local_dir` afterwards when it is a staging dir made by staging_dir()."""
        dest = self._staging_target(step)
        if self.root.is_posix and os.path.realpath(local_dir) == os.path.realpath(dest.path):
            return
        if not os.path.isdir(local_dir):
            raise RaytrainError(f"upload(step={step}): {local_dir!r} is not a directory")
        if self.root.scheme == "s3":
            # The step prefix is also the final place on S3: drop a manifest left by an abandoned run of the same
            # step first, so the prefix never looks committed while it holds a mix of old and new files.
            dest.join(MANIFEST_NAME).delete_file()
        hashes: dict[str, dict[str, Any]] = {}
        for dirpath, _, filenames in os.walk(local_dir):
            for filename in sorted(filenames):
                src = os.path.join(dirpath, filename)
                rel = os.path.relpath(src, local_dir).replace(os.sep, "/")
                if not is_payload_file(rel):
                    raise RaytrainError(f"upload(step={step}): {src!r} uses a name reserved by the store; rename it")
                with open(src, "rb") as fin, dest.join(rel).open_output() as fout:
                    hashes[rel] = _copy_hashing(fin, fout)
        sidecar = {"written_at": _now_iso(), "host": socket.gethostname(), "pid": os.getpid(), "files": hashes}
        name = f"{SIDECAR_PREFIX}{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}.json"
        dest.join(name).write_atomic(json.dumps(sidecar))
        if os.path.realpath(local_dir).startswith(os.path.realpath(self._local_staging_root) + os.sep + "raytrain-"):
            shutil.rmtree(local_dir, ignore_errors=True)

    def hash_share(self, step: int, rank: int, world: int) -> int:
        """POSIX roots, every rank after the barrier that follows the saves: hash (and fsync) this rank's share of
        the step's staged files (file i of the sorted listing belongs to rank i % world) and record sizes + sha256
        in a sidecar, so commit() reads the sidecars instead of hashing the whole checkpoint on one rank while the
        others wait. Returns the bytes hashed. A no-op on s3/hdfs, where upload() already hashed each rank's files.
        """
        if not self.root.is_posix:
            return 0
        src = self._partial(step)
        payload = sorted(rel for rel in src.list_files() if is_payload_file(rel))
        mine = payload[rank::world]
        hashes: dict[str, dict[str, Any]] = {}
        for rel in mine:
            loc = src.join(rel)
            hashes[rel] = {"size": loc.size(), "sha256": _hash_file(loc, fsync=True)}
        sidecar = {"written_at": _now_iso(), "host": socket.gethostname(), "pid": os.getpid(), "files": hashes}
        src.join(f"{SIDECAR_PREFIX}rank{rank}-{uuid.uuid4().hex[:8]}.json").write_atomic(json.dumps(sidecar))
        return sum(entry["size"] for entry in hashes.values())

    # ---- committing (one rank, after a barrier) -----------------------------------------------------------
    def commit(self, step: int, metadata: dict[str, Any], protect: Iterable[int] = ()) -> str:
        """Write manifest.json last, publish the checkpoint, point `latest` at it, apply retention.

        `metadata` (JSON-serialisable): data position, config, versions, metrics. `protect`: more steps retention
        must keep. Returns the URI of the committed step dir. Raises RaytrainError when nothing was staged."""
        try:
            metadata_json = json.loads(json.dumps(metadata))  # NaN/inf survive (a diverged loss is still recorded)
        except (TypeError, ValueError) as exc:
            raise RaytrainError(
                f"commit(step={step}): metadata is not JSON-serialisable ({exc}); pass plain values"
            ) from exc
        src = self._staging_target(step)
        listing = src.list_files()
        payload = {rel: size for rel, size in listing.items() if is_payload_file(rel)}
        if not payload:
            raise RaytrainError(
                f"commit(step={step}): nothing staged at {src.uri}; every rank must write into staging_dir({step}) "
                "(and call upload() on s3/hdfs) before the barrier that precedes commit()"
            )
        known = self._read_sidecars(src, listing)
        files = {}
        for rel, size in sorted(payload.items()):
            entry = known.get(rel)
            if entry is None or entry["size"] != size:
                entry = {"size": size, "sha256": _hash_file(src.join(rel), fsync=src.is_posix)}
            files[rel] = entry
        manifest = {
            "format": MANIFEST_FORMAT,
            "step": step,
            "files": files,
            "metadata": metadata_json,
            "created_at": _now_iso(),
            "writer": {"raytrain": __version__, "host": socket.gethostname(), "pid": os.getpid()},
        }
        self.check_fence(f"commit checkpoint step {step}")  # on S3 the manifest is what makes it committed
        src.join(MANIFEST_NAME).write_atomic(json.dumps(manifest, indent=1, sort_keys=True))
        for rel in listing:
            if not is_payload_file(rel) and rel != MANIFEST_NAME:
                src.join(rel).delete_file()
        if self._renames:
            self.check_fence(f"publish checkpoint step {step}")  # right before the rename that makes it visible
            self._publish_by_rename(step)
        self.check_fence(f"point {LATEST_NAME} at checkpoint step {step}")
        self.root.join(LATEST_NAME).write_atomic(step_dir_name(step) + "\n")
        if self.keep_best and self.keep_best not in metadata_json.get("metrics", {}):
            log.warning(
                "commit(step=%d): metadata['metrics'] has no %r (keep_best); it cannot rank", step, self.keep_best
            )
        self.check_fence("delete old checkpoints (retention)")
        self._apply_retention({step, *protect})
        return self._final(step).uri

    def check_fence(self, action: str) -> None:
        """Raise when this store may not `action`: LockLostError when the run's lock no longer holds this job's
        fence, RaytrainError on a read-only store. A no-op for a store built without a fence (tools, tests)."""
        if self.read_only:
            raise RaytrainError(f"{self.run_root.uri} is opened read-only (another run's checkpoints); refused to "
                                f"{action}")
        if self._fence is not None:
            check_fence(self.run_root, self._fence, action)

    def protect(self, step: int) -> None:
        """Never delete `step` in retention (call with the step a run resumed from)."""
        self._protected.add(step)

    # ---- reading ------------------------------------------------------------------------------------------
    def latest(self) -> CommittedCheckpoint | None:
        """The checkpoint `latest` names; when that is missing or broken, the newest committed one at or below it
        (logging why). None when there is no committed checkpoint. Does not verify hashes (see verify())."""
        pointer = self._read_pointer()
        steps = self._committed_step_names()
        if pointer is not None:
            ckpt = self._load(pointer)
            if ckpt is not None:
                return ckpt
            log.warning(
                "%s names %s, which has no readable manifest; using the newest committed checkpoint",
                self.root.join(LATEST_NAME).uri,
                step_dir_name(pointer),
            )
        for step in reversed(steps):
            if pointer is not None and step > pointer:
                continue  # from a timeline abandoned by a resume from an earlier step
            ckpt = self._load(step)
            if ckpt is not None:
                return ckpt
        return None

    def committed(self) -> list[CommittedCheckpoint]:
        """Every committed checkpoint with a readable manifest, oldest first."""
        return [c for c in (self._load(s, strict=False) for s in self._committed_step_names()) if c is not None]

    def get(self, step: int) -> CommittedCheckpoint | None:
        """The committed checkpoint of `step`, or None."""
        return self._load(step)

    def verify(self, ckpt: CommittedCheckpoint, problem: str | None = "") -> CommittedCheckpoint:
        """Check every manifest file's presence, size and sha256. Returns `ckpt` when good. When not: raises
        RaytrainError naming the bad file (on_corrupt="error"), or returns the newest earlier good checkpoint
        (on_corrupt="fallback"; raises when there is none). ``problem``: what ranks verifying shares in parallel
        (``find_problem(ckpt, rank, world)``) found, None when nothing; by default ``ckpt`` is checked whole here."""
        if problem == "":
            problem = self.find_problem(ckpt)
        if problem is None:
            return ckpt
        if self.on_corrupt == "error":
            raise CorruptCheckpointError(
                f"checkpoint {ckpt.uri} is corrupt: {problem}. Resume from an earlier checkpoint with "
                "on_corrupt='fallback', or delete this step dir if you know it is bad"
            )
        log.warning("checkpoint %s is corrupt (%s); looking for an earlier good one", ckpt.uri, problem)
        for step in reversed(self._committed_step_names()):
            if step >= ckpt.step:
                continue
            earlier = self._load(step, strict=False)
            if earlier is None:
                continue
            earlier_problem = self.find_problem(earlier)
            if earlier_problem is None:
                log.warning("falling back from step %d to step %d", ckpt.step, step)
                return earlier
            log.warning("checkpoint %s is corrupt too (%s)", earlier.uri, earlier_problem)
        raise CorruptCheckpointError(
            f"checkpoint {ckpt.uri} is corrupt ({problem}) and no earlier checkpoint is intact")

    def download(self, ckpt: CommittedCheckpoint, local_dir: str, files: Iterable[str] | None = None) -> str:
        """Copy the checkpoint's files (all, or only `files`: manifest paths) and its manifest into `local_dir`,
        checking each sha256 on the way. Returns `local_dir`. Raises CorruptCheckpointError naming a file whose
        content differs from the manifest, RaytrainError for a name the manifest does not list."""
        entries = ckpt.manifest["files"]
        wanted = sorted(entries) if files is None else sorted(set(files))
        unknown = [rel for rel in wanted if rel not in entries]
        if unknown:
            raise RaytrainError(f"download of {ckpt.uri}: {unknown[:5]} are not in its manifest")
        os.makedirs(local_dir, exist_ok=True)
        for rel in wanted:
            entry = entries[rel]
            dest = os.path.join(local_dir, *rel.split("/"))
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            try:
                with ckpt.location.join(rel).open_input() as fin, open(dest, "wb") as fout:
                    got = _copy_hashing(fin, fout)
            except FileNotFoundError as exc:
                raise CorruptCheckpointError(f"download of {ckpt.uri}: file {rel!r} is missing") from exc
            if got != {"size": entry["size"], "sha256": entry["sha256"]}:
                raise CorruptCheckpointError(
                    f"download of {ckpt.uri}: file {rel!r} is {got['size']} bytes sha256 {got['sha256'][:12]}…, "
                    f"manifest says {entry['size']} bytes sha256 {entry['sha256'][:12]}…; the checkpoint is corrupt"
                )
        with open(os.path.join(local_dir, MANIFEST_NAME), "w") as f:
            json.dump(ckpt.manifest, f, indent=1, sort_keys=True)
        return local_dir

    @contextlib.contextmanager
    def local_copy(self, ckpt: CommittedCheckpoint, files: Iterable[str] | None = None,
                   label: str = "read") -> Iterator[str]:
        """A local POSIX directory holding `ckpt` for the length of the block. POSIX roots: the step dir itself
        (nothing copied). s3/hdfs: only `files` (default: all) downloaded and hash-checked into a fresh dir under
        the node-local staging root, removed when the block ends, also on error: a rank's extra disk is its own
        files, once. `label` ends up in the temp dir's name (resume, export)."""
        if ckpt.local_path is not None:
            yield ckpt.local_path
            return
        run_key = hashlib.sha1(self.root.uri.encode()).hexdigest()[:12]
        parent = os.path.join(self._local_staging_root, "raytrain-local-copies", run_key)
        os.makedirs(parent, exist_ok=True)
        local = tempfile.mkdtemp(prefix=f"{step_dir_name(ckpt.step)}-{label}-", dir=parent)
        try:
            yield self.download(ckpt, local, files)
        finally:
            shutil.rmtree(local, ignore_errors=True)

    # ---- leases -------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def lease(self, step: int, purpose: str, ttl_s: float = LEASE_TTL_S) -> Iterator[str]:
        """Hold `step` against retention for the block: writes `checkpoints/leases/<step>.<id>.json` (holder,
        purpose, expiry), renews it every ttl_s/3 from a daemon thread, deletes it when the block ends. A holder
        killed without cleanup stops renewing, so its lease expires after `ttl_s`. Yields the lease's URI.
        Take the lease before reading the step, then check the step still exists (retention may have run just
        before the lease was written)."""
        if not (ttl_s > 0):
            raise RaytrainError(f"lease ttl_s={ttl_s!r} must be > 0 seconds")
        loc = self.root.join(LEASES_DIR, lease_file_name(step, uuid.uuid4().hex[:12]))
        holder = f"{_user()}@{socket.gethostname()}:{os.getpid()}"

        def write() -> None:
            loc.write_atomic(json.dumps({"step": step, "holder": holder, "purpose": purpose,
                                         "expires_unix_s": round(time.time() + ttl_s, 3)}))

        loc.parent.mkdirs()
        write()
        stop = threading.Event()

        def renew() -> None:
            while not stop.wait(ttl_s / 3):
                try:
                    write()
                except Exception as exc:  # noqa: BLE001 - a failed renewal is retried next period; say it
                    log.warning("could not renew checkpoint lease %s: %s", loc.uri, exc)

        thread = threading.Thread(target=renew, name=f"lease-{step_dir_name(step)}", daemon=True)
        thread.start()
        try:
            yield loc.uri
        finally:
            stop.set()
            thread.join()
            loc.delete_file()

    def leases(self) -> list[dict[str, Any]]:
        """Every readable lease file under `checkpoints/leases/` (live or expired), each with its `name`."""
        out = []
        folder = self.root.join(LEASES_DIR)
        for name in folder.listdir():
            if parse_lease_file_name(name) is None:
                continue
            try:
                lease = json.loads(folder.join(name).read_text())
            except (FileNotFoundError, ValueError, UnicodeDecodeError):
                continue  # released meanwhile, or torn: holds nothing (live_leased_steps)
            if isinstance(lease, dict):
                out.append({**lease, "name": name})
        return out

    # ---- housekeeping -------------------------------------------------------------------------------------
    def cleanup_partials(self) -> list[str]:
        """Remove leftovers of unfinished saves (partial dirs, trash; on S3 step prefixes without a manifest).
        Returns the removed URIs. Run only while no rank is staging. A read-only store removes nothing."""
        if self.read_only:
            return []
        self.check_fence("delete unfinished checkpoints")
        names = self.root.listdir()
        doomed = [self.root.join(n) for n in partial_names(names)]
        if not self._renames:
            doomed += [
                self.root.join(n)
                for n in names
                if parse_step_dir_name(n) is not None and not self.root.join(n, MANIFEST_NAME).exists()
            ]
        for loc in doomed:
            log.info("removing unfinished checkpoint %s", loc.uri)
            loc.delete_dir()
        return [loc.uri for loc in doomed]

    # ---- internals ----------------------------------------------------------------------------------------
    @property
    def _renames(self) -> bool:
        # POSIX and HDFS rename directories atomically; S3 has no rename.
        return self.root.scheme in ("file", "hdfs")

    def _final(self, step: int) -> StorageLocation:
        return self.root.join(step_dir_name(step))

    def _partial(self, step: int) -> StorageLocation:
        return self.root.join(partial_dir_name(step))

    def _staging_target(self, step: int) -> StorageLocation:
        return self._partial(step) if self._renames else self._final(step)

    def _committed_step_names(self) -> list[int]:
        return committed_steps(self.root.listdir())

    def _read_pointer(self) -> int | None:
        try:
            text = self.root.join(LATEST_NAME).read_text().strip()
        except FileNotFoundError:
            return None
        step = parse_step_dir_name(text)
        if step is None:
            log.warning("%s holds %r, not a step dir name; ignoring it", self.root.join(LATEST_NAME).uri, text[:80])
        return step

    def _load(self, step: int, strict: bool | None = None) -> CommittedCheckpoint | None:
        """The checkpoint of `step` or None when it has no manifest. An unreadable manifest raises when `strict`
        (default: on_corrupt == "error"), else is logged and skipped."""
        strict = self.on_corrupt == "error" if strict is None else strict
        loc = self._final(step)
        manifest_loc = loc.join(MANIFEST_NAME)
        try:
            manifest = json.loads(manifest_loc.read_text())
            if manifest.get("step") != step or not isinstance(manifest.get("files"), dict):
                raise ValueError(f"step {manifest.get('step')!r} / files missing")
        except FileNotFoundError:
            return None
        except (ValueError, UnicodeDecodeError, AttributeError) as exc:
            if strict:
                raise CorruptCheckpointError(
                    f"checkpoint manifest {manifest_loc.uri} is unreadable ({exc}); use on_corrupt='fallback' to "
                    "resume from an earlier checkpoint"
                ) from exc
            log.warning("skipping checkpoint %s: unreadable manifest (%s)", loc.uri, exc)
            return None
        return CommittedCheckpoint(step=step, location=loc, manifest=manifest)

    def find_problem(self, ckpt: CommittedCheckpoint, rank: int = 0, world: int = 1) -> str | None:
        """What is wrong with ``ckpt`` (a missing file, a size or sha256 differing from the manifest, naming the
        file), or None. Sizes of every file are checked; sha256 only of this rank's share (file i of the sorted
        manifest belongs to rank i % world), so ``world`` ranks verify a checkpoint in parallel on resume."""
        listing = ckpt.location.list_files()
        files = ckpt.manifest["files"]
        for rel, entry in sorted(files.items()):  # sizes first: cheap, and catches truncation
            if rel not in listing:
                return f"file {rel!r} is missing"
            if listing[rel] != entry["size"]:
                return f"file {rel!r} has {listing[rel]} bytes, manifest says {entry['size']}"
        for rel, entry in sorted(files.items())[rank::world]:
            digest = _hash_file(ckpt.location.join(rel), fsync=False)
            if digest != entry["sha256"]:
                return f"file {rel!r} has sha256 {digest[:16]}…, manifest says {entry['sha256'][:16]}…"
        return None

    def _read_sidecars(self, src: StorageLocation, listing: dict[str, int]) -> dict[str, dict[str, Any]]:
        """{relpath: {size, sha256}} from upload() sidecars; the newest sidecar wins for a path."""
        sidecars = []
        for rel in listing:
            if rel.rsplit("/", 1)[-1].startswith(SIDECAR_PREFIX):
                try:
                    sidecars.append(json.loads(src.join(rel).read_text()))
                except (ValueError, FileNotFoundError):
                    log.warning("ignoring unreadable upload sidecar %s", src.join(rel).uri)
        known: dict[str, dict[str, Any]] = {}
        for car in sorted(sidecars, key=lambda c: c.get("written_at", "")):
            for rel, entry in car.get("files", {}).items():
                known[rel] = {"size": int(entry["size"]), "sha256": str(entry["sha256"])}
        return known

    def _publish_by_rename(self, step: int) -> None:
        partial, final = self._partial(step), self._final(step)
        fs = self.root.filesystem
        trash = None
        if final.exists():
            # A re-run of a step (resume from an earlier checkpoint): move the old one aside, never merge into it.
            trash = self.root.join(f"{TRASH_PREFIX}{step_dir_name(step)}-{uuid.uuid4().hex[:8]}")
            fs.move(final.path, trash.path)
        fs.move(partial.path, final.path)
        if self.root.is_posix:
            fsync_dir(self.root.path)
        if trash is not None:
            trash.delete_dir()

    def _apply_retention(self, protected: set[int]) -> None:
        ckpts = self.committed()
        metric_by_step = {}
        if self.keep_best:
            for c in ckpts:
                value = c.metadata.get("metrics", {}).get(self.keep_best)
                if isinstance(value, int | float):
                    metric_by_step[c.step] = float(value)
        pointer = self._read_pointer()
        plan = plan_retention(
            [c.step for c in ckpts],
            keep_last=self.keep_last,
            best=best_step(metric_by_step, self.mode),
            protected={*protected, *self._protected, *([pointer] if pointer is not None else []),
                       *self._leased_steps()},
        )
        for step in plan.delete:
            loc = self._final(step)
            log.info("retention: deleting checkpoint %s", loc.uri)
            if self._renames:
                # Disappear atomically first, then free the space: no half-deleted dir ever looks committed.
                trash = self.root.join(f"{TRASH_PREFIX}{step_dir_name(step)}-{uuid.uuid4().hex[:8]}")
                self.root.filesystem.move(loc.path, trash.path)
                trash.delete_dir()
            else:
                loc.join(MANIFEST_NAME).delete_file()  # uncommit first, so a half-deleted prefix is a partial
                loc.delete_dir()


    def _leased_steps(self) -> set[int]:
        """Steps a live lease holds; removes lease files that expired a lease TTL ago (their holder is gone)."""
        now = time.time()
        leases = self.leases()
        for lease in leases:
            expires = lease.get("expires_unix_s")
            if isinstance(expires, int | float) and expires + LEASE_TTL_S < now:
                self.root.join(LEASES_DIR, lease["name"]).delete_file()
        return live_leased_steps(leases, now)


def _copy_hashing(fin: Any, fout: Any) -> dict[str, Any]:
    digest, size = hashlib.sha256(), 0
    while chunk := fin.read(_CHUNK_BYTES):
        digest.update(chunk)
        fout.write(chunk)
        size += len(chunk)
    return {"size": size, "sha256": digest.hexdigest()}


def _hash_file(loc: StorageLocation, fsync: bool) -> str:
    """sha256 of a file; with `fsync` (POSIX) also flushes it to stable storage before it is declared committed."""
    digest = hashlib.sha256()
    if fsync:
        fd = os.open(loc.path, os.O_RDONLY)
        try:
            while chunk := os.read(fd, _CHUNK_BYTES):
                digest.update(chunk)
            os.fsync(fd)
        finally:
            os.close(fd)
        return digest.hexdigest()
    with loc.open_input() as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry for the uid (containers)
        return str(os.getuid())


def _now_iso() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds")
