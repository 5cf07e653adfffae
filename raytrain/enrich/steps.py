"""The enrichment steps as Spark DataFrame transforms: each takes the working table and returns what it keeps and
what it quarantines, so a job is a straight chain and every row leaves through exactly one door.

    read -> derive -> license -> exact_dedup -> near_dedup -> decontaminate -> select_context -> tokenize_check

Per-batch row logic is in ``udfs.py`` (plain pandas, unit-tested); this module only wires it into Spark:
schemas, windows, groupings, joins. Only the enrich stage imports pyspark.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql import types as T

from raytrain.config import JobConfig
from raytrain.enrich import udfs
from raytrain.enrich.dedup import lsh_params

log = logging.getLogger(__name__)

NUM_PERM = 128  # MinHash permutations: standard error of the Jaccard estimate ~0.035 at 0.8
SHINGLE_CHARS = 5  # character 5-grams of the normalized text

_WORK_SCHEMA = ("row_id long, split string, uuid string, category string, license string, reasoning string, "
                "context string, question string, answer string, system_text string, text string, "
                "messages_json string")
_DERIVED_SCHEMA = ("row_id long, split string, uuid string, category string, license string, reasoning string, "
                   "status string, detail string, context string, question string, answer string, "
                   "system_text string, text string, messages_json string")
_SELECTION_SCHEMA = ("context_sentences array<string>, kept_indices array<int>, kept_sentences array<string>, "
                     "sentence_scores array<float>, question_scores array<float>, answer_scores array<float>, "
                     "replaced_system_prompt boolean")
QUARANTINE_COLUMNS = ("uuid", "split", "category", "reason", "detail")


@dataclass(frozen=True)
class StepResult:
    """What one step did: the rows it passes on and the rows it quarantined (QUARANTINE_COLUMNS)."""

    name: str
    kept: DataFrame
    quarantined: DataFrame
    shared: DataFrame | None = None
    """A frame both outputs are computed from: the job persists it while it materializes them (so the expensive
    part runs once) and unpersists it afterwards."""


def _quarantine(df: DataFrame, reason: F.Column | str, detail: F.Column) -> DataFrame:
    reason_col = F.lit(reason) if isinstance(reason, str) else reason
    return df.select("uuid", "split", "category", reason_col.alias("reason"), detail.alias("detail"))


def read_inputs(spark: SparkSession, files: dict[str, list[str]], max_rows: int) -> DataFrame:
    """Raw Nemotron rows of every split (``split`` column added; at most ``max_rows`` per split when > 0), with a
    ``row_id`` unique per row, assigned before any shuffle so it is stable for the life of the job."""
    frames = []
    for split, uris in files.items():
        df = spark.read.parquet(*uris).select("uuid", "license", "category", "reasoning", "messages")
        if max_rows:
            df = df.limit(max_rows)
        frames.append(df.withColumn("split", F.lit(split)))
    df = frames[0]
    for other in frames[1:]:
        df = df.unionByName(other)
    return df.withColumn("row_id", F.monotonically_increasing_id())


def derive(raw: DataFrame, job: JobConfig) -> StepResult:
    """Raw rows -> working rows (udfs.WORK_COLUMNS); malformed rows quarantined with conversation's reasons."""
    body = udfs.map_batches(udfs.derive_batch, max_chars=job.enrich.max_chars)
    derived = raw.repartition(job.enrich.num_partitions).mapInPandas(body, schema=_DERIVED_SCHEMA)
    kept = derived.filter(F.col("status") == udfs.OK).select(*udfs.WORK_COLUMNS)
    bad = derived.filter(F.col("status") != udfs.OK)
    return StepResult("derive", kept, _quarantine(bad, F.col("status"), F.col("detail")), shared=derived)


def license_filter(df: DataFrame, job: JobConfig) -> StepResult:
    """Keep rows whose ``license`` (trimmed, case-insensitive) is in enrich.licenses."""
    allowed = sorted({lic.strip().lower() for lic in job.enrich.licenses})
    ok = F.lower(F.trim(F.coalesce(F.col("license"), F.lit("")))).isin(allowed)
    detail = F.concat(F.lit("license '"), F.col("license"), F.lit(f"' not in enrich.licenses {allowed}"))
    return StepResult("license", df.filter(ok), _quarantine(df.filter(~ok), udfs.LICENSE, detail))


def exact_dedup(df: DataFrame) -> StepResult:
    """Rows with the same normalized text (dedup.exact_key) keep one: the smallest uuid (then row_id)."""
    key_udf = F.pandas_udf(udfs.exact_keys, returnType=T.StringType())
    keyed = df.withColumn("_key", key_udf("text"))
    w = Window.partitionBy("_key").orderBy("uuid", "row_id")
    ranked = keyed.withColumn("_rank", F.row_number().over(w)).withColumn("_kept_uuid", F.first("uuid").over(w))
    kept = ranked.filter(F.col("_rank") == 1).drop("_key", "_rank", "_kept_uuid")
    dups = ranked.filter(F.col("_rank") > 1)
    detail = F.concat(F.lit("duplicate of "), F.col("_kept_uuid"), F.lit(" (same normalized text)"))
    return StepResult("exact_dedup", kept, _quarantine(dups, udfs.EXACT_DUPLICATE, detail), shared=ranked)


def near_dedup(spark: SparkSession, df: DataFrame, job: JobConfig) -> StepResult:
    """MinHash/LSH near-duplicates (estimated Jaccard of character 5-gram sets >= enrich.near_dup_threshold).

    Signatures and band keys in a pandas UDF; band keys exploded and grouped in Spark (rows sharing a key are
    candidates); each bucket verified in applyInPandas; the verified pairs (few: only near-duplicates) are
    clustered on the driver (connected components) and each cluster keeps its smallest (uuid, row_id).
    """
    threshold = job.enrich.near_dup_threshold
    bands, rows = lsh_params(threshold, NUM_PERM)
    sig_body = udfs.map_batches(udfs.minhash_batch, num_perm=NUM_PERM, bands=bands, rows=rows, ngram=SHINGLE_CHARS)
    sigs = df.select("row_id", "uuid", "text").mapInPandas(
        sig_body, schema="row_id long, uuid string, signature binary, band_keys array<long>")
    exploded = sigs.select("row_id", "uuid", "signature", F.explode("band_keys").alias("band_key"))
    bucket_size = F.count("*").over(Window.partitionBy("band_key"))
    candidates = exploded.withColumn("_n", bucket_size).filter(F.col("_n") > 1).drop("_n")
    pairs = candidates.groupBy("band_key").applyInPandas(
        lambda pdf: udfs.verify_bucket(pdf, threshold),
        schema="a_row_id long, a_uuid string, b_row_id long, b_uuid string, jaccard double",
    ).dropDuplicates(["a_row_id", "b_row_id"])
    verified = [((r.a_uuid, r.a_row_id), (r.b_uuid, r.b_row_id), r.jaccard) for r in pairs.collect()]
    drops = udfs.near_duplicate_drops(verified)
    log.info("near_dedup: LSH %d bands x %d rows, %d verified pairs, %d rows in clusters to drop",
             bands, rows, len(verified), len(drops))
    flags = spark.createDataFrame(
        [(rid, f"near-duplicate of {d.kept[0]} (cluster kept; estimated Jaccard {d.jaccard:.3f} with "
               f"{d.neighbor[0]})") for (_, rid), d in sorted(drops.items())],
        schema="row_id long, detail string")
    flagged = df.join(F.broadcast(flags), "row_id", "left")
    kept = flagged.filter(F.col("detail").isNull()).drop("detail")
    dups = flagged.filter(F.col("detail").isNotNull())
    return StepResult("near_dedup", kept, _quarantine(dups, udfs.NEAR_DUPLICATE, F.col("detail")))


def decontaminate(spark: SparkSession, df: DataFrame, eval_hashes: set[int], job: JobConfig) -> StepResult:
    """Drop rows sharing at least one word ``enrich.decontam_ngram``-gram with an eval item (index broadcast as a
    sorted uint64 array); the detail says how many distinct n-grams matched."""
    n = job.enrich.decontam_ngram
    index = spark.sparkContext.broadcast(udfs.build_sorted_index(eval_hashes))

    def body(batches):
        for pdf in batches:
            out = pdf.copy()
            out["_matched"] = udfs.contamination_counts(pdf["text"], index.value, n)
            yield out

    counted = df.mapInPandas(body, schema=_WORK_SCHEMA + ", _matched long")
    kept = counted.filter(F.col("_matched") == 0).drop("_matched")
    bad = counted.filter(F.col("_matched") > 0)
    detail = F.concat(F.col("_matched").cast("string"), F.lit(f" distinct {n}-grams shared with the eval sets"))
    return StepResult("decontaminate", kept, _quarantine(bad, udfs.CONTAMINATED, detail), shared=counted)


def select_context(df: DataFrame, job: JobConfig) -> StepResult:
    """Relevance selection (udfs.select_batch): adds the score columns, rebuilds messages_json. Quarantines none."""
    cfg = job.enrich
    body = udfs.map_batches(udfs.select_batch, model_path=cfg.embedding_model, batch_size=cfg.embed_batch_size,
                            top_k=cfg.top_k, min_score=cfg.min_score, question_weight=cfg.question_weight,
                            num_threads=cfg.executor_cores)
    selected = df.mapInPandas(body, schema=_WORK_SCHEMA + ", " + _SELECTION_SCHEMA)
    none = df.sparkSession.createDataFrame([], schema=", ".join(f"{c} string" for c in QUARANTINE_COLUMNS))
    return StepResult("select_context", selected, none)


def tokenize_check(df: DataFrame, job: JobConfig) -> StepResult:
    """Tokenize each final conversation with the configured mistral-common tokenizer (as the pack stage will);
    rows it refuses are quarantined ("untokenizable") instead of failing Ray Data later. Adds ``num_tokens`` and
    ``dropped_text_turns`` and ``dropped_text_chars`` (dataset.text_with_tool_calls)."""
    body = udfs.map_batches(udfs.tokenize_check_batch, tokenizer_version=job.dataset.tokenizer,
                            text_with_tool_calls=job.dataset.text_with_tool_calls)
    schema = T.StructType([*df.schema.fields, T.StructField("num_tokens", T.LongType()),
                           T.StructField("dropped_text_turns", T.LongType()),
                           T.StructField("dropped_text_chars", T.LongType()),
                           T.StructField("status", T.StringType()), T.StructField("detail", T.StringType())])
    checked = df.mapInPandas(body, schema=schema)
    kept = checked.filter(F.col("status") == udfs.OK).drop("status", "detail")
    bad = checked.filter(F.col("status") != udfs.OK)
    return StepResult("tokenize_check", kept, _quarantine(bad, F.col("status"), F.col("detail")), shared=checked)


def _dist(row, prefix: str, as_int: bool = False) -> dict[str, float]:
    n = int(row[f"{prefix}_count"] or 0)
    if not n:
        return {"count": 0}
    conv = int if as_int else (lambda v: round(float(v), 6))
    pct = row[f"{prefix}_pct"]
    out = {"count": n, "min": conv(row[f"{prefix}_min"]), "p50": round(float(pct[0]), 6),
           "p90": round(float(pct[1]), 6), "max": conv(row[f"{prefix}_max"])}
    if as_int:
        out["sum"] = int(row[f"{prefix}_sum"])
    return out


def _agg(col: F.Column, prefix: str) -> list[F.Column]:
    # exact percentiles: the columns are small numbers per row, and a data team audits these
    return [F.count(col).alias(f"{prefix}_count"), F.min(col).alias(f"{prefix}_min"),
            F.max(col).alias(f"{prefix}_max"), F.sum(col).alias(f"{prefix}_sum"),
            F.percentile(col, F.array(F.lit(0.5), F.lit(0.9))).alias(f"{prefix}_pct")]


def selection_stats(df: DataFrame) -> dict[str, dict]:
    """Distributions (count/min/p50/p90/max) of the selection scores, over every candidate sentence and over the
    kept ones, of the question/answer similarities, and of num_tokens per row; two Spark jobs."""
    per_sentence = df.select(F.explode(F.arrays_zip(
        "sentence_scores", "question_scores", "answer_scores",
        F.expr("transform(sentence_scores, (s, i) -> array_contains(kept_indices, i))").alias("kept"),
    )).alias("z")).select("z.*")
    kept_score = F.when(F.col("kept"), F.col("sentence_scores"))
    row = per_sentence.agg(*_agg(F.col("sentence_scores"), "all"), *_agg(kept_score, "kept"),
                           *_agg(F.col("question_scores"), "q"), *_agg(F.col("answer_scores"), "a")).collect()[0]
    tok = df.agg(*_agg(F.col("num_tokens"), "tok"),
                 F.sum(F.col("replaced_system_prompt").cast("long")).alias("with_candidates"),
                 F.sum("dropped_text_turns").alias("dropped_text_turns"),
                 F.sum("dropped_text_chars").alias("dropped_text_chars"),
                 F.sum(F.when(F.col("dropped_text_turns") > 0, 1).otherwise(0)).alias("dropped_text_rows")
                 ).collect()[0]
    return {"all_sentences": _dist(row, "all"), "kept_sentences": _dist(row, "kept"),
            "question": _dist(row, "q"), "answer": _dist(row, "a"), "tokens": _dist(tok, "tok", as_int=True),
            "rows_with_candidates": int(tok["with_candidates"] or 0),
            "dropped_text_turns": int(tok["dropped_text_turns"] or 0),
            "dropped_text_chars": int(tok["dropped_text_chars"] or 0),
            "dropped_text_rows": int(tok["dropped_text_rows"] or 0)}


def output_columns(df: DataFrame, extra: Sequence[str] = ()) -> DataFrame:
    """The enriched table as written: identity, derived text, selection audit columns, training messages."""
    cols = ["uuid", "split", "category", "license", "reasoning", "context", "question", "answer",
            *udfs.SELECTION_COLUMNS, "num_tokens", "dropped_text_turns", "dropped_text_chars", "messages_json",
            *extra]
    return df.select(*cols)
