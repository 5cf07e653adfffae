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
                                                 "storage.user=ci", "train.checkpoint_every=3", *extra])


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


# ---- a streamed run (enrich.wave_rows): training starts on the first wave while the enrichment goes on ----------
STREAM_WAVE_ROWS = 80
"""The sample's files hold 32 or 64 rows: 3 waves (96, 96 and 128 rows)."""
STREAM_STEPS = 8


@pytest.fixture(scope="module")
def streamed_run(demo_data, ray_local, tmp_path_factory):
    """The demo's sample enriched in 3 waves by `run_sft`, 8 steps of 8 packs trained on the waves packed so far.

    The test holds the last wave's packing back (a wrapper around raytrain.streamed.pack_wave, real packing after
    it) until the trainer has trained every step the first two waves give: so the trainer catches up with the
    enrichment and must wait for the last wave, on any machine."""
    import time

    from raytrain import streamed
    from raytrain.dataset.wave_packs import WAVES

    root = tmp_path_factory.mktemp("streamed")
    job = _job(root, "streamed", f"input.path={open_run(demo_data.job()).paths.sample.path}",
               f"enrich.wave_rows={STREAM_WAVE_ROWS}", f"train.max_steps={STREAM_STEPS}", "train.grad_accum_steps=4",
               "train.eval_every=4")
    run = open_run(job)
    _reuse_corpus_table(open_run(demo_data.job()), run)
    global_batch = job.train.global_batch_size
    held: dict[str, int] = {}
    real_pack_wave = streamed.pack_wave

    def pack_wave(enriched_wave, packed, index, *args, **kwargs):
        if index == 2:  # the last wave: wait until the steps of waves 0 and 1 are trained
            earlier = [json.loads(packed.join(WAVES, f"wave-{w:05d}.json").read_text())["num_packs"] for w in (0, 1)]
            held["steps_before"] = sum(earlier) // global_batch
            deadline = time.monotonic() + 900
            while time.monotonic() < deadline:
                done = _metrics(run) if run.root.join("reports", "metrics.jsonl").exists() else []
                if len(done) >= held["steps_before"]:
                    break
                time.sleep(0.5)
        return real_pack_wave(enriched_wave, packed, index, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(streamed, "pack_wave", pack_wave)
        summary = run_sft(job)
    return job, summary, held


def _reuse_corpus_table(source, run) -> None:
    """The sample corpus's embedded sentence table of run ``source`` into ``run``'s data/corpus/ (the same corpus
    files and model: the enrichment reuses it, as a later run of one project does, instead of embedding again)."""
    shutil.copytree(source.paths.corpus.path, run.paths.corpus.path)


def _pack_rows(folder, files, column):
    return [v for name in files for v in pq.read_table(os.path.join(folder, name), columns=[column])
            .column(column).to_pylist()]


def test_streamed_run_trains_before_the_last_wave_and_waits_for_it(streamed_run):
    from raytrain.dataset.wave_packs import WAVES
    from raytrain.status import run_summary_lines
    from raytrain.trainer.pack_order import window_order

    job, summary, held = streamed_run
    run = open_run(job)
    packed = run.paths.packed.path
    records = [json.load(open(os.path.join(packed, WAVES, f"wave-{w:05d}.json"))) for w in range(3)]
    assert summary["waves"] == [r["num_packs"] for r in records] and summary["waves_at_start"] == 1
    metrics = {m["step"]: m for m in _metrics(run)}
    assert sorted(metrics) == list(range(1, STREAM_STEPS + 1))
    # from the run's own records: the first step finished before waves 1 and 2 were packed; every step that the
    # first two waves give was trained before the last wave was packed, then the trainer waited for it
    assert metrics[1]["finished_unix_s"] < records[1]["committed_unix_s"] < records[2]["committed_unix_s"]
    last_wave_step = held["steps_before"] + 1
    assert last_wave_step <= STREAM_STEPS  # the run needs the last wave
    assert metrics[last_wave_step - 1]["finished_unix_s"] < records[2]["committed_unix_s"]
    assert metrics[last_wave_step]["waited_for_waves_s"] > metrics[last_wave_step - 1]["waited_for_waves_s"]
    assert metrics[last_wave_step]["finished_unix_s"] > records[2]["committed_unix_s"]

    # the micro-batches consumed are those of the windowed order over the waves' packs (window 1: wave by wave)
    manifest = json.load(open(os.path.join(packed, "_manifest.json")))
    assert manifest["waves"] == summary["waves"]
    doc_ids = _pack_rows(packed, manifest["files"], "doc_ids")
    order = window_order(manifest["waves"], job.train.shuffle_window_waves, job.train.seed, job.train.shuffle, True)
    mbs = job.train.micro_batch_size
    expected = [hashlib.sha1("|".join(doc_ids[p] for p in order[k * mbs:(k + 1) * mbs]).encode()).hexdigest()[:16]
                for k in range(STREAM_STEPS * job.train.grad_accum_steps)]
    for rank in (0, 1):  # both stages of the pipeline read them
        with open(run.root.join("reports", f"data_trace_rank{rank}.jsonl").path) as f:
            assert [d for row in map(json.loads, f) for _, d in sorted(row["consumed"])] == expected, rank
    lines = "\n".join(run_summary_lines(run.root.uri))
    assert "streamed     3 waves packed" in lines and f"{len(records)} trained through" not in lines


def test_streamed_run_keeps_quarantines_and_packs_what_one_wave_does(streamed_run, demo_data):
    """The same rows kept and quarantined (with the same reasons) as the demo's one-wave enrichment of the same
    files, and the same tokens packed for training and for validation (the hold-out is per row)."""
    import numpy as np

    from raytrain.dataset.labels import PAD_SEGMENT_ID

    job, _, _ = streamed_run
    streamed, one_wave = open_run(job), open_run(demo_data.job())

    def rows(run, folder, columns):  # sorted as text: a quarantined row may have no uuid
        return sorted((tuple(r[c] for c in columns) for r in pq.read_table(run.root.join("data", folder).path,
                                                                           columns=list(columns)).to_pylist()),
                      key=repr)

    assert rows(streamed, "enriched", ("uuid",)) == rows(one_wave, "enriched", ("uuid",))
    assert rows(streamed, "quarantine", ("uuid", "reason")) == rows(one_wave, "quarantine", ("uuid", "reason"))

    def tokens(run, entry_of) -> np.ndarray:
        """Every real token of the packs the manifest lists (``entry_of(manifest)``: the files, relative to
        data/packed/), sorted."""
        folder = run.root.join("data", "packed").path
        files = entry_of(json.load(open(os.path.join(folder, "_manifest.json"))))
        ids, segments = (np.array(_pack_rows(folder, files, c)) for c in ("input_ids", "segment_ids"))
        return np.sort(ids[segments != PAD_SEGMENT_ID])

    def streamed_validation(manifest):
        records = [json.load(open(streamed.root.join("data", "packed", "waves", f"wave-{w:05d}.json").path))
                   for w in range(len(manifest["waves"]))]
        return [name for r in records for name in r["validation"]["files"]]

    one_wave_manifest = json.load(open(one_wave.root.join("data", "packed", "_manifest.json").path))
    streamed_manifest = json.load(open(streamed.root.join("data", "packed", "_manifest.json").path))
    assert streamed_manifest["validation_fraction"] == pytest.approx(one_wave_manifest["validation"]["fraction"])
    np.testing.assert_array_equal(tokens(streamed, lambda m: m["files"]), tokens(one_wave, lambda m: m["files"]))
    held_out = tokens(streamed, streamed_validation)
    assert len(held_out) and np.array_equal(held_out, tokens(
        one_wave, lambda m: [f"validation/{name}" for name in m["validation"]["files"]]))


def test_streamed_run_killed_mid_stream_resumes_exactly(streamed_run, ray_local, tmp_path_factory):
    """The streamed run's config in a driver process of its own (`raytrain run` on this module's Ray), SIGKILLed
    once its first checkpoint is committed, while waves are still being enriched; launched again (here): the
    enrichment goes on from its first uncommitted wave (no wave enriched twice), training from the checkpoint, and
    the losses and final weights equal the uninterrupted streamed run's, bit for bit."""
    import signal
    import subprocess
    import sys
    import time

    from raytrain.dataset.wave_packs import WAVES

    straight_job = streamed_run[0]
    overrides = [f"storage.root={tmp_path_factory.mktemp('killed')}", "storage.run_name=killed", "storage.user=ci",
                 f"input.path={straight_job.input.path}", f"enrich.wave_rows={STREAM_WAVE_ROWS}",
                 f"train.max_steps={STREAM_STEPS}", "train.grad_accum_steps=4", "train.eval_every=4",
                 "train.checkpoint_every=1"]
    job = load_job_config("configs/demo.yaml", overrides)
    run = open_run(job)
    _reuse_corpus_table(open_run(straight_job), run)
    env = dict(os.environ, HF_HUB_OFFLINE="1", RAY_ADDRESS=ray_local.get_runtime_context().gcs_address)
    driver = subprocess.Popen([sys.executable, "-m", "raytrain.cli", "run", "configs/demo.yaml", *overrides],
                              cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    enrich_records = run.root.join("data", "waves")
    try:
        deadline = time.monotonic() + 900
        while CheckpointStore(run.root).latest() is None:
            assert driver.poll() is None and time.monotonic() < deadline, "the driver ended before a checkpoint"
            time.sleep(0.2)
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=60)
    finally:
        if driver.poll() is None:
            driver.kill()
    committed_at_kill = {n: json.loads(enrich_records.join(n).read_text())["committed_unix_s"]
                         for n in enrich_records.listdir() if n.endswith(".json")}
    assert "wave-00002.json" not in committed_at_kill, "the enrichment finished before the kill: not mid-stream"
    killed_at_step = CheckpointStore(run.root).latest().step
    assert killed_at_step < STREAM_STEPS

    run_sft(job)
    for name, committed in committed_at_kill.items():  # the waves committed before the kill were not redone
        assert json.loads(enrich_records.join(name).read_text())["committed_unix_s"] == committed, name
    assert len([n for n in run.paths.packed.join(WAVES).listdir() if n.startswith("wave-")]) == 3
    straight, resumed = _metrics(open_run(straight_job)), _metrics(run)
    assert [m["step"] for m in resumed] == list(range(1, STREAM_STEPS + 1))
    assert [m["loss"] for m in resumed] == [m["loss"] for m in straight]
    a, b = CheckpointStore(run.root).latest(), CheckpointStore(open_run(straight_job).root).latest()
    assert a.step == b.step == STREAM_STEPS
    layer_files = sorted(f for f in a.manifest["files"] if "layer_" in f)
    assert layer_files == sorted(f for f in b.manifest["files"] if "layer_" in f) and layer_files
    for rel in layer_files:
        wa = torch.load(os.path.join(a.local_path, rel), map_location="cpu", weights_only=True)
        wb = torch.load(os.path.join(b.local_path, rel), map_location="cpu", weights_only=True)
        for k in wa:
            assert torch.equal(wa[k], wb[k]), f"{rel}:{k} differs"
    # the data traces of both launches: every global micro-batch up to the last step consumed, as in the
    # uninterrupted run (the killed launch's steps after its checkpoint are trained again)
    def trace(r):
        consumed = {}
        with open(r.root.join("reports", "data_trace_rank0.jsonl").path) as f:
            for row in map(json.loads, f):
                consumed.update(dict(map(tuple, row["consumed"])))
        return consumed

    assert trace(run) == trace(open_run(straight_job))
