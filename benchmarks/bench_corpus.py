"""Context from a corpus at 100,000 sentences: embedding sentences/s in Spark (the cached sentence table's build)
vs bare ``encode`` in one process, and retrieval rows/s with exact search vs the faiss HNSW index, with recall@k.
Prints figures; never asserts.

    python benchmarks/bench_corpus.py [--sentences 100000] [--bare-sentences 0] [--search-sentences 100000]
                                      [--queries 2000] [--out DIR]

The corpus is generated (documents of 10 sentences from a fixed vocabulary, rng seeded), the queries are
question/answer pairs written about random corpus sentences, as rows of a domain dataset would be. Embedding in
Spark goes through raytrain.enrich.corpus_table.ensure_table (1 executor x 1 core on this machine, Ray CPUs as in
the demo); bare ``encode`` runs in this process on the same number of threads, on the same sentences (or the first
--bare-sentences), once before and once after Spark, so the machine's drift shows. Run it when the machine is quiet
and read the load average it prints.

Figures of earlier runs: benchmarks/RESULTS.md, "Corpus embedding in Spark against bare encode".
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

_TOPICS = ("contract", "lease", "tenant", "court", "appeal", "invoice", "patent", "claim", "clause", "merger",
           "license", "warranty", "dividend", "audit", "tariff", "subsidy", "pension", "mortgage", "bond", "trust")
_VERBS = ("requires", "forbids", "permits", "delays", "voids", "extends", "limits", "restores", "transfers", "caps")
_OBJECTS = ("notice in writing", "a signed waiver", "payment within thirty days", "an independent review",
            "the consent of both parties", "a court order", "annual disclosure", "a security deposit",
            "registration with the regulator", "a cooling-off period", "two witnesses", "a sworn statement")
_PLACES = ("Ostvik", "Marrow Bay", "Quillan", "Tessaly", "Brannock", "Velden", "Hollis Ford", "Carrow", "Dunmere",
           "Ilsbeck", "Pellworth", "Sarnia Cove", "Norrland", "Aberlin", "Castwick", "Fenmoor")


def _sentence(r: random.Random) -> tuple[str, tuple[str, str, str, str]]:
    parts = (r.choice(_TOPICS), r.choice(_VERBS), r.choice(_OBJECTS), r.choice(_PLACES))
    year, n = r.randint(1950, 2025), r.randint(2, 400)
    return (f"Under the {year} rules of {parts[3]}, a {parts[0]} {parts[1]} {parts[2]} "
            f"for matters above {n} thousand crowns."), parts


WARM_UP_SENTENCES = 256


def write_corpus(path: str, sentences: int, seed: int = 0) -> list[tuple[str, tuple]]:
    r = random.Random(seed)
    out = [_sentence(r) for _ in range(sentences)]
    with open(path, "w", encoding="utf-8") as f:
        for d in range(0, sentences, 10):
            f.write(json.dumps({"id": f"doc-{d // 10:06d}", "text": " ".join(s for s, _ in out[d : d + 10])}) + "\n")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sentences", type=int, default=100_000)
    parser.add_argument("--bare-sentences", type=int, default=0,
                        help="sentences for the bare encode baseline (0: as many as --sentences)")
    parser.add_argument("--search-sentences", type=int, default=100_000,
                        help="corpus size for the search figures; above --sentences the embedded table is extended "
                             "with noisy copies of its vectors (renormalized), since embedding 100,000 sentences "
                             "takes ~20 min per contender on a 2-core machine")
    parser.add_argument("--queries", type=int, default=2_000)
    parser.add_argument("--top-k", type=int, default=3)
    parser.add_argument("--out", default="/tmp/bench_corpus")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    import numpy as np
    import ray
    import torch

    from raytrain.config import load_job_config
    from raytrain.enrich.corpus import (
        CorpusIndex,
        ann_top_k,
        build_ann,
        check_corpus,
        exact_top_k,
        query_vectors,
        recall_at_k,
        retrieve,
    )
    from raytrain.enrich.corpus_table import ensure_table, load_corpus_index
    from raytrain.enrich.relevance import embed_texts, load_embedder
    from raytrain.enrich.spark import spark_session
    from raytrain.runner import WORKER_ENV
    from raytrain.storage import resolve

    os.makedirs(args.out, exist_ok=True)
    corpus_path = os.path.join(args.out, "corpus.jsonl")
    sentences = write_corpus(corpus_path, args.sentences)
    job = load_job_config(os.path.join(os.path.dirname(__file__), "..", "configs", "demo.yaml"),
                          [f"storage.root={args.out}/runs", "enrich.num_partitions=4",
                           f"enrich.context_corpus=[{corpus_path}]"])
    cfg = job.enrich
    files = check_corpus(cfg.context_corpus, cfg.corpus_id_field, cfg.corpus_text_field)
    warm_path = os.path.join(args.out, "warm-up.jsonl")  # another corpus, so another table key
    write_corpus(warm_path, WARM_UP_SENTENCES, seed=1)
    warm_files = check_corpus([warm_path], cfg.corpus_id_field, cfg.corpus_text_field)
    run_root = resolve(os.path.join(args.out, "runs", f"bench-{time.time_ns()}"))  # fresh: embed, not reuse
    figures: dict = {"sentences": args.sentences, "cpu_count": os.cpu_count(), "load_avg_start": os.getloadavg()}

    torch.set_num_threads(cfg.num_executors * cfg.executor_cores)  # the cores Spark's executors have
    model = load_embedder(cfg.embedding_model or None)
    bare = [s for s, _ in sentences[: args.bare_sentences or args.sentences]]
    embed_texts(bare[:256], model)  # warm

    def bare_encode_s() -> float:
        t0 = time.perf_counter()
        embed_texts(bare, model, cfg.embed_batch_size)
        return time.perf_counter() - t0

    figures["bare_encode_before_s"] = bare_encode_s()  # before and after Spark: the machine's drift shows
    ray.init(num_cpus=4, include_dashboard=False, runtime_env={"env_vars": dict(WORKER_ENV)})
    try:
        with spark_session(cfg, app_name="bench-corpus") as spark:
            # first use of the session: Python workers start, each loads the model, the JVM warms up
            t0 = time.perf_counter()
            ensure_table(spark, warm_files, cfg, resolve(f"{run_root.path}-warm-up"))
            figures["spark_first_use_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            folder, meta, reused = ensure_table(spark, files, cfg, run_root)
            figures["spark_embed_s"] = time.perf_counter() - t0
            figures["table_sentences"], figures["reused"] = meta["sentences"], reused
    finally:
        ray.shutdown()
    figures["load_avg_after_spark"] = os.getloadavg()
    print(f"Spark embedding: {meta['sentences']} sentences in {figures['spark_embed_s']:.1f} s "
          f"= {meta['sentences'] / figures['spark_embed_s']:.0f} sentences/s (split, collapse, embed, write; "
          f"{cfg.num_executors} executor x {cfg.executor_cores} core), after the session's first table "
          f"({WARM_UP_SENTENCES} sentences: Python workers, model load) in {figures['spark_first_use_s']:.1f} s",
          flush=True)

    figures["bare_encode_after_s"] = bare_encode_s()
    figures["bare_encode_s"] = (figures["bare_encode_before_s"] + figures["bare_encode_after_s"]) / 2
    bare_rate = len(bare) / figures["bare_encode_s"]
    spark_rate = meta["sentences"] / figures["spark_embed_s"]
    print(f"bare encode: {len(bare)} sentences in {figures['bare_encode_s']:.1f} s = {bare_rate:.0f} sentences/s "
          f"(mean of {figures['bare_encode_before_s']:.1f} s before Spark and {figures['bare_encode_after_s']:.1f} s "
          f"after); Spark / bare = {spark_rate / bare_rate:.2f} (with the first table's time added to Spark's: "
          f"{meta['sentences'] / (figures['spark_embed_s'] + figures['spark_first_use_s']) / bare_rate:.2f})",
          flush=True)

    index = load_corpus_index(folder, meta["key"], set(), cfg.decontam_ngram, exact_max=10**12)  # exact
    r = random.Random(1)
    picks = [sentences[r.randrange(len(sentences))] for _ in range(args.queries)]
    questions = [f"What does a {p[0]} in {p[3]} need: is {p[2]} required?" for _, p in picks]
    answers = [f"In {p[3]} a {p[0]} {p[1]} {p[2]}." for _, p in picks]
    emb, _ = embed_texts(questions + answers, model, cfg.embed_batch_size)
    q, a = emb[: args.queries], emb[args.queries :]
    queries = query_vectors(q, a, cfg.question_weight)

    if args.search_sentences > index.emb.shape[0]:
        rng = np.random.default_rng(0)
        base = index.emb
        extra = base[rng.integers(0, len(base), args.search_sentences - len(base))]
        extra = extra + rng.normal(scale=0.02, size=extra.shape).astype(np.float32)  # cos ~0.9 with the original
        emb = np.concatenate([base, extra / np.linalg.norm(extra, axis=1, keepdims=True)]).astype(np.float32)
        index = CorpusIndex([f"d{i}" for i in range(len(emb))], np.zeros(len(emb), np.int64),
                            [""] * len(emb), emb, "bench")
        figures["search_vectors_synthetic"] = len(emb) - len(base)
    figures["search_sentences"] = index.emb.shape[0]
    t0 = time.perf_counter()
    _, exact = exact_top_k(queries, index.emb, args.top_k)
    figures["exact_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    ann = np.asarray(build_ann(index.emb))
    figures["ann_build_s"] = time.perf_counter() - t0
    ann_top_k(queries[:10], ann, "bench", args.top_k)  # deserialize once, untimed (once per executor in a run)
    t0 = time.perf_counter()
    _, approx = ann_top_k(queries, ann, "bench", args.top_k)
    figures["ann_s"] = time.perf_counter() - t0
    figures["recall_at_k"] = recall_at_k(exact, approx)
    # the whole retrieval a row gets (search + exact rescoring + min_score), both ways
    approx_index = CorpusIndex(index.doc_ids, index.sentence_indices, index.texts, index.emb, "bench", ann=ann)
    for name, idx in (("exact", index), ("approximate", approx_index)):
        t0 = time.perf_counter()
        retrieve(idx, q, a, args.top_k, cfg.min_score, cfg.question_weight)
        figures[f"retrieve_{name}_s"] = time.perf_counter() - t0
    figures["load_avg_end"] = os.getloadavg()
    n = args.queries
    print(f"search over {index.emb.shape[0]} sentences, {n} rows, top-{args.top_k}: exact "
          f"{n / figures['exact_s']:.0f} rows/s, HNSW {n / figures['ann_s']:.0f} rows/s "
          f"(index built in {figures['ann_build_s']:.1f} s), recall@{args.top_k} {figures['recall_at_k']:.4f}; "
          f"with rescoring: exact {n / figures['retrieve_exact_s']:.0f} rows/s, approximate "
          f"{n / figures['retrieve_approximate_s']:.0f} rows/s", flush=True)
    print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in figures.items()}, indent=1))


if __name__ == "__main__":
    main()
