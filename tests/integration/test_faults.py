"""Fault injection with real processes: a TorchTrainer worker SIGKILLed mid-training, checkpoint files corrupted on
disk, a Spark executor SIGKILLed during enrichment. Each run must end as an undisturbed run would (same weights, same
micro-batches, same row count) or fail with an error naming what is broken.

Training runs skip Spark: synthetic conversations are packed once with raytrain.dataset.stream.pack_enriched and
copied into each run (the packed sequences are the run's fixed data; checkpoints record a position in them).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

import psutil
import pyarrow.parquet as pq
import pytest
from synthetic_data import synthetic_conversations, write_packed

from raytrain.checkpoint.store import CheckpointStore
from raytrain.config import load_job_config
from raytrain.errors import CorruptCheckpointError, RaytrainError
from raytrain.runner import open_run, run_train

# 18-step schedule, checkpoint every 3 steps: the kill lands after the step-6 checkpoint, with steps left to redo.
MAX_STEPS = 18
CHECKPOINT_EVERY = 3
KILL_AFTER_STEP = 7
NUM_CONVERSATIONS = 160
KILL_AFTER_SPARK_JOBS = 4  # the enrich steps' first materializations (derive, license) have run


# ---- helpers ------------------------------------------------------------------------------------------------------
def make_job(root, run_name: str, *extra: str):
    # 128-token packs of the synthetic conversations (the demo packs 1,024), split where one is longer: enough
    # sequences for MAX_STEPS steps at the cost these tests always had
    return load_job_config("configs/demo.yaml", [
        f"storage.root={root}", "storage.user=ci", f"storage.run_name={run_name}", "dataset.seq_len=128",
        "dataset.length_policy=split",
        f"train.max_steps={MAX_STEPS}", f"train.checkpoint_every={CHECKPOINT_EVERY}", "train.keep_last=3", *extra])


def read_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def last_per_step(rows: list[dict]) -> dict[int, dict]:
    """The row of each step written last: a step redone after a restart replaces the one the killed attempt wrote
    (that one was never committed to a checkpoint)."""
    out: dict[int, dict] = {}
    for row in rows:
        out[row["step"]] = row
    return dict(sorted(out.items()))


def param_digests(run) -> dict[int, dict]:
    reports = run.root.join("reports").path
    return {rank: json.load(open(os.path.join(reports, f"param_digest_rank{rank}.json"))) for rank in (0, 1)}


def copy_run_data(src_run, dst_run, *, checkpoints: bool = False) -> None:
    """Give `dst_run` the packed data (and optionally the checkpoints) of `src_run`; never its reports or lock."""
    names = ("data", "checkpoints") if checkpoints else ("data",)
    for name in names:
        shutil.copytree(src_run.root.join(name).path, dst_run.root.join(name).path)


@dataclass
class KillReport:
    killed_pid: int | None = None
    killed_cmdline: str = ""
    metrics_step_at_kill: int = 0
    checkpoint_step_at_kill: int | None = None
    error: str = ""
    candidates: list[str] = field(default_factory=list)


def _my_processes(marker: str) -> list[psutil.Process]:
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


def kill_train_worker_when(run, *, after_step: int, timeout_s: float, report: KillReport, done: threading.Event):
    """Background thread: once metrics.jsonl shows step >= after_step and a checkpoint is committed, SIGKILL one
    RayTrainWorker process of our Ray (the highest pid: a pipeline stage, chosen without knowing which)."""
    metrics_path = run.root.join("reports", "metrics.jsonl").path
    store = CheckpointStore(run.root)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not done.is_set():
        step = 0
        if os.path.exists(metrics_path):
            rows = read_jsonl(metrics_path)
            step = max((r["step"] for r in rows), default=0)
        latest = store.latest() if step >= after_step else None
        if latest is not None:
            workers = _my_processes("RayTrainWorker")
            report.candidates = [f"{p.pid}: {' '.join(p.cmdline())[:80]}" for p in workers]
            if workers:
                victim = max(workers, key=lambda p: p.pid)
                report.killed_cmdline = " ".join(victim.cmdline())
                report.metrics_step_at_kill, report.checkpoint_step_at_kill = step, latest.step
                os.kill(victim.pid, signal.SIGKILL)
                report.killed_pid = victim.pid
                return
        time.sleep(0.05)
    report.error = "run ended or timed out before the kill condition was met"


# ---- fixtures -----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs_root(ray_local, tmp_path_factory):
    return tmp_path_factory.mktemp("fault-runs")


@pytest.fixture(scope="module")
def reference(runs_root):
    """An uninterrupted run: packs the synthetic data once, trains MAX_STEPS steps."""
    job = make_job(runs_root, "reference")
    packed = write_packed(job, synthetic_conversations(NUM_CONVERSATIONS), enriched=runs_root / "enriched")
    run = open_run(job)
    assert packed.num_packs >= 2 * job.train.global_batch_size
    t0 = time.perf_counter()
    summary = run_train(job)
    return {"job": job, "run": run, "summary": summary, "seconds": time.perf_counter() - t0}


# ---- Spark executor killed during enrichment ----------------------------------------------------------------------
ENRICH_DEADLINE_S = 1200  # one enrichment took ~3.5-5 min on the loaded 2-core machine; a hang fails, not blocks


@pytest.fixture
def own_ray():
    """A Ray started for this test alone (not the module's `ray_local`, which the training tests share).

    Why: run after the training tests in the module's Ray, the second enrichment hung in RayDP's
    ``ray.get(RayDPSparkMaster.start_up.remote())`` (raydp/spark/ray_cluster.py:78) before any executor was killed.
    The pytest driver's core-worker log showed its GCS actor-state notifications stop after the last training run's
    Ray Train controller was destroyed ("received notification on actor" last at its DEAD; the first Spark master's
    DEAD never arrived); the new Spark master was created and ALIVE in the GCS, yet the driver never saw ALIVE and so
    never pushed start_up (the actor's worker received one PushTask: its constructor). A Ray-core problem of the
    driver process (Ray 2.60), seen only after the trainer's actor churn; a fresh driver connection avoids it.
    """
    import ray

    from raytrain.runner import WORKER_ENV

    if ray.is_initialized():  # the module's Ray: later tests in the module then start an embedded Ray per run
        ray.shutdown()
    ray.init(num_cpus=4, include_dashboard=False, runtime_env={"env_vars": dict(WORKER_ENV)})
    yield ray
    ray.shutdown()


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


def _active_spark_context():
    from pyspark import SparkContext

    return SparkContext._active_spark_context


def _spark_jobs_started(sc) -> int:
    """Spark jobs `sc` has run so far (0 when it is gone). Each enrich step materializes its output with a count():
    a few jobs in, persisted blocks live on the executor."""
    try:
        return len(sc.statusTracker().getJobIdsForGroup()) if sc is not None else 0
    except Exception:  # noqa: BLE001 - a context being stopped answers with Py4J errors
        return 0


def spark_executor_processes() -> list[psutil.Process]:
    """RayDP executor JVMs of our Ray: Java Ray workers (DefaultWorker) started with the Spark driver's port. The
    other Java worker, the RayDP app master, is started with spark.executor.* settings instead."""
    return [p for p in _my_processes("io.ray.runtime.runner.worker.DefaultWorker")
            if "-Dspark.driver.port=" in " ".join(p.cmdline())]


def _enrich_job(runs_root, run_name: str):
    return load_job_config("configs/demo.yaml", [f"storage.root={runs_root}", "storage.user=ci",
                                                 f"storage.run_name={run_name}", "enrich.num_partitions=2"])


def _enriched_rows(run) -> int:
    return pq.read_table(run.root.join("data", "enriched").path, columns=["uuid"]).num_rows


def test_killed_spark_executor_enrichment_completes_with_same_rows(demo_data, own_ray, tmp_path):
    """The demo's enrichment with the Spark executor JVM SIGKILLed a few Spark jobs in: RayDP restarts the executor
    actor (max_restarts=-1; the new JVM registers under a new executor id), Spark re-runs the lost tasks and
    recomputes lost persisted blocks, and the output is the same rows as the undisturbed enrichment of the session's
    shared demo run (same data settings)."""
    from raytrain.runner import run_enrich_only

    runs_root = tmp_path
    undisturbed = open_run(demo_data.job())
    undisturbed_s = demo_data.seconds
    job = _enrich_job(runs_root, "enrich-killed")
    done, killed, restarted, jobs_at_kill = threading.Event(), [], [], []

    stale_context = _active_spark_context()  # an earlier module's (stopped) context, if pyspark kept it

    def killer() -> None:
        # wait until the killed run's own Spark session is a few jobs in
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not done.is_set():
            sc = _active_spark_context()
            if sc is not None and sc is not stale_context and _spark_jobs_started(sc) >= KILL_AFTER_SPARK_JOBS:
                break
            time.sleep(0.2)
        else:
            return
        jobs_at_kill.append(_spark_jobs_started(sc))
        for proc in spark_executor_processes():
            os.kill(proc.pid, signal.SIGKILL)
            killed.append(proc.pid)
        # RayDP creates executor actors with restarts allowed: Ray starts a new JVM, Spark re-runs lost tasks
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not done.is_set():
            fresh = [p.pid for p in spark_executor_processes() if p.pid not in killed]
            if fresh:
                restarted.extend(fresh)
                return
            time.sleep(0.5)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    try:
        t0 = time.perf_counter()
        run_with_deadline(lambda: run_enrich_only(job), ENRICH_DEADLINE_S, "enrichment with the executor kill")
        killed_s = time.perf_counter() - t0
    finally:
        done.set()
        thread.join(timeout=10)
    assert killed, "no Spark executor process found to kill"
    assert restarted, "no executor came back after the kill"
    run = open_run(job)
    report = json.load(open(run.root.join("reports", "enrich_report.json").path))
    ref_report = json.load(open(undisturbed.root.join("reports", "enrich_report.json").path))
    assert _enriched_rows(run) == _enriched_rows(undisturbed) == report["rows_out"] == ref_report["rows_out"] > 0
    assert report["quarantined"] == ref_report["quarantined"]
    assert report["rows_in"] == ref_report["rows_in"]
    # same rows, not just the same count
    ids = pq.read_table(run.root.join("data", "enriched").path, columns=["uuid"]).column("uuid").to_pylist()
    ref_ids = pq.read_table(undisturbed.root.join("data", "enriched").path, columns=["uuid"]).column("uuid").to_pylist()
    assert sorted(ids) == sorted(ref_ids)
    print(f"[faults] killed Spark executor pid(s) {killed} after {jobs_at_kill} Spark jobs, restarted as {restarted}; enrichment finished with {report['rows_out']} rows "
          f"(undisturbed {ref_report['rows_out']}); {killed_s:.0f}s with the kill (the whole undisturbed demo run: {undisturbed_s:.0f}s)")


# ---- worker killed mid-training -----------------------------------------------------------------------------------
def test_killed_worker_restarts_from_checkpoint_and_matches_uninterrupted(reference, runs_root):
    job = make_job(runs_root, "killed")
    run = open_run(job)
    copy_run_data(reference["run"], run)
    report, done = KillReport(), threading.Event()
    killer = threading.Thread(target=kill_train_worker_when, daemon=True,
                              kwargs={"run": run, "after_step": KILL_AFTER_STEP, "timeout_s": 300,
                                      "report": report, "done": done})
    killer.start()
    try:
        summary = run_train(job, max_failures=1)
    finally:
        done.set()
        killer.join(timeout=10)
    assert report.killed_pid is not None, f"no worker killed: {report.error}; candidates {report.candidates}"
    assert summary["final"]["step"] == MAX_STEPS

    # metrics: the killed attempt wrote steps past its checkpoint; the restart redid them from the checkpoint
    metrics = read_jsonl(run.root.join("reports", "metrics.jsonl").path)
    steps_written = [m["step"] for m in metrics]
    restarts = [i for i in range(1, len(steps_written)) if steps_written[i] <= steps_written[i - 1]]
    assert len(restarts) == 1, f"expected exactly one restart, steps written: {steps_written}"
    resumed_from = steps_written[restarts[0]] - 1  # the restart began with the step after its checkpoint
    assert resumed_from % CHECKPOINT_EVERY == 0 and resumed_from >= report.checkpoint_step_at_kill, steps_written
    assert steps_written[: restarts[0]] == list(range(1, restarts[0] + 1))
    assert steps_written[restarts[0]:] == list(range(resumed_from + 1, MAX_STEPS + 1)), steps_written
    steps_redone = restarts[0] - resumed_from
    ref_metrics = last_per_step(read_jsonl(reference["run"].root.join("reports", "metrics.jsonl").path))
    got = last_per_step(metrics)
    assert list(got) == list(ref_metrics) == list(range(1, MAX_STEPS + 1))
    assert [got[s]["loss"] for s in got] == [ref_metrics[s]["loss"] for s in ref_metrics]  # bit-exact on CPU

    # final weights: every parameter digest of both stages equals the uninterrupted run's
    mine, ref = param_digests(run), param_digests(reference["run"])
    for rank in (0, 1):
        assert mine[rank]["step"] == ref[rank]["step"] == MAX_STEPS
        assert mine[rank]["digests"] == ref[rank]["digests"] and mine[rank]["digests"], f"rank {rank} weights differ"

    # data: counting only micro-batches consumed by committed steps (the last attempt of each step), every
    # micro-batch of the schedule was seen exactly once, in the uninterrupted run's order, on both stages
    per_step = job.train.dp * job.train.grad_accum_steps
    for rank in (0, 1):
        trace = read_jsonl(run.root.join("reports", f"data_trace_rank{rank}.jsonl").path)
        ref_trace = last_per_step(read_jsonl(reference["run"].root.join("reports", f"data_trace_rank{rank}.jsonl").path))
        final = last_per_step(trace)
        consumed = [tuple(c) for s in final for c in final[s]["consumed"]]
        indices = [i for i, _ in consumed]
        assert indices == list(range(MAX_STEPS * per_step)), f"rank {rank}: skipped or repeated micro-batches"
        assert consumed == [tuple(c) for s in ref_trace for c in ref_trace[s]["consumed"]]
        # a step the killed attempt had run past the checkpoint was redone on the same micro-batches
        redone = [r for r in trace if r["step"] > resumed_from and sum(x["step"] == r["step"] for x in trace) > 1]
        for r in redone:
            assert r["consumed"] == final[r["step"]]["consumed"]
    # checkpoints: the last one is intact and records the full data position
    latest = CheckpointStore(run.root).latest()
    CheckpointStore(run.root).verify(latest)
    assert latest.step == MAX_STEPS and latest.metadata["data_position"] == MAX_STEPS * per_step
    print(f"[faults] killed pid {report.killed_pid} ({report.killed_cmdline[:60]}) at metrics step "
          f"{report.metrics_step_at_kill}, checkpoint step {resumed_from}; restarted and finished {MAX_STEPS} steps; "
          f"steps redone: {steps_redone}; micro-batches lost/duplicated: 0")


# ---- corrupted checkpoint -----------------------------------------------------------------------------------------
def _flip_bytes_in_layer_file(ckpt) -> str:
    """XOR 16 bytes in the middle of one layer file of `ckpt` (size unchanged); returns its relative path."""
    rel = sorted(f for f in ckpt.manifest["files"] if "layer_" in f)[-1]
    path = os.path.join(ckpt.local_path, rel)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size // 2)
        chunk = f.read(16)
        f.seek(size // 2)
        f.write(bytes(b ^ 0xFF for b in chunk))
    return rel


def _corrupted_copy(reference, runs_root, run_name: str, *extra: str):
    job = make_job(runs_root, run_name, *extra)
    run = open_run(job)
    copy_run_data(reference["run"], run, checkpoints=True)
    store = CheckpointStore(run.root)
    latest = store.latest()
    assert latest.step == MAX_STEPS
    return job, run, latest, _flip_bytes_in_layer_file(latest)


def _train_run_attempts(since_ns: int) -> list[int]:
    """Attempts of each Ray Train run started after ``since_ns``, from Ray Train's own state actor."""
    import ray
    from ray.train.v2._internal.state.state_actor import get_state_actor

    actor = get_state_actor()
    runs = ray.get(actor.get_train_runs.remote())
    attempts = ray.get(actor.get_train_run_attempts.remote())
    return [len(attempts.get(run_id, {})) for run_id, r in runs.items() if r.start_time_ns >= since_ns]


def test_corrupt_checkpoint_error_names_the_file(reference, runs_root, monkeypatch):
    """With retries allowed (max_failures=2), a corrupt checkpoint still ends the run after its first attempt:
    every retry would read the same bytes."""
    job, run, latest, rel = _corrupted_copy(reference, runs_root, "corrupt-error", "train.on_corrupt_checkpoint=error")
    monkeypatch.setenv("RAY_TRAIN_ENABLE_STATE_TRACKING", "1")  # fit() then records its attempts in the state actor
    since = time.time_ns()
    with pytest.raises(CorruptCheckpointError) as excinfo:
        run_train(job, max_failures=2)
    message = str(excinfo.value)
    assert rel in message and "corrupt" in message, message[-2000:]
    assert _train_run_attempts(since) == [1]
    # nothing was trained or re-committed on top of the bad checkpoint
    assert [c.step for c in CheckpointStore(run.root).committed()] == [MAX_STEPS - 2 * CHECKPOINT_EVERY,
                                                                      MAX_STEPS - CHECKPOINT_EVERY, MAX_STEPS]
    with pytest.raises(RaytrainError, match=rel.replace(".", r"\.")):
        CheckpointStore(run.root).verify(CheckpointStore(run.root).latest())


def test_corrupt_checkpoint_fallback_resumes_from_previous_good(reference, runs_root):
    job, run, latest, rel = _corrupted_copy(reference, runs_root, "corrupt-fallback",
                                            "train.on_corrupt_checkpoint=fallback")
    summary = run_train(job)
    assert summary["final"]["step"] == MAX_STEPS
    metrics = read_jsonl(run.root.join("reports", "metrics.jsonl").path)
    # resumed from the previous good checkpoint: only the steps after it were trained again
    assert [m["step"] for m in metrics] == list(range(MAX_STEPS - CHECKPOINT_EVERY + 1, MAX_STEPS + 1))
    ref_metrics = last_per_step(read_jsonl(reference["run"].root.join("reports", "metrics.jsonl").path))
    assert [m["loss"] for m in metrics] == [ref_metrics[m["step"]]["loss"] for m in metrics]
    mine, ref = param_digests(run), param_digests(reference["run"])
    for rank in (0, 1):
        assert mine[rank]["digests"] == ref[rank]["digests"], f"rank {rank} weights differ after the fallback"
    # the corrupt step was replaced by a good one
    store = CheckpointStore(run.root)
    assert store.verify(store.latest()).step == MAX_STEPS


