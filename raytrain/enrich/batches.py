"""The per-batch bodies Spark runs in its Python workers (mapInPandas / applyInPandas), as plain pandas functions.

No pyspark import: each function takes a ``pandas.DataFrame`` batch and returns one, so it is unit-tested without
a JVM. The Spark wiring (schemas, joins, aggregations) lives in ``passes.py``; the row logic comes from the pure
modules next to this one (conversation, dedup, decontam, relevance, sentences) and from raytrain.dataset.tokenize.

The enrichment has two row passes, and the tables they produce are described once, here, as pyarrow schemas
(passes.py hands them to Spark): ``PREPARED`` (``prepare_batch``: derive, license, exact-dedup key, MinHash
signature and LSH band keys, eval n-gram count, for every input row) and ``finished_schema()`` (``finish_batch``: the
relevance selection, the corpus context, the tokenization with its token ids and loss mask, for the rows still
kept; the others pass through with their quarantine reason). ``status`` is "ok" or the reason a row is
quarantined; ``detail`` says why in words.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import pyarrow as pa

from raytrain.dataset.reasons import Reason
from raytrain.enrich.context import (
    answer_for_scoring,
    candidate_sentences,
    with_context_block,
    with_selected_system_prompt,
)
from raytrain.enrich.conversation import Example, derive_example
from raytrain.enrich.decontam import contamination_counts
from raytrain.enrich.dedup import exact_key, lsh_band_keys, minhash_signature, verified_pairs

if TYPE_CHECKING:
    from raytrain.config import DatasetConfig, EnrichConfig

OK = "ok"
GUARD_REASON = "guard_reason"
GUARD_DETAIL = "guard_detail"
"""The columns raytrain.enrich.row_guard adds (named here too: this module imports no pyspark)."""
# Quarantine reasons decided here and in passes.py (raytrain.dataset.reasons lists them all).
LICENSE = Reason.LICENSE
EXACT_DUPLICATE = Reason.EXACT_DUPLICATE
NEAR_DUPLICATE = Reason.NEAR_DUPLICATE
CONTAMINATED = Reason.CONTAMINATED
UNTOKENIZABLE = Reason.UNTOKENIZABLE

ROW = pa.schema([("row_id", pa.int64()), ("split", pa.string()), ("uuid", pa.string()), ("category", pa.string()),
                 ("license", pa.string()), ("reasoning", pa.string()), ("status", pa.string()),
                 ("detail", pa.string()), ("context", pa.string()), ("question", pa.string()),
                 ("answer", pa.string()), ("messages_json", pa.string())])
"""The row columns every table of the enrichment starts with (pass 2 reads them, with the final verdict)."""
PREPARED = pa.schema([*ROW, ("group_index", pa.int64()), ("exact_key", pa.string()), ("signature", pa.binary()),
                      ("band_keys", pa.list_(pa.int64())), ("eval_ngrams", pa.int64())])
"""``prepare_batch``'s output: every input row, its verdict so far, what dedup and decontamination compare.
``group_index``: the position of the row's Parquet row group in the input order: the files in order, each file's
row groups in order (duplicates keep the first row in the order ``INPUT_ORDER``; a file of one row group, or a JSON
Lines file, is one group). ``eval_ngrams``: distinct word n-grams shared with the eval sets (decided after dedup, as the
chain orders it)."""
INPUT_ORDER = ("group_index", "uuid", "row_id")
"""The order in which a duplicate keeps its first row: the row groups in input order, then uuid within a row group
(row_id only breaks ties between copies of one uuid in one group). Processing the groups in that order, front to
back (waves are runs of whole groups), decides every row the same way as processing them all at once."""
SELECTION = pa.schema([("context_sentences", pa.list_(pa.string())), ("kept_indices", pa.list_(pa.int32())),
                       ("kept_sentences", pa.list_(pa.string())), ("sentence_scores", pa.list_(pa.float32())),
                       ("question_scores", pa.list_(pa.float32())), ("answer_scores", pa.list_(pa.float32())),
                       ("chunked_texts", pa.int64()), ("system_prompt_chars_removed", pa.int64())])
"""``select_batch``'s audit columns."""
CORPUS = pa.schema([("corpus_path", pa.string()), ("corpus_doc_ids", pa.list_(pa.string())),
                    ("corpus_sentence_indices", pa.list_(pa.int64())), ("corpus_sentences", pa.list_(pa.string())),
                    ("corpus_scores", pa.list_(pa.float32())), ("corpus_question_scores", pa.list_(pa.float32())),
                    ("corpus_answer_scores", pa.list_(pa.float32())), ("corpus_dropped_for_eval", pa.int64())])
"""``corpus_batches.corpus_context_batch``'s audit columns (with enrich.context_corpus)."""
TOKENS = pa.schema([("num_tokens", pa.int64()), ("train_tokens", pa.int64()), ("dropped_text_turns", pa.int64()),
                    ("dropped_text_chars", pa.int64()), ("length_action", pa.string()),
                    ("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.bool_()))])
"""``tokenize_batch``'s columns: the token ids and loss mask the pack stage packs without tokenizing again."""


def finished_schema(corpus: bool) -> pa.Schema:
    """``finish_batch``'s output: the row columns, the selection audit, the corpus audit (with a corpus), tokens."""
    return pa.schema([*ROW, *SELECTION, *(CORPUS if corpus else []), *TOKENS])


def _defaults(schema: pa.Schema, n: int) -> dict[str, list]:
    """Empty values of each column of ``schema`` for ``n`` rows: "" strings, 0 numbers, [] lists."""
    def empty(t: pa.DataType) -> Any:
        return "" if pa.types.is_string(t) else [] if pa.types.is_list(t) else b"" if pa.types.is_binary(t) else 0
    return {f.name: [empty(f.type) for _ in range(n)] for f in schema}


# ---- pass 1: derive, license, dedup keys, eval n-grams ----------------------------------------------------------
def prepare_batch(pdf: pd.DataFrame, *, max_chars: int, licenses: Iterable[str], num_perm: int, bands: int,
                  rows: int, shingle_chars: int, eval_index: np.ndarray, ngram: int) -> pd.DataFrame:
    """Raw Nemotron rows (+ ``row_id``, ``split``, ``group_index`` (0 when absent), and ``guard_reason`` /
    ``guard_detail`` when Spark checked them first: raytrain.enrich.row_guard) -> one PREPARED row each.

    ``status``: the guard's reason when it has one, else a derive reason (conversation.QUARANTINE_REASONS), "license" (its trimmed, case-folded license not
    in ``licenses``) or "ok". Rows with "ok" get the exact-dedup key (dedup.exact_key of every turn's text), the
    MinHash signature of its character ``shingle_chars``-grams, its LSH band keys and ``eval_ngrams``; the others
    keep uuid/category/split, the reason's detail, and empty text columns.
    """
    allowed = sorted({lic.strip().lower() for lic in licenses})
    empty = {name: values[0] for name, values in _defaults(PREPARED, 1).items()}
    out = _defaults(PREPARED, 0)
    texts: list[str] = []  # of the rows with status "ok", in order
    for row in pdf.to_dict("records"):
        # pandas writes a missing string as NaN; the quarantine detail should say None, as pyarrow rows do
        row = {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in row.items()}
        refused = row.get(GUARD_REASON)
        if refused:  # Spark refused it already (row_guard): its text never reached this process
            category = row.get("category")
            values: dict[str, Any] = {**empty, "row_id": int(row["row_id"]), "split": row["split"],
                                      "group_index": int(row.get("group_index") or 0),
                                      "uuid": row.get("uuid"), "status": refused, "detail": row.get(GUARD_DETAIL) or "",
                                      "category": category if isinstance(category, str) else ""}
            for name in PREPARED.names:
                out[name].append(values[name])
            continue
        result = derive_example(row, max_chars=max_chars)
        values = {**empty, "row_id": int(row["row_id"]), "split": row["split"], "uuid": result.uuid,
                  "group_index": int(row.get("group_index") or 0)}
        if isinstance(result, Example):
            values.update(category=result.category, license=result.license, reasoning=result.reasoning)
            if result.license.strip().lower() in allowed:
                text = result.full_text()
                values.update(status=OK, context=result.context, question=result.question, answer=result.answer,
                              messages_json=json.dumps(list(result.messages), ensure_ascii=False),
                              exact_key=exact_key(text))
                texts.append(text)
            else:
                values.update(status=LICENSE, detail=f"license '{result.license}' not in enrich.licenses {allowed}")
        else:
            category = row.get("category")
            values.update(category=category if isinstance(category, str) else "", status=result.reason,
                          detail=result.detail)
        for name in PREPARED.names:
            out[name].append(values[name])
    fill_dedup_columns(out, texts, num_perm=num_perm, bands=bands, rows=rows, shingle_chars=shingle_chars,
                       eval_index=eval_index, ngram=ngram)
    return pd.DataFrame(out, columns=list(PREPARED.names)).astype({"row_id": "int64", "group_index": "int64",
                                                                   "eval_ngrams": "int64"})


def fill_dedup_columns(out: dict[str, list], texts: list[str], *, num_perm: int, bands: int, rows: int,
                       shingle_chars: int, eval_index: np.ndarray, ngram: int) -> None:
    """Set ``signature``, ``band_keys`` and ``eval_ngrams`` of the rows of ``out`` whose status is "ok", in order,
    from ``texts`` (one per such row): the MinHash of its character ``shingle_chars``-grams, its LSH band keys, its
    distinct word ``ngram``-grams shared with the eval sets."""
    if not texts:
        return
    sigs = np.stack([minhash_signature(t, num_perm=num_perm, ngram=shingle_chars) for t in texts])  # (K, P)
    keys = lsh_band_keys(sigs, bands, rows)  # (K, B)
    matched = contamination_counts(texts, eval_index, ngram)
    ok = [i for i, status in enumerate(out["status"]) if status == OK]
    for j, i in enumerate(ok):
        out["signature"][i], out["band_keys"][i], out["eval_ngrams"][i] = sigs[j].tobytes(), keys[j].tolist(), \
            matched[j]


PAIRS = pa.schema([("a_row_id", pa.int64()), ("a_group_index", pa.int64()), ("a_uuid", pa.string()),
                   ("b_row_id", pa.int64()), ("b_group_index", pa.int64()), ("b_uuid", pa.string()),
                   ("jaccard", pa.float64())])
"""``verify_bucket``'s output: a near-duplicate pair, a before b in ``INPUT_ORDER``: b is the near duplicate."""


def verify_bucket(pdf: pd.DataFrame, threshold: float) -> pd.DataFrame:
    """One LSH bucket (row_id, group_index, uuid, signature) -> its verified pairs (PAIRS), a before b in
    ``INPUT_ORDER``, with estimated Jaccard >= threshold. Blocks of rows keep a huge bucket within ~4M booleans."""
    pdf = pdf.sort_values(list(INPUT_ORDER), kind="stable").reset_index(drop=True)
    sigs = np.stack([np.frombuffer(s, dtype=np.uint32) for s in pdf["signature"]]) if len(pdf) \
        else np.zeros((0, 1), dtype=np.uint32)  # (M, P)
    ids = list(zip(pdf["row_id"].astype(np.int64).tolist(), pdf["group_index"].astype(np.int64).tolist(),
                   pdf["uuid"].tolist(), strict=True))
    return pd.DataFrame([(*ids[i], *ids[j], jaccard) for i, j, jaccard in verified_pairs(sigs, threshold)],
                        columns=list(PAIRS.names))


# ---- relevance selection -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SelectedContext:
    """One conversation after the relevance selection (``select_conversations``)."""

    messages: list[dict]
    """The conversation with the kept sentences placed (a context block, or the selected system prompt)."""
    candidates: list[str]
    """The sentences the selection chose from (empty: the conversation was not embedded)."""
    selection: Any
    """raytrain.enrich.relevance.Selection: scores and the kept indices."""
    kept: list[str]
    """The kept sentences."""
    system_prompt_chars_removed: int
    """Characters the 'select' mode removed from the system prompt (0 in 'keep' mode)."""


def select_conversations(conversations: list[list[dict]], questions: list[str], answers: list[str], *,
                         model_path: str, batch_size: int, top_k: int, min_score: float, question_weight: float,
                         system_prompt: str = "keep", answer_text: str = "final", num_threads: int = 0
                         ) -> list[SelectedContext]:
    """The relevance selection of a batch of conversations (raytrain.enrich.context has the rules), one ``encode``
    call for the batch (the model loaded once per process); what the fine-tune's rows and the preference pairs'
    prompts share.

    ``system_prompt`` "keep": candidates are the prose sentences of the context (system prompts less toggle lines,
    earlier turns); the kept ones go into a ``<context>`` block before the last user turn, every system prompt
    stays verbatim. "select": candidates are the system prompt's sentences, and only a conversation with more of
    them than ``top_k`` and no tool calls is changed: its system prompt becomes its toggle lines plus the kept
    sentences. The answer side embeds ``answer_for_scoring(answer, answer_text)``. Conversations without
    candidates are not embedded and keep their messages."""
    from raytrain.enrich.relevance import configure_threads, load_embedder, score_batch

    if num_threads:
        configure_threads(num_threads)
    contexts = []
    for messages in conversations:
        if system_prompt == "keep":
            contexts.append(candidate_sentences(messages).all)
        else:
            sents = candidate_sentences(messages, include_earlier_turns=False).system
            has_calls = any(m.get("tool_calls") for m in messages)
            contexts.append(sents if len(sents) > top_k and not has_calls else [])
    selections = score_batch(contexts, questions, [answer_for_scoring(a, answer_text) for a in answers],
                             load_embedder(model_path or None), batch_size=batch_size, top_k=top_k,
                             threshold=min_score, question_weight=question_weight) if conversations else []
    out = []
    for messages, sents, sel in zip(conversations, contexts, selections, strict=True):
        kept = sel.kept(sents)
        chars = 0
        if system_prompt == "keep":
            messages = with_context_block(messages, kept)
        elif sents:
            messages, chars = with_selected_system_prompt(messages, kept)
        out.append(SelectedContext(messages, sents, sel, kept, chars))
    return out


def select_batch(pdf: pd.DataFrame, *, model_path: str, batch_size: int, top_k: int, min_score: float,
                 question_weight: float, system_prompt: str = "keep", answer_text: str = "final",
                 num_threads: int = 0) -> pd.DataFrame:
    """Working rows -> the same rows with the SELECTION columns added and ``messages_json`` rebuilt by
    ``select_conversations`` (the row's ``question`` and ``answer`` are the two sides of the score);
    ``system_prompt_chars_removed`` counts what the 'select' mode removed."""
    records = pdf.to_dict("records")
    selected = select_conversations([json.loads(r["messages_json"]) for r in records],
                                    [r["question"] for r in records], [r["answer"] for r in records],
                                    model_path=model_path, batch_size=batch_size, top_k=top_k, min_score=min_score,
                                    question_weight=question_weight, system_prompt=system_prompt,
                                    answer_text=answer_text, num_threads=num_threads)
    out = pdf.copy()
    out["context_sentences"] = [c.candidates for c in selected]
    out["kept_indices"] = [list(c.selection.kept_indices) for c in selected]
    out["kept_sentences"] = [c.kept for c in selected]
    out["sentence_scores"] = [c.selection.scores.tolist() for c in selected]
    out["question_scores"] = [c.selection.q_scores.tolist() for c in selected]
    out["answer_scores"] = [c.selection.a_scores.tolist() for c in selected]
    out["chunked_texts"] = np.asarray([c.selection.chunked_texts for c in selected], dtype=np.int64)
    out["system_prompt_chars_removed"] = np.asarray([c.system_prompt_chars_removed for c in selected],
                                                    dtype=np.int64)
    out["messages_json"] = [json.dumps(c.messages, ensure_ascii=False) for c in selected]
    return out


# ---- tokenization --------------------------------------------------------------------------------------------------
def tokenize_batch(pdf: pd.DataFrame, tokenizer_version: str, seq_len: int, length_policy: str = "drop",
                   text_with_tool_calls: str = "drop_text") -> pd.DataFrame:
    """Rows -> the same rows plus the TOKENS columns, tokenizing ``messages_json`` once, for good: the pack stage
    packs the stored ``input_ids`` / ``loss_mask`` (True on assistant-generated tokens) and never tokenizes again.

    ``num_tokens`` (the whole conversation; -1 when refused), ``train_tokens`` (what packing keeps after the length
    policy), ``length_action`` ("keep", "truncate", "split" or "drop": raytrain.dataset.length; "" when refused),
    ``dropped_text_turns`` / ``dropped_text_chars`` (assistant turns whose text was dropped for their tool calls,
    and that text's characters); ``status`` becomes "untokenizable" or "too_many_tokens" for the rows refused
    (their ids stay empty), with ``detail``. Assistant turns with text and tool calls are first fitted to the
    tokenizer (tokenize.fit_tool_call_turns): ``messages_json`` is rewritten when text was dropped, so the
    written row is what gets trained."""
    from raytrain.dataset.length import TOO_MANY_TOKENS, decide_length
    from raytrain.dataset.tokenize import fit_tool_call_turns, load_tokenizer, tokenize_conversation
    from raytrain.errors import RaytrainError

    tokenizer = load_tokenizer(tokenizer_version)
    cols = _defaults(TOKENS, 0) | {"status": [], "detail": [], "messages_json": []}

    def emit(**values) -> None:
        for k, v in values.items():
            cols[k].append(v)

    for messages_json in pdf["messages_json"]:
        try:
            fitted = fit_tool_call_turns(json.loads(messages_json), tokenizer_version, text_with_tool_calls)
            tokenized = tokenize_conversation(fitted.messages, tokenizer, verify=False)
        except (RaytrainError, ValueError) as e:  # ValueError: pydantic's ValidationError, bad JSON
            emit(num_tokens=-1, train_tokens=0, length_action="", status=UNTOKENIZABLE, detail=str(e)[:500],
                 dropped_text_turns=0, dropped_text_chars=0, messages_json=messages_json, input_ids=[], loss_mask=[])
            continue
        decision = decide_length(tokenized.loss_mask, seq_len, length_policy)
        dropped = decision.action == "drop"
        emit(num_tokens=decision.num_tokens, train_tokens=decision.train_tokens, length_action=decision.action,
             status=TOO_MANY_TOKENS if dropped else OK, detail=decision.detail,
             dropped_text_turns=fitted.dropped_text_turns, dropped_text_chars=fitted.dropped_text_chars,
             messages_json=json.dumps(fitted.messages, ensure_ascii=False) if fitted.dropped_text_turns
             else messages_json,
             input_ids=[] if dropped else tokenized.input_ids, loss_mask=[] if dropped else tokenized.loss_mask)
    out = pdf.copy()
    for k, values in cols.items():
        out[k] = np.asarray(values, dtype=np.int64) if k in _INT64_TOKEN_COLUMNS else values
    return out


_INT64_TOKEN_COLUMNS = frozenset(f.name for f in TOKENS if pa.types.is_int64(f.type))


# ---- pass 2: selection, corpus context, tokenization ----------------------------------------------------------------
@dataclass(frozen=True)
class Scoring:
    """How sentences are embedded and kept (enrich.*): what the selection from a row's own context and the corpus
    search share (``select_batch`` and ``corpus_context_batch`` take these as keywords)."""

    model_path: str
    batch_size: int
    top_k: int
    min_score: float
    question_weight: float
    answer_text: str = "final"
    num_threads: int = 0

    @classmethod
    def from_config(cls, cfg: EnrichConfig, num_threads: int = 0) -> Scoring:
        return cls(cfg.embedding_model, cfg.embed_batch_size, cfg.top_k, cfg.min_score, cfg.question_weight,
                   cfg.answer_text, num_threads)

    def keywords(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class Tokenizing:
    """How rows are tokenized (dataset.*; ``tokenize_batch`` takes these as keywords)."""

    tokenizer_version: str
    seq_len: int
    length_policy: str = "drop"
    text_with_tool_calls: str = "drop_text"

    @classmethod
    def from_config(cls, ds: DatasetConfig) -> Tokenizing:
        return cls(ds.tokenizer, ds.seq_len, ds.length_policy, ds.text_with_tool_calls)


@dataclass(frozen=True)
class CorpusSearch:
    """What the corpus search needs besides ``Scoring``: the corpus index and the eval n-grams its sentences are
    checked against (``corpus_context_batch``)."""

    index: Any
    """raytrain.enrich.corpus.CorpusIndex"""
    eval_index: np.ndarray
    ngram: int


def refused_before_context(pdf: pd.DataFrame, tokenize: Tokenizing, system_prompt: str = "keep") -> pd.DataFrame:
    """The kept rows ``finish_batch`` can quarantine before selection, as ``tokenize_batch(**tokenize)`` returns
    them: those whose conversation as it stands is already refused (too many tokens for the length policy, or
    untokenizable), so that the relevance selection and the corpus retrieval never embed a row that cannot train.

    Sound because neither step can rescue such a row: with ``enrich.system_prompt`` "keep" (the default) they only
    add a context block to the last user turn: more prompt tokens, the same messages and roles. So a row over
    ``seq_len`` stays over it (policy drop), a prompt that leaves no answer token inside ``seq_len`` stays so
    (truncate), and a conversation the tokenizer refuses stays refused. With "select" the system prompt may shrink,
    so nothing is decided early. Only rows whose ``messages_json`` is longer than ``seq_len`` characters are
    tokenized here (a cheap filter: real Nemotron code and math rows run to 40-48 KB).
    """
    if system_prompt != "keep" or tokenize.length_policy == "split":
        return pdf.iloc[:0]
    long = pdf[pdf["messages_json"].str.len() > tokenize.seq_len]
    if long.empty:
        return long
    tokenized = tokenize_batch(long, **asdict(tokenize))
    refused = tokenized[tokenized["status"] != OK].copy()
    refused["detail"] = refused["detail"] + " [before any context was added: selection and corpus skipped]"
    return refused


def finish_batch(pdf: pd.DataFrame, *, scoring: Scoring, tokenize: Tokenizing, system_prompt: str = "keep",
                 corpus: CorpusSearch | None = None, seconds: dict[str, float] | None = None) -> pd.DataFrame:
    """Rows of the finishing pass (PREPARED's row columns with the final dedup/decontamination verdict in
    ``status``) -> ``finished_schema(corpus is not None)`` rows in the same order.

    Rows with status "ok" go through ``select_batch`` (``scoring``, ``system_prompt``),
    ``corpus_batches.corpus_context_batch`` (``corpus`` and ``scoring``, with a corpus) and ``tokenize_batch``
    (``tokenize``), which may still quarantine them; rows that
    ``refused_before_context`` finds refused already are tokenized as they stand and quarantined without being
    embedded (their token count and detail are the conversation's without a context block, and the detail says so).
    The others pass through with their reason, empty text (the quarantine keeps uuid, split, category, reason and
    detail) and ``num_tokens`` -1 (never tokenized)."""
    schema = finished_schema(corpus is not None)
    keep = (pdf["status"] == OK).to_numpy()
    parts = []
    if keep.any():
        kept = pdf[keep]
        refused = refused_before_context(kept, tokenize, system_prompt)
        if len(refused):
            parts.append(_with_defaults(refused, schema))
        rest_ok = kept.drop(index=refused.index)
        if len(rest_ok):
            ok = select_batch(rest_ok, **scoring.keywords(), system_prompt=system_prompt)
            if corpus is not None:
                from raytrain.enrich.corpus_batches import corpus_context_batch

                t0 = time.perf_counter()
                ok = corpus_context_batch(ok, index=corpus.index, eval_index=corpus.eval_index, ngram=corpus.ngram,
                                          **scoring.keywords())
                if seconds is not None:  # the corpus retrieval's share of the pass, for the report
                    seconds["corpus"] = seconds.get("corpus", 0.0) + time.perf_counter() - t0
            parts.append(tokenize_batch(ok, **asdict(tokenize)))
    if not keep.all():
        rest = pdf[~keep][[n for n in schema.names if n in pdf.columns]].copy()
        rest[["context", "question", "answer", "messages_json"]] = ""
        rest = _with_defaults(rest, schema)
        rest["num_tokens"] = -1
        parts.append(rest)
    out = pd.concat(parts).loc[pdf.index] if parts else pdf.iloc[:0].reindex(columns=schema.names)
    return out[list(schema.names)]


def _with_defaults(pdf: pd.DataFrame, schema: pa.Schema) -> pd.DataFrame:
    """``pdf`` with every column of ``schema`` it lacks filled with empty values (_defaults)."""
    for name, values in _defaults(schema, len(pdf)).items():
        if name not in pdf.columns:
            pdf[name] = values
    return pdf


def map_batches(fn, **kwargs):
    """A mapInPandas body applying ``fn(batch, **kwargs)`` to each Arrow batch of a partition."""
    def body(batches: Iterator[pd.DataFrame]) -> Iterator[pd.DataFrame]:
        for pdf in batches:
            yield fn(pdf, **kwargs)
    return body
