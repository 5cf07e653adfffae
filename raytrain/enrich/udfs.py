"""The per-batch bodies Spark runs in its Python workers (mapInPandas / applyInPandas), as plain pandas functions.

No pyspark import: each function takes a ``pandas.DataFrame`` batch and returns one, so it is unit-tested without
a JVM. The Spark wiring (schemas, joins, counts) lives in ``steps.py``; the row logic comes from the pure modules
next to this one (conversation, dedup, decontam, relevance, sentences) and from raytrain.dataset.tokenize.

Column contract of the working table (``WORK_COLUMNS``), one row per derived example:
``row_id`` (int64, unique per input row), ``split``, ``uuid``, ``category``, ``license``, ``reasoning``,
``context``, ``question``, ``answer``, ``text`` (every turn as text: what dedup and decontamination compare) and
``messages_json`` (the normalized conversation as JSON).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from raytrain.enrich.context import (
    answer_for_scoring,
    candidate_sentences,
    with_context_block,
    with_selected_system_prompt,
)
from raytrain.enrich.conversation import Example, derive_example
from raytrain.enrich.decontam import ngram_hashes
from raytrain.enrich.dedup import exact_key, lsh_band_keys, minhash_signature

OK = "ok"
WORK_COLUMNS = ("row_id", "split", "uuid", "category", "license", "reasoning", "context", "question", "answer",
                "text", "messages_json")
# derive_batch's output: the working columns plus the verdict (status "ok" or a quarantine reason).
DERIVED_COLUMNS = (*WORK_COLUMNS[:6], "status", "detail", *WORK_COLUMNS[6:])
SELECTION_COLUMNS = ("context_sentences", "kept_indices", "kept_sentences", "sentence_scores", "question_scores",
                     "answer_scores", "chunked_texts", "system_prompt_chars_removed")
# Quarantine reasons added by the Spark steps (conversation.QUARANTINE_REASONS are the derive ones).
LICENSE = "license"
EXACT_DUPLICATE = "exact_duplicate"
NEAR_DUPLICATE = "near_duplicate"
CONTAMINATED = "contaminated"
UNTOKENIZABLE = "untokenizable"


# ---- derive ------------------------------------------------------------------------------------------------------
def derive_batch(pdf: pd.DataFrame, max_chars: int) -> pd.DataFrame:
    """Raw Nemotron rows (+ ``row_id``, ``split``) -> one DERIVED_COLUMNS row each; status "ok" or the reason.

    Quarantined rows keep row_id/split/uuid/category and the reason's detail; their text columns are "".
    """
    out: list[dict[str, Any]] = []
    for row in pdf.to_dict("records"):
        # pandas writes a missing string as NaN; the quarantine detail should say None, as pyarrow rows do
        row = {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in row.items()}
        result = derive_example(row, max_chars=max_chars)
        base = {"row_id": int(row["row_id"]), "split": row["split"]}
        if isinstance(result, Example):
            out.append({**base, "uuid": result.uuid, "category": result.category, "license": result.license,
                        "reasoning": result.reasoning, "status": OK, "detail": "", "context": result.context,
                        "question": result.question, "answer": result.answer, "text": result.full_text(),
                        "messages_json": json.dumps(list(result.messages), ensure_ascii=False)})
        else:
            category = row.get("category")
            out.append({**base, "uuid": result.uuid, "category": category if isinstance(category, str) else "",
                        "license": "", "reasoning": "", "status": result.reason, "detail": result.detail,
                        **{c: "" for c in DERIVED_COLUMNS[8:]}})
    return pd.DataFrame(out, columns=list(DERIVED_COLUMNS))


# ---- exact and near duplicates -----------------------------------------------------------------------------------
def exact_keys(texts: pd.Series) -> pd.Series:
    """dedup.exact_key of each text (sha1 of the normalized text), for a Spark pandas UDF."""
    return texts.map(exact_key)


def minhash_batch(pdf: pd.DataFrame, num_perm: int, bands: int, rows: int, ngram: int = 5) -> pd.DataFrame:
    """(row_id, uuid, text) -> (row_id, uuid, signature: bytes of (num_perm,) uint32, band_keys: list of int64)."""
    sigs = np.stack([minhash_signature(t, num_perm=num_perm, ngram=ngram) for t in pdf["text"]]) if len(pdf) \
        else np.zeros((0, num_perm), dtype=np.uint32)  # (N, P)
    keys = lsh_band_keys(sigs, bands, rows) if len(pdf) else np.zeros((0, bands), dtype=np.int64)  # (N, B)
    return pd.DataFrame({"row_id": pdf["row_id"].astype("int64").to_numpy(), "uuid": pdf["uuid"].to_numpy(),
                         "signature": [s.tobytes() for s in sigs], "band_keys": [k.tolist() for k in keys]})


PAIR_COLUMNS = ("a_row_id", "a_uuid", "b_row_id", "b_uuid", "jaccard")


def verify_bucket(pdf: pd.DataFrame, threshold: float) -> pd.DataFrame:
    """One LSH bucket (row_id, uuid, signature) -> its verified pairs (PAIR_COLUMNS), a ordered before b by
    (uuid, row_id), with estimated Jaccard >= threshold. Blocks of rows keep a huge bucket within ~4M booleans."""
    pdf = pdf.sort_values(["uuid", "row_id"], kind="stable").reset_index(drop=True)
    sigs = np.stack([np.frombuffer(s, dtype=np.uint32) for s in pdf["signature"]]) if len(pdf) \
        else np.zeros((0, 1), dtype=np.uint32)  # (M, P)
    out: list[tuple] = []
    block = max(1, (1 << 22) // max(1, len(pdf) * sigs.shape[1]))
    for start in range(0, len(pdf), block):
        sim = (sigs[start : start + block, None, :] == sigs[None, :, :]).mean(axis=2)  # (b, M)
        for a, b in zip(*np.nonzero(sim >= threshold), strict=True):
            i, j = start + int(a), int(b)
            if i < j:
                out.append((int(pdf.at[i, "row_id"]), pdf.at[i, "uuid"], int(pdf.at[j, "row_id"]), pdf.at[j, "uuid"],
                            float(sim[a, b])))
    return pd.DataFrame(out, columns=list(PAIR_COLUMNS))


@dataclass(frozen=True)
class DuplicateOf:
    """Why a row is dropped as a near-duplicate."""

    kept: tuple[str, int]
    """(uuid, row_id) of the row its cluster keeps: the smallest member."""
    neighbor: tuple[str, int]
    """The verified partner with the highest estimated Jaccard (the link that put it in the cluster)."""
    jaccard: float
    """Estimated Jaccard with ``neighbor``."""


def near_duplicate_drops(pairs: Iterable[tuple[tuple[str, int], tuple[str, int], float]]) -> dict[tuple, DuplicateOf]:
    """Verified near-duplicate pairs -> {member: DuplicateOf} for every cluster member except the smallest.

    Clusters are connected components of the pairs (transitive: a~b and b~c put a, b, c together even when a and
    c differ more), the same rule as dedup.near_duplicate_groups. Ids are (uuid, row_id) tuples.
    """
    parent: dict[tuple, tuple] = {}
    best: dict[tuple, tuple[tuple, float]] = {}

    def find(x: tuple) -> tuple:
        root = x
        while parent.setdefault(root, root) != root:
            root = parent[root]
        while parent[x] != root:  # path compression
            parent[x], x = root, parent[x]
        return root

    for a, b, jaccard in pairs:
        for x, y in ((a, b), (b, a)):
            if x not in best or jaccard > best[x][1] or (jaccard == best[x][1] and y < best[x][0]):
                best[x] = (y, jaccard)
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)  # the smallest id is always its cluster's root
    return {x: DuplicateOf(kept=find(x), neighbor=best[x][0], jaccard=best[x][1]) for x in parent if find(x) != x}


# ---- decontamination ---------------------------------------------------------------------------------------------
def build_sorted_index(hashes: Iterable[int]) -> np.ndarray:
    """An eval n-gram hash set as a sorted (K,) uint64 array: ~8 bytes per n-gram to broadcast, vectorized lookups."""
    return np.unique(np.fromiter(hashes, dtype=np.uint64))


def contamination_counts(texts: Iterable[str], sorted_index: np.ndarray, n: int) -> list[int]:
    """Per text, how many of its distinct n-grams are in the eval index (decontam.contaminated's count)."""
    if sorted_index.size == 0:
        return [0 for _ in texts]
    return [int(np.isin(ngram_hashes(t, n), sorted_index, assume_unique=True).sum()) for t in texts]


# ---- relevance selection -----------------------------------------------------------------------------------------
def _configure_threads(num_threads: int) -> None:
    # A Spark Python worker should use its executor's cores, not every core of the machine (oversubscription).
    import torch

    if torch.get_num_threads() != num_threads:
        torch.set_num_threads(num_threads)


def select_batch(pdf: pd.DataFrame, *, model_path: str, batch_size: int, top_k: int, min_score: float,
                 question_weight: float, system_prompt: str = "keep", answer_text: str = "final",
                 num_threads: int = 0) -> pd.DataFrame:
    """Working rows -> the same rows with SELECTION_COLUMNS added and ``messages_json`` rebuilt (raytrain.enrich
    .context has the rules).

    ``system_prompt`` "keep": candidates are the prose sentences of the context (system prompts less toggle lines,
    earlier turns); the kept ones go into a ``<context>`` block before the last user turn, every system prompt
    stays verbatim. "select": candidates are the system prompt's sentences, and only a row with more of them than
    ``top_k`` and no tool calls is changed: its system prompt becomes its toggle lines plus the kept sentences
    (``system_prompt_chars_removed`` counts what went). The answer side embeds ``answer_for_scoring(answer,
    answer_text)``. One ``encode`` call per batch (model loaded once per process); rows without candidates are
    not embedded and keep their messages.
    """
    from raytrain.enrich.relevance import load_embedder, score_batch

    if num_threads:
        _configure_threads(num_threads)
    records = pdf.to_dict("records")
    conversations = [json.loads(r["messages_json"]) for r in records]
    contexts = []
    for messages in conversations:
        if system_prompt == "keep":
            contexts.append(candidate_sentences(messages).all)
        else:
            sents = candidate_sentences(messages, include_earlier_turns=False).system
            has_calls = any(m.get("tool_calls") for m in messages)
            contexts.append(sents if len(sents) > top_k and not has_calls else [])
    answers = [answer_for_scoring(r["answer"], answer_text) for r in records]
    selections = score_batch(contexts, [r["question"] for r in records], answers,
                             load_embedder(model_path or None), batch_size=batch_size, top_k=top_k,
                             threshold=min_score, question_weight=question_weight) if records else []
    out = pdf.copy()
    rebuilt, kept_sentences, removed = [], [], []
    for messages, sents, sel in zip(conversations, contexts, selections, strict=True):
        kept = sel.kept(sents)
        kept_sentences.append(kept)
        chars = 0
        if system_prompt == "keep":
            messages = with_context_block(messages, kept)
        elif sents:
            messages, chars = with_selected_system_prompt(messages, kept)
        removed.append(chars)
        rebuilt.append(json.dumps(messages, ensure_ascii=False))
    out["context_sentences"] = contexts
    out["kept_indices"] = [list(s.kept_indices) for s in selections]
    out["kept_sentences"] = kept_sentences
    out["sentence_scores"] = [s.scores.tolist() for s in selections]
    out["question_scores"] = [s.q_scores.tolist() for s in selections]
    out["answer_scores"] = [s.a_scores.tolist() for s in selections]
    out["chunked_texts"] = np.asarray([s.chunked_texts for s in selections], dtype=np.int64)
    out["system_prompt_chars_removed"] = np.asarray(removed, dtype=np.int64)
    out["messages_json"] = rebuilt
    return out


# ---- tokenization check ------------------------------------------------------------------------------------------
def tokenize_check_batch(pdf: pd.DataFrame, tokenizer_version: str, seq_len: int, length_policy: str = "drop",
                         text_with_tool_calls: str = "drop_text") -> pd.DataFrame:
    """Rows -> the same rows plus, tokenizing ``messages_json`` exactly as the pack stage will:

    ``num_tokens`` (int64, the whole conversation; -1 when refused), ``train_tokens`` (int64, what packing will
    use after the length policy), ``length_action`` ("keep", "truncate", "split" or "drop": raytrain.dataset
    .length; "" when refused), ``dropped_text_turns`` / ``dropped_text_chars`` (int64: assistant turns whose
    text was dropped for their tool calls, and that text's characters), ``status`` ("ok", "untokenizable" or "too_many_tokens") and
    ``detail``. Assistant turns with text and tool calls are first fitted to the tokenizer
    (tokenize.fit_tool_call_turns): ``messages_json`` is rewritten when text was dropped, so the written row is
    what gets trained."""
    from raytrain.dataset.length import TOO_MANY_TOKENS, decide_length
    from raytrain.dataset.tokenize import fit_tool_call_turns, load_tokenizer, tokenize_conversation
    from raytrain.errors import RaytrainError

    tokenizer = load_tokenizer(tokenizer_version)
    cols: dict[str, list] = {k: [] for k in ("num_tokens", "train_tokens", "length_action", "status", "detail",
                                             "dropped_text_turns", "dropped_text_chars", "messages_json")}

    def emit(**values) -> None:
        for k, v in values.items():
            cols[k].append(v)

    for messages_json in pdf["messages_json"]:
        try:
            fitted = fit_tool_call_turns(json.loads(messages_json), tokenizer_version, text_with_tool_calls)
            tokenized = tokenize_conversation(fitted.messages, tokenizer, verify=False)
        except (RaytrainError, ValueError) as e:  # ValueError: pydantic's ValidationError, bad JSON
            emit(num_tokens=-1, train_tokens=0, length_action="", status=UNTOKENIZABLE, detail=str(e)[:500],
                 dropped_text_turns=0, dropped_text_chars=0, messages_json=messages_json)
            continue
        decision = decide_length(tokenized.loss_mask, seq_len, length_policy)
        dropped = decision.action == "drop"
        emit(num_tokens=decision.num_tokens, train_tokens=decision.train_tokens, length_action=decision.action,
             status=TOO_MANY_TOKENS if dropped else OK, detail=decision.detail,
             dropped_text_turns=fitted.dropped_text_turns, dropped_text_chars=fitted.dropped_text_chars,
             messages_json=json.dumps(fitted.messages, ensure_ascii=False) if fitted.dropped_text_turns
             else messages_json)
    out = pdf.copy()
    for k, values in cols.items():
        out[k] = np.asarray(values, dtype=np.int64) if k in INT_TOKEN_COLUMNS else values
    return out


INT_TOKEN_COLUMNS = ("num_tokens", "train_tokens", "dropped_text_turns", "dropped_text_chars")


def map_batches(fn, **kwargs):
    """A mapInPandas body applying ``fn(batch, **kwargs)`` to each Arrow batch of a partition."""
    def body(batches: Iterator[pd.DataFrame]) -> Iterator[pd.DataFrame]:
        for pdf in batches:
            yield fn(pdf, **kwargs)
    return body
