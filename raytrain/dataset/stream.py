"""Ray Data hand-off: enriched Parquet -> tokenized, packed sequences (Parquet on the run root) -> training stream.

The packed sequences are written once per run so a resumed or restarted run reads exactly the same micro-batches in
the same order (the checkpoint records a position in this fixed sequence).

Held-out validation: every enriched row goes to training or to validation by a hash of its uuid
(``validation_mask``), so the split is the same on every rerun, resume and machine, and a validation row never
trains. Validation rows are packed like training rows (same length policy) under ``packed/validation/``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import ray

from raytrain.config import DatasetConfig
from raytrain.dataset.pack import tokenize_and_pack_batch
from raytrain.errors import RaytrainError
from raytrain.storage import StorageLocation

log = logging.getLogger(__name__)

MANIFEST = "_manifest.json"
TOKENIZE_BATCH_ROWS = 512  # conversations per map_batches call: large enough that per-batch padding stays small


@dataclass(frozen=True)
class PackedData:
    location: StorageLocation
    files: tuple[str, ...]  # filesystem-native paths, in the fixed read order
    num_packs: int
    num_real_tokens: int
    validation: PackedData | None = None
    """The held-out validation packs (under ``location/validation``); None when no row was held out."""


def validation_mask(uuids: Iterable[str], fraction: float) -> np.ndarray:
    """True for the rows held out for validation: sha1(uuid) read as a number in [0, 1) is below ``fraction``.

    Depends on nothing but the uuid: stable across reruns, resumes, machines and row order."""
    scale = float(2**64)
    return np.array([int.from_bytes(hashlib.sha1(str(u).encode()).digest()[:8], "big") / scale < fraction
                     for u in uuids], dtype=bool)


def _rows_of_role(batch: pd.DataFrame, fraction: float, validation: bool) -> pd.DataFrame:
    """The batch's validation rows (``validation``) or its training rows; for Ray Data ``map_batches``."""
    mask = validation_mask(batch["uuid"], fraction)
    return batch[mask if validation else ~mask]


def validation_fraction(cfg: DatasetConfig, num_rows: int) -> float:
    """``dataset.validation_fraction``, lowered so that about ``validation_max_rows`` of ``num_rows`` are held out."""
    if num_rows <= 0:
        return 0.0
    return min(cfg.validation_fraction, cfg.validation_max_rows / num_rows)


def _parquet_files(loc: StorageLocation) -> list[str]:
    return sorted(loc.join(n).path for n in loc.listdir() if n.endswith(".parquet"))


def load_packed(packed: StorageLocation, data_hash: str) -> PackedData | None:
    """The run's packed sequences when a committed manifest exists (None otherwise); packed from other settings
    is an error: a run's data cannot change under its checkpoints."""
    manifest_loc = packed.join(MANIFEST)
    if not manifest_loc.exists():
        return None
    existing = json.loads(manifest_loc.read_text())
    if existing["data_hash"] != data_hash:
        raise RaytrainError(
            f"{packed.uri} holds sequences packed with other data/enrich/dataset settings (hash "
            f"{existing['data_hash']} != {data_hash}); a run's data cannot change under its checkpoints. "
            "Use a new storage.run_name, or the settings the run was started with.")
    log.info("dataset: reusing %d packed sequences from %s", existing["num_packs"], packed.uri)
    held_out = existing.get("validation") or {}
    validation = None
    if held_out.get("num_packs"):
        folder = packed.join("validation")
        validation = PackedData(folder, tuple(folder.join(n).path for n in held_out["files"]),
                                held_out["num_packs"], held_out["num_real_tokens"])
    return PackedData(packed, tuple(packed.join(n).path for n in existing["files"]), existing["num_packs"],
                      existing["num_real_tokens"], validation)


def _pack(ds: ray.data.Dataset, out: StorageLocation, cfg: DatasetConfig) -> tuple[list[str], int, int]:
    """Tokenize + pack ``ds`` into Parquet under ``out``: (files in read order, packs, real tokens)."""
    ds = ds.map_batches(tokenize_and_pack_batch, batch_format="pandas", batch_size=TOKENIZE_BATCH_ROWS,
                        fn_kwargs={"tokenizer_version": cfg.tokenizer, "seq_len": cfg.seq_len,
                                  "length_policy": cfg.length_policy})
    ds.write_parquet(out.path, filesystem=out.filesystem)
    out_files = _parquet_files(out) if out.exists() else []
    num_packs, num_tokens = 0, 0
    for path in out_files:
        with out.filesystem.open_input_file(path) as f:
            t = pq.read_table(f, columns=["num_tokens"])
        num_packs += t.num_rows
        num_tokens += int(t.column("num_tokens").to_numpy().sum()) if t.num_rows else 0
    return out_files, num_packs, num_tokens


def tokenize_and_pack(enriched: StorageLocation, packed: StorageLocation, cfg: DatasetConfig,
                      data_hash: str) -> PackedData:
    """Tokenize + pack the enriched conversations with Ray Data and write them, manifest last, under `packed`."""
    if packed.exists():
        packed.delete_dir()  # a partial output from an interrupted run (no manifest): start clean
    t0 = time.perf_counter()
    files = _parquet_files(enriched)
    if not files:
        raise RaytrainError(f"no enriched Parquet under {enriched.uri}: did the enrich stage keep any row?")
    num_rows = sum(pq.ParquetFile(enriched.filesystem.open_input_file(f)).metadata.num_rows for f in files)
    fraction = validation_fraction(cfg, num_rows)
    ds = ray.data.read_parquet(files, filesystem=enriched.filesystem, columns=["uuid", "messages_json"])
    validation, held_out = None, {"rows": 0, "num_packs": 0, "num_real_tokens": 0, "files": [], "fraction": fraction}
    train_ds = ds if fraction == 0 else ds.map_batches(_rows_of_role, batch_format="pandas",
                                                       fn_kwargs={"fraction": fraction, "validation": False})
    out_files, num_packs, num_tokens = _pack(train_ds, packed, cfg)
    if fraction > 0:
        held_out_ds = ds.map_batches(_rows_of_role, batch_format="pandas",
                                     fn_kwargs={"fraction": fraction, "validation": True}).materialize()
        held_out["rows"] = held_out_ds.count()
        if held_out["rows"]:
            folder = packed.join("validation")
            val_files, val_packs, val_tokens = _pack(held_out_ds, folder, cfg)
            held_out.update(num_packs=val_packs, num_real_tokens=val_tokens,
                            files=[p.rsplit("/", 1)[-1] for p in val_files])
            validation = PackedData(folder, tuple(val_files), val_packs, val_tokens)
    manifest = {"data_hash": data_hash, "num_packs": num_packs, "num_real_tokens": num_tokens,
                "seq_len": cfg.seq_len, "tokenizer": cfg.tokenizer,
                "files": [p.rsplit("/", 1)[-1] for p in out_files], "rows": num_rows - held_out["rows"],
                "validation": held_out}
    packed.join(MANIFEST).write_atomic(json.dumps(manifest, indent=2))
    log.info("dataset: %d conversations -> %d packed sequences of %d tokens (%d real tokens, %.1f%% fill) in %.1fs",
             num_rows - held_out["rows"], num_packs, cfg.seq_len, num_tokens,
             100.0 * num_tokens / max(1, num_packs * cfg.seq_len), time.perf_counter() - t0)
    log.info("dataset: %d conversations held out for validation (uuid hash < %.4f) -> %d packed sequences",
             held_out["rows"], fraction, held_out["num_packs"])
    return PackedData(packed, tuple(out_files), num_packs, num_tokens, validation)


def training_dataset(packed: PackedData) -> ray.data.Dataset:  # also the validation stream (packed.validation)
    """The packed sequences as a lazily read Ray Dataset, files in a fixed order."""
    ds = ray.data.read_parquet(list(packed.files), filesystem=packed.location.filesystem).select_columns(
        ["input_ids", "position_ids", "segment_ids", "labels", "doc_ids"])
    # Every reading worker executes this dataset once per epoch; its progress bars would be drawn in the driver's
    # console between the step lines. The driver shows the packing bars, the workers print their steps. Only this
    # dataset's context is changed, not the driver's.
    ds.context.enable_progress_bars = False
    return ds
