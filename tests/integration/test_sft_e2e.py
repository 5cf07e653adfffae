"""The thin slice end to end on CPU: sample Parquet -> Spark on Ray -> Ray Data tokenize/pack -> TorchTrainer with
2 workers, each one DeepSpeed pipeline stage of a tiny Mistral -> checkpoint -> resume."""

import json
import math
import os
import shutil

import pyarrow.parquet as pq
import pytest
import torch

from raytrain.checkpoint.store import CheckpointStore
from raytrain.config import load_job_config
from raytrain.runner import open_run, run_sft


def _job(root, run_name, *extra):
    return load_job_config("configs/demo.yaml", [f"storage.root={root}", f"storage.run_name={run_name}",
                                                 "storage.user=ci", "train.checkpoint_every=3", *extra])


def _metrics(run):
    path = run.root.join("reports", "metrics.jsonl").path
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def first_run(ray_local, tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    # the schedule spans 8 steps; this launch stops at 6 (as a preempted allocation would)
    job = _job(root, "e2e", "train.max_steps=8", "train.stop_at_step=6")
    summary = run_sft(job)
    return root, job, summary


def test_enrich_and_pack_outputs(first_run):
    root, job, _ = first_run
    run = open_run(job)
    report = json.loads(open(run.root.join("reports", "enrich_report.json").path).read())
    assert report["rows_out"] > 0
    # pyarrow (not our code) reads what Spark wrote; every input row is accounted for
    enriched = pq.read_table(run.root.join("data", "enriched").path)
    quarantine = pq.read_table(run.root.join("data", "quarantine").path)
    assert enriched.num_rows == report["rows_out"]
    assert quarantine.num_rows == report["quarantined_total"]
    assert report["rows_in"] == enriched.num_rows + quarantine.num_rows
    packed = pq.read_table(run.root.join("data", "packed").path)
    assert packed.num_rows > 0
    assert {len(x) for x in packed.column("input_ids").to_pylist()} == {job.dataset.seq_len}


def test_loss_is_finite_and_decreases(first_run):
    _, job, summary = first_run
    metrics = _metrics(open_run(job))
    assert [m["step"] for m in metrics] == list(range(1, 7))
    losses = [m["loss"] for m in metrics]
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]
    assert summary["final"]["step"] == 6


def test_checkpoints_committed(first_run):
    _, job, _ = first_run
    store = CheckpointStore(open_run(job).root)
    steps = [c.step for c in store.committed()]
    assert steps == [3, 6]
    latest = store.latest()
    assert latest.step == 6
    store.verify(latest)  # sizes + sha256 of every file listed in the manifest
    meta = latest.metadata
    assert meta["data_position"] == 6 * job.train.dp * job.train.grad_accum_steps
    files = latest.manifest["files"]
    # each of the 2 stages wrote its own layer files
    assert any("layer_00-model_states.pt" in f for f in files)
    # tiny: embed (0), 2 decoder layers (1, 2), norm (3), lm head (4): stage 1 holds the head
    assert any("layer_04-model_states.pt" in f for f in files)


def test_both_stages_consumed_identical_micro_batches(first_run):
    _, job, _ = first_run
    reports = open_run(job).root.join("reports")

    def trace(rank):
        with open(reports.join(f"data_trace_rank{rank}.jsonl").path) as f:
            return [(row["step"], row["consumed"]) for row in map(json.loads, f)]

    first_stage, last_stage = trace(0), trace(1)
    assert len(first_stage) == 6
    assert all(len(consumed) == job.train.grad_accum_steps for _, consumed in first_stage)
    assert first_stage == last_stage


def test_resume_continues_and_matches_uninterrupted(first_run, tmp_path_factory):
    root, job, _ = first_run
    # launch the same run name again: it resumes from step 6 and finishes the 8-step schedule
    resumed_job = _job(root, "e2e", "train.max_steps=8")
    run_sft(resumed_job)
    metrics = _metrics(open_run(resumed_job))
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6, 7, 8]

    # an uninterrupted run to step 8 on the same packed data (copied, so Spark is not started again)
    fresh = _job(root, "e2e-straight", "train.max_steps=8")
    src, dst = open_run(job).root.join("data", "packed").path, open_run(fresh).root.join("data", "packed").path
    shutil.copytree(src, dst)
    run_sft(fresh)
    straight = _metrics(open_run(fresh))
    # bit-exact on CPU with fixed seeds: same losses step by step, and the same final weights
    assert [m["loss"] for m in straight] == [m["loss"] for m in metrics]
    a = CheckpointStore(open_run(resumed_job).root).latest()
    b = CheckpointStore(open_run(fresh).root).latest()
    assert a.step == b.step == 8
    layer_files = sorted(f for f in a.manifest["files"] if "layer_" in f)
    assert layer_files == sorted(f for f in b.manifest["files"] if "layer_" in f) and layer_files
    for rel in layer_files:
        wa = torch.load(os.path.join(a.local_path, rel), map_location="cpu", weights_only=True)
        wb = torch.load(os.path.join(b.local_path, rel), map_location="cpu", weights_only=True)
        assert wa.keys() == wb.keys()
        for k in wa:
            assert torch.equal(wa[k], wb[k]), f"{rel}:{k} differs"
