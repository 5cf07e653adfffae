"""The enrichment job on Spark-on-Ray: Nemotron Parquet in -> enriched + quarantine Parquet out, with a manifest
and a run report.

    read -> pass 1 (derive, license, dedup keys, eval n-grams) -> dedup (narrow) -> pass 2 (selection, corpus
    context, tokenization) -> write enriched, write quarantine -> two statistics rollups

``steps.py`` has the passes. Every row carries a status ("ok" or its quarantine reason) from pass 1 on; the
per-step counts come from one aggregation of it, and the job checks on the written Parquet footers that no row
went missing: rows in == enriched + quarantined. Spark actions per enrichment (no corpus): the near-duplicate
flags' count (which runs pass 1, the LSH buckets and the clustering), one per write, two statistics rollups, and
a job of Spark's own when it broadcasts the flags to pass 2's join (when it estimates them under
spark.sql.autoBroadcastJoinThreshold: on 100 and 400 card-length rows, not on 2,000, where it sort-merge joins): 5
or 6; no global sort (benchmarks/bench_enrich.py counts the jobs Spark runs for them). Outputs, under the run's
``data/`` folder:

- ``data/enriched/part-*.parquet``: kept rows, files hash-partitioned by uuid and sorted by uuid within each
  (the same files and order on every run of the same inputs and config), with the audit columns of the selection
  (``context_sentences``, ``kept_indices``, ``kept_sentences``, ``sentence_scores``, ``question_scores``,
  ``answer_scores``), the token ids and loss mask (``input_ids``, ``loss_mask``: packing never tokenizes again),
  ``num_tokens`` and the training conversation ``messages_json``.
- ``data/quarantine/part-*.parquet``: ``uuid, split, category, reason, detail`` for every row not kept.
- ``data/enriched/_manifest.json``, written last: row counts, files, the config hash, the eval sets' sha256.
- ``reports/enrich_summary.txt`` here, ``reports/enrich_report.json`` by the runner (the report dict).

Hand-off to Ray Data: training reads the enriched Parquet (``ray.data.read_parquet``, raytrain.dataset.stream),
not ``ray.data.from_spark`` (why: docs/decisions.md).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import pyarrow.parquet as pq

from raytrain.config import JobConfig
from raytrain.console import QUIET
from raytrain.enrich.conversation import QUARANTINE_REASONS
from raytrain.enrich.corpus import check_corpus
from raytrain.enrich.decontam import build_eval_index, build_sorted_index, eval_text, iter_eval_records
from raytrain.enrich.inputs import discover_inputs, validate_inputs
from raytrain.enrich.report import STEP_REASONS_AFTER_DERIVE, dedup_ratio, step_counts, summary_text
from raytrain.enrich.udfs import CONTAMINATED, OK
from raytrain.errors import RaytrainError
from raytrain.storage import MANIFEST, StorageLocation, resolve
from raytrain.telemetry import record_enrich_step, record_quarantine

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class EnrichResult:
    enriched: StorageLocation
    """Folder of the enriched Parquet files (flat, plus _manifest.json)."""
    quarantine: StorageLocation
    """Folder of the quarantine Parquet files."""
    report: dict[str, Any] = field(default_factory=dict)
    """The run report (see module docstring); the runner writes it to reports/enrich_report.json."""


@dataclass(frozen=True)
class EvalSets:
    """Decontamination input: the eval texts and where they came from."""

    texts: list[str]
    sources: list[dict[str, Any]]  # {"uri", "sha256", "items"} per file
    records: list[dict[str, Any] | str] = field(default_factory=list)
    """The items as read (records, or plain-text lines), parallel to ``texts``: the benchmark loss formats the
    question/answer records as conversations (raytrain.dataset.stream.pack_benchmark)."""


def load_eval_texts(eval_sets: tuple[str, ...], input_root: StorageLocation, s3_endpoint: str | None) -> EvalSets:
    """Read the eval files (paths or URIs; 'sample' = the input's eval/eval_set.jsonl); object-store files are
    copied to a temp dir first because decontam.iter_eval_records reads local files."""
    texts: list[str] = []
    records: list[dict[str, Any] | str] = []
    sources: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="raytrain-eval-") as tmp:
        for i, spec in enumerate(eval_sets):
            loc = input_root.join("eval", "eval_set.jsonl") if spec == "sample" else resolve(spec, s3_endpoint=s3_endpoint)
            if not loc.is_file():
                raise RaytrainError(f"enrich.eval_sets[{i}]: {loc.uri} is not a file. Fix: point it at a JSONL, "
                                    "Parquet or text eval file, or drop it.")
            data = loc.read_bytes()
            local = loc.path if loc.is_posix else os.path.join(tmp, f"{i}-{loc.name}")
            if not loc.is_posix:
                with open(local, "wb") as f:
                    f.write(data)
            items = list(iter_eval_records([local]))
            texts.extend(eval_text(record, None, where) for where, record in items)
            records.extend(record for _, record in items)
            sources.append({"uri": loc.uri, "sha256": hashlib.sha256(data).hexdigest(), "items": len(items)})
    return EvalSets(texts, sources, records)


def enrich_in_session(spark, job: JobConfig, input_root: StorageLocation, run_root: StorageLocation,
                      eval_sets: tuple[str, ...] | None = None) -> EnrichResult:
    """The whole enrichment inside an open Spark session (spark.spark_session); see the module docstring.

    ``eval_sets`` overrides ``job.enrich.eval_sets`` (the runner passes them resolved). Raises RaytrainError for
    bad inputs, AssertionError when rows go missing (a bug).
    """
    from pyspark.sql import functions as F

    from raytrain.enrich import steps
    from raytrain.enrich.spark import spark_uri

    t_start = time.perf_counter()
    cfg = job.enrich
    inputs = discover_inputs(input_root, job.data.splits)
    footers = validate_inputs(inputs)
    files = inputs.files
    rows_per_split = {k: v["rows"] for k, v in footers.items()}
    if job.data.max_rows:
        rows_per_split = {k: min(v, job.data.max_rows) for k, v in rows_per_split.items()}
    for line in inputs.describe():
        log.info("enrich: %s", line)
    rows_in = sum(rows_per_split.values())
    evals = load_eval_texts(tuple(cfg.eval_sets if eval_sets is None else eval_sets), input_root,
                            job.storage.s3_endpoint or None)
    eval_index = build_eval_index(evals.texts, cfg.decontam_ngram)
    enriched = run_root.join("data", "enriched")
    quarantine = run_root.join("data", "quarantine")
    log.info("enrich: %d rows in %d files (%s); %d eval items (%d %d-grams) from %d file(s)", rows_in,
             sum(len(v) for v in files.values()), ", ".join(f"{k}={v}" for k, v in rows_per_split.items()),
             len(evals.texts), len(eval_index), cfg.decontam_ngram, len(evals.sources))
    corpus_files = check_corpus(cfg.context_corpus, cfg.corpus_id_field, cfg.corpus_text_field, input_root,
                                job.storage.s3_endpoint or None) if cfg.context_corpus else None
    sc = spark.sparkContext
    eval_array = sc.broadcast(build_sorted_index(eval_index))
    passes: dict[str, float] = {}

    t0 = time.perf_counter()
    raw = steps.read_inputs(spark, {k: [spark_uri(loc) for loc in v] for k, v in files.items()}, job.data.max_rows,
                            {k: v["schema"] for k, v in footers.items()})
    prepared = steps.prepare(raw, eval_array, job)
    dups = steps.duplicates(spark, prepared, job)  # its one Spark job runs pass 1
    passes["prepare_and_dedup"] = time.perf_counter() - t0
    log.info("enrich: pass 1 (derive, license, dedup keys, eval n-grams) and near-dup clustering (LSH buckets, "
             "components) over %d rows (%.1fs)", rows_in, passes["prepare_and_dedup"])

    corpus: dict[str, Any] = {}
    shipped = None
    if corpus_files:
        from raytrain.enrich.corpus_table import ensure_table, load_corpus_index

        t0 = time.perf_counter()
        folder, meta, reused = ensure_table(spark, corpus_files, cfg, run_root)
        index = load_corpus_index(folder, meta["key"], eval_index, cfg.decontam_ngram, cfg.corpus_exact_max_sentences)
        shipped = sc.broadcast(index)
        corpus.update(table_uri=folder.uri, table=meta, reused=reused, index=index.stats,
                      sentences_embedded_this_run=0 if reused else meta["sentences"],
                      prepare_seconds=round(time.perf_counter() - t0, 2))
        passes["corpus_table"] = corpus["prepare_seconds"]

    t0 = time.perf_counter()
    retrieve_seconds = sc.accumulator(0.0)
    finished = steps.finish(prepared, dups.flags, job, corpus=shipped, eval_index=eval_array,
                            retrieve_seconds=retrieve_seconds)
    finished.filter(F.col("status") == OK).select(*steps.enriched_columns(bool(corpus_files))) \
        .write.mode("overwrite").parquet(spark_uri(enriched))
    prepared.unpersist()
    dups.unpersist()
    passes["finish"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    steps.quarantined(finished).write.mode("overwrite").parquet(spark_uri(quarantine))
    passes["write_quarantine"] = time.perf_counter() - t0
    log.info("enrich: pass 2 (selection%s, tokenization) wrote %s (%.1fs) and %s (%.1fs)",
             ", corpus context" if corpus_files else "", enriched.uri, passes["finish"], quarantine.uri,
             passes["write_quarantine"])

    t0 = time.perf_counter()
    reasons = (*QUARANTINE_REASONS, *STEP_REASONS_AFTER_DERIVE)
    rows = steps.row_stats(finished, job.dataset.seq_len, reasons, bool(corpus_files))
    sentences = steps.sentence_stats(finished, bool(corpus_files))
    overall = rows["overall"]
    if overall.get("status", {}).get("other"):
        raise AssertionError(f"enrich: {overall['status']['other']} rows with a status outside the known reasons "
                             "(a bug)")
    status = overall.get("status", {})
    per_reason = {r: n for r, n in sorted(status.items()) if r != OK}
    counts = step_counts(rows_in, per_reason, corpus=bool(corpus_files))
    for c in counts:
        log.info("enrich step %-15s %7d in -> %7d kept, %d quarantined %s", c.step, c.rows_in, c.rows_out,
                 sum(c.quarantined.values()), c.quarantined or "")
    record_quarantine(job.storage.run_name, per_reason)
    for name, seconds in passes.items():
        record_enrich_step(job.storage.run_name, name, rows_in, seconds)  # dashboard: rows/s per pass
    rows_out = status.get(OK, 0)
    enriched_files, enriched_rows = _footer_rows(enriched)
    quarantine_files, quarantine_rows = _footer_rows(quarantine)
    # Nothing dropped silently: checked on what was actually written, by reading the Parquet footers.
    if not rows_in == enriched_rows + quarantine_rows == rows_out + sum(per_reason.values()):
        raise AssertionError(f"enrich: {rows_in} rows in but {enriched_rows} written + {quarantine_rows} quarantined "
                             f"(status counts say {rows_out} + {sum(per_reason.values())}); rows went missing (a bug)")

    contaminated = [{"uuid": r["uuid"], "split": r["split"], "detail": r["detail"]} for r in sorted(
        pq.read_table(quarantine.path, filesystem=quarantine.filesystem, columns=["uuid", "split", "reason", "detail"],
                      filters=[("reason", "=", CONTAMINATED)]).to_pylist(), key=lambda r: r["uuid"])]
    sel_overall = {k: v for k, v in sentences["overall"].items() if k != "corpus"}
    config_hash = job.data_hash()
    manifest_loc = enriched.join(MANIFEST)
    report: dict[str, Any] = {
        "run_uri": run_root.uri, "config_hash": config_hash,
        "rows_in": rows_in, "rows_in_per_split": rows_per_split, "rows_out": rows_out,
        "quarantined": per_reason, "quarantined_total": sum(per_reason.values()),
        "quarantined_per_split": {k: {r: n for r, n in sorted(v["status"].items()) if r != OK}
                                  for k, v in rows["per_split"].items()
                                  if any(r != OK for r in v["status"])},
        "rows_out_per_split": {k: v["rows"] for k, v in rows["per_split"].items() if v["rows"]},
        "steps": [c.to_dict() for c in counts], "dedup_ratio": dedup_ratio(counts),
        "passes": {k: round(v, 2) for k, v in passes.items()},
        "decontamination": {"count": len(contaminated), "ngram": cfg.decontam_ngram, "eval_sets": evals.sources,
                            "eval_ngrams": len(eval_index), "rows": contaminated},
        "similarity": {"question_weight": cfg.question_weight, "top_k": cfg.top_k, "min_score": cfg.min_score,
                       "system_prompt": cfg.system_prompt, "answer_text": cfg.answer_text, **sel_overall,
                       **{k: overall.get(k, 0) for k in SELECTION_ROW_COUNTS},
                       "per_split": {split: {"rows": d["rows"], **{k: d[k] for k in SELECTION_ROW_COUNTS},
                                             **{k: d[k] for k in ("dropped_text_turns", "dropped_text_chars",
                                                                  "dropped_text_rows")},
                                             **{k: v for k, v in sentences["per_split"].get(split, sentences["empty"])
                                                .items() if k != "corpus"}}
                                     for split, d in rows["per_split"].items() if d["rows"]}},
        "tokenizer": job.dataset.tokenizer, "tokens": overall.get("tokens", {"count": 0}),
        "length": {"policy": job.dataset.length_policy, "seq_len": job.dataset.seq_len,
                   "overall": overall.get("length", {}),
                   "per_split": {k: v["length"] for k, v in rows["per_split"].items() if v["length"]["tokens"]["count"]}},
        "text_with_tool_calls": {"policy": job.dataset.text_with_tool_calls, "rows": overall.get("dropped_text_rows", 0),
                                 "turns_text_dropped": overall.get("dropped_text_turns", 0),
                                 "chars_text_dropped": overall.get("dropped_text_chars", 0)},
        "inputs": {"layout": inputs.layout, "root": inputs.root.uri,
                   "files": {k: [loc.name for loc in v] for k, v in files.items()},
                   "missing_shards": inputs.missing_shards, "rows_in_files": {k: v["rows"] for k, v in footers.items()}},
        "enriched_uri": enriched.uri, "quarantine_uri": quarantine.uri, "manifest_uri": manifest_loc.uri,
        "summary_uri": run_root.join("reports", "enrich_summary.txt").uri,
    }
    if corpus_files:
        from raytrain.enrich.corpus_table import ann_recall

        index = shipped.value
        # task seconds summed over the workers (a retried task counts twice): retrieval runs inside pass 2
        corpus["retrieve_seconds"] = round(retrieve_seconds.value, 2)
        corpus["recall"] = ann_recall(finished.filter(F.col("status") == OK), index, cfg) \
            if index.ann is not None else None
        corpus_rows = {"overall": overall, "per_split": {k: v for k, v in rows["per_split"].items() if v["rows"]}}
        report["corpus"] = _corpus_report(corpus, corpus_rows, sentences, steps.top_documents(finished), corpus_files, cfg)
    passes["statistics"] = time.perf_counter() - t0
    report["passes"]["statistics"] = round(passes["statistics"], 2)
    log.info("enrich: report statistics computed (%.1fs)", passes["statistics"])
    report["seconds"] = round(time.perf_counter() - t_start, 2)
    manifest = {
        "config_hash": config_hash, "created_unix_s": round(time.time(), 3), "rows_in": rows_in,
        "rows_in_per_split": rows_per_split,
        "enriched": {"rows": enriched_rows, "files": enriched_files, "sorted_by": "uuid within each file",
                     "partitioned_by": "hash of uuid"},
        "quarantine": {"uri": quarantine.uri, "rows": quarantine_rows, "files": quarantine_files,
                       "per_reason": per_reason},
        "eval_sets": evals.sources, "config": {k: job.to_dict()[k] for k in ("data", "enrich", "dataset")},
    }
    manifest_loc.write_atomic(json.dumps(manifest, indent=2, sort_keys=True))  # last: vouches for the files
    summary = summary_text(report)
    summary_loc = run_root.join("reports", "enrich_summary.txt")
    summary_loc.parent.mkdirs()
    summary_loc.write_atomic(summary)
    log.info("enrich summary:\n%s", summary, extra={QUIET: False})  # screens of text: the log file only
    log.info("enrich: %d rows in -> %d kept, %d quarantined (%s); summary in %s", rows_in, enriched_rows,
             quarantine_rows, ", ".join(f"{k} {v}" for k, v in per_reason.items()) or "none", summary_loc.uri)
    finished.unpersist()
    return EnrichResult(enriched=enriched, quarantine=quarantine, report=report)


SELECTION_ROW_COUNTS = ("rows_with_candidates", "rows_with_context_added", "rows_chunked", "texts_chunked",
                        "system_prompts_changed", "system_prompt_chars_removed")


def _corpus_report(prepared: dict[str, Any], rows: dict[str, Any], sentences: dict[str, Any],
                   top_documents: list[dict[str, Any]], files, cfg) -> dict[str, Any]:
    """report["corpus"]: the files, the table (reused or embedded now, and how long that took), the eval filter,
    the search method and its recall, per-split row paths, score distributions and the most-used documents."""
    table = prepared["table"]
    return {
        "files": [{"uri": f.loc.uri, "sha256": f.sha256, "records": f.records} for f in files],
        "id_field": cfg.corpus_id_field, "text_field": cfg.corpus_text_field,
        "table_uri": prepared["table_uri"], "key": table["key"], "reused": prepared["reused"],
        "sentences_embedded_this_run": prepared["sentences_embedded_this_run"],
        "documents": table["documents"], "documents_without_sentences": table["documents_without_sentences"],
        "sentences_split": table["sentences_split"], "duplicates_collapsed": table["duplicates_collapsed"],
        "sentences": table["sentences"], "embed_seconds": table["embed_seconds"],
        "contaminated_removed": prepared["index"]["contaminated_removed"],
        "contaminated": prepared["index"]["contaminated"], "searchable": prepared["index"]["searchable"],
        "method": prepared["index"]["method"], "exact_max_sentences": cfg.corpus_exact_max_sentences,
        "ann_build_seconds": prepared["index"]["ann_build_seconds"], "recall": prepared["recall"],
        "prepare_seconds": prepared["prepare_seconds"], "retrieve_seconds": prepared["retrieve_seconds"],
        "top_k": cfg.top_k, "min_score": cfg.min_score, "question_weight": cfg.question_weight,
        "rows": rows["overall"].get("rows", 0), **rows["overall"].get("corpus", {}),
        **sentences["overall"]["corpus"], "top_documents": top_documents,
        "per_split": {k: {"rows": v["rows"], **v.get("corpus", {}),
                          **sentences["per_split"].get(k, sentences["empty"])["corpus"]}
                      for k, v in rows["per_split"].items()},
    }


def _footer_rows(loc: StorageLocation) -> tuple[list[str], int]:
    """(sorted Parquet file names, total rows from their footers) of a flat folder."""
    names = sorted(n for n in loc.listdir() if n.endswith(".parquet"))
    rows = 0
    for n in names:
        with loc.filesystem.open_input_file(loc.join(n).path) as f:
            rows += pq.ParquetFile(f).metadata.num_rows
    return names, rows


def run_enrich(job: JobConfig, input_root: StorageLocation, run_root: StorageLocation,
               eval_sets: tuple[str, ...] | None = None) -> EnrichResult:
    """Start Spark on the running Ray cluster, enrich, stop Spark; returns where the outputs are and the report."""
    from raytrain.enrich.jars import spark_jar_configs
    from raytrain.enrich.spark import spark_conf, spark_session

    # Fail on bad inputs (and missing s3a jars) in seconds, before a JVM starts.
    validate_inputs(discover_inputs(input_root, job.data.splits))
    corpus_locs = [f.loc for f in check_corpus(job.enrich.context_corpus, job.enrich.corpus_id_field,
                                               job.enrich.corpus_text_field, input_root,
                                               job.storage.s3_endpoint or None)] if job.enrich.context_corpus else []
    configs = spark_conf(input_root) | spark_conf(run_root)
    for loc in corpus_locs:
        configs |= spark_conf(loc)
    configs |= spark_jar_configs(job.enrich.spark_jars, (input_root, run_root, *corpus_locs))
    with spark_session(job.enrich, extra_configs=configs) as spark:
        return enrich_in_session(spark, job, input_root, run_root, eval_sets)
