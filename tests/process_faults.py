"""Fault-injection helpers shared by the integration tests that kill real processes: finding this test process's
own Ray workers (other agents run their own Ray on the machine), Spark executor JVMs, and a deadline that turns a
hang into a failure with the stuck thread's stack."""

from __future__ import annotations

import sys
import threading
import traceback

import psutil
import pytest


def my_processes(marker: str) -> list[psutil.Process]:
    """Descendants of this test process whose command line holds `marker`. Other agents run their own Ray on this
    machine: only processes started under our own embedded Ray (children of this process) are candidates."""
    out = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if marker in " ".join(proc.cmdline()):
                out.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return out


def spark_executor_processes() -> list[psutil.Process]:
    """RayDP executor JVMs of our Ray: Java Ray workers (DefaultWorker) started with the Spark driver's port. The
    other Java worker, the RayDP app master, is started with spark.executor.* settings instead."""
    return [p for p in my_processes("io.ray.runtime.runner.worker.DefaultWorker")
            if "-Dspark.driver.port=" in " ".join(p.cmdline())]


def spark_jobs_started(sc) -> int:
    """Spark jobs `sc` has run so far (0 when it is gone)."""
    try:
        return len(sc.statusTracker().getJobIdsForGroup()) if sc is not None else 0
    except Exception:  # noqa: BLE001 - a context being stopped answers with Py4J errors
        return 0


def run_with_deadline(fn, timeout_s: float, what: str):
    """`fn()` in a worker thread; fails the test (with the thread's stack) when it has not returned in `timeout_s`,
    so a hang shows up as a failure instead of blocking the suite. The thread is left blocked; ray.shutdown() in the
    fixture's teardown makes its pending ray.get raise."""
    result, errors = [], []

    def body() -> None:
        try:
            result.append(fn())
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread below
            errors.append(e)

    thread = threading.Thread(target=body, name=what, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        frame = sys._current_frames().get(thread.ident)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "(no frame)"
        pytest.fail(f"{what} did not finish within {timeout_s:.0f}s; its stack:\n{stack}")
    if errors:
        raise errors[0]
    return result[0]
