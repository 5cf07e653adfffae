"""The thin slice end to end on CPU: sample Parquet -> Spark on Ray -> Ray Data tokenize/pack (the session's shared
demo run, tests/demo_run.py) -> TorchTrainer with 2 workers, each one DeepSpeed pipeline stage of a tiny Mistral ->
checkpoint -> resume. This module's runs train on a copy of the demo run's packed data: the same settings, so the
runner skips its data stages, as a relaunch of one run does."""

import hashlib
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
                                                 "storage.user=ci", "train.checkpoint_every=3", "enrich.wave_rows=0",
                                                 "train.generation_tokens=0", *extra])  # test_export checks them


def _metrics(run):
    path = run.root.join("reports", "metrics.jsonl").path
    with open(path) as f:
        return [json.loads(line) for line in f]


def _copy_packed(src_job, dst_job) -> None:
    """The packed sequences of `src_job`'s run into `dst_job`'s (same data settings: the run skips enrich and
    pack)."""
    assert src_job.data_hash() == dst_job.data_hash()
    shutil.copytree(open_run(src_job).paths.packed.path, open_run(dst_job).paths.packed.path)


@pytest.fixture(scope="module")
def first_run(demo_data, ray_local, tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    # the schedule spans 8 steps; this launch stops at 6 (as a preempted allocation would)
    job = _job(root, "e2e", "train.max_steps=8", "train.stop_at_step=6")
    _copy_packed(demo_data.job(), job)
    summary = run_sft(job)
    return root, job, summary


def test_enrich_and_pack_outputs(demo_data):
    job = demo_data.job()
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


def test_validation_rows_are_held_out_by_uuid_and_never_trained(first_run, demo_data):
    from raytrain.dataset.stream import validation_mask
    from raytrain.trainer.pack_order import epoch_order

    _, job, _ = first_run
    run = open_run(job)
    packed_dir = run.root.join("data", "packed").path
    with open(os.path.join(packed_dir, "_manifest.json")) as f:
        manifest = json.load(f)
    held_out = manifest["validation"]

    def uuids(folder, files):
        return {u for name in files for ids in pq.read_table(os.path.join(folder, name), columns=["doc_ids"])
                .column("doc_ids").to_pylist() for u in ids.split(",")}

    enriched = pq.read_table(open_run(demo_data.job()).paths.enriched.path, columns=["uuid"]).column("uuid").to_pylist()
    expected = {u for u, held in zip(enriched, validation_mask(enriched, held_out["fraction"]), strict=True) if held}
    train_uuids = uuids(packed_dir, manifest["files"])
    validation_uuids = uuids(os.path.join(packed_dir, "validation"), held_out["files"])
    assert validation_uuids == expected and held_out["rows"] == len(expected) > 0
    assert train_uuids | validation_uuids == set(enriched) and not train_uuids & validation_uuids

    # what the trainer consumed (its data trace) are training micro-batches only
    packs = [ids for name in manifest["files"]
             for ids in pq.read_table(os.path.join(packed_dir, name), columns=["doc_ids"]).column("doc_ids")
             .to_pylist()]
    mbs, tc = job.train.micro_batch_size, job.train
    train_digests = {hashlib.sha1("|".join(packs[p] for p in order[k * mbs:(k + 1) * mbs]).encode()).hexdigest()[:16]
                     for order in (epoch_order(len(packs), e, tc.seed, tc.shuffle) for e in range(3))
                     for k in range(len(packs) // mbs)}
    with open(run.root.join("reports", "data_trace_rank0.jsonl").path) as f:
        consumed = [digest for row in map(json.loads, f) for _, digest in row["consumed"]]
    assert consumed and set(consumed) <= train_digests

    # validation loss every train.eval_every steps and at the last step of the launch (stop_at_step=6)
    evaluated = {m["step"]: m["validation_loss"] for m in _metrics(run) if "validation_loss" in m}
    assert sorted(evaluated) == [5, 6] and all(math.isfinite(v) for v in evaluated.values())

    # the decontamination eval set's question/answer items, packed as conversations, give the benchmark loss at the
    # same steps
    benchmark = manifest["benchmark"]
    assert benchmark["items"] == benchmark["conversations"] + sum(benchmark["skipped"].values()) > 0
    assert benchmark["num_packs"] > 0
    scored = {m["step"]: m["benchmark_loss"] for m in _metrics(run) if "benchmark_loss" in m}
    assert sorted(scored) == [5, 6] and all(math.isfinite(v) for v in scored.values())


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


def test_run_is_owned_fenced_and_closed_to_other_users(first_run, demo_data):
    """The run records its owner and its lock's generation (one acquisition so far); the folders down to it are
    0750 and every checkpoint file the trainer workers (DeepSpeed's torch.save, the store) wrote is 0640."""
    import stat

    _, job, _ = first_run
    run = open_run(job)
    assert json.loads(run.root.join("owner.json").read_text())["user"] == "ci"
    assert run.root.join(".lock.generation").read_text().strip() == "1"
    for folder in (run.root.parent.parent, run.root.parent, run.root):
        assert stat.S_IMODE(os.stat(folder.path).st_mode) & 0o777 == 0o750, folder.path
    checkpoints = run.root.join("checkpoints").path
    modes = {}
    for dirpath, dirs, names in os.walk(checkpoints):
        for name in dirs + names:
            modes[os.path.relpath(os.path.join(dirpath, name), checkpoints)] = \
                stat.S_IMODE(os.stat(os.path.join(dirpath, name)).st_mode) & 0o777
    assert modes and all(mode == (0o750 if os.path.isdir(os.path.join(checkpoints, rel)) else 0o640)
                         for rel, mode in modes.items()), modes
    # nothing in the run, nor in the demo run whose data it trained on (Spark's and Ray Data's output), is open to
    # other users
    open_to_others = [os.path.join(d, n) for top in (run.root.path, demo_data.run_dir)
                      for d, dirs, names in os.walk(top) for n in dirs + names
                      if os.stat(os.path.join(d, n)).st_mode & 0o007]
    assert not open_to_others, open_to_others[:5]


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
    # validation losses too: the same validation set and weights at steps 5 and 8 (the first launch also evaluated at 6)
    resumed_eval = {m["step"]: m["validation_loss"] for m in metrics if "validation_loss" in m}
    straight_eval = {m["step"]: m["validation_loss"] for m in straight if "validation_loss" in m}
    assert sorted(resumed_eval) == [5, 6, 8] and sorted(straight_eval) == [5, 8]
    assert resumed_eval[5] == straight_eval[5] and resumed_eval[8] == straight_eval[8]
    # tokens seen carries over the resume; real (non-padding) tokens never exceed the global batch's slots
    assert [m["tokens_seen"] for m in straight] == [m["tokens_seen"] for m in metrics]
    slots = job.train.global_batch_size * job.dataset.seq_len
    assert all(0 < m["real_tokens"] <= slots and m["target_tokens"] < m["real_tokens"] for m in metrics)
    assert metrics[-1]["tokens_seen"] == sum(m["real_tokens"] for m in metrics)
    assert all(m["grad_norm"] > 0 for m in metrics) and metrics[-1]["eta_s"] == 0

    # TensorBoard, read by tensorboard's own reader: the two launches' event files give one curve per tag, steps
    # 1..8 once each (the resumed launch purged what came after its checkpoint), values as in metrics.jsonl
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(open_run(resumed_job).root.join("reports", "tensorboard").path)
    board.Reload()
    assert {"train/loss", "train/lr", "train/grad_norm", "train/real_tokens_per_s", "train/tokens_seen",
            "validation/loss", "benchmark/loss"} <= set(board.Tags()["scalars"])
    evaluated = [m for m in metrics if "validation_loss" in m]
    assert [e.step for e in board.Scalars("validation/loss")] == [m["step"] for m in evaluated]
    assert [e.value for e in board.Scalars("validation/loss")] == pytest.approx([m["validation_loss"] for m in evaluated],
                                                                          rel=1e-6)
    for tag, key in (("train/loss", "loss"), ("train/grad_norm", "grad_norm"), ("train/tokens_seen", "tokens_seen")):
        events = board.Scalars(tag)
        assert [e.step for e in events] == [m["step"] for m in metrics], tag
        assert [e.value for e in events] == pytest.approx([m[key] for m in metrics], rel=1e-6), tag
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

