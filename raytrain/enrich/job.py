"""The enrichment job on Spark-on-Ray: Nemotron Parquet in -> enriched + quarantine Parquet out, with a manifest
and a run report.

    read -> derive -> license -> exact_dedup -> near_dedup -> decontaminate -> select_context -> tokenize_check

Each step (``steps.py``) passes rows on or quarantines them with a reason; the job materializes every step's
output once (persist + count), logs the counts, and checks that no row went missing: rows_in == rows_out +
quarantined, per step and overall. Outputs, under the run's ``data/`` folder:

- ``data/enriched/part-*.parquet``: kept rows sorted by uuid (flat files, one per Spark partition), with the
  audit columns of the selection (``context_sentences``, ``kept_indices``, ``kept_sentences``, ``sentence_scores``,
  ``question_scores``, ``answer_scores``), ``num_tokens`` and the training conversation ``messages_json``.
- ``data/quarantine/part-*.parquet``: ``uuid, split, category, reason, detail`` for every row not kept.
- ``data/enriched/_manifest.json``, written last: row counts, files, the config hash, the eval sets' sha256.
- ``reports/enrich_summary.txt`` here, ``reports/enrich_report.json`` by the runner (the report dict).

Hand-off to Ray Data: training reads the enriched Parquet (``ray.data.read_parquet``, raytrain.dataset.stream),
not ``ray.data.from_spark``. Chosen by measurement (benchmarks/bench_enrich.py, 2,000 sample rows -> 1,699 kept,
2 executors, 2-core machine shared with other jobs, load average 3-6): reading the Parquet into a materialized
Ray Dataset took 2.8 s (best of 2; 0.022 of the 130 s enrichment), ``from_spark`` on the persisted final
DataFrame 3.8 s (0.030). Both are small next to the enrichment, so the rest decides: the Parquet is written anyway
(the durable record the manifest vouches for, and what a resumed run re-reads), reading it does not need Spark
alive, Spark's executors are released before Ray Data and the trainer need the CPUs (the starvation hang in
FACTS.md), and in the same benchmark a ``read_parquet`` issued after ``from_spark`` in one Ray session died in Ray
Data's ListFiles actor (twice out of two tries; Ray 2.60 + RayDP 1.6.5). RayDP 1.6.5 converts through its
"recoverable" path, so ``from_spark`` blocks stayed readable after ``raydp.stop_spark()`` (the README's
``cleanup_data=False`` advice is about the older conversion).
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
from raytrain.enrich.corpus import check_corpus
from raytrain.enrich.corpus_udfs import CORPUS_COLUMNS
from raytrain.enrich.decontam import build_eval_index, eval_text, iter_eval_records
from raytrain.enrich.inputs import discover_inputs, validate_inputs
from raytrain.enrich.report import StepCounts, dedup_ratio, enrich_config_hash, merge_reasons, summary_text
from raytrain.errors import RaytrainError
from raytrain.storage import StorageLocation, resolve
from raytrain.telemetry import record_enrich_step, record_quarantine

log = logging.getLogger(__name__)

MANIFEST = "_manifest.json"


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


@dataclass
class EnrichSession:
    """What `enrich_in_session` leaves behind: the result, and the final Spark DataFrame (persisted) for callers
    that still hold the Spark session (the benchmark's from_spark hand-off)."""

    result: EnrichResult
    frame: Any


def _materialize(step, rows_in: int, t0: float, prev_kept) -> tuple[Any, StepCounts, dict[str, Any] | None]:
    """Persist and count a step's outputs (running it once), compute the step's statistics (``step.stats``) on
    its shared frame, unpersist what the step no longer needs."""
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    if step.shared is not None:
        step.shared.persist(StorageLevel.MEMORY_AND_DISK)
    kept = step.kept.persist(StorageLevel.MEMORY_AND_DISK)
    rows_out = kept.count()
    quarantined = step.quarantined.persist(StorageLevel.MEMORY_AND_DISK)
    per_reason = {r["reason"]: int(r["count"]) for r in quarantined.groupBy("reason").agg(F.count("*").alias("count"))
                  .collect()}
    stats = step.stats(step.shared) if step.stats is not None else None
    if step.shared is not None:
        step.shared.unpersist()
    if prev_kept is not None:
        prev_kept.unpersist()
    counts = StepCounts(step.name, rows_in, rows_out, per_reason, time.perf_counter() - t0)
    log.info("enrich step %-15s %7d in -> %7d kept, %d quarantined %s (%.1fs)", step.name, rows_in, rows_out,
             sum(per_reason.values()), per_reason or "", counts.seconds)
    counts.check()
    return kept, counts, stats


def enrich_in_session(spark, job: JobConfig, input_root: StorageLocation, run_root: StorageLocation,
                      eval_sets: tuple[str, ...] | None = None) -> EnrichSession:
    """The whole enrichment inside an open Spark session (spark.spark_session); see the module docstring.

    ``eval_sets`` overrides ``job.enrich.eval_sets`` (the runner passes them resolved). Raises RaytrainError for
    bad inputs, AssertionError when rows go missing (a bug).
    """
    from raytrain.enrich import steps

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
    corpus: dict[str, Any] = {}

    def corpus_step(df):
        from raytrain.enrich.corpus_table import ann_recall, ensure_table, load_corpus_index

        t0 = time.perf_counter()
        folder, meta, reused = ensure_table(spark, corpus_files, cfg, run_root)
        index = load_corpus_index(folder, meta["key"], eval_index, cfg.decontam_ngram, cfg.corpus_exact_max_sentences)
        recall = ann_recall(df, index, cfg) if index.ann is not None else None
        corpus.update(table_uri=folder.uri, table=meta, reused=reused,
                      sentences_embedded_this_run=0 if reused else meta["sentences"], index=index.stats,
                      recall=recall, prepare_seconds=round(time.perf_counter() - t0, 2))
        return steps.corpus_context(spark, df, index, eval_index, job)

    raw = steps.read_inputs(spark, {k: [loc.spark_uri for loc in v] for k, v in files.items()}, job.data.max_rows)
    chain = [
        lambda df: steps.derive(df, job),
        lambda df: steps.license_filter(df, job),
        steps.exact_dedup,
        lambda df: steps.near_dedup(spark, df, job),
        lambda df: steps.decontaminate(spark, df, eval_index, job),
        lambda df: steps.select_context(df, job),
        *([corpus_step] if corpus_files else []),
        lambda df: steps.tokenize_check(df, job),
    ]
    df, prev, n, counts, quarantined, step_stats = raw, None, rows_in, [], [], {}
    for make_step in chain:
        t0 = time.perf_counter()
        step = make_step(df)
        df, c, extra = _materialize(step, n, t0, prev)
        if extra is not None:
            step_stats[step.name] = extra
        prev, n = df, c.rows_out
        counts.append(c)
        record_enrich_step(job.storage.run_name, c.step, c.rows_in, c.seconds)  # dashboard: rows/s per step
        quarantined.append(step.quarantined)

    t0 = time.perf_counter()
    out = steps.output_columns(df, CORPUS_COLUMNS if corpus_files else ()).orderBy("uuid")
    out.write.mode("overwrite").parquet(enriched.spark_uri)
    all_bad = quarantined[0]
    for q in quarantined[1:]:
        all_bad = all_bad.unionByName(q)
    all_bad.orderBy("reason", "uuid").write.mode("overwrite").parquet(quarantine.spark_uri)

    log.info("enrich: wrote %s and %s (%.1fs)", enriched.uri, quarantine.uri, time.perf_counter() - t0)
    per_reason = merge_reasons(counts)
    record_quarantine(job.storage.run_name, per_reason)
    rows_out = n
    enriched_files, enriched_rows = _footer_rows(enriched)
    quarantine_files, quarantine_rows = _footer_rows(quarantine)
    # Nothing dropped silently: checked on what was actually written, by reading the Parquet footers.
    if not rows_in == enriched_rows + quarantine_rows == rows_out + sum(per_reason.values()):
        raise AssertionError(f"enrich: {rows_in} rows in but {enriched_rows} written + {quarantine_rows} quarantined "
                             f"(steps say {rows_out} + {sum(per_reason.values())}); rows went missing (a bug)")

    # Statistics from the files just written, not from the step chain: a DataFrame read back from Parquet has a
    # one-node plan, while the chain's plan (every step, 14 cached frames) took Spark's planner seconds per query.
    # The final frame stays cached for callers holding the session (EnrichSession.frame); Spark's stop frees it.
    for q in quarantined:
        q.unpersist()
    contaminated = [{"uuid": r["uuid"], "split": r["split"], "detail": r["detail"]} for r in sorted(
        pq.read_table(quarantine.path, filesystem=quarantine.filesystem, columns=["uuid", "split", "reason", "detail"],
                      filters=[("reason", "=", "contaminated")]).to_pylist(), key=lambda r: r["uuid"])]
    stats = steps.selection_stats(spark.read.parquet(enriched.spark_uri))
    quarantined_per_split: dict[str, dict[str, int]] = {}
    for r in spark.read.parquet(quarantine.spark_uri).groupBy("split", "reason").count().collect():
        quarantined_per_split.setdefault(r["split"], {})[r["reason"]] = int(r["count"])
    config_hash = enrich_config_hash(job)
    manifest_loc = enriched.join(MANIFEST)
    report: dict[str, Any] = {
        "run_uri": run_root.uri, "config_hash": config_hash,
        "rows_in": rows_in, "rows_in_per_split": rows_per_split, "rows_out": rows_out,
        "quarantined": per_reason, "quarantined_total": sum(per_reason.values()),
        "quarantined_per_split": {k: dict(sorted(v.items())) for k, v in sorted(quarantined_per_split.items())},
        "rows_out_per_split": {k: v["rows"] for k, v in stats["per_split"].items()},
        "steps": [c.to_dict() for c in counts], "dedup_ratio": dedup_ratio(counts),
        "decontamination": {"count": len(contaminated), "ngram": cfg.decontam_ngram, "eval_sets": evals.sources,
                            "eval_ngrams": len(eval_index), "rows": contaminated},
        "similarity": {"question_weight": cfg.question_weight, "top_k": cfg.top_k, "min_score": cfg.min_score,
                       "system_prompt": cfg.system_prompt, "answer_text": cfg.answer_text,
                       **{k: stats[k] for k in ("all_sentences", "kept_sentences", "question", "answer",
                                                "rows_with_candidates", "rows_with_context_added",
                                                "rows_chunked", "texts_chunked",
                                                "system_prompts_changed", "system_prompt_chars_removed")},
                       "per_split": {split: {k: v for k, v in d.items() if k != "tokens"}
                                     for split, d in stats["per_split"].items()}},
        "tokenizer": job.dataset.tokenizer, "tokens": stats["tokens"],
        "length": {"policy": job.dataset.length_policy, "seq_len": job.dataset.seq_len,
                   **step_stats.get("tokenize_check", {"overall": {}, "per_split": {}})},
        "text_with_tool_calls": {"policy": job.dataset.text_with_tool_calls, "rows": stats["dropped_text_rows"],
                                 "turns_text_dropped": stats["dropped_text_turns"],
                                 "chars_text_dropped": stats["dropped_text_chars"]},
        "inputs": {"layout": inputs.layout, "root": inputs.root.uri,
                   "files": {k: [loc.name for loc in v] for k, v in files.items()},
                   "missing_shards": inputs.missing_shards, "rows_in_files": {k: v["rows"] for k, v in footers.items()}},
        "enriched_uri": enriched.uri, "quarantine_uri": quarantine.uri, "manifest_uri": manifest_loc.uri,
        "summary_uri": run_root.join("reports", "enrich_summary.txt").uri,
    }
    if corpus_files:
        report["corpus"] = _corpus_report(corpus, steps.corpus_stats(spark.read.parquet(enriched.spark_uri)),
                                          corpus_files, counts, cfg)
    log.info("enrich: report statistics computed (%.1fs)", time.perf_counter() - t0)
    report["seconds"] = round(time.perf_counter() - t_start, 2)
    manifest = {
        "config_hash": config_hash, "created_unix_s": round(time.time(), 3), "rows_in": rows_in,
        "rows_in_per_split": rows_per_split,
        "enriched": {"rows": enriched_rows, "files": enriched_files, "sorted_by": "uuid"},
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
    return EnrichSession(EnrichResult(enriched=enriched, quarantine=quarantine, report=report), df)


def _corpus_report(prepared: dict[str, Any], stats: dict[str, Any], files, counts: list[StepCounts], cfg
                   ) -> dict[str, Any]:
    """report["corpus"]: the files, the table (reused or embedded now, and how long that took), the eval filter,
    the search method and its recall, per-split row paths, score distributions and the most-used documents."""
    step = next(c for c in counts if c.step == "corpus_context")
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
        "prepare_seconds": prepared["prepare_seconds"],
        "retrieve_seconds": round(step.seconds - prepared["prepare_seconds"], 2),
        "top_k": cfg.top_k, "min_score": cfg.min_score, "question_weight": cfg.question_weight, **stats,
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
    from raytrain.enrich.spark import spark_session

    # Fail on bad inputs (and missing s3a jars) in seconds, before a JVM starts.
    validate_inputs(discover_inputs(input_root, job.data.splits))
    corpus_locs = [f.loc for f in check_corpus(job.enrich.context_corpus, job.enrich.corpus_id_field,
                                               job.enrich.corpus_text_field, input_root,
                                               job.storage.s3_endpoint or None)] if job.enrich.context_corpus else []
    configs = input_root.spark_conf | run_root.spark_conf
    for loc in corpus_locs:
        configs |= loc.spark_conf
    configs |= spark_jar_configs(job.enrich.spark_jars, (input_root, run_root, *corpus_locs))
    with spark_session(job.enrich, extra_configs=configs) as spark:
        return enrich_in_session(spark, job, input_root, run_root, eval_sets).result
