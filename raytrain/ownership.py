"""Who a run belongs to: `<run>/owner.json` records the submitting user who created it, so a job acting for someone
else never resumes, overwrites or deletes it (it may still start a run of its own from it: storage.init_from_run).

A run folder from before owners were recorded belongs to the user whose namespace folder holds it
(`<root>/<user>/<project>/<run>`); the first job of that user records it.
"""

from __future__ import annotations

import json
import socket
import time

from raytrain.errors import RaytrainError
from raytrain.storage import StorageLocation

OWNER_NAME = "owner.json"
RUN_CONTENT = ("checkpoints", "data", "reports")
"""Folders whose presence makes a folder an existing run (one without owner.json predates owners)."""


class RunOwnerError(RaytrainError):
    """The run belongs to another user."""


def recorded_owner(run: StorageLocation) -> str | None:
    """The user owner.json names, None when the run has none (new, or from before owners were recorded)."""
    try:
        raw = json.loads(run.join(OWNER_NAME).read_text())
    except FileNotFoundError:
        return None
    except ValueError as exc:
        raise RaytrainError(f"{run.join(OWNER_NAME).uri} is unreadable ({exc}); restore it or ask the run's "
                            "owner") from exc
    return str(raw.get("user")) if isinstance(raw, dict) and raw.get("user") else None


def run_owner(run: StorageLocation) -> str | None:
    """Who owns `run`: owner.json's user; for an existing run without it, the namespace folder's name; None for
    a folder that holds no run yet."""
    owner = recorded_owner(run)
    if owner is not None:
        return owner
    if any(run.join(name).exists() for name in RUN_CONTENT):
        return run.parent.parent.name
    return None


def check_owner(run: StorageLocation, user: str) -> None:
    """Return when `user` may write `run` (it is theirs, or no run is there yet); else raise RunOwnerError naming
    the owner and how to start a run of one's own from its checkpoint. Reads only."""
    owner = run_owner(run)
    if owner is None or owner == user:
        return
    raise RunOwnerError(
        f"run {run.uri} belongs to {owner!r}; this job acts for {user!r} and will not resume, overwrite or delete "
        f"another user's run. To start a run of your own from its latest checkpoint, leave storage.user empty "
        f"(your runs live under your own name) and set storage.init_from_run={run.uri} (read only), e.g. "
        f"`storage.user= storage.init_from_run={run.uri}`. If {owner!r} is you under another name, set "
        f"RAYTRAIN_USER={owner}."
    )


def claim(run: StorageLocation, user: str) -> None:
    """Record `user` as the run's owner when none is recorded (exclusive create: of two first jobs racing, one
    records itself and the other is refused), then check again. Call while holding the run lock."""
    check_owner(run, user)
    if recorded_owner(run) is None:
        record = {"user": user, "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": socket.gethostname()}
        run.join(OWNER_NAME).create_exclusive(json.dumps(record, indent=1, sort_keys=True) + "\n")
    check_owner(run, user)
