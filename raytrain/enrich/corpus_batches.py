"""The corpus's per-batch bodies for Spark's Python workers, as plain pandas functions (no pyspark import).

``corpus_split_batch`` and ``corpus_embed_batch`` build the sentence table (raytrain.enrich.corpus_table);
``corpus_context_batch`` gives rows without context of their own the corpus sentences that score highest
(raytrain.enrich.corpus.retrieve) in a ``<context>`` block (context.with_context_block), with audit columns.
Embedding goes through relevance.embed_texts / load_embedder, the selection's own path.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd

from raytrain.enrich.context import answer_for_scoring, context_block, with_context_block
from raytrain.enrich.corpus import CorpusIndex, document_sentences, retrieve
from raytrain.enrich.decontam import contamination_counts
from raytrain.enrich.relevance import configure_threads

CORPUS_COLUMNS = ("corpus_path", "corpus_doc_ids", "corpus_sentence_indices", "corpus_sentences", "corpus_scores",
                  "corpus_question_scores", "corpus_answer_scores", "corpus_dropped_for_eval")
# Every row's path through the corpus step (the report counts each):
OWN_CONTEXT = "own_context"  # the row had context sentences of its own: not searched
ADDED = "added"  # corpus sentences added in a context block
BELOW_MIN_SCORE = "below_min_score"  # searched, nothing at or above enrich.min_score
CORPUS_PATHS = (OWN_CONTEXT, ADDED, BELOW_MIN_SCORE)


def corpus_split_batch(pdf: pd.DataFrame) -> pd.DataFrame:
    """(doc_id, text) documents -> (doc_id, sentence_index, text, empty) sentences; a document without a prose
    sentence gives one row with text None and empty=1 (counted, then left out of the table)."""
    out: list[tuple] = []
    for doc_id, text in zip(pdf["doc_id"], pdf["text"], strict=True):
        sents = document_sentences(text if isinstance(text, str) else None)
        out.extend((doc_id, i, s, 0) for i, s in sents)
        if not sents:
            out.append((doc_id, -1, None, 1))
    return pd.DataFrame(out, columns=["doc_id", "sentence_index", "text", "empty"]).astype(
        {"sentence_index": "int64", "empty": "int64"})


def corpus_embed_batch(pdf: pd.DataFrame, *, model_path: str, batch_size: int, num_threads: int = 0) -> pd.DataFrame:
    """(doc_id, sentence_index, text) -> the same plus ``embedding`` (unit float32 list), one encode per batch."""
    from raytrain.enrich.relevance import embed_texts, load_embedder

    if num_threads:
        configure_threads(num_threads)
    out = pdf[["doc_id", "sentence_index", "text"]].copy()
    if not len(pdf):
        out["embedding"] = []
        return out
    emb, _ = embed_texts(list(pdf["text"]), load_embedder(model_path or None), batch_size)  # (N, d)
    out["embedding"] = list(emb)
    return out


def _clean_block(kept: list[int], scores: list[float], index: CorpusIndex, question: str, eval_index: np.ndarray,
                 ngram: int) -> list[int]:
    """Drop the lowest-scoring kept sentences until the block plus the question shares no n-gram with the eval
    sets: each sentence is clean on its own, but adjacent sentences (or a sentence and the question) could still
    form a benchmark n-gram across the boundary."""
    kept = list(kept)
    while kept and contamination_counts([context_block([index.texts[i] for i in kept]) + "\n\n" + question],
                                        eval_index, ngram)[0]:
        worst = min(range(len(kept)), key=lambda j: (scores[j], -j))
        kept.pop(worst)
        scores = scores[:worst] + scores[worst + 1:]
    return kept


def corpus_context_batch(pdf: pd.DataFrame, *, index: CorpusIndex, eval_index: np.ndarray, ngram: int,
                         model_path: str, batch_size: int, top_k: int, min_score: float, question_weight: float,
                         answer_text: str = "final", num_threads: int = 0) -> pd.DataFrame:
    """Selected rows (select_batch's output) -> the same plus CORPUS_COLUMNS; rows without context sentences of
    their own are searched and, when a sentence scores >= min_score, get the kept sentences (document order) in
    a context block before the last user turn (``messages_json`` rebuilt). One encode call per batch."""
    from raytrain.enrich.relevance import embed_texts, load_embedder

    if num_threads:
        configure_threads(num_threads)
    out = pdf.copy()
    n = len(pdf)
    cols: dict[str, list] = {c: [] for c in CORPUS_COLUMNS}
    searched = [i for i, sents in enumerate(pdf["context_sentences"]) if len(sents) == 0]
    results = {}
    if searched:
        questions = [pdf["question"].iloc[i] for i in searched]
        answers = [answer_for_scoring(pdf["answer"].iloc[i], answer_text) for i in searched]
        emb, _ = embed_texts(questions + answers, load_embedder(model_path or None), batch_size)  # (2S, d)
        found = retrieve(index, emb[: len(searched)], emb[len(searched):], top_k, min_score, question_weight)
        results = dict(zip(searched, found, strict=True))
    messages_out = list(pdf["messages_json"])
    for i in range(n):
        r = results.get(i)
        kept = list(r.indices) if r else []
        if kept:
            clean = _clean_block(kept, list(r.scores), index, pdf["question"].iloc[i], eval_index, ngram)
            pos = [kept.index(j) for j in clean]
            dropped = len(kept) - len(clean)
            kept = clean
        else:
            pos, dropped = [], 0
        path = OWN_CONTEXT if r is None else ADDED if kept else BELOW_MIN_SCORE
        cols["corpus_path"].append(path)
        cols["corpus_doc_ids"].append([index.doc_ids[j] for j in kept])
        cols["corpus_sentence_indices"].append([int(index.sentence_indices[j]) for j in kept])
        cols["corpus_sentences"].append([index.texts[j] for j in kept])
        cols["corpus_scores"].append([r.scores[p] for p in pos])
        cols["corpus_question_scores"].append([r.q_scores[p] for p in pos])
        cols["corpus_answer_scores"].append([r.a_scores[p] for p in pos])
        cols["corpus_dropped_for_eval"].append(dropped)
        if kept:
            messages = json.loads(messages_out[i])
            messages_out[i] = json.dumps(with_context_block(messages, [index.texts[j] for j in kept]),
                                         ensure_ascii=False)
    for c, values in cols.items():
        out[c] = np.asarray(values, dtype=np.int64) if c == "corpus_dropped_for_eval" else values
    out["messages_json"] = messages_out
    return out
