"""The corpus sentence table, built in Spark once per (corpus, model) and reused: data/corpus/<key>/.

    documents (Parquet / JSONL) -> split into sentences (corpus.document_sentences) -> exact duplicates collapsed
    (the first (doc id, sentence index) keeps the text) -> embedded (relevance.embed_texts, the selection's
    embedding path) -> sentences/part-*.parquet (each sorted by doc_id, sentence_index), then _corpus.json (last).

Columns: ``doc_id`` (string), ``sentence_index`` (int64), ``text``, ``embedding`` (list<float32>, unit). A later
run whose corpus files and model hash to the same key finds ``_corpus.json`` and reads the table instead of
embedding again (the report says which, and how many sentences were embedded in this run).

``load_corpus_index`` turns the table into the search's CorpusIndex on the driver: sentences sharing an n-gram
with the eval sets removed (counted), and the faiss index built when the corpus is above the exact-search limit.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow.parquet as pq
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from raytrain.config import EnrichConfig
from raytrain.enrich.batches import map_batches
from raytrain.enrich.corpus import CORPUS_FORMAT, CorpusFile, CorpusIndex, build_ann, corpus_key, model_hash
from raytrain.enrich.corpus_batches import corpus_embed_batch, corpus_split_batch
from raytrain.enrich.decontam import build_sorted_index, contamination_counts
from raytrain.enrich.relevance import default_model_path
from raytrain.enrich.spark import spark_uri
from raytrain.storage import RunPaths, StorageLocation

log = logging.getLogger(__name__)

TABLE_META = "_corpus.json"
SENTENCES = "sentences"


def _read_documents(spark: SparkSession, files: Sequence[CorpusFile], id_field: str, text_field: str) -> DataFrame:
    frames = []
    for fmt in ("parquet", "json"):
        uris = [spark_uri(f.loc) for f in files if f.fmt == fmt]
        if uris:
            df = spark.read.parquet(*uris) if fmt == "parquet" else spark.read.json(uris)
            frames.append(df.select(F.col(f"`{id_field}`").cast("string").alias("doc_id"),
                                    F.col(f"`{text_field}`").cast("string").alias("text")))
    docs = frames[0]
    for other in frames[1:]:
        docs = docs.unionByName(other)
    return docs


def build_table(spark: SparkSession, files: Sequence[CorpusFile], cfg: EnrichConfig, folder: StorageLocation,
                key: str) -> dict[str, Any]:
    """Split, collapse, embed and write the table under ``folder``; returns the table's metadata (written last as
    _corpus.json): documents, sentences split, duplicates collapsed, sentences embedded, seconds."""
    from pyspark import StorageLevel

    t0 = time.perf_counter()
    docs = _read_documents(spark, files, cfg.corpus_id_field, cfg.corpus_text_field).repartition(cfg.num_partitions)
    split = docs.mapInPandas(map_batches(corpus_split_batch),
                             schema="doc_id string, sentence_index long, text string, empty long")
    split = split.persist(StorageLevel.MEMORY_AND_DISK)
    counts = split.agg(F.countDistinct("doc_id").alias("docs"), F.sum("empty").alias("empty"),
                       F.count("text").alias("sentences")).collect()[0]
    first = split.filter(F.col("text").isNotNull()).groupBy("text").agg(
        F.min(F.struct("doc_id", "sentence_index")).alias("first"))
    unique = first.select("first.doc_id", "first.sentence_index", "text").repartition(cfg.num_partitions)
    body = map_batches(corpus_embed_batch, model_path=cfg.embedding_model, batch_size=cfg.embed_batch_size,
                       num_threads=cfg.executor_cores)
    schema = T.StructType([T.StructField("doc_id", T.StringType()), T.StructField("sentence_index", T.LongType()),
                           T.StructField("text", T.StringType()),
                           T.StructField("embedding", T.ArrayType(T.FloatType()))])
    embedded = unique.mapInPandas(body, schema=schema)
    sentences = folder.join(SENTENCES)
    # Sorted within each file only: a global orderBy samples its input first, which would run the embedding twice;
    # load_corpus_index puts the table in document order on the driver anyway.
    embedded.sortWithinPartitions("doc_id", "sentence_index").write.mode("overwrite").parquet(spark_uri(sentences))
    split.unpersist()
    written = sum(pq.ParquetFile(sentences.filesystem.open_input_file(sentences.join(n).path)).metadata.num_rows
                  for n in sentences.listdir() if n.endswith(".parquet"))
    meta = {"key": key, "format": CORPUS_FORMAT, "files": [{"uri": f.loc.uri, "sha256": f.sha256,
                                                             "records": f.records} for f in files],
            "documents": int(counts["docs"] or 0), "documents_without_sentences": int(counts["empty"] or 0),
            "sentences_split": int(counts["sentences"] or 0), "sentences": written,
            "duplicates_collapsed": int(counts["sentences"] or 0) - written,
            "embed_seconds": round(time.perf_counter() - t0, 2), "created_unix_s": round(time.time(), 3)}
    folder.join(TABLE_META).write_atomic(json.dumps(meta, indent=2, sort_keys=True))  # last: vouches for the table
    return meta


def ensure_table(spark: SparkSession, files: Sequence[CorpusFile], cfg: EnrichConfig, run_root: StorageLocation
                 ) -> tuple[StorageLocation, dict[str, Any], bool]:
    """(table folder, its metadata, reused?): the cached table for this corpus and model, built when absent."""
    t0 = time.perf_counter()
    model_sha = model_hash(cfg.embedding_model or default_model_path())
    key = corpus_key(files, cfg.corpus_id_field, cfg.corpus_text_field, model_sha)
    folder = RunPaths(run_root).corpus.join(key)
    meta_loc = folder.join(TABLE_META)
    if meta_loc.is_file():
        meta = json.loads(meta_loc.read_text())
        if meta.get("key") == key and meta.get("format") == CORPUS_FORMAT:
            log.info("corpus: reusing %s (%d sentences of %d documents; hashed in %.1fs)", folder.uri,
                     meta["sentences"], meta["documents"], time.perf_counter() - t0)
            return folder, meta, True
    meta = build_table(spark, files, cfg, folder, key)
    log.info("corpus: embedded %d sentences of %d documents (%d duplicates collapsed) into %s in %.1fs",
             meta["sentences"], meta["documents"], meta["duplicates_collapsed"], folder.uri, meta["embed_seconds"])
    return folder, meta, False


def load_corpus_index(folder: StorageLocation, key: str, eval_index: set[int], ngram: int, exact_max: int
                      ) -> CorpusIndex:
    """The table -> CorpusIndex on the driver, in document order, without the sentences that share an
    ``ngram``-gram with the eval sets; a faiss index when more than ``exact_max`` sentences remain."""
    t0 = time.perf_counter()
    sentences = folder.join(SENTENCES)
    names = sorted(n for n in sentences.listdir() if n.endswith(".parquet"))
    table = pq.read_table([sentences.join(n).path for n in names], filesystem=sentences.filesystem)
    table = table.sort_by([("doc_id", "ascending"), ("sentence_index", "ascending")])
    texts = table.column("text").to_pylist()
    contaminated = np.asarray(contamination_counts(texts, build_sorted_index(eval_index), ngram), dtype=np.int64) > 0
    keep = np.flatnonzero(~contaminated)
    emb_col = table.column("embedding").combine_chunks()
    dim = len(emb_col[0]) if len(emb_col) else 0
    emb = np.asarray(emb_col.flatten(), dtype=np.float32).reshape(len(texts), dim)[keep]  # (M, d)
    doc_ids = table.column("doc_id").to_pylist()
    removed = [{"doc_id": doc_ids[i], "sentence_index": int(table.column("sentence_index")[i].as_py()),
                "text": texts[i]} for i in np.flatnonzero(contaminated)]
    index = CorpusIndex(doc_ids=[doc_ids[i] for i in keep],
                        sentence_indices=np.asarray(table.column("sentence_index").to_numpy())[keep].astype(np.int64),
                        texts=[texts[i] for i in keep], emb=np.ascontiguousarray(emb), key=key)
    t_ann = 0.0
    if len(keep) > exact_max:
        t1 = time.perf_counter()
        index.ann = np.asarray(build_ann(index.emb))
        t_ann = time.perf_counter() - t1
    index.stats = {"contaminated_removed": int(contaminated.sum()), "contaminated": removed[:50],
                   "searchable": int(len(keep)), "method": index.method, "exact_max_sentences": exact_max,
                   "ann_build_seconds": round(t_ann, 2), "load_seconds": round(time.perf_counter() - t0, 2)}
    log.info("corpus: %d searchable sentences (%d removed: an n-gram shared with the eval sets), %s search",
             len(keep), int(contaminated.sum()), index.method)
    return index


def ann_recall(rows: DataFrame, index: CorpusIndex, cfg: EnrichConfig) -> dict[str, Any]:
    """recall@top_k of the approximate index against exact search, on up to enrich.corpus_recall_sample rows
    without context of their own (their real queries: question and answer embedded on the driver)."""
    from raytrain.enrich.context import answer_for_scoring
    from raytrain.enrich.corpus import ann_top_k, exact_top_k, query_vectors, recall_at_k
    from raytrain.enrich.relevance import embed_texts, load_embedder

    sample = rows.filter(F.size("context_sentences") == 0).select("question", "answer") \
        .limit(cfg.corpus_recall_sample).collect()
    if not sample or index.ann is None:
        return {"rows": 0, "k": cfg.top_k, "recall": None}
    texts = [r["question"] for r in sample] + [answer_for_scoring(r["answer"], cfg.answer_text) for r in sample]
    emb, _ = embed_texts(texts, load_embedder(cfg.embedding_model or None), cfg.embed_batch_size)  # (2N, d)
    queries = query_vectors(emb[: len(sample)], emb[len(sample):], cfg.question_weight)
    _, exact = exact_top_k(queries, index.emb, cfg.top_k)
    _, approx = ann_top_k(queries, index.ann, index.key, cfg.top_k)
    return {"rows": len(sample), "k": cfg.top_k, "recall": round(recall_at_k(exact, approx), 6)}
