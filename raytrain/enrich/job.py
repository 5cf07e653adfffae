"""The enrichment job on Spark-on-Ray: Nemotron Parquet in -> enriched + quarantine Parquet out, with a report.

Spark does the row work (derive, quality filters, relevance selection); the per-row logic lives in the pure
modules next to this one (conversation, relevance, dedup, decontam), called from pandas UDFs.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import pyarrow.parquet as pq

from raytrain.config import JobConfig
from raytrain.enrich.conversation import Example, build_training_messages, derive_example
from raytrain.enrich.schema import validate_schema
from raytrain.errors import RaytrainError
from raytrain.storage import StorageLocation

log = logging.getLogger(__name__)

# Columns of the derived table Spark writes (all strings: one schema for good and quarantined rows).
DERIVED_COLUMNS = ("uuid", "category", "status", "detail", "context", "question", "answer", "messages_json")
OK = "ok"


@dataclass(frozen=True)
class EnrichResult:
    enriched: StorageLocation
    quarantine: StorageLocation
    report: dict[str, Any] = field(default_factory=dict)


def list_input_files(input_root: StorageLocation, splits: tuple[str, ...]) -> dict[str, list[StorageLocation]]:
    """`<root>/<split>/*.parquet` for each requested split; a missing split or empty folder is an error."""
    if not input_root.exists():
        raise RaytrainError(f"data.input_path: {input_root.uri} does not exist. Point it at a folder with one "
                            f"sub-folder per split ({', '.join(splits)}) or use data.input_path=sample.")
    files: dict[str, list[StorageLocation]] = {}
    for split in splits:
        split_dir = input_root.join(split)
        names = sorted(n for n in (split_dir.listdir() if split_dir.is_dir() else []) if n.endswith(".parquet"))
        if not names:
            raise RaytrainError(f"data.splits: no Parquet files under {split_dir.uri} for split {split!r}. "
                                f"Drop {split!r} from data.splits or add its files.")
        files[split] = [split_dir.join(n) for n in names]
    return files


def validate_inputs(files: dict[str, list[StorageLocation]]) -> int:
    """Check every file's schema from its footer (no rows read); returns the total row count."""
    rows = 0
    for locs in files.values():
        for loc in locs:
            with loc.filesystem.open_input_file(loc.path) as f:  # seekable: Parquet reads the footer
                try:
                    meta = pq.ParquetFile(f).metadata
                except Exception as e:  # pyarrow raises ArrowInvalid/OSError subclasses for non-Parquet bytes
                    raise RaytrainError(f"{loc.uri}: not a readable Parquet file ({e}). Fix or remove it.") from None
                validate_schema(meta.schema.to_arrow_schema(), loc.uri)
                rows += meta.num_rows
    return rows


def _derive_partition(batches: Iterator[pd.DataFrame], max_chars: int) -> Iterator[pd.DataFrame]:
    """Spark mapInPandas body: raw Nemotron rows -> one derived row each, status 'ok' or a quarantine reason."""
    for pdf in batches:
        out: list[dict[str, Any]] = []
        for row in pdf.to_dict("records"):
            result = derive_example(row, max_chars=max_chars)
            if isinstance(result, Example):
                messages = build_training_messages(result, [])
                out.append({"uuid": result.uuid, "category": result.category, "status": OK, "detail": "",
                            "context": result.context, "question": result.question, "answer": result.answer,
                            "messages_json": json.dumps(messages, ensure_ascii=False)})
            else:
                out.append({"uuid": result.uuid, "category": str(row.get("category") or ""),
                            "status": result.reason, "detail": result.detail, "context": "", "question": "",
                            "answer": "", "messages_json": ""})
        yield pd.DataFrame(out, columns=list(DERIVED_COLUMNS))


def run_enrich(job: JobConfig, input_root: StorageLocation, run_root: StorageLocation) -> EnrichResult:
    from raytrain.enrich.spark import spark_session

    t_start = time.perf_counter()
    files = list_input_files(input_root, job.data.splits)
    rows_in = validate_inputs(files)
    enriched = run_root.join("data", "enriched")
    quarantine = run_root.join("data", "quarantine")
    log.info("enrich: %d rows in %d files (%s)", rows_in, sum(len(v) for v in files.values()),
             ", ".join(f"{k}={len(v)}" for k, v in files.items()))
    with spark_session(job.enrich, extra_configs=input_root.spark_conf | run_root.spark_conf) as spark:
        from pyspark.sql import functions as F

        df = spark.read.parquet(*[loc.spark_uri for locs in files.values() for loc in locs])
        if job.data.max_rows:
            df = df.limit(job.data.max_rows * len(files))
        schema = ", ".join(f"{c} string" for c in DERIVED_COLUMNS)
        max_chars = job.enrich.max_chars
        derived = df.repartition(job.enrich.num_partitions).mapInPandas(
            lambda it: _derive_partition(it, max_chars), schema=schema).cache()
        ok = derived.filter(F.col("status") == OK).orderBy("uuid").drop("status", "detail")
        bad = derived.filter(F.col("status") != OK).select("uuid", "category", F.col("status").alias("reason"),
                                                          "detail")
        ok.write.mode("overwrite").parquet(enriched.spark_uri)
        bad.write.mode("overwrite").parquet(quarantine.spark_uri)
        per_reason = {r["reason"]: r["count"] for r in bad.groupBy("reason").count().collect()}
        rows_out = spark.read.parquet(enriched.spark_uri).count()
    report = {
        "rows_in": rows_in, "rows_out": rows_out, "quarantined": per_reason,
        "quarantined_total": sum(per_reason.values()), "seconds": round(time.perf_counter() - t_start, 2),
        "enriched_uri": enriched.uri, "quarantine_uri": quarantine.uri,
    }
    if rows_in != rows_out + report["quarantined_total"] and not job.data.max_rows:
        raise RaytrainError(f"enrich: {rows_in} rows in but {rows_out} out + {report['quarantined_total']} "
                            "quarantined; rows went missing (this is a bug, please report it)")
    log.info("enrich: %d rows kept, %d quarantined %s", rows_out, report["quarantined_total"], per_reason)
    return EnrichResult(enriched=enriched, quarantine=quarantine, report=report)
