"""Checkpoint names and retention, as pure functions (no I/O): what `CheckpointStore` writes under `checkpoints/`.

    checkpoints/
      step_00000010/            committed: every rank's files + manifest.json (written last)
      step_00000020.partial/    being written, or left by a crash: never loaded, removed by cleanup_partials()
      latest                    text file: the name of the newest committed step dir
      leases/step_00000010.<id>.json   a reader (export) holds step 10 until the lease's expiry: retention keeps it

Names are zero-padded so a listing sorts by step, but code always orders by the parsed step (steps past
99,999,999 simply get longer names).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from raytrain.errors import RaytrainError

STEP_PREFIX = "step_"
STEP_DIGITS = 8
PARTIAL_SUFFIX = ".partial"
MANIFEST_NAME = "manifest.json"
LATEST_NAME = "latest"
# Files the store writes next to the payload while staging (per-uploader hash lists); never part of a checkpoint.
SIDECAR_PREFIX = ".raytrain-upload-"
# A committed dir moved aside while a re-run of the same step replaces it.
TRASH_PREFIX = ".trash-"
# Folder of read leases: one JSON file per holder of a step, {step, holder, purpose, expires_unix_s}.
LEASES_DIR = "leases"

_STEP_RE = re.compile(rf"^{STEP_PREFIX}(\d{{{STEP_DIGITS},}})$")
_PARTIAL_RE = re.compile(rf"^{STEP_PREFIX}(\d{{{STEP_DIGITS},}})\.partial$")


def _check_step(step: int) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise RaytrainError(f"checkpoint step={step!r} must be an int >= 0")
    return step


def step_dir_name(step: int) -> str:
    """10 -> "step_00000010"."""
    return f"{STEP_PREFIX}{_check_step(step):0{STEP_DIGITS}d}"


def partial_dir_name(step: int) -> str:
    """10 -> "step_00000010.partial"."""
    return step_dir_name(step) + PARTIAL_SUFFIX


def parse_step_dir_name(name: str) -> int | None:
    """Parse "step_00000010" -> 10; None for anything else (partials, trash, manifests, foreign files)."""
    match = _STEP_RE.match(name.rstrip("/"))
    return int(match.group(1)) if match else None


def parse_partial_dir_name(name: str) -> int | None:
    """Parse "step_00000010.partial" -> 10; None for anything else."""
    match = _PARTIAL_RE.match(name.rstrip("/"))
    return int(match.group(1)) if match else None


def committed_steps(names: Iterable[str]) -> list[int]:
    """Steps of the committed-dir names among `names`, ascending (by number, not by string)."""
    return sorted({s for s in (parse_step_dir_name(n) for n in names) if s is not None})


def partial_names(names: Iterable[str]) -> list[str]:
    """Names among `names` that are leftovers of unfinished saves (partials and trash), sorted."""
    return sorted(n for n in names if parse_partial_dir_name(n) is not None or n.startswith(TRASH_PREFIX))


def lease_file_name(step: int, lease_id: str) -> str:
    """(10, "ab12") -> "step_00000010.ab12.json": a lease's file under `leases/`, one per holder."""
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", lease_id):
        raise RaytrainError(f"lease id {lease_id!r} must be 1-64 characters of [A-Za-z0-9_-]")
    return f"{step_dir_name(step)}.{lease_id}.json"


def parse_lease_file_name(name: str) -> int | None:
    """"step_00000010.ab12.json" -> 10; None for anything else."""
    stem, _, rest = name.partition(".")
    return parse_step_dir_name(stem) if rest.endswith(".json") and rest.count(".") == 1 else None


def live_leased_steps(leases: Iterable[Mapping[str, object]], now_unix_s: float) -> set[int]:
    """Steps held by a lease (parsed lease files) that has not expired at `now_unix_s`. A lease without a usable
    step or expiry holds nothing: a torn or foreign file must not pin a checkpoint forever."""
    live = set()
    for lease in leases:
        step, expires = lease.get("step"), lease.get("expires_unix_s")
        if isinstance(step, int) and not isinstance(step, bool) and isinstance(expires, int | float) \
                and math.isfinite(expires) and expires > now_unix_s:
            live.add(step)
    return live


def is_payload_file(relpath: str) -> bool:
    """True for a checkpoint's own files; False for the manifest and the store's staging sidecars, including a
    sidecar another rank is writing at that moment (storage's atomic write names its temporary file
    ``.<name>.tmp-<pid>-<hex>``: ``..raytrain-upload-...``, gone once renamed)."""
    base = relpath.rsplit("/", 1)[-1]
    return relpath != MANIFEST_NAME and not base.startswith((SIDECAR_PREFIX, "." + SIDECAR_PREFIX))


def best_step(metric_by_step: Mapping[int, float], mode: str) -> int | None:
    """Step with the lowest ("min") or highest ("max") finite metric; ties go to the newer step; None if none."""
    if mode not in ("min", "max"):
        raise RaytrainError(f"mode={mode!r} must be 'min' or 'max'")
    finite = {s: v for s, v in metric_by_step.items() if isinstance(v, int | float) and math.isfinite(v)}
    if not finite:
        return None
    sign = 1.0 if mode == "min" else -1.0
    return min(finite, key=lambda s: (sign * finite[s], -s))


@dataclass(frozen=True)
class RetentionPlan:
    """Which committed steps to keep and which to delete (disjoint; together all the given steps)."""

    keep: tuple[int, ...]
    """Steps kept, ascending."""
    delete: tuple[int, ...]
    """Steps to delete, ascending."""


def plan_retention(
    steps: Iterable[int],
    *,
    keep_last: int | None,
    best: int | None = None,
    protected: Iterable[int] = (),
) -> RetentionPlan:
    """Keep the newest `keep_last` steps (None = all), the `best` step and every `protected` step; delete the rest.

    `protected` holds the checkpoint being resumed from, the one just committed and the one `latest` names:
    those are never deleted whatever their age or metric.
    """
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise RaytrainError(f"keep_last={keep_last!r} must be an int >= 1, or None to keep every checkpoint")
    ordered = sorted(set(steps))
    keep = set(ordered if keep_last is None else ordered[-keep_last:])
    keep.update(s for s in (best, *protected) if s is not None and s in ordered)
    return RetentionPlan(keep=tuple(sorted(keep)), delete=tuple(s for s in ordered if s not in keep))
