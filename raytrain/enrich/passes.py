"""The enrichment as Spark DataFrame transforms, in two row passes and one narrow dedup in between:

    read -> guard (in the JVM: invalid UTF-8, too many turns, too long; row_guard.py)
         -> prepare (one pass: derive, license, exact-dedup key, MinHash + LSH band keys, eval n-gram count)
         -> duplicates (narrow columns only, all in Spark: exact groups, LSH buckets verified; a duplicate is
            the later row of a pair in input order)
         -> finish (one pass over the rows still kept: selection, corpus context, tokenization to ids)

Every row carries a ``status`` column from the first pass on ("ok" or the reason it is quarantined), so every row
leaves through exactly one door and the per-step counts come from one aggregation of that column. Per-batch row
logic is in ``batches.py`` (plain pandas, unit-tested), whose pyarrow schemas describe the tables; this module only
wires it into Spark. Only the enrich stage imports pyspark.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import pyarrow as pa
from pyspark import StorageLevel
from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql import types as T
from pyspark.sql.pandas.types import from_arrow_schema

from raytrain.config import JobConfig
from raytrain.enrich import batches
from raytrain.enrich.conversation import MAX_TURNS
from raytrain.enrich.dedup import lsh_params
from raytrain.enrich.row_guard import guard_rows
from raytrain.enrich.waves import Part

log = logging.getLogger(__name__)

NUM_PERM = 128  # MinHash permutations: standard error of the Jaccard estimate ~0.035 at 0.8
SHINGLE_CHARS = 5  # character 5-grams of the normalized text
TORCH_THREADS_PER_TASK = 1
"""Torch threads of each Python worker. Spark runs ``executor_cores`` tasks at once per executor (spark.task.cpus
is 1), each in its own Python worker: one thread each keeps workers x threads = the executor's cores."""
ROW_COLUMNS = ("uuid", "split", "category", "license", "reasoning", "context", "question", "answer")
"""The enriched table's identity and derived-text columns; the audit columns come from batches' schemas."""


def spark_schema(schema: pa.Schema) -> T.StructType:
    """A batches pyarrow schema as the Spark schema mapInPandas / applyInPandas declare."""
    return from_arrow_schema(schema)


def read_inputs(spark: SparkSession, parts: dict[str, list[tuple[str, Part]]], max_rows: int,
                schemas: dict[str, pa.Schema | None] | None = None) -> DataFrame:
    """Raw Nemotron rows of every split's parts (``(uri, waves.Part)``: a file or a run of its row groups; ``split``
    column added; at most ``max_rows`` per split when > 0), with a ``row_id`` unique per row, assigned before any
    shuffle so it is stable for the life of the job, and the ``group_index`` of the row's Parquet row group in the
    input order: the order in which duplicates keep their first row. Part of a file is read by Spark's row index
    (``_metadata.row_index``, pushed into the scan). ``schemas``: each split's files' pyarrow schema, read from their
    footers already (inputs.validate_inputs); given, Spark reads with it instead of running a job to infer it."""
    frames = []
    for split, split_parts in parts.items():
        reader = spark.read
        schema = (schemas or {}).get(split)
        if schema is not None:
            try:
                reader = reader.schema(from_arrow_schema(schema))
            except TypeError:  # a type Spark's converter does not map: let Spark infer it
                pass
        per_part = [_read_part(reader, uri, part) for uri, part in split_parts]
        df = per_part[0]
        for other in per_part[1:]:
            df = df.unionByName(other)
        if max_rows:
            df = df.limit(max_rows)
        frames.append(df.withColumn("split", F.lit(split)))
    df = frames[0]
    for other in frames[1:]:
        df = df.unionByName(other)
    return df.withColumn("row_id", F.monotonically_increasing_id())


def _read_part(reader, uri: str, part: Part) -> DataFrame:
    """One reader per part: its rows, with the ``group_index`` of each (the part's first group's, plus the row
    groups of the part that start at or before the row)."""
    df = reader.parquet(uri)
    row_index = F.col("_metadata.row_index")
    if not part.whole:
        df = df.filter(row_index.between(part.start, part.stop - 1))
    group = F.lit(part.first_group).cast("long")
    starts = part.group_starts()
    if starts:
        group = group + F.size(F.filter(F.array(*[F.lit(s).cast("long") for s in starts]), lambda s: s <= row_index))
    return df.select("uuid", "license", "category", "reasoning", "messages", group.alias("group_index"))


def prepare(raw: DataFrame, eval_index: Any, job: JobConfig, row_seconds: Any = None) -> DataFrame:
    """Pass 1 (batches.prepare_batch) over every raw row, spread over enrich.num_partitions, after row_guard refused
    in the JVM the rows Python must not receive; ``eval_index`` is the broadcast sorted eval n-gram array;
    ``row_seconds``, a Spark accumulator, sums the seconds its tasks spend in the batch function. Persisted: the
    dedup reads its narrow columns, the finishing pass the rest."""
    cfg = job.enrich
    bands, rows = lsh_params(cfg.near_dup_threshold, NUM_PERM)

    def body(frames):
        for pdf in frames:
            t0 = time.perf_counter()
            out = batches.prepare_batch(pdf, max_chars=cfg.max_chars, licenses=cfg.licenses, num_perm=NUM_PERM,
                                        bands=bands, rows=rows, shingle_chars=SHINGLE_CHARS,
                                        eval_index=eval_index.value, ngram=cfg.decontam_ngram)
            if row_seconds is not None:
                row_seconds.add(time.perf_counter() - t0)
            yield out

    # The guard runs before the shuffle: a refused row crosses it (and reaches Python) without its text.
    guarded = guard_rows(raw, cfg.max_chars, MAX_TURNS)
    prepared = guarded.repartition(cfg.num_partitions).mapInPandas(body, schema=spark_schema(batches.PREPARED))
    return prepared.persist(StorageLevel.MEMORY_AND_DISK)


class Duplicates(NamedTuple):
    flags: DataFrame  # (row_id, dup_reason, dup_detail), persisted; its near half is computed, the exact half not
    near: DataFrame  # the near half, persisted and computed
    survivors: DataFrame  # DEDUP_STATE columns of the rows no earlier row has the exact key of
    pairs: int  # verified near-duplicate pairs
    near_drops: int  # rows dropped as near duplicates

    def unpersist(self) -> None:
        self.flags.unpersist()
        self.near.unpersist()


DEDUP_STATE = ("row_id", "group_index", "uuid", "exact_key", "signature", "band_keys")
"""What a wave leaves for the waves after it (waves.py): its exact survivors' keys, signatures and band keys."""


def duplicates(spark: SparkSession, prepared: DataFrame, job: JobConfig, prior: DataFrame | None = None,
               first_group: int = 0) -> Duplicates:
    """(``row_id``, ``dup_reason``, ``dup_detail``) of every kept-so-far row that is an exact or near duplicate of
    a row before it in the input order (batches.INPUT_ORDER: the row groups in order, uuid within a group). Runs one
    Spark job (the near half's count, which also runs pass 1); the exact half is computed with pass 2.

    Exact: a row whose key an earlier row has (a window over the key, in Spark); the detail names the first. Near,
    among the exact survivors: rows sharing an LSH band key are candidates, each bucket verified in applyInPandas
    (estimated Jaccard >= enrich.near_dup_threshold); the later row of a verified pair is the near duplicate, and
    its detail names its most similar earlier partner. A row's verdict depends only on the rows before it, so the
    files processed front to back in waves decide every row as processing them at once does (docs/decisions.md,
    'Duplicates keep the first row in input order'): ``prior`` holds the earlier waves' exact survivors
    (DEDUP_STATE columns, all in row groups before ``first_group``, the wave's first). Reads only the narrow
    columns (ids, keys, signatures); nothing comes to the driver but the two counts."""
    threshold = job.enrich.near_dup_threshold
    order = [F.col(c) for c in batches.INPUT_ORDER]
    ok = prepared.filter(F.col("status") == batches.OK).select(*DEDUP_STATE)
    if prior is not None:  # a key an earlier wave has: the duplicate of that wave's first row with it
        ok = ok.join(prior.select("exact_key", F.col("uuid").alias("_prior_uuid")), "exact_key", "left")
    else:
        ok = ok.withColumn("_prior_uuid", F.lit(None).cast("string"))
    w = Window.partitionBy("exact_key").orderBy(*order)
    ranked = ok.withColumn("_rank", F.row_number().over(w)) \
        .withColumn("_kept_uuid", F.coalesce("_prior_uuid", F.first("uuid").over(w)))
    is_copy = (F.col("_rank") > 1) | F.col("_prior_uuid").isNotNull()
    exact = ranked.filter(is_copy).select(
        "row_id", F.lit(batches.EXACT_DUPLICATE).alias("dup_reason"),
        F.concat(F.lit("duplicate of "), F.col("_kept_uuid"), F.lit(" (same normalized text)")).alias("dup_detail"))
    survivors = ranked.filter(~is_copy).select(*DEDUP_STATE)
    candidates = survivors.withColumn("_current", F.lit(True))
    if prior is not None:
        candidates = candidates.unionByName(prior.select(*DEDUP_STATE).withColumn("_current", F.lit(False)))
    exploded = candidates.select("row_id", "group_index", "uuid", "signature", "_current",
                                 F.explode("band_keys").alias("band_key"))
    bucket = Window.partitionBy("band_key")
    candidates = exploded.withColumn("_n", F.count("*").over(bucket)) \
        .withColumn("_new", F.max(F.col("_current").cast("int")).over(bucket)) \
        .filter((F.col("_n") > 1) & (F.col("_new") == 1)).drop("_n", "_new", "_current")
    pairs = candidates.groupBy("band_key").applyInPandas(
        lambda pdf: batches.verify_bucket(pdf, threshold), schema=spark_schema(batches.PAIRS),
    ).filter(F.col("b_group_index") >= first_group) \
        .dropDuplicates(["a_group_index", "a_row_id", "b_row_id"])  # a row id is unique within one wave
    closest = Window.partitionBy("b_row_id").orderBy(F.desc("jaccard"), "a_group_index", "a_uuid", "a_row_id")
    near = pairs.withColumn("_rank", F.row_number().over(closest)) \
        .withColumn("_pairs", F.count("*").over(Window.partitionBy("b_row_id"))).filter(F.col("_rank") == 1) \
        .select(F.col("b_row_id").alias("row_id"), F.lit(batches.NEAR_DUPLICATE).alias("dup_reason"),
                F.format_string("near-duplicate of %s (estimated Jaccard %.3f)", "a_uuid", "jaccard")
                .alias("dup_detail"), "_pairs").persist(StorageLevel.MEMORY_AND_DISK)
    # Only the near half here: a job over both halves would run their two shuffles of `prepared` (pruned to
    # different columns, so not one reused exchange) as concurrent stages, each computing pass 1's partitions it
    # finds uncached; pass 2 then reads the exact half's columns from the cache.
    counted = near.agg(F.count("*").alias("drops"), F.sum("_pairs").alias("pairs")).collect()[0]
    num_drops, num_pairs = int(counted["drops"]), int(counted["pairs"] or 0)
    bands, rows = lsh_params(threshold, NUM_PERM)
    log.info("enrich: near-duplicates: %d pairs at estimated Jaccard >= %.2f (LSH %d bands x %d rows), %d rows to "
             "drop (each the later row of a pair in input order)", num_pairs, threshold, bands, rows, num_drops)
    flags = exact.unionByName(near.drop("_pairs")).persist(StorageLevel.MEMORY_AND_DISK)
    return Duplicates(flags, near, survivors, num_pairs, num_drops)


def with_final_verdict(prepared: DataFrame, flags: DataFrame, ngram: int, columns: Sequence[str]) -> DataFrame:
    """``columns`` of ``prepared`` joined with the dedup flags, ``status`` and ``detail`` the final verdict: pass 1's
    reason, else exact or near duplicate, else contaminated (eval n-grams shared), else ok."""
    status = (F.when(F.col("status") != batches.OK, F.col("status")).when(F.col("dup_reason").isNotNull(), F.col("dup_reason"))
              .when(F.col("eval_ngrams") > 0, F.lit(batches.CONTAMINATED)).otherwise(F.lit(batches.OK)))
    detail = (F.when(F.col("status") != batches.OK, F.col("detail")).when(F.col("dup_reason").isNotNull(), F.col("dup_detail"))
              .when(F.col("eval_ngrams") > 0, F.concat(F.col("eval_ngrams").cast("string"),
                                                       F.lit(f" distinct {ngram}-grams shared with the eval sets")))
              .otherwise(F.lit("")))
    verdict = {"status": status.alias("status"), "detail": detail.alias("detail")}
    return prepared.join(flags, "row_id", "left").select(*(verdict.get(c, F.col(c)) for c in columns))


def finish(prepared: DataFrame, flags: DataFrame, job: JobConfig, corpus: Any = None,
           eval_index: Any = None, retrieve_seconds: Any = None, row_seconds: Any = None) -> DataFrame:
    """Pass 2: every row with its final verdict (derive/license from pass 1, then exact or near duplicate, then
    contaminated), hash-partitioned by uuid and sorted by uuid within each partition (the written files' order,
    deterministic without a global sort), through batches.finish_batch. ``corpus``: the broadcast CorpusIndex when
    enrich.context_corpus is set (``eval_index`` then the broadcast eval array); ``retrieve_seconds``, a Spark
    accumulator, sums the seconds its tasks spend in the corpus retrieval, ``row_seconds`` those in the batch
    function. Persisted: the enriched and quarantine writes and the statistics read it."""
    cfg, ds = job.enrich, job.dataset
    n = cfg.decontam_ngram
    rows = with_final_verdict(prepared, flags, n, batches.ROW.names)
    rows = rows.repartition(cfg.num_partitions, "uuid").sortWithinPartitions("uuid", "row_id")
    scoring = batches.Scoring.from_config(cfg, num_threads=TORCH_THREADS_PER_TASK)
    tokenize = batches.Tokenizing.from_config(ds)

    def body(frames):
        search = None if corpus is None else batches.CorpusSearch(corpus.value, eval_index.value, n)
        for pdf in frames:
            seconds: dict[str, float] = {}
            t0 = time.perf_counter()
            out = batches.finish_batch(pdf, scoring=scoring, tokenize=tokenize, system_prompt=cfg.system_prompt,
                                       corpus=search, seconds=seconds)
            if row_seconds is not None:
                row_seconds.add(time.perf_counter() - t0)
            if retrieve_seconds is not None and "corpus" in seconds:
                retrieve_seconds.add(seconds["corpus"])
            yield out

    schema = spark_schema(batches.finished_schema(corpus is not None))
    return rows.mapInPandas(body, schema=schema).persist(StorageLevel.MEMORY_AND_DISK)


def _dist(row, prefix: str, as_int: bool = False) -> dict[str, float]:
    """The distribution ``prefix`` of an aggregated row; ``{"count": 0}`` when empty (or ``row`` is None)."""
    n = 0 if row is None else int(row[f"{prefix}_count"] or 0)
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


def row_stats(finished: DataFrame, seq_len: int, reasons: Sequence[str], corpus: bool) -> dict[str, Any]:
    """One rollup over every row of the finishing pass (one Spark job), overall and per split: rows per status
    (``reasons`` is the fixed vocabulary; "other" counts anything else, a bug the caller refuses); over the kept
    rows the num_tokens distribution, rows that had candidates, got context, were embedded in chunks, had their
    system prompt changed or tool-call text dropped (and with a corpus, rows per corpus path, sentences added and
    dropped at the block's eval check); over the rows tokenized (kept or refused for length) the token-length
    distribution and what the length policy did: rows and tokens dropped, truncated, split and their chunks."""
    from raytrain.enrich.corpus_batches import CORPUS_PATHS

    status = F.col("status")
    kept = status == batches.OK
    tokenized = F.col("num_tokens") >= 0
    act = F.col("length_action")
    removed = F.col("num_tokens") - F.col("train_tokens")
    kept_sums = ("texts_chunked", "system_prompt_chars_removed", "dropped_text_turns", "dropped_text_chars")
    aggs = [
        *(_count_if(status == r, f"n_{r}") for r in (batches.OK, *reasons)),
        _count_if(~status.isin(batches.OK, *reasons), "n_other"),
        *_agg(F.when(kept, F.col("num_tokens")), "tok"), *_agg(F.when(tokenized, F.col("num_tokens")), "len"),
        _count_if(kept & (F.size("context_sentences") > 0), "rows_with_candidates"),
        _count_if(kept & (F.size("kept_sentences") > 0), "rows_with_context_added"),
        _count_if(kept & (F.col("chunked_texts") > 0), "rows_chunked"),
        _count_if(kept & (F.col("system_prompt_chars_removed") > 0), "system_prompts_changed"),
        _count_if(kept & (F.col("dropped_text_turns") > 0), "dropped_text_rows"),
        _count_if(kept, "texts_chunked", F.col("chunked_texts")),
        _count_if(kept, "system_prompt_chars_removed", F.col("system_prompt_chars_removed")),
        _count_if(kept, "dropped_text_turns", F.col("dropped_text_turns")),
        _count_if(kept, "dropped_text_chars", F.col("dropped_text_chars")),
        _count_if(tokenized & (act == "drop"), "rows_dropped"),
        _count_if(tokenized & (act == "drop"), "tokens_dropped", F.col("num_tokens")),
        _count_if(tokenized & (act == "truncate"), "rows_truncated"),
        _count_if(tokenized & (act == "truncate"), "tokens_truncated", removed),
        _count_if(tokenized & (act == "split"), "rows_split"),
        _count_if(tokenized & (act == "split"), "split_chunks", F.ceil(F.col("num_tokens") / F.lit(seq_len))),
    ]
    if corpus:
        aggs += [*(_count_if(kept & (F.col("corpus_path") == p), f"path_{p}") for p in CORPUS_PATHS),
                 _count_if(kept, "sentences_added", F.size("corpus_sentences")),
                 _count_if(kept, "dropped_for_eval", F.col("corpus_dropped_for_eval"))]

    def convert(r) -> dict[str, Any]:
        out = {"status": {k: int(r[f"n_{k}"] or 0) for k in (batches.OK, *reasons, "other") if r[f"n_{k}"]},
               "rows": int(r[f"n_{batches.OK}"] or 0), "tokens": _dist(r, "tok", as_int=True),
               **{k: int(r[k] or 0) for k in ("rows_with_candidates", "rows_with_context_added", "rows_chunked",
                                              "system_prompts_changed", "dropped_text_rows", *kept_sums)},
               "length": {"tokens": _dist(r, "len", as_int=True),
                          **{k: int(r[k] or 0) for k in ("rows_dropped", "tokens_dropped", "rows_truncated",
                                                         "tokens_truncated", "rows_split", "split_chunks")}}}
        if corpus:
            out["corpus"] = {**{f"rows_{p}": int(r[f"path_{p}"] or 0) for p in CORPUS_PATHS},
                             "sentences_added": int(r["sentences_added"] or 0),
                             "sentences_dropped_at_block_check": int(r["dropped_for_eval"] or 0)}
        return out

    return _by_split(finished.rollup("split").agg(*aggs).collect(), convert)


def sentence_stats(finished: DataFrame, corpus: bool) -> dict[str, Any]:
    """One rollup over the kept rows' sentences (one Spark job), overall and per split: distributions (count/min/
    p50/p90/p99/max) of the combined score over every candidate sentence and over the kept ones, of the question/
    answer similarities, and with a corpus of the added corpus sentences' combined/question/answer scores.
    ``"empty"``: the same dict with every distribution empty, for a split without sentences (and "overall" is that
    when no row had any)."""
    kept = finished.filter(F.col("status") == batches.OK)
    own = kept.select("split", F.lit("own").alias("kind"), F.explode(F.arrays_zip(
        F.col("sentence_scores").alias("s"), F.col("question_scores").alias("q"), F.col("answer_scores").alias("a"),
        F.expr("transform(sentence_scores, (s, i) -> array_contains(kept_indices, i))").alias("kept"),
    )).alias("z")).select("split", "kind", "z.s", "z.q", "z.a", "z.kept")
    if corpus:
        own = own.unionByName(kept.select("split", F.lit("corpus").alias("kind"), F.explode(F.arrays_zip(
            F.col("corpus_scores").alias("s"), F.col("corpus_question_scores").alias("q"),
            F.col("corpus_answer_scores").alias("a"))).alias("z")).select(
            "split", "kind", "z.s", "z.q", "z.a", F.lit(True).alias("kept")))
    mine, theirs = F.col("kind") == "own", F.col("kind") == "corpus"
    aggs = [*_agg(F.when(mine, F.col("s")), "all"), *_agg(F.when(mine & F.col("kept"), F.col("s")), "kept"),
            *_agg(F.when(mine, F.col("q")), "q"), *_agg(F.when(mine, F.col("a")), "a")]
    if corpus:
        aggs += [*_agg(F.when(theirs, F.col("s")), "cs"), *_agg(F.when(theirs, F.col("q")), "cq"),
                 *_agg(F.when(theirs, F.col("a")), "ca")]

    def convert(r) -> dict[str, Any]:
        out = {"all_sentences": _dist(r, "all"), "kept_sentences": _dist(r, "kept"), "question": _dist(r, "q"),
               "answer": _dist(r, "a")}
        if corpus:
            out["corpus"] = {"scores": _dist(r, "cs"), "question": _dist(r, "cq"), "answer": _dist(r, "ca")}
        return out

    out = _by_split(own.rollup("split").agg(*aggs).collect(), convert)
    return {**out, "overall": out["overall"] or convert(None), "empty": convert(None)}


def top_documents(finished: DataFrame, n: int = 10) -> list[dict[str, Any]]:
    """The corpus documents most used by the kept rows: sentences added from each and rows they went to."""
    kept = finished.filter(F.col("status") == batches.OK)
    return [{"doc_id": r["doc_id"], "sentences_added": int(r["count"]), "rows": int(r["rows"])} for r in
            kept.select("uuid", F.explode("corpus_doc_ids").alias("doc_id")).groupBy("doc_id")
            .agg(F.count("*").alias("count"), F.countDistinct("uuid").alias("rows"))
            .orderBy(F.desc("count"), "doc_id").limit(n).collect()]


def enriched_columns(corpus: bool) -> list[str]:
    """The enriched table as written: identity, derived text, selection (and corpus) audit, tokens, messages."""
    return [*ROW_COLUMNS, *batches.SELECTION.names, *(batches.CORPUS.names if corpus else ()),
            *batches.TOKENS.names, "messages_json"]


def quarantined(finished: DataFrame) -> DataFrame:
    """The quarantine table as written: ``uuid, split, category, reason, detail`` of every row not kept."""
    return finished.filter(F.col("status") != batches.OK).select(
        "uuid", "split", "category", F.col("status").alias("reason"), "detail")
