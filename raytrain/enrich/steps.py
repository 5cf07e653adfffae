"""The enrichment steps as Spark DataFrame transforms: each takes the working table and returns what it keeps and
what it quarantines, so a job is a straight chain and every row leaves through exactly one door.

    read -> derive -> license -> exact_dedup -> near_dedup -> decontaminate -> select_context
         [-> corpus_context, with enrich.context_corpus] -> tokenize_check

Per-batch row logic is in ``udfs.py`` (plain pandas, unit-tested); this module only wires it into Spark:
schemas, windows, groupings, joins. Only the enrich stage imports pyspark.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

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
                "context string, question string, answer string, text string, messages_json string")
_DERIVED_SCHEMA = ("row_id long, split string, uuid string, category string, license string, reasoning string, "
                   "status string, detail string, context string, question string, answer string, "
                   "text string, messages_json string")
_SELECTION_SCHEMA = ("context_sentences array<string>, kept_indices array<int>, kept_sentences array<string>, "
                     "sentence_scores array<float>, question_scores array<float>, answer_scores array<float>, "
                     "chunked_texts long, system_prompt_chars_removed long")
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
    stats: Callable[[DataFrame], dict[str, Any]] | None = None
    """Statistics the report needs from ``shared`` (quarantined rows included), computed while it is persisted."""


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
                            system_prompt=cfg.system_prompt, answer_text=cfg.answer_text,
                            num_threads=cfg.executor_cores)
    selected = df.mapInPandas(body, schema=_WORK_SCHEMA + ", " + _SELECTION_SCHEMA)
    none = df.sparkSession.createDataFrame([], schema=", ".join(f"{c} string" for c in QUARANTINE_COLUMNS))
    return StepResult("select_context", selected, none)


def corpus_context(spark: SparkSession, df: DataFrame, index: Any, eval_hashes: set[int], job: JobConfig
                   ) -> StepResult:
    """Context from the corpus (corpus_udfs.corpus_context_batch) for rows without context of their own: adds
    corpus_udfs.CORPUS_COLUMNS, rebuilds messages_json. The CorpusIndex (embeddings, texts, the faiss index when
    used) and the eval n-gram index are broadcast once. Quarantines none."""
    from raytrain.enrich.corpus_udfs import CORPUS_SCHEMA, corpus_context_batch

    cfg = job.enrich
    shipped = spark.sparkContext.broadcast(index)
    evals = spark.sparkContext.broadcast(udfs.build_sorted_index(eval_hashes))

    def body(batches):
        for pdf in batches:
            yield corpus_context_batch(
                pdf, index=shipped.value, eval_index=evals.value, ngram=cfg.decontam_ngram,
                model_path=cfg.embedding_model, batch_size=cfg.embed_batch_size, top_k=cfg.top_k,
                min_score=cfg.min_score, question_weight=cfg.question_weight, answer_text=cfg.answer_text,
                num_threads=cfg.executor_cores)

    found = df.mapInPandas(body, schema=_WORK_SCHEMA + ", " + _SELECTION_SCHEMA + ", " + CORPUS_SCHEMA)
    none = df.sparkSession.createDataFrame([], schema=", ".join(f"{c} string" for c in QUARANTINE_COLUMNS))
    return StepResult("corpus_context", found, none)


def corpus_stats(df: DataFrame, top_documents: int = 10) -> dict[str, Any]:
    """Over the enriched rows (with CORPUS_COLUMNS), overall and per split: rows per corpus path, distributions
    of the kept sentences' combined / question / answer scores, sentences dropped at the block's eval check; and
    the documents most used (sentences added from each)."""
    from raytrain.enrich.corpus_udfs import CORPUS_PATHS

    per_sentence = df.select("split", F.explode(F.arrays_zip(
        "corpus_scores", "corpus_question_scores", "corpus_answer_scores")).alias("z")).select("split", "z.*")
    scores = _by_split(per_sentence.rollup("split").agg(
        *_agg(F.col("corpus_scores"), "s"), *_agg(F.col("corpus_question_scores"), "q"),
        *_agg(F.col("corpus_answer_scores"), "a")).collect(),
        lambda r: {"scores": _dist(r, "s"), "question": _dist(r, "q"), "answer": _dist(r, "a")})
    rows = _by_split(df.rollup("split").agg(
        F.count("*").alias("rows"), *(_count_if(F.col("corpus_path") == p, p) for p in CORPUS_PATHS),
        F.sum(F.size("corpus_sentences")).alias("sentences_added"),
        F.sum("corpus_dropped_for_eval").alias("dropped_for_eval")).collect(),
        lambda r: {"rows": int(r["rows"]), **{f"rows_{p}": int(r[p] or 0) for p in CORPUS_PATHS},
                   "sentences_added": int(r["sentences_added"] or 0),
                   "sentences_dropped_at_block_check": int(r["dropped_for_eval"] or 0)})
    docs = [{"doc_id": r["doc_id"], "sentences_added": int(r["count"]), "rows": int(r["rows"])} for r in
            df.select("uuid", F.explode("corpus_doc_ids").alias("doc_id")).groupBy("doc_id")
            .agg(F.count("*").alias("count"), F.countDistinct("uuid").alias("rows"))
            .orderBy(F.desc("count"), "doc_id").limit(top_documents).collect()]
    empty = {"scores": {"count": 0}, "question": {"count": 0}, "answer": {"count": 0}}
    return {**rows["overall"], **(scores["overall"] or empty), "top_documents": docs,
            "per_split": {k: {**v, **scores["per_split"].get(k, empty)} for k, v in rows["per_split"].items()}}


def tokenize_check(df: DataFrame, job: JobConfig) -> StepResult:
    """Tokenize each final conversation with the configured mistral-common tokenizer (as the pack stage will) and
    apply dataset.length_policy; rows it refuses are quarantined ("untokenizable") instead of failing Ray Data
    later, rows the policy drops as "too_many_tokens" with their token count. Adds ``num_tokens``,
    ``train_tokens``, ``length_action``, ``dropped_text_turns`` and ``dropped_text_chars``
    (udfs.tokenize_check_batch)."""
    ds = job.dataset
    body = udfs.map_batches(udfs.tokenize_check_batch, tokenizer_version=ds.tokenizer, seq_len=ds.seq_len,
                            length_policy=ds.length_policy, text_with_tool_calls=ds.text_with_tool_calls)
    schema = T.StructType([*df.schema.fields,
                           *(T.StructField(c, T.LongType()) for c in udfs.INT_TOKEN_COLUMNS),
                           T.StructField("length_action", T.StringType()),
                           T.StructField("status", T.StringType()), T.StructField("detail", T.StringType())])
    checked = df.mapInPandas(body, schema=schema)
    kept = checked.filter(F.col("status") == udfs.OK).drop("status", "detail")
    bad = checked.filter(F.col("status") != udfs.OK)
    return StepResult("tokenize_check", kept, _quarantine(bad, F.col("status"), F.col("detail")), shared=checked,
                      stats=lambda frame: length_stats(frame, ds.seq_len))


def _dist(row, prefix: str, as_int: bool = False) -> dict[str, float]:
    n = int(row[f"{prefix}_count"] or 0)
    if not n:
        return {"count": 0}
    conv = int if as_int else (lambda v: round(float(v), 6))
    pct = row[f"{prefix}_pct"]
    out = {"count": n, "min": conv(row[f"{prefix}_min"]), "p50": round(float(pct[0]), 6),
           "p90": round(float(pct[1]), 6), "p99": round(float(pct[2]), 6), "max": conv(row[f"{prefix}_max"])}
    if as_int:
        out["sum"] = int(row[f"{prefix}_sum"])
    return out


def _agg(col: F.Column, prefix: str) -> list[F.Column]:
    # exact percentiles: the columns are small numbers per row, and a data team audits these
    return [F.count(col).alias(f"{prefix}_count"), F.min(col).alias(f"{prefix}_min"),
            F.max(col).alias(f"{prefix}_max"), F.sum(col).alias(f"{prefix}_sum"),
            F.percentile(col, F.array(F.lit(0.5), F.lit(0.9), F.lit(0.99))).alias(f"{prefix}_pct")]


def _count_if(cond: F.Column, alias: str, value: F.Column | None = None) -> F.Column:
    return F.sum(F.when(cond, F.lit(1) if value is None else value).otherwise(0)).alias(alias)


def _by_split(rows, convert) -> dict[str, Any]:
    """Rows of a ``rollup("split")`` -> {"overall": convert(total row), "per_split": {split: convert(row)}}."""
    out: dict[str, Any] = {"overall": {}, "per_split": {}}
    for r in rows:
        if r["split"] is None:
            out["overall"] = convert(r)
        else:
            out["per_split"][r["split"]] = convert(r)
    out["per_split"] = dict(sorted(out["per_split"].items()))
    return out


def selection_stats(df: DataFrame) -> dict[str, Any]:
    """Over the enriched rows, overall and per split (two Spark jobs, rollups): distributions (count/min/p50/p90/
    p99/max) of the combined score over every candidate sentence and over the kept ones, of the question/answer
    similarities, and of num_tokens; rows that had candidates, texts embedded in chunks, system prompts changed
    (enrich.system_prompt=select) and text dropped for tool calls."""
    per_sentence = df.select("split", F.explode(F.arrays_zip(
        "sentence_scores", "question_scores", "answer_scores",
        F.expr("transform(sentence_scores, (s, i) -> array_contains(kept_indices, i))").alias("kept"),
    )).alias("z")).select("split", "z.*")
    kept_score = F.when(F.col("kept"), F.col("sentence_scores"))
    scores = _by_split(per_sentence.rollup("split").agg(
        *_agg(F.col("sentence_scores"), "all"), *_agg(kept_score, "kept"), *_agg(F.col("question_scores"), "q"),
        *_agg(F.col("answer_scores"), "a")).collect(),
        lambda r: {"all_sentences": _dist(r, "all"), "kept_sentences": _dist(r, "kept"), "question": _dist(r, "q"),
                   "answer": _dist(r, "a")})
    rows = _by_split(df.rollup("split").agg(
        F.count("*").alias("rows"), *_agg(F.col("num_tokens"), "tok"),
        _count_if(F.size("context_sentences") > 0, "rows_with_candidates"),
        _count_if(F.size("kept_sentences") > 0, "rows_with_context_added"),
        _count_if(F.col("chunked_texts") > 0, "rows_chunked"), F.sum("chunked_texts").alias("texts_chunked"),
        _count_if(F.col("system_prompt_chars_removed") > 0, "system_prompts_changed"),
        F.sum("system_prompt_chars_removed").alias("system_prompt_chars_removed"),
        F.sum("dropped_text_turns").alias("dropped_text_turns"), F.sum("dropped_text_chars").alias("dropped_text_chars"),
        _count_if(F.col("dropped_text_turns") > 0, "dropped_text_rows")).collect(),
        lambda r: {"rows": int(r["rows"]), "tokens": _dist(r, "tok", as_int=True),
                   **{k: int(r[k] or 0) for k in ("rows_with_candidates", "rows_with_context_added",
                                                  "rows_chunked", "texts_chunked",
                                                  "system_prompts_changed", "system_prompt_chars_removed",
                                                  "dropped_text_turns", "dropped_text_chars", "dropped_text_rows")}})
    empty_scores = {"all_sentences": {"count": 0}, "kept_sentences": {"count": 0}, "question": {"count": 0},
                    "answer": {"count": 0}}
    overall = {**rows["overall"], **(scores["overall"] or empty_scores)}
    per_split = {k: {**v, **scores["per_split"].get(k, empty_scores)} for k, v in rows["per_split"].items()}
    return {**overall, "per_split": per_split}


def length_stats(checked: DataFrame, seq_len: int) -> dict[str, Any]:
    """Over the rows the tokenization check saw (tokenize_check's frame, quarantined rows included), overall and
    per split: the token-length distribution of whole conversations (p50/p90/p99/max) and what the length policy
    did: rows and tokens dropped, rows truncated and tokens cut, rows split and the chunks they became."""
    tokenized = checked.filter(F.col("num_tokens") >= 0)
    act = F.col("length_action")
    removed = F.col("num_tokens") - F.col("train_tokens")
    return _by_split(tokenized.rollup("split").agg(
        *_agg(F.col("num_tokens"), "tok"),
        _count_if(act == "drop", "rows_dropped"), _count_if(act == "drop", "tokens_dropped", F.col("num_tokens")),
        _count_if(act == "truncate", "rows_truncated"), _count_if(act == "truncate", "tokens_truncated", removed),
        _count_if(act == "split", "rows_split"),
        _count_if(act == "split", "split_chunks", F.ceil(F.col("num_tokens") / F.lit(seq_len)))).collect(),
        lambda r: {"tokens": _dist(r, "tok", as_int=True),
                   **{k: int(r[k] or 0) for k in ("rows_dropped", "tokens_dropped", "rows_truncated",
                                                  "tokens_truncated", "rows_split", "split_chunks")}})


def output_columns(df: DataFrame, extra: Sequence[str] = ()) -> DataFrame:
    """The enriched table as written: identity, derived text, selection audit columns, training messages."""
    cols = ["uuid", "split", "category", "license", "reasoning", "context", "question", "answer",
            *udfs.SELECTION_COLUMNS, *udfs.INT_TOKEN_COLUMNS, "length_action", "messages_json", *extra]
    return df.select(*cols)
