"""Batch functions of the preference enrichment, pandas in and out, that Spark's Python workers run (the pairs'
counterpart of ``raytrain.enrich.batches``).

- ``prepare_pairs_batch``: JSON lines -> one PAIR_PREPARED row each: a pair (``enrich.preference.derive_pair``) or a
  quarantine reason, and for pairs the exact-dedup key, MinHash signature, LSH band keys and eval n-grams of the
  prompt and both responses (what the fine-tune's dedup and decontamination compare, so the same Spark passes
  serve both).
- ``finish_pairs_batch``: pairs with their final verdict -> PAIR_FINISHED rows: the prompt's tokens once and each
  response's (``dataset.tokenize.tokenize_pair``); a pair whose two sequences do not fit one pack goes through
  ``dataset.length_policy`` (``dataset.length.decide_pair_length``): truncated (the responses' ends cut) or
  quarantined as too_many_tokens (a pair is never split).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from raytrain.dataset.length import DROP, decide_pair_length
from raytrain.dataset.reasons import Reason
from raytrain.dataset.tokenize import load_tokenizer, tokenize_pair
from raytrain.enrich.batches import OK, CorpusSearch, Scoring, fill_dedup_columns, select_conversations
from raytrain.enrich.context import last_user_index
from raytrain.enrich.conversation import short_repr
from raytrain.enrich.dedup import exact_key
from raytrain.enrich.preference import PreferenceExample, derive_pair
from raytrain.errors import RaytrainError

PAIR_ROW = pa.schema([("row_id", pa.int64()), ("split", pa.string()), ("uuid", pa.string()), ("domain", pa.string()),
                      ("language", pa.string()), ("status", pa.string()), ("detail", pa.string()),
                      ("pair_json", pa.string())])
"""Every pair table's first columns; ``pair_json`` holds the PreferenceExample's prompt, chosen, rejected, margin."""
PAIR_PREPARED = pa.schema([*PAIR_ROW, ("group_index", pa.int64()), ("exact_key", pa.string()),
                           ("signature", pa.binary()), ("band_keys", pa.list_(pa.int64())),
                           ("eval_ngrams", pa.int64())])
PAIR_TOKENS = pa.schema([("margin", pa.float64()), ("prompt_ids", pa.list_(pa.int32())),
                         ("chosen_ids", pa.list_(pa.int32())), ("rejected_ids", pa.list_(pa.int32())),
                         ("num_tokens", pa.int64()), ("length_action", pa.string()),
                         ("tokens_truncated", pa.int64())])
"""A kept pair's tokens, as they go into a pack: ``num_tokens`` is what it takes there (the prompt twice and both
responses, after any truncation). ``length_action``: the length policy's keep, truncate or drop ("" when the pair was
not tokenized); ``tokens_truncated``: the response tokens truncation cut (0 otherwise)."""
PAIR_CONTEXT = pa.schema([("context_sentences_kept", pa.int64()), ("system_prompt_chars_removed", pa.int64()),
                          ("corpus_sentences_added", pa.int64())])
"""What enrich.pair_context did to a pair's prompt (0 when off): the sentences the relevance selection kept (in a
context block, or as the system prompt with enrich.system_prompt=select), the system prompt's characters it
removed, and the corpus sentences added to a prompt without context of its own (enrich.context_corpus)."""
PAIR_FINISHED = pa.schema([*PAIR_ROW, *PAIR_TOKENS, *PAIR_CONTEXT])


def _empty(schema: pa.Schema) -> dict[str, Any]:
    def value(t: pa.DataType) -> Any:
        return "" if pa.types.is_string(t) else [] if pa.types.is_list(t) else b"" if pa.types.is_binary(t) else 0
    return {f.name: value(f.type) for f in schema}


def _line_id(line: str) -> str:
    return "line-" + hashlib.sha256(line.encode("utf-8", "backslashreplace")).hexdigest()[:32]


def _parse(line: str) -> dict | str:
    """A JSON line as a dict, or the reason it is not one (a detail for undecodable_text)."""
    try:
        row = json.loads(line)
    except ValueError as e:
        return f"the line is not JSON ({e.msg} at character {e.pos}): {short_repr(line)}"
    return row if isinstance(row, dict) else f"the line is a JSON {type(row).__name__}, not an object"


def prepare_pairs_batch(pdf: pd.DataFrame, *, max_chars: int, num_perm: int, bands: int, rows: int,
                        shingle_chars: int, eval_index: np.ndarray, ngram: int) -> pd.DataFrame:
    """Lines of the input files (``value``, with ``split``, ``row_id`` and ``group_index``, 0 when absent) -> one
    PAIR_PREPARED row each: status
    "ok" with the dedup and eval columns, or a derive reason (a line that is not a JSON object: undecodable_text)."""
    empty = _empty(PAIR_PREPARED)
    out: dict[str, list] = {name: [] for name in PAIR_PREPARED.names}
    texts: list[str] = []
    group_indices = pdf["group_index"] if "group_index" in pdf else [0] * len(pdf)
    for line, split, row_id, group_index in zip(pdf["value"], pdf["split"], pdf["row_id"], group_indices, strict=True):
        values = {**empty, "row_id": int(row_id), "split": split, "group_index": int(group_index)}
        row = _parse(line)
        if isinstance(row, str):
            values.update(uuid=_line_id(line), status=Reason.UNDECODABLE_TEXT.value, detail=row)
        else:
            result = derive_pair(row, max_chars=max_chars)
            if isinstance(result, PreferenceExample):
                text = result.full_text()
                values.update(uuid=result.pair_id, domain=result.domain, language=result.language, status=OK,
                              exact_key=exact_key(text), pair_json=json.dumps(
                                  {"prompt": list(result.prompt), "chosen": result.chosen,
                                   "rejected": result.rejected, "margin": result.margin}, ensure_ascii=False))
                texts.append(text)
            else:
                values.update(uuid=result.uuid, status=str(result.reason), detail=result.detail,
                              domain=_plain(row.get("domain")), language=_plain(row.get("language")))
        for name in PAIR_PREPARED.names:
            out[name].append(values[name])
    fill_dedup_columns(out, texts, num_perm=num_perm, bands=bands, rows=rows, shingle_chars=shingle_chars,
                       eval_index=eval_index, ngram=ngram)
    return pd.DataFrame(out, columns=list(PAIR_PREPARED.names)).astype({"row_id": "int64", "group_index": "int64",
                                                                        "eval_ngrams": "int64"})


def finish_pairs_batch(pdf: pd.DataFrame, *, tokenizer_version: str, seq_len: int, length_policy: str,
                       scoring: Scoring | None = None, system_prompt: str = "keep",
                       corpus: CorpusSearch | None = None) -> pd.DataFrame:
    """PAIR_ROW rows with their final verdict -> PAIR_FINISHED rows; the kept ones tokenized, or quarantined as
    untokenizable or too_many_tokens.

    With ``scoring`` (enrich.pair_context) the kept pairs' prompts first go through the fine-tune's relevance
    selection (``batches.select_conversations``, ``system_prompt`` as enrich.system_prompt): the last user turn is
    the question, the chosen response the answer side; with ``corpus`` (enrich.context_corpus) a prompt without
    context sentences of its own gets the corpus's (``corpus_batches.corpus_context_batch``), as a fine-tune row
    does. ``pair_json`` holds the prompt as trained.

    A pair longer than ``seq_len`` goes through ``length_policy`` (drop | truncate): a truncated pair keeps the start
    of each response, so a cut response has no EOS (as the fine-tune's truncated answer); a dropped one keeps its
    full tokens in the row (the quarantine does not write them) and the detail names the counts."""
    tokenizer = load_tokenizer(tokenizer_version)
    empty = _empty(PAIR_TOKENS) | _empty(PAIR_CONTEXT)
    out: dict[str, list] = {name: [] for name in PAIR_FINISHED.names}
    rows = pdf[list(PAIR_ROW.names)].to_dict("records")
    pairs = {i: json.loads(row["pair_json"]) for i, row in enumerate(rows) if row["status"] == OK}
    context = _select_prompts(pairs, scoring, system_prompt, corpus) if scoring is not None else {}
    for i, row in enumerate(rows):
        values = {**row, **empty, **context.get(i, {})}
        if row["status"] == OK:
            pair = pairs[i]
            values["pair_json"] = json.dumps(pair, ensure_ascii=False) if i in context else row["pair_json"]
            try:
                tokens = tokenize_pair(row["uuid"], pair["prompt"], pair["chosen"], pair["rejected"], tokenizer)
            except RaytrainError as e:
                values.update(status=Reason.UNTOKENIZABLE.value, detail=str(e))
            else:
                decision = decide_pair_length(len(tokens.prompt), len(tokens.chosen), len(tokens.rejected), seq_len,
                                              length_policy)
                values.update(margin=float(pair["margin"]), prompt_ids=list(tokens.prompt),
                              length_action=decision.action, tokens_truncated=decision.tokens_removed)
                if decision.action == DROP:
                    values.update(status=Reason.TOO_MANY_TOKENS.value, detail=decision.detail,
                                  chosen_ids=list(tokens.chosen), rejected_ids=list(tokens.rejected),
                                  num_tokens=tokens.num_tokens)
                else:
                    values.update(chosen_ids=list(tokens.chosen[:decision.chosen]),
                                  rejected_ids=list(tokens.rejected[:decision.rejected]),
                                  num_tokens=decision.train_tokens)
        for name in PAIR_FINISHED.names:
            out[name].append(values[name])
    return pd.DataFrame(out, columns=list(PAIR_FINISHED.names)).astype(
        {"row_id": "int64", "num_tokens": "int64", "margin": "float64", "tokens_truncated": "int64",
         "context_sentences_kept": "int64", "system_prompt_chars_removed": "int64",
         "corpus_sentences_added": "int64"})


def _select_prompts(pairs: dict[int, dict], scoring: Scoring, system_prompt: str, corpus: CorpusSearch | None
                    ) -> dict[int, dict[str, int]]:
    """The relevance selection, then the corpus search, on the prompts of ``pairs`` (row -> pair, changed in
    place): row -> PAIR_CONTEXT."""
    rows = list(pairs)
    prompts = [pairs[i]["prompt"] for i in rows]
    questions = [prompt[last_user_index(prompt)]["content"] for prompt in prompts]
    answers = [pairs[i]["chosen"] for i in rows]
    selected = select_conversations(prompts, questions, answers, **scoring.keywords(), system_prompt=system_prompt)
    added = [0] * len(rows)
    if corpus is not None and rows:
        from raytrain.enrich.corpus_batches import corpus_context_batch

        searched = corpus_context_batch(pd.DataFrame({
            "context_sentences": [c.candidates for c in selected], "question": questions, "answer": answers,
            "messages_json": [json.dumps(c.messages, ensure_ascii=False) for c in selected]}),
            index=corpus.index, eval_index=corpus.eval_index, ngram=corpus.ngram, **scoring.keywords())
        added = [len(sentences) for sentences in searched["corpus_sentences"]]
        messages = [json.loads(m) for m in searched["messages_json"]]
    else:
        messages = [c.messages for c in selected]
    out = {}
    for k, (i, chosen) in enumerate(zip(rows, selected, strict=True)):
        pairs[i]["prompt"] = messages[k]
        out[i] = {"context_sentences_kept": len(chosen.kept),
                  "system_prompt_chars_removed": chosen.system_prompt_chars_removed, "corpus_sentences_added": added[k]}
    return out


def _plain(value: Any) -> str:
    return value if isinstance(value, str) else ""
