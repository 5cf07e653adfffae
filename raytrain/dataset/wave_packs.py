"""Packs of a streamed run, wave by wave: each enrichment wave's kept rows are packed as soon as the wave is
committed, so training can start on the first waves while the enrichment goes on (``enrich.wave_rows``).

Under the run's ``data/packed/``:

- ``wave-NNNNN/part-*.parquet``: the wave's training packs (mixture-weighted as in one wave);
  ``validation/wave-NNNNN/``: its held-out rows' packs (``stream.validation_mask``: per row, by uuid hash, with the
  fraction ``validation_fraction`` of the run's *input* rows, known before any wave is enriched);
  ``benchmark/``: the eval sets' items, packed with wave 0.
- ``waves/wave-NNNNN.json``, written last for its wave: the commit record the trainer waits for (packs, files,
  real tokens, the same for validation).
- ``_manifest.json`` once every wave is packed: the files of all waves in wave order (``load_packed`` reads it as
  any packed set), ``waves`` (packs per wave: the pack order of raytrain.trainer.pack_order depends on them) and the
  validation set the trainer evaluates on: the held-out packs of the first ``train.shuffle_window_waves`` waves.

Pack indices count through the waves in order; a wave's packs never change once its record exists, so a resumed run
(or the trainer of an unfinished enrichment) reads the same packs at the same indices.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import pyarrow.parquet as pq
import ray

from raytrain.config import DatasetConfig
from raytrain.dataset.pack import TOKENIZED_COLUMNS
from raytrain.dataset.stream import (
    PackedData,
    _entry,
    _pack,
    _parquet_files,
    _rows_of_role,
    benchmark_conversations,
    packed_entry,
    read_enriched,
    validation_mask,
)
from raytrain.errors import RaytrainError
from raytrain.storage import MANIFEST, StorageLocation

log = logging.getLogger(__name__)

WAVES = "waves"
"""Folder of the wave commit records under data/packed/."""
FAILED = "_failed.json"
"""Under data/packed/waves/: written when the enrichment of a streamed run fails, so waiting workers stop too."""


def wave_name(index: int) -> str:
    return f"wave-{index:05d}"


def wave_fraction(cfg: DatasetConfig, rows_in: int) -> float:
    """The validation hold-out fraction of a streamed run: ``dataset.validation_fraction``, lowered so that about
    ``validation_max_rows`` of the input's rows are held out (the kept rows are not known before the last wave)."""
    return min(cfg.validation_fraction, cfg.validation_max_rows / rows_in) if rows_in > 0 else 0.0


def _relative(entry: dict[str, Any], folder: str) -> dict[str, Any]:
    return {**entry, "files": [f"{folder}/{name}" for name in entry["files"]]}


def pack_wave(enriched_wave: StorageLocation, packed: StorageLocation, index: int, cfg: DatasetConfig,
              data_hash: str, fraction: float, eval_records: tuple[Any, ...] = ()) -> dict[str, Any]:
    """Pack wave ``index``'s enriched rows (``enriched_wave``: data/enriched/wave-NNNNN) under ``packed`` and write
    its commit record last; returns the record. A record for the same settings already there is returned as is
    (the wave was packed by an earlier launch); a half-written wave is packed again."""
    record_loc = packed.join(WAVES, f"{wave_name(index)}.json")
    if record_loc.exists():
        record = json.loads(record_loc.read_text())
        if record.get("data_hash") == data_hash:
            return record
    t0 = time.perf_counter()
    name = wave_name(index)
    train_out, held_out = packed.join(name), packed.join("validation", name)
    for loc in (train_out, held_out, *([packed.join("benchmark")] if index == 0 else [])):
        loc.delete_dir()
    files = _parquet_files(enriched_wave) if enriched_wave.exists() else []
    weights = cfg.weights()
    train = validation = None
    rows = held_rows = 0
    if files:
        uuids = pq.read_table(files, filesystem=enriched_wave.filesystem, columns=["uuid"]).column("uuid").to_pylist()
        rows, held_rows = len(uuids), int(validation_mask(uuids, fraction).sum())
        columns = [*TOKENIZED_COLUMNS, "split"] if weights else list(TOKENIZED_COLUMNS)
        ds = read_enriched(files, enriched_wave.filesystem, columns)
        role = {"fraction": fraction, "weights": weights}
        train = _pack(ds.map_batches(_rows_of_role, batch_format="pandas", fn_kwargs={**role, "validation": False}),
                      train_out, cfg)
        if fraction > 0:
            validation = _pack(ds.map_batches(_rows_of_role, batch_format="pandas",
                                              fn_kwargs={**role, "validation": True}), held_out, cfg)
    record = {"wave": index, "data_hash": data_hash, "enriched_files": len(files),
              **_relative(_entry(train, rows=rows - held_rows), name),
              "validation": _relative(_entry(validation, rows=held_rows), f"validation/{name}")}
    if index == 0:
        record["benchmark"] = _pack_benchmark(packed, cfg, eval_records)
    record["seconds"] = round(time.perf_counter() - t0, 2)
    record["committed_unix_s"] = round(time.time(), 3)
    record_loc.write_atomic(json.dumps(record, sort_keys=True))
    log.info("dataset: wave %d packed: %d training sequences, %d held out (%.1fs)", index + 1, record["num_packs"],
             record["validation"]["num_packs"], record["seconds"])
    return record


def _pack_benchmark(packed: StorageLocation, cfg: DatasetConfig, eval_records: tuple[Any, ...]) -> dict[str, Any]:
    if not eval_records:
        return _entry(None)
    conversations, skipped = benchmark_conversations(eval_records, cfg)
    benchmark = _pack(ray.data.from_pandas(conversations), packed.join("benchmark"), cfg) if len(conversations) \
        else None
    return _entry(benchmark, items=len(eval_records), conversations=len(conversations), skipped=skipped)


@dataclass(frozen=True)
class WaveRecords:
    """The waves packed so far (consecutive from wave 0) and whether every wave is (the manifest exists)."""

    records: tuple[dict[str, Any], ...]
    complete: bool

    @property
    def wave_packs(self) -> tuple[int, ...]:
        return tuple(r["num_packs"] for r in self.records)


def read_wave_records(packed: StorageLocation, data_hash: str, known: int = 0,
                      earlier: tuple[dict[str, Any], ...] = ()) -> WaveRecords:
    """The commit records of waves 0, 1, ... up to the first one missing (``earlier``: the first ``known`` of them,
    read before), and whether the enrichment packed its last wave."""
    failed = packed.join(WAVES, FAILED)
    if failed.exists():
        raise RaytrainError(f"the enrichment of this streamed run failed ({json.loads(failed.read_text())['error']}); "
                            "its error is in the driver's output")
    records = list(earlier[:known])
    while True:
        loc = packed.join(WAVES, f"{wave_name(len(records))}.json")
        if not loc.exists():
            break
        record = json.loads(loc.read_text())
        if record.get("data_hash") != data_hash:
            raise RaytrainError(f"{loc.uri} was packed with other input/enrich/dataset settings; a run's data cannot "
                                "change under its checkpoints: use a new storage.run_name")
        records.append(record)
    manifest = packed.join(MANIFEST)
    complete = manifest.exists() and len(records) == len(json.loads(manifest.read_text()).get("waves", [None]))
    return WaveRecords(tuple(records), complete)


def validation_of(packed: StorageLocation, records: tuple[dict[str, Any], ...], window: int) -> PackedData | None:
    """The streamed run's validation set: the held-out packs of the first ``window`` waves, in wave order."""
    entries = [r["validation"] for r in records[:window]]
    files = tuple(packed.join(name).path for e in entries for name in e["files"])
    num_packs = sum(e["num_packs"] for e in entries)
    return PackedData(packed, files, num_packs, sum(e["num_real_tokens"] for e in entries)) if num_packs else None


def benchmark_of(packed: StorageLocation, records: tuple[dict[str, Any], ...]) -> PackedData | None:
    return packed_entry((records[0].get("benchmark") or {}) if records else {}, packed.join("benchmark"))


def streamed_packs(packed: StorageLocation, waves: WaveRecords, window: int) -> PackedData:
    """What the driver hands the trainer: the packs of the waves so far (files relative to ``packed``), the
    validation set of the first ``window`` waves and the benchmark set."""
    files = tuple(packed.join(name).path for r in waves.records for name in r["files"])
    return PackedData(packed, files, sum(waves.wave_packs), sum(r["num_real_tokens"] for r in waves.records),
                      validation_of(packed, waves.records, window), benchmark_of(packed, waves.records),
                      waves=waves.wave_packs, complete=waves.complete)


def finish_waves(packed: StorageLocation, records: list[dict[str, Any]], cfg: DatasetConfig, data_hash: str,
                 fraction: float, window: int) -> None:
    """Write the packed set's manifest once every wave is packed (module docstring)."""
    files = [name for r in records for name in r["files"]]
    held = validation_of(packed, tuple(records), window)
    first = [r["validation"] for r in records[:window]]
    manifest = {"data_hash": data_hash, "seq_len": cfg.seq_len, "tokenizer": cfg.tokenizer, "files": files,
                "num_packs": sum(r["num_packs"] for r in records), "rows": sum(r["rows"] for r in records),
                "num_real_tokens": sum(r["num_real_tokens"] for r in records),
                "waves": [r["num_packs"] for r in records], "validation_fraction": fraction,
                # the validation set the trainer evaluates on: the held-out packs of the first window of waves
                "validation": {"num_packs": held.num_packs if held else 0, "rows": sum(e["rows"] for e in first),
                               "num_real_tokens": held.num_real_tokens if held else 0,
                               "files": [n for e in first for n in e["files"]], "fraction": fraction,
                               "waves": len(first)},
                "benchmark": records[0].get("benchmark") if records else _entry(None)}
    packed.join(MANIFEST).write_atomic(json.dumps(manifest, indent=2))
    log.info("dataset: %d waves packed: %d training sequences of %d tokens", len(records), manifest["num_packs"],
             cfg.seq_len)
