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
