"""Fault injection with real processes: a TorchTrainer worker SIGKILLed mid-training, checkpoint files corrupted on
disk. Each run must end as an undisturbed run would (same weights, same micro-batches) or fail with an error naming
what is broken. (The Spark executor SIGKILLed during an enrichment is in test_enrich_spark.py: the streamed
enrichment there has it, and is compared with the undisturbed one-wave run.)

Training runs skip Spark: synthetic conversations are packed once with raytrain.dataset.stream.pack_enriched and
copied into each run (the packed sequences are the run's fixed data; checkpoints record a position in them).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field

import pytest
from process_faults import my_processes
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


# ---- helpers ------------------------------------------------------------------------------------------------------
def make_job(root, run_name: str, *extra: str):
    # 128-token packs of the synthetic conversations (the demo packs 1,024), split where one is longer: enough
    # sequences for MAX_STEPS steps at the cost these tests always had
    return load_job_config("configs/demo.yaml", [
        f"storage.root={root}", "storage.user=ci", f"storage.run_name={run_name}", "dataset.seq_len=128",
        "dataset.length_policy=split", "enrich.wave_rows=0",
        f"train.max_steps={MAX_STEPS}", f"train.checkpoint_every={CHECKPOINT_EVERY}", "train.keep_last=3",
        "train.generation_tokens=0", *extra])  # the generations at each checkpoint: test_export checks them


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
            workers = my_processes("RayTrainWorker")
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


