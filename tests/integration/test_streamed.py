"""A streamed run end to end on CPU (enrich.wave_rows): the demo's sample enriched in three waves by Spark on Ray
while a TorchTrainer (2 pipeline stages) trains on the waves packed so far; checked against the session's shared
one-wave demo run (tests/demo_run.py), and killed mid-stream and resumed."""

import hashlib
import json
import os
import re
import shutil

import pyarrow.parquet as pq
import pytest
import torch

from raytrain.checkpoint.store import CheckpointStore
from raytrain.config import load_job_config
from raytrain.runner import open_run, run_sft


def _job(root, run_name, *extra):
    return load_job_config("configs/demo.yaml", [f"storage.root={root}", f"storage.run_name={run_name}",
                                                 "storage.user=ci", "train.checkpoint_every=3",
                                                 "train.generation_tokens=0", *extra])  # test_export checks them


def _metrics(run):
    with open(run.root.join("reports", "metrics.jsonl").path) as f:
        return [json.loads(line) for line in f]


STREAM_WAVE_ROWS = 80
"""The sample's files hold 32 or 64 rows: 3 waves (96, 96 and 128 rows)."""
STREAM_STEPS = 4
"""Wave 0's packs give steps 1 and 2; steps 3 and 4 need wave 1, held until step 2 is trained."""


@pytest.fixture(scope="module")
def one_spark(demo_data, ray_local):
    """One Spark session for this module's runs in this process (the uninterrupted run, the resumed launch), started
    with the settings run_enrich starts a session with: one JVM start and stop less. The killed launch, a process of
    its own, starts its own. Use: ``patch.setattr(raytrain.enrich.spark, "spark_session", one_spark)``."""
    from contextlib import contextmanager

    from raytrain.enrich.job import session_configs
    from raytrain.enrich.spark import spark_session

    job = _job("/unused", "unused", f"enrich.wave_rows={STREAM_WAVE_ROWS}")  # the enrich settings of both runs
    run_root = open_run(demo_data.job()).root  # local, as every run of this module: the same settings
    configs = session_configs(job, run_root, run_root, None)
    with spark_session(job.enrich, extra_configs=configs) as session:
        @contextmanager
        def the_session(cfg, app_name="raytrain-enrich", extra_configs=None):
            assert cfg == job.enrich and extra_configs == configs, "a session with other settings was asked for"
            yield session

        yield the_session


@pytest.fixture(scope="module")
def streamed_run(demo_data, ray_local, one_spark, tmp_path_factory):
    """The demo's sample enriched in 3 waves by `run_sft`, STREAM_STEPS steps of 8 packs trained on the waves packed
    so far.

    The test holds packing back (a wrapper around raytrain.streamed.pack_wave, real packing after it): wave 1's
    until the trainer has trained every step wave 0 gives; so the first steps come before the later waves are
    packed, and the trainer catches up with the enrichment and must wait for wave 1, on any machine, however fast
    the enrichment."""
    import time

    from raytrain import streamed
    from raytrain.dataset.wave_packs import WAVES
    from raytrain.enrich import spark as spark_module

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
        if index == 1:  # wait until every step of wave 0 is trained
            wave_0 = json.loads(packed.join(WAVES, "wave-00000.json").read_text())["num_packs"]
            held["steps_before_1"] = wave_0 // global_batch
            deadline = time.monotonic() + 900
            while time.monotonic() < deadline:
                done = _metrics(run) if run.root.join("reports", "metrics.jsonl").exists() else []
                if len(done) >= held["steps_before_1"]:
                    break
                time.sleep(0.5)
        return real_pack_wave(enriched_wave, packed, index, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(streamed, "pack_wave", pack_wave)
        patch.setattr(spark_module, "spark_session", one_spark)
        summary = run_sft(job)
    return job, summary, held


def _reuse_corpus_table(source, run) -> None:
    """The sample corpus's embedded sentence table of run ``source`` into ``run``'s data/corpus/ (the same corpus
    files and model: the enrichment reuses it, as a later run of one project does, instead of embedding again)."""
    shutil.copytree(source.paths.corpus.path, run.paths.corpus.path)


def _reuse_first_wave(source, run) -> None:
    """Wave 0 as run ``source`` committed it (its enriched and quarantined rows, dedup state, statistics table and
    commit record; not its packs) into ``run``, the same config's data: to ``run`` an earlier launch committed it."""
    from raytrain.enrich.waves import wave_outputs

    for src, dst in zip(wave_outputs(source.paths, "wave-00000"), wave_outputs(run.paths, "wave-00000"), strict=True):
        shutil.copytree(src.path, dst.path)
    shutil.copy(source.paths.waves.join("wave-00000.json").path, run.paths.waves.join("wave-00000.json").path)


def _pack_rows(folder, files, column):
    return [v for name in files for v in pq.read_table(os.path.join(folder, name), columns=[column])
            .column(column).to_pylist()]


def test_streamed_run_trains_before_the_later_waves_and_waits_for_them(streamed_run):
    from raytrain.dataset.wave_packs import WAVES
    from raytrain.status import run_summary_lines
    from raytrain.trainer.pack_order import window_order

    job, summary, held = streamed_run
    run = open_run(job)
    packed = run.paths.packed.path
    records = [json.load(open(os.path.join(packed, WAVES, f"wave-{w:05d}.json"))) for w in range(3)]
    assert summary["waves"] == [r["num_packs"] for r in records] and summary["waves_at_start"] == 0
    metrics = {m["step"]: m for m in _metrics(run)}
    assert sorted(metrics) == list(range(1, STREAM_STEPS + 1))
    # from the run's own records: the first step finished before waves 1 and 2 were packed; every step that wave 0
    # gives was trained before wave 1 was packed, then the trainer waited for it
    assert metrics[1]["finished_unix_s"] < records[1]["committed_unix_s"] < records[2]["committed_unix_s"]
    assert held["steps_before_1"] >= 2  # wave 0 alone gives steps 1 and 2
    wave_1_step = held["steps_before_1"] + 1
    assert wave_1_step <= STREAM_STEPS  # the run needs wave 1
    assert metrics[wave_1_step - 1]["finished_unix_s"] < records[1]["committed_unix_s"]
    assert metrics[wave_1_step]["waited_for_waves_s"] > metrics[wave_1_step - 1]["waited_for_waves_s"]
    assert metrics[wave_1_step]["finished_unix_s"] > records[1]["committed_unix_s"]

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
    assert f"from {manifest['rows']} rows, {manifest['validation']['num_packs']} held out" in lines

    # a later launch of the run (resume, `raytrain train`) reads the finished waves in the same order, with the
    # first window's held-out packs as its validation set
    from raytrain.dataset.stream import load_packed

    again = load_packed(run.paths.packed, job.data_hash())
    assert again.waves == tuple(manifest["waves"]) and again.complete and again.num_packs == len(doc_ids)
    assert again.validation.num_packs == records[0]["validation"]["num_packs"] == manifest["validation"]["num_packs"]
    report = json.load(open(run.root.join("reports", "enrich_report.json").path))
    assert manifest["rows"] + sum(r["validation"]["rows"] for r in records) == report["rows_out"]
    # each enrichment wave's seconds split into the rows' work (Spark accumulators over the tasks' batch
    # functions) and the rest around it
    for wave in report["waves"]:
        assert wave["rows_work_s"] > 0 and wave["around_s"] > 0, wave
        assert wave["rows_work_s"] + wave["around_s"] == pytest.approx(wave["seconds"], abs=0.02)
    assert report["rows_work_s"] >= sum(w["rows_work_s"] for w in report["waves"]) - 0.02


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

    one_wave_report = json.load(open(one_wave.root.join("reports", "enrich_report.json").path))
    assert one_wave_report["rows_work_s"] > 0 and one_wave_report["around_s"] > 0
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


def test_streamed_run_killed_mid_stream_resumes_exactly(streamed_run, ray_local, one_spark, tmp_path_factory):
    """The streamed run's config in a driver process of its own (`raytrain run` on this module's Ray), with wave 0
    committed by an earlier launch (the uninterrupted run's, copied: one wave less to enrich here), SIGKILLed once
    its first checkpoint and its wave 1 are committed, while wave 2 is still being enriched
    (tests/held_stream_driver.py holds the enrichment after wave 1 until that checkpoint); launched again (here): the
    enrichment goes on from its first uncommitted wave (no wave enriched twice), training from the checkpoint, and
    the losses and final weights equal the uninterrupted streamed run's, bit for bit."""
    import signal
    import subprocess
    import sys
    import time

    from raytrain.dataset.wave_packs import WAVES

    straight_job = streamed_run[0]
    # the same waves as the straight run's: wave 0 alone must give the killed run's first checkpoint (step 2), or
    # the held enrichment would wait for a checkpoint that waits for it
    assert streamed_run[2]["steps_before_1"] >= 2, streamed_run[2]
    overrides = [f"storage.root={tmp_path_factory.mktemp('killed')}", "storage.run_name=killed", "storage.user=ci",
                 f"input.path={straight_job.input.path}", f"enrich.wave_rows={STREAM_WAVE_ROWS}",
                 f"train.max_steps={STREAM_STEPS}", "train.grad_accum_steps=4", "train.eval_every=4",
                 # the first checkpoint at step 2, the last step that wave 1 (held until then) does not feed
                 "train.checkpoint_every=2", "train.generation_tokens=0"]
    job = load_job_config("configs/demo.yaml", overrides)
    run = open_run(job)
    _reuse_corpus_table(open_run(straight_job), run)
    _reuse_first_wave(open_run(straight_job), run)
    env = dict(os.environ, HF_HUB_OFFLINE="1", RAY_ADDRESS=ray_local.get_runtime_context().gcs_address,
               PYTHONUNBUFFERED="1")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    console = tmp_path_factory.mktemp("killed-console") / "console.txt"
    # `raytrain run`, its enrichment held after wave 1 until the first checkpoint: killed then, it is mid-stream
    with open(console, "w") as out:
        driver = subprocess.Popen([sys.executable, os.path.join(repo, "tests", "held_stream_driver.py"),
                                   "configs/demo.yaml", *overrides], cwd=repo,
                                  env=env, stdout=out, stderr=subprocess.STDOUT)
    enrich_records = run.root.join("data", "waves")
    try:
        deadline = time.monotonic() + 900
        # killed once both are there (in either order): the first checkpoint, and wave 1 committed by this launch
        while CheckpointStore(run.root).latest() is None or not enrich_records.join("wave-00001.json").exists():
            assert driver.poll() is None and time.monotonic() < deadline, \
                "the driver ended (or timed out) before its first checkpoint and wave 1's commit"
            time.sleep(0.2)
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=60)
    finally:
        if driver.poll() is None:
            driver.kill()
    committed_at_kill = {n: json.loads(enrich_records.join(n).read_text())["committed_unix_s"]
                         for n in enrich_records.listdir() if n.endswith(".json")}
    assert "wave-00002.json" not in committed_at_kill, "the enrichment finished before the kill: not mid-stream"
    # what the streamed `raytrain run` told on its console before the kill: the trainer started with the enrichment,
    # before any wave was packed; wave 0 taken as committed, wave 1 enriched and committed
    text = console.read_text()
    assert re.search(r"raytrain: enrich: wave 1/3 committed already \(\d+ rows in -> \d+ kept\)", text), text[-3000:]
    assert re.search(r"raytrain: enrich: wave 2/3 committed: \d+ files?, \d+ rows in -> \d+ kept, \d+ quarantined "
                     r"\([0-9.]+s: [0-9.]+s of the rows' work", text), text[-3000:]
    assert re.search(r"raytrain: stream: training starts with the enrichment \(0 wave\(s\) packed so far\)", text), \
        text[-3000:]
    killed_at_step = CheckpointStore(run.root).latest().step
    assert killed_at_step < STREAM_STEPS

    from raytrain.enrich import spark as spark_module

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(spark_module, "spark_session", one_spark)
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
