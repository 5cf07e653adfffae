"""The preference enrichment on Spark-on-Ray: HelpSteer3-shaped JSON lines in -> enriched pairs + quarantine Parquet
out, with a manifest and a report, through the same doors as the fine-tune's rows.

    read lines -> pass 1 (parse, derive the pair, dedup keys, eval n-grams) -> dedup (the fine-tune's) ->
    [corpus table] -> pass 2 (final verdict, [context on the prompt], tokenize, length) -> write enriched,
    write quarantine -> one tally

Outputs, under the run's ``data/`` folder: ``data/enriched/part-*.parquet`` (pair_passes.ENRICHED_COLUMNS: the
prompt's tokens once, each response's, the margin), ``data/quarantine/part-*.parquet`` (uuid, split, domain,
language, reason, detail), ``data/enriched/_manifest.json`` last; ``reports/enrich_summary.txt`` here,
``reports/enrich_report.json`` by the runner (the report dict). Every line in is a kept pair or a quarantined row, checked on the written footers.
"""

from __future__ import annotations

import json
import logging
import time

from raytrain.config import JobConfig
from raytrain.enrich.corpus import CorpusFile, check_corpus
from raytrain.enrich.decontam import build_eval_index, build_sorted_index
from raytrain.enrich.job import EnrichResult, corpus_table, footer_rows, session_configs
from raytrain.enrich.pair_inputs import PairInputFiles, discover_pair_inputs
from raytrain.enrich.plan import EvalSets, load_eval_texts
from raytrain.enrich.report import build_pair_report, pair_summary_text
from raytrain.storage import MANIFEST, RunPaths, StorageLocation

log = logging.getLogger(__name__)


def enrich_pairs_in_session(spark, job: JobConfig, inputs: PairInputFiles, evals: EvalSets,
                            run_root: StorageLocation, corpus_files: list[CorpusFile] | None = None) -> EnrichResult:
    """The whole pair enrichment inside an open Spark session; see the module docstring. ``corpus_files``: the
    checked enrich.context_corpus (enrich.corpus.check_corpus), whose sentences a prompt without context of its
    own may get (enrich.pair_context)."""
    from pyspark.sql import functions as F

    from raytrain.enrich import pair_passes, passes
    from raytrain.enrich.spark import spark_uri

    t_start = time.perf_counter()
    for line in inputs.describe():
        log.info("enrich: %s", line)
    paths = RunPaths(run_root)
    eval_index = build_eval_index(evals.texts, job.enrich.decontam_ngram)
    eval_array = spark.sparkContext.broadcast(build_sorted_index(eval_index))
    lines = pair_passes.read_pair_lines(spark, {split: spark_uri(loc) for split, loc in inputs.files.items()})
    rows_in = lines.count()  # the input's own count, which the written files must add up to
    prepared = pair_passes.prepare_pairs(lines, eval_array, job)
    dups = passes.duplicates(spark, prepared, job)
    corpus, shipped = corpus_table(spark, job, corpus_files, eval_index, run_root, {})
    finished = pair_passes.finish_pairs(prepared, dups.flags, job, corpus=shipped, eval_index=eval_array)
    finished.filter(F.col("status") == "ok").select(*pair_passes.ENRICHED_COLUMNS) \
        .write.mode("overwrite").parquet(spark_uri(paths.enriched))
    pair_passes.quarantined_pairs(finished).write.mode("overwrite").parquet(spark_uri(paths.quarantine))
    groups = pair_passes.tally(finished)
    prepared.unpersist()
    dups.unpersist()
    finished.unpersist()

    report = build_pair_report(rows_in, groups, evals.sources, inputs.describe(), time.perf_counter() - t_start,
                               job.dataset, job.enrich, corpus)
    enriched_files, enriched_rows = footer_rows(paths.enriched)
    quarantine_files, quarantine_rows = footer_rows(paths.quarantine)
    if not rows_in == enriched_rows + quarantine_rows == report["rows_out"] + sum(report["quarantined"].values()):
        raise AssertionError(f"enrich: {rows_in} lines in but {enriched_rows} pairs written + {quarantine_rows} "
                             f"quarantined (the tally says {report['rows_out']} + "
                             f"{sum(report['quarantined'].values())}); rows went missing (a bug)")
    manifest = {"config_hash": job.data_hash(), "created_unix_s": round(time.time(), 3), "rows_in": rows_in,
                "kind": "preference_pairs",
                "enriched": {"rows": enriched_rows, "files": enriched_files, "sorted_by": "uuid within each file",
                             "partitioned_by": "hash of uuid"},
                "quarantine": {"uri": paths.quarantine.uri, "rows": quarantine_rows, "files": quarantine_files,
                               "per_reason": report["quarantined"]},
                "eval_sets": evals.sources, "config": {k: job.to_dict()[k] for k in ("input", "enrich", "dataset")}}
    paths.enriched.join(MANIFEST).write_atomic(json.dumps(manifest, indent=2, sort_keys=True))
    paths.reports.mkdirs()
    paths.reports.join("enrich_summary.txt").write_atomic(pair_summary_text(report))
    log.info("enrich: %d pairs in -> %d kept, %d quarantined (%s)", rows_in, report["rows_out"], quarantine_rows,
             ", ".join(f"{k} {v}" for k, v in report["quarantined"].items()) or "none")
    return EnrichResult(paths.enriched, paths.quarantine, evals, report)


def run_enrich_pairs(job: JobConfig, input_root: StorageLocation, run_root: StorageLocation,
                     eval_sets: tuple[str, ...] | None = None, inputs: PairInputFiles | None = None) -> EnrichResult:
    """Find the inputs (``inputs``: what ``discover_pair_inputs`` found already) and read the eval sets (bad ones
    fail here, before a JVM starts), start Spark on the running Ray cluster, enrich the pairs, stop Spark."""
    from raytrain.enrich.spark import spark_session

    cfg, endpoint = job.enrich, job.storage.s3_endpoint or None
    inputs = inputs or discover_pair_inputs(input_root)
    evals = load_eval_texts(tuple(cfg.eval_sets if eval_sets is None else eval_sets), input_root, endpoint)
    corpus_files = check_corpus(cfg.context_corpus, cfg.corpus_id_field, cfg.corpus_text_field, input_root,
                                endpoint) if cfg.context_corpus else None
    configs = session_configs(job, input_root, run_root, corpus_files)
    with spark_session(cfg, extra_configs=configs) as spark:
        return enrich_pairs_in_session(spark, job, inputs, evals, run_root, corpus_files)
