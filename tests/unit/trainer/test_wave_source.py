"""A streamed run's packs as a worker reads them (raytrain.trainer.wave_source): wave records written as
raytrain.dataset.wave_packs writes them, over real Parquet packs; a worker that catches up waits for the next wave."""

import json
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raytrain.config import DatasetConfig
from raytrain.dataset.wave_packs import WAVES, read_wave_records, wave_fraction
from raytrain.errors import RaytrainError
from raytrain.storage import MANIFEST, resolve
from raytrain.trainer import wave_source
from raytrain.trainer.evaluation import PackedFiles
from raytrain.trainer.pack_order import WaveOrder, window_order
from raytrain.trainer.wave_source import WavePackSource

SEQ, HASH = 8, "h1"
WAVE_PACKS = (3, 5, 2)


def _commit_wave(packed, index: int, first: int) -> None:
    """Wave ``index``'s packs (numbered from ``first``: input ids = the pack number) and its record, last."""
    n = WAVE_PACKS[index]
    folder = packed / f"wave-{index:05d}"
    folder.mkdir(parents=True)
    k = np.arange(first, first + n)
    pq.write_table(pa.table({"input_ids": list(np.repeat(k[:, None], SEQ, axis=1)),
                             "position_ids": list(np.zeros((n, SEQ), int)), "segment_ids": list(np.zeros((n, SEQ), int)),
                             "labels": list(np.full((n, SEQ), 1)), "doc_ids": [f"d{p}" for p in k],
                             "num_tokens": np.full(n, SEQ), "num_targets": np.full(n, SEQ) + k}),
                   folder / "part-0.parquet", row_group_size=1)
    record = {"wave": index, "data_hash": HASH, "files": [f"wave-{index:05d}/part-0.parquet"], "num_packs": n,
              "num_real_tokens": n * SEQ, "validation": {"files": [], "num_packs": 0, "num_real_tokens": 0}}
    (packed / WAVES).mkdir(exist_ok=True)
    # atomically, as the enrichment commits it: a reader polling meanwhile sees no record or the whole one
    resolve(str(packed / WAVES / f"wave-{index:05d}.json")).write_atomic(json.dumps(record))


def _complete(packed) -> None:
    resolve(str(packed / MANIFEST)).write_atomic(json.dumps({"data_hash": HASH, "waves": list(WAVE_PACKS)}))


def test_records_are_read_up_to_the_first_missing_wave_and_complete_with_the_manifest(tmp_path):
    loc = resolve(str(tmp_path))
    assert read_wave_records(loc, HASH).records == ()
    _commit_wave(tmp_path, 0, 0)
    _commit_wave(tmp_path, 1, 3)
    waves = read_wave_records(loc, HASH)
    assert waves.wave_packs == (3, 5) and not waves.complete
    _commit_wave(tmp_path, 2, 8)
    _complete(tmp_path)
    assert read_wave_records(loc, HASH, 2, waves.records).complete
    with pytest.raises(RaytrainError, match="other input/enrich/dataset settings"):
        read_wave_records(loc, "other")
    (tmp_path / WAVES / "_failed.json").write_text(json.dumps({"error": "ValueError: bad row"}))
    with pytest.raises(RaytrainError, match="ValueError: bad row"):
        read_wave_records(loc, HASH)


def test_a_worker_waits_for_the_wave_its_micro_batch_needs_and_reads_its_packs(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(wave_source, "POLL_S", 0.05)
    _commit_wave(tmp_path, 0, 0)
    source = WavePackSource(PackedFiles(str(tmp_path), (), 0, streamed=True, data_hash=HASH), None, announce=True)
    order = WaveOrder(source.wait, 2, window=1, seed=3, shuffle=True)
    assert order.state.wave_packs == (3,) and source.packed.num_packs == 3

    def enrichment():
        time.sleep(0.3)
        _commit_wave(tmp_path, 1, 3)
        time.sleep(0.2)
        _commit_wave(tmp_path, 2, 8)
        _complete(tmp_path)

    thread = threading.Thread(target=enrichment)
    thread.start()
    packs = order.packs_of(2)  # wave 0 gives one micro-batch (3 packs): this one needs wave 1
    thread.join()
    final = window_order(WAVE_PACKS, 1, seed=3, shuffle=True, complete=True)
    np.testing.assert_array_equal(packs, final[4:6])
    assert source.waited_s > 0 and "waiting for wave 2" in capsys.readouterr().out
    batch = source.read(packs)  # the reader sees the files of the waves packed since
    np.testing.assert_array_equal(batch["input_ids"][:, 0], packs)  # pack k holds k
    np.testing.assert_array_equal(order.counts.num_targets[packs], SEQ + packs)
    order.packs_of(4)  # the last micro-batch of epoch 0 (10 packs)
    assert order.state.complete and source.packed.num_packs == 10


def test_validation_fraction_of_a_streamed_run_is_taken_over_the_input_rows():
    cfg = DatasetConfig(validation_fraction=0.05, validation_max_rows=10)
    assert wave_fraction(cfg, 100) == 0.05 and wave_fraction(cfg, 1000) == 0.01 and wave_fraction(cfg, 0) == 0.0


def test_a_worker_started_with_the_enrichment_waits_for_the_first_window_and_its_held_out_sets(tmp_path, monkeypatch,
                                                                                               capsys):
    """The trainer starts before any wave is packed: a worker's first_window polls the wave records until the first
    train.shuffle_window_waves waves are packed, then hands the loop the training packs so far, the validation set
    (the window's held-out packs, in wave order) and the benchmark set (packed with wave 0); a held-out set that
    gives a dp replica no micro-batch is dropped with the reason on the console."""
    from types import SimpleNamespace

    from raytrain.config import TrainConfig

    def held_out(index: int, packs: int) -> dict:
        return {"files": [f"validation/wave-{index:05d}/part-0.parquet"], "num_packs": packs, "num_real_tokens": 8}

    def commit(index: int, first: int) -> None:
        _commit_wave(tmp_path, index, first)
        path = tmp_path / WAVES / f"wave-{index:05d}.json"
        record = {**json.loads(path.read_text()), "validation": held_out(index, 2 + index)}
        if index == 0:
            record["benchmark"] = {"files": ["part-0.parquet"], "num_packs": 1, "num_real_tokens": 5}
        resolve(str(path)).write_atomic(json.dumps(record))

    polls = []

    def sleep(_seconds: float) -> None:  # the enrichment packs one more wave while the worker waits
        polls.append(len(polls))
        commit(len(polls) - 1, sum(WAVE_PACKS[:len(polls) - 1]))

    monkeypatch.setattr(wave_source, "time", SimpleNamespace(sleep=sleep, perf_counter=time.perf_counter))
    uri = resolve(str(tmp_path)).uri  # as the driver hands it (PackedData.location.uri)
    start = PackedFiles(uri, (), 0, streamed=True, data_hash=HASH)
    tc = TrainConfig(shuffle_window_waves=2, micro_batch_size=2, dp=1, eval_every=5)
    sets = wave_source.first_window(start, tc, None, announce=True)
    assert len(polls) == 2  # nothing packed, then wave 0: waited twice; wave 1 closes the window
    assert sets["packed"] == PackedFiles(uri, ("wave-00000/part-0.parquet", "wave-00001/part-0.parquet"), 8,
                                         streamed=True, data_hash=HASH)
    assert sets["validation"].files == ("validation/wave-00000/part-0.parquet", "validation/wave-00001/part-0.parquet")
    assert sets["validation"].num_packs == 5 and not sets["validation"].streamed
    assert (sets["benchmark"].uri, sets["benchmark"].files, sets["benchmark"].num_packs) == (
        f"{uri}/benchmark", ("part-0.parquet",), 1)
    assert "waiting for wave 1" in capsys.readouterr().out

    # every wave packed (fewer than the window): no waiting; dp 2: the benchmark's one pack is no micro-batch for
    # the second replica
    commit(2, 8)
    _complete(tmp_path)
    sets = wave_source.first_window(start, TrainConfig(shuffle_window_waves=5, micro_batch_size=2, dp=2), None,
                                    announce=True)
    assert sets["benchmark"] is None and sets["validation"].num_packs == 2 + 3 + 4 and len(polls) == 2
    assert "benchmark: 1 sequences make fewer micro-batches than train.dp=2 replicas" in capsys.readouterr().out
