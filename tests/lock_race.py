"""Contenders racing for one run lock, shared by the lock tests of every backend."""

from __future__ import annotations

import threading

from raytrain.errors import RaytrainError
from raytrain.runlock import RunLock


def race_for_lock(run, contenders: int) -> tuple[list[str], list[str]]:
    """`contenders` threads released by one barrier each try RunLock(run).acquire(): (winners' tokens, every
    outcome, a refusal as 'REFUSED <message>')."""
    barrier, outcomes = threading.Barrier(contenders), []

    def contend() -> None:
        lock = RunLock(run, heartbeat_interval_s=None)
        barrier.wait()
        try:
            outcomes.append(lock.acquire().token)
        except RaytrainError as exc:
            outcomes.append(f"REFUSED {exc}")

    threads = [threading.Thread(target=contend) for _ in range(contenders)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [o for o in outcomes if not o.startswith("REFUSED")], outcomes
