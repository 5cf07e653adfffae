"""The preference enrichment's DataFrame passes: the JSON lines read as text, pass 1 (pair_batches.prepare_pairs_batch),
the fine-tune's dedup (passes.duplicates: same keys, same LSH, same rule) and final verdict, pass 2
(pair_batches.finish_pairs_batch)."""

from __future__ import annotations

from typing import Any

from pyspark import StorageLevel
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from raytrain.config import JobConfig
from raytrain.dataset.length import TRUNCATE
from raytrain.enrich import pair_batches
from raytrain.enrich.batches import CorpusSearch, Scoring
from raytrain.enrich.dedup import lsh_params
from raytrain.enrich.passes import NUM_PERM, SHINGLE_CHARS, TORCH_THREADS_PER_TASK, spark_schema, with_final_verdict

ENRICHED_COLUMNS = ("uuid", "split", "domain", "language", "margin", "prompt_ids", "chosen_ids", "rejected_ids",
                    "num_tokens", "length_action", "tokens_truncated", "context_sentences_kept",
                    "corpus_sentences_added", "pair_json")
"""The enriched pairs' columns (``uuid`` is the pair id; the token columns as they go into a pack, after the length
policy, with what it did: ``length_action`` keep or truncate, ``tokens_truncated``; ``pair_json`` the prompt as
trained, ``context_sentences_kept`` / ``corpus_sentences_added`` what enrich.pair_context put into it)."""
QUARANTINE_COLUMNS = ("uuid", "split", "domain", "language", "reason", "detail")


def read_pair_lines(spark: SparkSession, files: dict[str, str]) -> DataFrame:
    """Every non-blank line of each split's file (``value``, ``split``), with a ``row_id`` unique per line assigned
    before any shuffle and the ``group_index`` of its file in ``files``' order (a file is one group; the input order
    duplicates keep their first row in). Spark decompresses ``.gz`` by the name; blank lines are not rows in JSON
    Lines."""
    frames = [spark.read.text(uri).filter(F.trim(F.col("value")) != "").withColumn("split", F.lit(split))
              .withColumn("group_index", F.lit(i).cast("long")) for i, (split, uri) in enumerate(files.items())]
    df = frames[0]
    for other in frames[1:]:
        df = df.unionByName(other)
    return df.withColumn("row_id", F.monotonically_increasing_id())


def prepare_pairs(lines: DataFrame, eval_index: Any, job: JobConfig) -> DataFrame:
    """Pass 1 over every line, spread over enrich.num_partitions; persisted (the dedup reads its narrow columns,
    pass 2 the rest). ``eval_index``: the broadcast sorted eval n-gram array."""
    cfg = job.enrich
    bands, rows = lsh_params(cfg.near_dup_threshold, NUM_PERM)

    def body(frames):
        for pdf in frames:
            yield pair_batches.prepare_pairs_batch(pdf, max_chars=cfg.max_chars, num_perm=NUM_PERM, bands=bands,
                                                   rows=rows, shingle_chars=SHINGLE_CHARS,
                                                   eval_index=eval_index.value, ngram=cfg.decontam_ngram)

    prepared = lines.repartition(cfg.num_partitions).mapInPandas(body, schema=spark_schema(pair_batches.PAIR_PREPARED))
    return prepared.persist(StorageLevel.MEMORY_AND_DISK)


def finish_pairs(prepared: DataFrame, flags: DataFrame, job: JobConfig, corpus: Any = None,
                 eval_index: Any = None) -> DataFrame:
    """Pass 2: every pair with its final verdict, hash-partitioned by uuid and sorted by uuid within each partition
    (the written files' order), tokenized; persisted (the writes and the tally read it). ``corpus``: the broadcast
    corpus index (job.corpus_table) with ``eval_index``, the broadcast eval n-grams its blocks are checked against."""
    rows = with_final_verdict(prepared, flags, job.enrich.decontam_ngram, pair_batches.PAIR_ROW.names)
    rows = rows.repartition(job.enrich.num_partitions, "uuid").sortWithinPartitions("uuid", "row_id")
    version, seq_len, policy = job.dataset.tokenizer, job.dataset.seq_len, job.dataset.length_policy
    scoring = Scoring.from_config(job.enrich, num_threads=TORCH_THREADS_PER_TASK) if job.enrich.pair_context else None
    system_prompt, ngram = job.enrich.system_prompt, job.enrich.decontam_ngram

    def body(frames):
        search = None if corpus is None else CorpusSearch(corpus.value, eval_index.value, ngram)
        for pdf in frames:
            yield pair_batches.finish_pairs_batch(pdf, tokenizer_version=version, seq_len=seq_len,
                                                  length_policy=policy, scoring=scoring, system_prompt=system_prompt,
                                                  corpus=search)

    finished = rows.mapInPandas(body, schema=spark_schema(pair_batches.PAIR_FINISHED))
    return finished.persist(StorageLevel.MEMORY_AND_DISK)


def quarantined_pairs(finished: DataFrame) -> DataFrame:
    return finished.filter(F.col("status") != pair_batches.OK).withColumnRenamed("status", "reason") \
        .select(*QUARANTINE_COLUMNS)


TALLY_SUMS = ("rows_truncated", "tokens_truncated", "rows_with_context", "context_sentences_kept",
              "system_prompt_chars_removed", "rows_with_corpus_context", "corpus_sentences_added")
"""What ``tally`` adds up per group besides the rows: the length policy's cuts and the context selection's work."""


def tally(finished: DataFrame) -> list[dict[str, Any]]:
    """Rows per (split, domain, language, status), with the pairs the length policy truncated and the tokens it cut,
    the kept pairs that got context sentences and how many: one small aggregation the report is built from."""
    kept = F.col("status") == pair_batches.OK  # the context of a pair quarantined later is not counted
    groups = finished.groupBy("split", "domain", "language", "status").agg(
        F.count(F.lit(1)).alias("rows"),
        F.sum(F.when(F.col("length_action") == TRUNCATE, 1).otherwise(0)).alias("rows_truncated"),
        F.sum("tokens_truncated").alias("tokens_truncated"),
        F.sum(F.when(kept & (F.col("context_sentences_kept") > 0), 1).otherwise(0)).alias("rows_with_context"),
        F.sum(F.when(kept, F.col("context_sentences_kept")).otherwise(0)).alias("context_sentences_kept"),
        F.sum(F.when(kept, F.col("system_prompt_chars_removed")).otherwise(0)).alias("system_prompt_chars_removed"),
        F.sum(F.when(kept & (F.col("corpus_sentences_added") > 0), 1).otherwise(0)).alias("rows_with_corpus_context"),
        F.sum(F.when(kept, F.col("corpus_sentences_added")).otherwise(0)).alias("corpus_sentences_added")
    ).collect()
    return sorted(({"split": r["split"], "domain": r["domain"], "language": r["language"], "status": r["status"],
                    "rows": int(r["rows"]), **{k: int(r[k]) for k in TALLY_SUMS}} for r in groups),
                  key=lambda g: (g["split"], g["domain"], g["language"], g["status"]))
