"""Ray Data hand-off: enriched Parquet (token ids stored by the enrichment) -> packed sequences (Parquet on the run
root) -> training stream.

The packed sequences are written once per run so a resumed or restarted run reads exactly the same micro-batches in
the same order (the checkpoint records a position in this fixed sequence).

Held-out validation: every enriched row goes to training or to validation by a hash of its uuid
(``validation_mask``), so the split is the same on every rerun, resume and machine, and a validation row never
trains. Validation rows are packed like training rows (same length policy) under ``packed/validation/``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import ray

from raytrain.config import DatasetConfig
from raytrain.dataset.pack import TOKENIZED_COLUMNS, pack_batch, tokenize_frame
from raytrain.dataset.pack_reader import PackReader
from raytrain.dataset.pair_pack import MAX_PAIRS_PER_PACK, PAIR_TOKEN_COLUMNS, pair_pack_batch
from raytrain.errors import RaytrainError
from raytrain.storage import MANIFEST, StorageLocation, parquet_names

log = logging.getLogger(__name__)

PACK_ROW_GROUP_ROWS = 1
PACK_BATCH_ROWS = 512  # conversations per map_batches call: large enough that per-batch padding stays small


@dataclass(frozen=True)
class PackedData:
    location: StorageLocation
    files: tuple[str, ...]  # filesystem-native paths, in the fixed read order
    num_packs: int
    num_real_tokens: int
    validation: PackedData | None = None
    """The held-out validation packs (under ``location/validation``); None when no row was held out."""
    benchmark: PackedData | None = None
    """The decontamination eval sets' question/answer items as conversations (under ``location/benchmark``):
    the loss on their answers is the run's benchmark loss; None when no item could be formatted."""
    waves: tuple[int, ...] | None = None
    """A streamed run's packs per wave, in wave order (raytrain.dataset.wave_packs); None for packs of one wave."""
    complete: bool = True
    """False while a streamed run's enrichment still adds waves."""


def _uuid_unit(uuids: Iterable[str], salt: str = "") -> np.ndarray:
    """sha1(salt + uuid) read as a number in [0, 1), per uuid: depends on nothing but the uuid."""
    scale = float(2**64)
    return np.array([int.from_bytes(hashlib.sha1(f"{salt}{u}".encode()).digest()[:8], "big") / scale
                     for u in uuids], dtype=np.float64)


def validation_mask(uuids: Iterable[str], fraction: float) -> np.ndarray:
    """True for the rows held out for validation: sha1(uuid) read as a number in [0, 1) is below ``fraction``.

    Depends on nothing but the uuid: stable across reruns, resumes, machines and row order."""
    return _uuid_unit(uuids) < fraction


def mixture_copies(uuids: Iterable[str], splits: Iterable[str], weights: dict[str, float]) -> np.ndarray:
    """How many times each training row is used under ``dataset.split_weights``: floor(w), plus one when
    sha1("mixture:" + uuid) in [0, 1) is below w - floor(w) (independent of the validation hash)."""
    w = np.array([weights.get(split, 1.0) for split in splits], dtype=np.float64)
    whole = np.floor(w)
    return (whole + (_uuid_unit(uuids, "mixture:") < w - whole)).astype(np.int64)


def _rows_of_role(batch: pd.DataFrame, fraction: float, validation: bool,
                  weights: dict[str, float] | None = None) -> pd.DataFrame:
    """The batch's validation rows (``validation``) or its training rows, each training row repeated by its
    mixture weight; for Ray Data ``map_batches``."""
    mask = validation_mask(batch["uuid"], fraction)
    rows = batch[mask if validation else ~mask]
    if validation or not weights:
        return rows
    return rows.loc[rows.index.repeat(mixture_copies(rows["uuid"], rows["split"], weights))].reset_index(drop=True)


def _mixture_counts(enriched: StorageLocation, files: list[str], fraction: float,
                    weights: dict[str, float]) -> dict[str, dict[str, int]]:
    """Training rows per split before and after the mixture weights (reads the uuid and split columns only)."""
    table = pa.concat_tables([pq.read_table(enriched.filesystem.open_input_file(f), columns=["uuid", "split"])
                              for f in files])
    uuids, splits = table.column("uuid").to_pylist(), table.column("split").to_pylist()
    train = ~validation_mask(uuids, fraction)
    copies = mixture_copies(uuids, splits, weights)
    out: dict[str, dict[str, int]] = {}
    for split, keep, n in zip(splits, train.tolist(), copies.tolist(), strict=True):
        if keep:
            entry = out.setdefault(split, {"rows": 0, "sampled_rows": 0})
            entry["rows"] += 1
            entry["sampled_rows"] += n
    return dict(sorted(out.items()))


def validation_fraction(cfg: DatasetConfig, num_rows: int) -> float:
    """``dataset.validation_fraction``, lowered so that about ``validation_max_rows`` of ``num_rows`` are held out."""
    if num_rows <= 0:
        return 0.0
    return min(cfg.validation_fraction, cfg.validation_max_rows / num_rows)


def _parquet_files(loc: StorageLocation) -> list[str]:
    """Filesystem paths of the folder's Parquet files in read order (storage.parquet_names: wave by wave)."""
    return [loc.join(n).path for n in parquet_names(loc)]


def load_packed(packed: StorageLocation, data_hash: str, say_reused: bool = True) -> PackedData | None:
    """The run's packed sequences when a committed manifest exists (None otherwise); packed from other settings
    is an error: a run's data cannot change under its checkpoints. ``say_reused``: log that they are reused (not
    for a check before the stage that uses them)."""
    manifest_loc = packed.join(MANIFEST)
    if not manifest_loc.exists():
        return None
    existing = json.loads(manifest_loc.read_text())
    if existing["data_hash"] != data_hash:
        raise RaytrainError(
            f"{packed.uri} holds sequences packed with other input/enrich/dataset settings (hash "
            f"{existing['data_hash']} != {data_hash}); a run's data cannot change under its checkpoints. "
            "Use a new storage.run_name, or the settings the run was started with.")
    if say_reused:
        log.info("dataset: reusing %d packed sequences from %s", existing["num_packs"], packed.uri)
    train = PackedData(packed, tuple(packed.join(n).path for n in existing["files"]), existing["num_packs"],
                       existing["num_real_tokens"])
    if "waves" in existing:  # a streamed run's packs, wave by wave (raytrain.dataset.wave_packs): paths relative to
        # data/packed/, its validation set the first window's held-out packs
        return dataclasses.replace(train, validation=packed_entry(existing["validation"], packed),
                                   benchmark=packed_entry(existing["benchmark"], packed.join("benchmark")),
                                   waves=tuple(existing["waves"]), complete=True)
    return dataclasses.replace(
        train, validation=packed_entry(existing.get("validation") or {}, packed.join("validation")),
        benchmark=packed_entry(existing.get("benchmark") or {}, packed.join("benchmark")))


def packed_entry(entry: dict[str, Any], folder: StorageLocation) -> PackedData | None:
    """A manifest entry (``_entry``'s: files relative to ``folder``, packs, real tokens) as PackedData; None when it
    holds no pack."""
    if not entry.get("num_packs"):
        return None
    return PackedData(folder, tuple(folder.join(n).path for n in entry["files"]), entry["num_packs"],
                      entry["num_real_tokens"])


FOOTER_ACTORS_ENV = "RAY_DATA_PARQUET_FOOTER_NUM_ACTORS"
"""Ray Data 2.60 reads every Parquet file's footer on a pool of this many new actors (32 by default) each time a
Parquet dataset is created; one reads the few files of an enriched wave or run (docs/decisions.md, "One footer
reader for Ray Data's Parquet reads"). A value in the environment wins."""


def read_enriched(files: Sequence[str], filesystem: Any, columns: Sequence[str]) -> ray.data.Dataset:
    """``files`` as a Ray Data dataset of ``columns``, in the files' row order (the same rows always give the same
    packs, not whatever order the tasks finish in)."""
    os.environ.setdefault(FOOTER_ACTORS_ENV, "1")  # read where the dataset is created (this process)
    ds = ray.data.read_parquet(list(files), filesystem=filesystem, columns=list(columns))
    ds.context.execution_options.preserve_order = True
    return ds


def _pack(ds: ray.data.Dataset, out: StorageLocation, cfg: DatasetConfig, pairs: bool = False) -> PackedData | None:
    """Pack ``ds`` (TOKENIZED_COLUMNS rows; with ``pairs``, PAIR_TOKEN_COLUMNS rows) into Parquet under ``out``;
    None when it gave no pack."""
    if pairs:
        ds = ds.map_batches(pair_pack_batch, batch_format="pandas", batch_size=PACK_BATCH_ROWS,
                            fn_kwargs={"seq_len": cfg.seq_len})
    else:
        ds = ds.map_batches(pack_batch, batch_format="pandas", batch_size=PACK_BATCH_ROWS,
                            fn_kwargs={"seq_len": cfg.seq_len, "length_policy": cfg.length_policy})
    # one pack per row group: a trainer rank reads exactly the packs it trains (raytrain.dataset.pack_reader)
    ds.write_parquet(out.path, filesystem=out.filesystem, row_group_size=PACK_ROW_GROUP_ROWS)
    out_files = _parquet_files(out) if out.exists() else []
    num_packs, num_tokens = 0, 0
    for path in out_files:
        with out.filesystem.open_input_file(path) as f:
            t = pq.read_table(f, columns=["num_tokens"])
        num_packs += t.num_rows
        num_tokens += int(t.column("num_tokens").to_numpy().sum()) if t.num_rows else 0
    return PackedData(out, tuple(out_files), num_packs, num_tokens) if num_packs else None


def _entry(data: PackedData | None, **extra: Any) -> dict[str, Any]:
    """A packed set's manifest entry: packs, real tokens, file names (plus ``extra``)."""
    return {**extra, "num_packs": data.num_packs if data else 0, "num_real_tokens": data.num_real_tokens if data else 0,
            "files": [p.rsplit("/", 1)[-1] for p in data.files] if data else []}


def benchmark_conversations(records: Sequence[dict[str, Any] | str], cfg: DatasetConfig
                            ) -> tuple[pd.DataFrame, dict[str, int]]:
    """Eval items with a non-empty ``question`` and ``answer`` as [user: question, assistant: answer] conversations,
    tokenized (TOKENIZED_COLUMNS, ``uuid`` benchmark-<i>), and the counts of items left out: no question/answer
    fields (e.g. plain-text eval sets), or longer than ``dataset.seq_len`` tokens (never cut: a cut answer is
    another benchmark)."""
    rows: list[dict[str, str]] = []
    skipped = {"no_question_answer": 0, "longer_than_seq_len": 0}
    for i, record in enumerate(records):
        question = record.get("question") if isinstance(record, dict) else None
        answer = record.get("answer") if isinstance(record, dict) else None
        if not (isinstance(question, str) and question.strip() and isinstance(answer, str) and answer.strip()):
            skipped["no_question_answer"] += 1
            continue
        messages = [{"role": "user", "content": question, "tool_calls": None},
                    {"role": "assistant", "content": answer, "tool_calls": None}]
        rows.append({"uuid": f"benchmark-{i}", "messages_json": json.dumps(messages)})
    tokenized = tokenize_frame(pd.DataFrame(rows, columns=["uuid", "messages_json"]), cfg.tokenizer)
    fits = np.array([len(ids) <= cfg.seq_len for ids in tokenized["input_ids"]], dtype=bool)
    skipped["longer_than_seq_len"] = int((~fits).sum())
    return tokenized[fits].reset_index(drop=True), skipped


def _fresh_output(enriched: StorageLocation, packed: StorageLocation, what: str) -> list[str]:
    """The enriched Parquet files to pack, after clearing ``packed`` of a partial output (an interrupted run's,
    without a manifest); RaytrainError when there is none."""
    if packed.exists():
        packed.delete_dir()
    files = _parquet_files(enriched)
    if not files:
        raise RaytrainError(f"no enriched Parquet under {enriched.uri}: did the enrich stage keep any {what}?")
    return files


def pack_enriched(enriched: StorageLocation, packed: StorageLocation, cfg: DatasetConfig,
                  data_hash: str, eval_records: Sequence[dict[str, Any] | str] = ()) -> PackedData:
    """Pack the enriched rows' stored token ids with Ray Data and write them, manifest last, under `packed`: the
    training rows (mixture-weighted), the validation rows (``validation_mask``) under ``validation/``, and
    ``eval_records`` (the decontamination eval sets' items) as the benchmark set (``benchmark_conversations``)
    under ``benchmark/``."""
    t0 = time.perf_counter()
    files = _fresh_output(enriched, packed, "row")
    num_rows = sum(pq.ParquetFile(enriched.filesystem.open_input_file(f)).metadata.num_rows for f in files)
    fraction = validation_fraction(cfg, num_rows)
    weights = cfg.weights()
    names = pq.read_schema(enriched.filesystem.open_input_file(files[0])).names
    if weights and "split" not in names:
        raise RaytrainError(f"dataset.split_weights needs the enriched rows' 'split' column; {files[0]} has none. "
                            "Re-run the enrichment, or drop dataset.split_weights.")
    missing = [c for c in TOKENIZED_COLUMNS if c not in names]
    if missing:
        raise RaytrainError(f"{files[0]} has no {missing} column(s): enriched data written before the enrichment "
                            "stored token ids. Re-run the enrichment (a new storage.run_name).")
    columns = [*TOKENIZED_COLUMNS, "split"] if weights else list(TOKENIZED_COLUMNS)
    log.info("dataset: packing %d tokenized conversations (%s) into %d-token sequences with Ray Data",
             num_rows, cfg.tokenizer, cfg.seq_len)
    ds = read_enriched(files, enriched.filesystem, columns)
    train_ds = ds if fraction == 0 and not weights else ds.map_batches(
        _rows_of_role, batch_format="pandas", fn_kwargs={"fraction": fraction, "validation": False,
                                                         "weights": weights})
    train = _pack(train_ds, packed, cfg)
    if train is None:
        raise RaytrainError(f"no training sequence packed from {enriched.uri} ({num_rows} rows, validation "
                            f"fraction {fraction:.4f}): keep more rows, or lower dataset.validation_fraction.")
    validation, held_out_rows = None, 0
    if fraction > 0:
        held_out_ds = ds.map_batches(_rows_of_role, batch_format="pandas",
                                     fn_kwargs={"fraction": fraction, "validation": True}).materialize()
        held_out_rows = held_out_ds.count()
        validation = _pack(held_out_ds, packed.join("validation"), cfg) if held_out_rows else None
    benchmark, bench = None, {"items": len(eval_records)}
    if eval_records:
        conversations, bench["skipped"] = benchmark_conversations(eval_records, cfg)
        bench["conversations"] = len(conversations)
        if len(conversations):
            benchmark = _pack(ray.data.from_pandas(conversations), packed.join("benchmark"), cfg)
        log.info("dataset: benchmark loss on %d of %d eval items (left out: %d without a question and answer, %d "
                 "longer than seq_len) -> %d packed sequences", len(conversations), len(eval_records),
                 bench["skipped"]["no_question_answer"], bench["skipped"]["longer_than_seq_len"],
                 benchmark.num_packs if benchmark else 0)
    manifest = {"data_hash": data_hash, "seq_len": cfg.seq_len, "tokenizer": cfg.tokenizer,
                **_entry(train, rows=num_rows - held_out_rows),
                "validation": _entry(validation, rows=held_out_rows, fraction=fraction),
                "benchmark": _entry(benchmark, **bench)}
    if weights:
        manifest["mixture"] = {"weights": weights, "per_split": _mixture_counts(enriched, files, fraction, weights)}
        for split, n in manifest["mixture"]["per_split"].items():
            log.info("dataset: mixture %s x%g: %d training rows -> %d", split, weights.get(split, 1.0), n["rows"],
                     n["sampled_rows"])
    packed.join(MANIFEST).write_atomic(json.dumps(manifest, indent=2))
    log.info("dataset: %d conversations -> %d packed sequences of %d tokens (%d real tokens, %.1f%% fill) in %.1fs",
             num_rows - held_out_rows, train.num_packs, cfg.seq_len, train.num_real_tokens,
             100.0 * train.num_real_tokens / max(1, train.num_packs * cfg.seq_len), time.perf_counter() - t0)
    log.info("dataset: %d conversations held out for validation (uuid hash < %.4f) -> %d packed sequences",
             held_out_rows, fraction, validation.num_packs if validation else 0)
    return PackedData(packed, train.files, train.num_packs, train.num_real_tokens, validation, benchmark)


def _pairs_of_split(batch: pd.DataFrame, split: str) -> pd.DataFrame:
    return batch[batch["split"] == split][list(PAIR_TOKEN_COLUMNS)]


def _num_pairs(data: PackedData | None) -> int:
    return sum(int(pq.read_table(data.location.filesystem.open_input_file(f), columns=["num_pairs"])
                   .column("num_pairs").to_numpy().sum()) for f in data.files) if data else 0


def pack_enriched_pairs(enriched: StorageLocation, packed: StorageLocation, cfg: DatasetConfig,
                        data_hash: str) -> PackedData:
    """Pack the enriched preference pairs with Ray Data and write them, manifest last, under ``packed``: the pairs
    of the input's train split for training, those of its validation split under ``validation/`` (the published
    hold-out: no hash split here). A pair is never split (raytrain.dataset.pair_pack); the files' row order is
    kept, so the same pairs always give the same packs."""
    t0 = time.perf_counter()
    files = _fresh_output(enriched, packed, "pair")
    ds = read_enriched(files, enriched.filesystem, [*PAIR_TOKEN_COLUMNS, "split"])
    train = _pack(ds.map_batches(_pairs_of_split, batch_format="pandas", fn_kwargs={"split": "train"}), packed, cfg,
                  pairs=True)
    if train is None:
        raise RaytrainError(f"no training pair packed from {enriched.uri}: the input's train split kept no pair.")
    validation = _pack(ds.map_batches(_pairs_of_split, batch_format="pandas", fn_kwargs={"split": "validation"}),
                       packed.join("validation"), cfg, pairs=True)
    counts = {"train": _num_pairs(train), "validation": _num_pairs(validation)}
    manifest = {"data_hash": data_hash, "seq_len": cfg.seq_len, "tokenizer": cfg.tokenizer,
                "kind": "preference_pairs", "max_pairs_per_pack": MAX_PAIRS_PER_PACK,
                **_entry(train, pairs=counts["train"]), "validation": _entry(validation, pairs=counts["validation"]),
                "benchmark": _entry(None)}
    packed.join(MANIFEST).write_atomic(json.dumps(manifest, indent=2))
    log.info("dataset: %d training pairs -> %d packed sequences of %d tokens (%.1f%% fill), %d validation pairs -> "
             "%d, in %.1fs", counts["train"], train.num_packs, cfg.seq_len,
             100.0 * train.num_real_tokens / max(1, train.num_packs * cfg.seq_len), counts["validation"],
             validation.num_packs if validation else 0, time.perf_counter() - t0)
    return PackedData(packed, train.files, train.num_packs, train.num_real_tokens, validation, None)


def _read_micro_batches(batch: dict[str, np.ndarray], folder_uri: str, files: tuple[str, ...],
                        s3_endpoint: str | None) -> dict[str, np.ndarray]:
    """Ray Data ``map_batches`` function: rows of pack-index arrays (one micro-batch each) -> their packs, in order,
    with the Parquet bytes this call read in ``bytes_read`` (on the first row; 0 on the others)."""
    reader = _pack_reader(folder_uri, files, s3_endpoint)
    before = reader.bytes_read
    packs = np.concatenate([np.asarray(p, dtype=np.int64) for p in batch["packs"]])
    out = reader.read(packs)
    out["bytes_read"] = np.zeros(len(packs), dtype=np.int64)
    out["bytes_read"][0] = reader.bytes_read - before
    return out


@functools.lru_cache(maxsize=4)
def _pack_reader(folder_uri: str, files: tuple[str, ...], s3_endpoint: str | None) -> PackReader:
    return PackReader(folder_uri, files, s3_endpoint)  # one per Ray worker process: file footers read once


def stream_micro_batches(folder_uri: str, files: tuple[str, ...], s3_endpoint: str | None,
                         micro_batches: list[np.ndarray], micro_batch_size: int,
                         stats: dict[str, int] | None = None) -> Iterator[dict[str, np.ndarray]]:
    """The packs of ``micro_batches`` (arrays of pack indices, ``micro_batch_size`` each) streamed by Ray Data
    tasks in that order, one numpy batch per micro-batch; ``stats['bytes_read']`` and ``stats['packs_read']``
    add up what was read. Used by the trainer for the packs of its own replica only."""
    if not micro_batches:
        return
    per_task = 16  # micro-batches per read task: file footers are cached per worker process
    ds = ray.data.from_items([{"packs": np.asarray(p, dtype=np.int64)} for p in micro_batches],
                             override_num_blocks=max(1, len(micro_batches) // per_task))
    ds = ds.map_batches(_read_micro_batches, batch_size=per_task, batch_format="numpy",
                        fn_kwargs={"folder_uri": folder_uri, "files": files, "s3_endpoint": s3_endpoint},
                        num_cpus=READ_TASK_CPUS)
    ds.context.execution_options.preserve_order = True
    # Every reading worker runs this once per epoch; its progress bars would be drawn in the driver's console
    # between the step lines (only this dataset's context is changed).
    ds.context.enable_progress_bars = False
    for batch in ds.iter_batches(batch_size=micro_batch_size, batch_format="numpy", prefetch_batches=4):
        if stats is not None:
            stats["bytes_read"] = stats.get("bytes_read", 0) + int(batch.pop("bytes_read").sum())
            stats["packs_read"] = stats.get("packs_read", 0) + len(batch["pack_index"])
        yield batch


READ_TASK_CPUS = 0.25
"""Logical CPUs a pack-reading task reserves: reading is I/O, and a cluster whose CPUs the trainer's workers hold
(pp * dp workers on as many CPUs) must still run it."""
