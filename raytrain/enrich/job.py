"""The enrichment job on Spark-on-Ray: Nemotron Parquet in -> enriched + quarantine Parquet out, with a manifest
and a run report.

    read -> pass 1 (derive, license, dedup keys, eval n-grams) -> dedup (narrow) -> pass 2 (selection, corpus
    context, tokenization) -> write enriched, write quarantine -> two statistics rollups

``passes.py`` has the passes. Every row carries a status ("ok" or its quarantine reason) from pass 1 on; the
per-step counts come from one aggregation of it, and the job checks on the written Parquet footers that no row
went missing: rows in == enriched + quarantined. Spark actions per enrichment (no corpus): the near-duplicate
flags' count (which runs pass 1, the LSH buckets and the clustering), one per write, two statistics rollups, and
a job of Spark's own when it broadcasts the flags to pass 2's join (when it estimates them under
spark.sql.autoBroadcastJoinThreshold); no global sort. Outputs, under the run's ``data/`` folder:

- ``data/enriched/part-*.parquet``: kept rows, files hash-partitioned by uuid and sorted by uuid within each
  (the same files and order on every run of the same inputs and config), with the audit columns of the selection
  (``context_sentences``, ``kept_indices``, ``kept_sentences``, ``sentence_scores``, ``question_scores``,
  ``answer_scores``), the token ids and loss mask (``input_ids``, ``loss_mask``: packing never tokenizes again),
  ``num_tokens`` and the training conversation ``messages_json``.
- ``data/quarantine/part-*.parquet``: ``uuid, split, category, reason, detail`` for every row not kept.
- With ``enrich.wave_rows`` the input goes through in waves of whole row groups (raytrain.enrich.waves): each wave's
  files under ``wave-NNNNN/`` of both folders, its dedup state and statistics table under ``data/waves/``, and its
  commit record ``data/waves/wave-NNNNN.json`` written last; the statistics and the checks below then run over all
  waves.
- ``data/enriched/_manifest.json``, written last: row counts, files, the config hash, the eval sets' sha256.
- ``reports/enrich_summary.txt`` here, ``reports/enrich_report.json`` by the runner (the report dict).

Hand-off to Ray Data: training reads the enriched Parquet (``ray.data.read_parquet``, raytrain.dataset.stream),
not ``ray.data.from_spark`` (docs/decisions.md, 'Enriched rows reach Ray Data as Parquet').
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pyarrow.parquet as pq

from raytrain.config import JobConfig
from raytrain.console import QUIET
from raytrain.enrich.batches import CONTAMINATED, OK
from raytrain.enrich.conversation import QUARANTINE_REASONS
from raytrain.enrich.decontam import build_sorted_index
from raytrain.enrich.plan import EnrichPlan, EvalSets, plan_enrichment
from raytrain.enrich.report import STEP_REASONS_AFTER_DERIVE, Tally, build_report, step_counts, summary_text
from raytrain.enrich.waves import ORDER, Wave, commit_record, committed, input_files, plan_waves, wave_outputs
from raytrain.storage import MANIFEST, RunPaths, StorageLocation, parquet_names
from raytrain.telemetry import record_enrich_step, record_quarantine

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EnrichResult:
    enriched: StorageLocation
    """Folder of the enriched Parquet files (flat, plus _manifest.json)."""
    quarantine: StorageLocation
    """Folder of the quarantine Parquet files."""
    evals: EvalSets
    """The eval sets as read (their question/answer items give the benchmark loss)."""
    report: dict[str, Any] = field(default_factory=dict)
    """The run report (see module docstring); the runner writes it to reports/enrich_report.json."""


def enrich_in_session(spark, job: JobConfig, input_root: StorageLocation, run_root: StorageLocation,
                      eval_sets: tuple[str, ...] | None = None, plan: EnrichPlan | None = None,
                      on_wave: Callable[[Wave, dict[str, Any]], None] | None = None) -> EnrichResult:
    """The whole enrichment inside an open Spark session (spark.spark_session); see the module docstring. The
    input goes through in one wave, or wave by wave with enrich.wave_rows (raytrain.enrich.waves); ``on_wave(wave,
    commit record)`` is called once each wave is committed (by this run or an earlier one), in wave order.

    ``plan`` is what ``plan_enrichment(job, input_root, eval_sets)`` returns (computed here when None). Raises
    RaytrainError for bad inputs, AssertionError when rows go missing (a bug).
    """
    from pyspark.sql import functions as F

    t_start = time.perf_counter()
    cfg = job.enrich
    plan = plan or plan_enrichment(job, input_root, eval_sets)
    for line in plan.inputs.describe():
        log.info("enrich: %s", line)
    log.info("enrich: %d rows in %d files (%s); %d eval items (%d %d-grams) from %d file(s)", plan.rows_in,
             sum(len(v) for v in plan.inputs.files.values()),
             ", ".join(f"{k}={v}" for k, v in plan.rows_per_split.items()), len(plan.evals.texts),
             len(plan.eval_index), cfg.decontam_ngram, len(plan.evals.sources))
    paths = RunPaths(run_root)
    sc = spark.sparkContext
    pass_seconds: dict[str, float] = {}
    corpus, shipped = corpus_table(spark, job, plan.corpus_files, plan.eval_index, run_root, pass_seconds)
    ctx = _Enrichment(spark, job, plan, sc.broadcast(build_sorted_index(plan.eval_index)), shipped,
                      sc.accumulator(0.0), sc.accumulator(0.0), pass_seconds)
    waves = plan_waves(input_files(plan.inputs.files, {k: v["file_row_groups"] for k, v in plan.footers.items()}),
                       job.wave_rows)
    records: list[dict[str, Any]] = []
    if len(waves) == 1:
        finished = ctx.enrich(waves[0], paths.enriched, paths.quarantine)
        stats, kept = finished, finished.filter(F.col("status") == OK)
    else:
        stats, kept, records = _enrich_waves(ctx, waves, paths, on_wave)
    t0 = time.perf_counter()
    tally = _tally(stats, job, plan, paths.enriched, paths.quarantine)
    if corpus:
        corpus.update(_corpus_statistics(stats, kept, shipped.value, cfg, ctx.retrieve_seconds.value))
    pass_seconds["statistics"] = time.perf_counter() - t0
    log.info("enrich: report statistics computed (%.1fs)", pass_seconds["statistics"])
    for name, took in pass_seconds.items():
        record_enrich_step(job.storage.run_name, name, plan.rows_in, took)  # dashboard: rows/s per pass
    took = time.perf_counter() - t_start
    report = build_report(job, plan, tally, pass_seconds, corpus, run_root=run_root, enriched=paths.enriched,
                          quarantine=paths.quarantine, seconds=took)
    report.update(rows_work(job, took, ctx.row_seconds.value))
    log.info("enrich: %.1fs in all: %.1fs of the rows' work, %.1fs around it (the corpus table, Spark's planning, "
             "reads, shuffles and writes, the statistics)", took, report["rows_work_s"], report["around_s"],
             extra={QUIET: False})  # the log file; enrich_summary.txt has it too
    if records:
        report["waves"] = records
    _commit(job, plan, tally, report, paths.enriched, paths.quarantine, run_root)
    if len(waves) == 1:
        finished.unpersist()
    return EnrichResult(enriched=paths.enriched, quarantine=paths.quarantine, report=report, evals=plan.evals)


@dataclass
class _Enrichment:
    """What every wave of one enrichment shares: the session, the plan, the broadcast eval n-grams and corpus
    index, the seconds the tasks spend in the corpus retrieval and in the rows' batch functions (Spark
    accumulators), and the passes' seconds, summed over the waves."""

    spark: Any
    job: JobConfig
    plan: EnrichPlan
    eval_array: Any
    corpus: Any
    retrieve_seconds: Any
    row_seconds: Any
    pass_seconds: dict[str, float]

    def enrich(self, wave: Wave, enriched: StorageLocation, quarantine: StorageLocation, prior=None,
               state: StorageLocation | None = None):
        """Pass 1, dedup (against ``prior``, the earlier waves' dedup state), pass 2 over the wave's parts; writes
        the enriched and quarantined rows (and with ``state`` the wave's own dedup state); returns the finished
        rows, persisted."""
        from pyspark.sql import functions as F

        from raytrain.enrich import passes
        from raytrain.enrich.spark import spark_uri

        job, seconds = self.job, self.pass_seconds
        rows = wave.rows if job.wave_rows else self.plan.rows_in  # one wave: input.max_rows applied
        t0 = time.perf_counter()
        parts = {split: [(spark_uri(p.file.loc), p) for p in split_parts]
                 for split, split_parts in wave.parts_by_split().items()}
        schemas = {split: footers["schema"] for split, footers in self.plan.footers.items()}
        raw = passes.read_inputs(self.spark, parts, job.input.max_rows, schemas)
        prepared = passes.prepare(raw, self.eval_array, job, row_seconds=self.row_seconds)
        dups = passes.duplicates(self.spark, prepared, job, prior=prior, first_group=wave.first_group)
        if state is not None:
            dups.survivors.write.mode("overwrite").parquet(spark_uri(state))
        _add(seconds, "prepare_and_dedup", time.perf_counter() - t0)
        log.info("enrich: pass 1 (derive, license, dedup keys, eval n-grams) and near-dup verdicts over %d rows "
                 "(%.1fs)", rows, time.perf_counter() - t0)
        t0 = time.perf_counter()
        finished = passes.finish(prepared, dups.flags, job, corpus=self.corpus, eval_index=self.eval_array,
                                 retrieve_seconds=self.retrieve_seconds, row_seconds=self.row_seconds)
        finished.filter(F.col("status") == OK).select(*passes.enriched_columns(self.corpus is not None)) \
            .write.mode("overwrite").parquet(spark_uri(enriched))
        prepared.unpersist()
        dups.unpersist()
        _add(seconds, "finish", time.perf_counter() - t0)
        t1 = time.perf_counter()
        passes.quarantined(finished).write.mode("overwrite").parquet(spark_uri(quarantine))
        _add(seconds, "write_quarantine", time.perf_counter() - t1)
        log.info("enrich: pass 2 (selection%s, tokenization) wrote %s and %s (%.1fs)",
                 ", corpus context" if self.corpus else "", enriched.uri, quarantine.uri, time.perf_counter() - t0)
        return finished


def rows_work(job: JobConfig, took: float, task_seconds: float) -> dict[str, float]:
    """``took`` seconds of enrichment split into the rows' work (``task_seconds``, what the tasks spent in the
    batch functions, over the tasks that run at once: enrich.num_executors x executor_cores, at most
    num_partitions) and the rest around it: Spark's planning and scheduling, reading, shuffles, writing, waiting for
    a worker; with few rows, the fixed cost of a wave."""
    cfg = job.enrich
    work = task_seconds / max(1, min(cfg.num_executors * cfg.executor_cores, cfg.num_partitions))
    return {"rows_work_s": round(work, 2), "around_s": round(took - work, 2)}


def _add(seconds: dict[str, float], name: str, took: float) -> None:
    seconds[name] = seconds.get(name, 0.0) + took


STATS_LEFT_OUT = ("context", "question", "answer", "messages_json", "input_ids", "loss_mask")
"""Columns of the finished rows a wave's statistics table leaves out: the report's rollups read none of them."""


def _enrich_waves(ctx: _Enrichment, waves: list[Wave], paths: RunPaths,
                  on_wave: Callable[[Wave, dict[str, Any]], None] | None = None):
    """Every wave not committed yet, in order: enriched and quarantined rows under ``wave-NNNNN/`` of the run's
    enriched/ and quarantine/ folders, the wave's dedup state and statistics table under data/waves/, then its
    commit record (last). A wave left half-written by an interrupted run is cleared and done again, and so is every
    wave after it (their verdicts depend on its dedup state). Returns (the statistics of every wave's rows, every
    wave's kept rows, the commit records)."""
    from raytrain.enrich.spark import spark_uri

    folder, data_hash = paths.waves, ctx.job.data_hash()
    records: list[dict[str, Any]] = []
    redone = False  # once a wave is done again, the waves after it are too
    for wave in waves:
        record = None if redone else committed(folder, wave, data_hash)
        if record is not None:
            log.info("enrich: wave %d/%d committed already (%d rows in -> %d kept)", wave.index + 1, len(waves),
                     record["rows_in"], record["kept"])
            records.append(record)
            if on_wave is not None:
                on_wave(wave, record)
            continue
        redone, t0, work_before = True, time.perf_counter(), ctx.row_seconds.value
        outputs = wave_outputs(paths, wave.name)
        for loc in outputs:
            loc.delete_dir()
        before = [spark_uri(folder.join("dedup", w.name)) for w in waves[:wave.index]]
        prior = ctx.spark.read.parquet(*before) if before else None
        finished = ctx.enrich(wave, outputs[0], outputs[1], prior=prior, state=outputs[2])
        finished.drop(*STATS_LEFT_OUT).write.mode("overwrite").parquet(spark_uri(outputs[3]))
        finished.unpersist()
        kept, quarantined = footer_rows(outputs[0])[1], footer_rows(outputs[1])[1]
        if kept + quarantined != wave.rows:
            raise AssertionError(f"enrich: wave {wave.index}: {wave.rows} rows in but {kept} written + "
                                 f"{quarantined} quarantined; rows went missing (a bug)")
        took = time.perf_counter() - t0
        split = rows_work(ctx.job, took, ctx.row_seconds.value - work_before)
        record = {"wave": wave.index, "files": wave.identity(), "order": ORDER, "data_hash": data_hash,
                  "rows_in": wave.rows, "kept": kept, "quarantined": quarantined, "seconds": round(took, 2), **split,
                  "committed_unix_s": round(time.time(), 3)}
        commit_record(folder, wave).write_atomic(json.dumps(record, sort_keys=True))
        log.info("enrich: wave %d/%d committed: %d file%s, %d rows in -> %d kept, %d quarantined (%.1fs: %.1fs of "
                 "the rows' work, %.1fs around it)", wave.index + 1, len(waves), wave.num_files,
                 "" if wave.num_files == 1 else "s", wave.rows, kept, quarantined, took, split["rows_work_s"],
                 split["around_s"])
        records.append(record)
        if on_wave is not None:
            on_wave(wave, record)
    stats = ctx.spark.read.parquet(*[spark_uri(folder.join("stats", w.name)) for w in waves])
    kept = ctx.spark.read.parquet(*[spark_uri(paths.enriched.join(w.name)) for w in waves])
    return stats, kept, records


def corpus_table(spark, job: JobConfig, corpus_files: list[Any] | None, eval_index: set[int],
                 run_root: StorageLocation, pass_seconds: dict[str, float]) -> tuple[dict[str, Any], Any]:
    """The corpus sentence table of ``corpus_files`` (embedded now or reused) and its search index without the
    sentences sharing an n-gram with ``eval_index``, broadcast to the executors: (the report's corpus facts so far,
    the broadcast), or ({}, None) without a corpus. The preference pairs' job uses it too."""
    if not corpus_files:
        return {}, None
    from raytrain.enrich.corpus_table import ensure_table, load_corpus_index

    cfg = job.enrich
    t0 = time.perf_counter()
    folder, meta, reused = ensure_table(spark, corpus_files, cfg, run_root)
    index = load_corpus_index(folder, meta["key"], eval_index, cfg.decontam_ngram, cfg.corpus_exact_max_sentences)
    corpus = {"table_uri": folder.uri, "table": meta, "reused": reused, "index": index.stats,
              "sentences_embedded_this_run": 0 if reused else meta["sentences"],
              "prepare_seconds": round(time.perf_counter() - t0, 2)}
    pass_seconds["corpus_table"] = corpus["prepare_seconds"]
    return corpus, spark.sparkContext.broadcast(index)


def _corpus_statistics(finished, kept, index, cfg, retrieve_seconds: float) -> dict[str, Any]:
    """Retrieval time (task seconds summed over the workers: a retried task counts twice), the approximate
    search's recall against exact search (on ``kept``, the kept rows with their texts), the most-used documents
    (from ``finished``: the finished rows, or the waves' statistics tables)."""
    from raytrain.enrich import passes
    from raytrain.enrich.corpus_table import ann_recall

    recall = ann_recall(kept, index, cfg) if index.ann is not None else None
    return {"retrieve_seconds": round(retrieve_seconds, 2), "recall": recall,
            "top_documents": passes.top_documents(finished)}


def _tally(finished, job: JobConfig, plan: EnrichPlan, enriched: StorageLocation, quarantine: StorageLocation
           ) -> Tally:
    """Two statistics rollups over the finished rows, then the footers of what was written: every row in is
    either enriched or quarantined (checked on the files), else AssertionError."""
    from raytrain.enrich import passes

    reasons = tuple(str(r) for r in (*QUARANTINE_REASONS, *STEP_REASONS_AFTER_DERIVE))  # plain text in reports
    rows = passes.row_stats(finished, job.dataset.seq_len, reasons, bool(plan.corpus_files))
    sentences = passes.sentence_stats(finished, bool(plan.corpus_files))
    status = rows["overall"].get("status", {})
    if status.get("other"):
        raise AssertionError(f"enrich: {status['other']} rows with a status outside the known reasons (a bug)")
    per_reason = {r: n for r, n in sorted(status.items()) if r != OK}
    counts = step_counts(plan.rows_in, per_reason, corpus=bool(plan.corpus_files))
    for c in counts:
        log.info("enrich step %-15s %7d in -> %7d kept, %d quarantined %s", c.step, c.rows_in, c.rows_out,
                 sum(c.quarantined.values()), c.quarantined or "")
    record_quarantine(job.storage.run_name, per_reason)
    rows_out = status.get(OK, 0)
    enriched_files, enriched_rows = footer_rows(enriched)
    quarantine_files, quarantine_rows = footer_rows(quarantine)
    # Nothing dropped silently: checked on what was actually written, by reading the Parquet footers.
    if not plan.rows_in == enriched_rows + quarantine_rows == rows_out + sum(per_reason.values()):
        raise AssertionError(f"enrich: {plan.rows_in} rows in but {enriched_rows} written + {quarantine_rows} "
                             f"quarantined (status counts say {rows_out} + {sum(per_reason.values())}); rows went "
                             "missing (a bug)")
    contaminated = [{"uuid": r["uuid"], "split": r["split"], "detail": r["detail"]} for r in sorted(
        pq.read_table(quarantine.path, filesystem=quarantine.filesystem, columns=["uuid", "split", "reason", "detail"],
                      filters=[("reason", "=", CONTAMINATED)]).to_pylist(), key=lambda r: r["uuid"])]
    per_split_reason = {k: {r: n for r, n in sorted(v["status"].items()) if r != OK}
                        for k, v in rows["per_split"].items() if any(r != OK for r in v["status"])}
    return Tally(rows, sentences, per_reason, per_split_reason, counts, rows_out, enriched_files, quarantine_files,
                 quarantine_rows, contaminated)


def _commit(job: JobConfig, plan: EnrichPlan, tally: Tally, report: dict[str, Any], enriched: StorageLocation,
            quarantine: StorageLocation, run_root: StorageLocation) -> None:
    """The manifest last (it vouches for the files), then the readable summary."""
    manifest = {
        "config_hash": job.data_hash(), "created_unix_s": round(time.time(), 3), "rows_in": plan.rows_in,
        "rows_in_per_split": plan.rows_per_split,
        "enriched": {"rows": tally.rows_out, "files": tally.enriched_files, "sorted_by": "uuid within each file",
                     "partitioned_by": "hash of uuid"},
        "quarantine": {"uri": quarantine.uri, "rows": tally.quarantine_rows, "files": tally.quarantine_files,
                       "per_reason": tally.per_reason},
        "eval_sets": plan.evals.sources, "config": {k: job.to_dict()[k] for k in ("input", "enrich", "dataset")},
    }
    enriched.join(MANIFEST).write_atomic(json.dumps(manifest, indent=2, sort_keys=True))
    summary = summary_text(report)
    summary_loc = RunPaths(run_root).reports.join("enrich_summary.txt")
    summary_loc.parent.mkdirs()
    summary_loc.write_atomic(summary)
    log.info("enrich summary:\n%s", summary, extra={QUIET: False})  # screens of text: the log file only
    log.info("enrich: %d rows in -> %d kept, %d quarantined (%s); summary in %s", plan.rows_in, tally.rows_out,
             tally.quarantine_rows, ", ".join(f"{k} {v}" for k, v in tally.per_reason.items()) or "none",
             summary_loc.uri)


def footer_rows(loc: StorageLocation) -> tuple[list[str], int]:
    """(Parquet file names in read order, total rows from their footers) of a folder Spark wrote (wave by wave in
    a streamed enrichment: storage.parquet_names)."""
    names = parquet_names(loc)
    rows = 0
    for n in names:
        with loc.filesystem.open_input_file(loc.join(n).path) as f:
            rows += pq.ParquetFile(f).metadata.num_rows
    return names, rows


def run_enrich(job: JobConfig, input_root: StorageLocation, run_root: StorageLocation,
               eval_sets: tuple[str, ...] | None = None, plan: EnrichPlan | None = None,
               on_wave: Callable[[Wave, dict[str, Any]], None] | None = None) -> EnrichResult:
    """Start Spark on the running Ray cluster, enrich, stop Spark; returns where the outputs are and the report.
    ``plan``: ``plan_enrichment(job, input_root, eval_sets)`` when the caller made it already."""
    from raytrain.enrich.spark import spark_session

    # Fail on bad inputs (and missing s3a jars) in seconds, before a JVM starts.
    plan = plan or plan_enrichment(job, input_root, eval_sets)
    configs = session_configs(job, input_root, run_root, plan.corpus_files)
    with spark_session(job.enrich, extra_configs=configs) as spark:
        return enrich_in_session(spark, job, input_root, run_root, plan=plan, on_wave=on_wave)


def session_configs(job: JobConfig, input_root: StorageLocation, run_root: StorageLocation,
                    corpus_files: list[Any] | None) -> dict[str, str]:
    """Spark settings for reading the input and the corpus files and writing the run root (each location's
    filesystem settings, the s3a jars when one is on S3); the preference pairs' job uses it too."""
    from raytrain.enrich.jars import spark_jar_configs
    from raytrain.enrich.spark import spark_conf

    corpus_locs = [f.loc for f in corpus_files or []]
    configs = spark_conf(input_root) | spark_conf(run_root)
    for loc in corpus_locs:
        configs |= spark_conf(loc)
    return configs | spark_jar_configs(job.enrich.spark_jars, (input_root, run_root, *corpus_locs))
