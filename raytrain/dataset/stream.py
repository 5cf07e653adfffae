"""Ray Data hand-off: enriched Parquet -> tokenized, packed sequences (Parquet on the run root) -> training stream.

The packed sequences are written once per run so a resumed or restarted run reads exactly the same micro-batches in
the same order (the checkpoint records a position in this fixed sequence).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

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
    return PackedData(packed, tuple(packed.join(n).path for n in existing["files"]), existing["num_packs"],
                      existing["num_real_tokens"])


def tokenize_and_pack(enriched: StorageLocation, packed: StorageLocation, cfg: DatasetConfig,
                      data_hash: str) -> PackedData:
    """Tokenize + pack the enriched conversations with Ray Data and write them, manifest last, under `packed`."""
    if packed.exists():
        packed.delete_dir()  # a partial output from an interrupted run (no manifest): start clean
    t0 = time.perf_counter()
    files = _parquet_files(enriched)
    if not files:
        raise RaytrainError(f"no enriched Parquet under {enriched.uri}: did the enrich stage keep any row?")
    ds = ray.data.read_parquet(files, filesystem=enriched.filesystem, columns=["uuid", "messages_json"])
    ds = ds.map_batches(tokenize_and_pack_batch, batch_format="pandas", batch_size=TOKENIZE_BATCH_ROWS,
                        fn_kwargs={"tokenizer_version": cfg.tokenizer, "seq_len": cfg.seq_len,
                                  "length_policy": cfg.length_policy})
    ds.write_parquet(packed.path, filesystem=packed.filesystem)
    out_files = _parquet_files(packed)
    num_packs, num_tokens = 0, 0
    for path in out_files:
        with packed.filesystem.open_input_file(path) as f:
            t = pq.read_table(f, columns=["num_tokens"])
        num_packs += t.num_rows
        num_tokens += int(t.column("num_tokens").to_numpy().sum()) if t.num_rows else 0
    manifest = {"data_hash": data_hash, "num_packs": num_packs, "num_real_tokens": num_tokens,
                "seq_len": cfg.seq_len, "tokenizer": cfg.tokenizer,
                "files": [p.rsplit("/", 1)[-1] for p in out_files]}
    packed.join(MANIFEST).write_atomic(json.dumps(manifest, indent=2))
    log.info("dataset: %d conversations -> %d packed sequences of %d tokens (%d real tokens, %.1f%% fill) in %.1fs",
             sum(pq.ParquetFile(enriched.filesystem.open_input_file(f)).metadata.num_rows for f in files),
             num_packs, cfg.seq_len, num_tokens, 100.0 * num_tokens / max(1, num_packs * cfg.seq_len),
             time.perf_counter() - t0)
    return PackedData(packed, tuple(out_files), num_packs, num_tokens)


def training_dataset(packed: PackedData) -> ray.data.Dataset:
    """The packed sequences as a lazily read Ray Dataset, files in a fixed order."""
    ds = ray.data.read_parquet(list(packed.files), filesystem=packed.location.filesystem).select_columns(
        ["input_ids", "position_ids", "segment_ids", "labels", "doc_ids"])
    # Every reading worker executes this dataset once per epoch; its progress bars would be drawn in the driver's
    # console between the step lines. The driver shows the packing bars, the workers print their steps. Only this
    # dataset's context is changed, not the driver's.
    ds.context.enable_progress_bars = False
    return ds
