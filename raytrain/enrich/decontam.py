"""Eval-set decontamination: drop training rows that share a long word n-gram (13 by default) with an eval item.

Text is reduced to normalized word tokens (NFKC, case-folded, split on anything that is not a letter or
digit), each n-gram hashed to a stable 64-bit integer (blake2b per token, then dedup.window_hashes), so the
eval index built on the driver matches hashes computed on any Spark worker. The index is a plain ``set`` of
Python ints: small enough to broadcast (a 10k-item eval set of ~200 words is ~2M hashes).
"""

from __future__ import annotations

import json
import os
import re
import unicodedata
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from raytrain.enrich.dedup import token_hashes, window_hashes
from raytrain.errors import RaytrainError

DEFAULT_NGRAM = 13
_TOKEN = re.compile(r"[^\W_]+")  # runs of letters/digits in any script


def tokenize(text: str) -> list[str]:
    """Normalized word tokens: NFKC, case-folded, punctuation and whitespace removed."""
    return _TOKEN.findall(unicodedata.normalize("NFKC", text).casefold())


def ngram_hashes(text: str, n: int = DEFAULT_NGRAM) -> np.ndarray:
    """Distinct stable 64-bit hashes of the text's n-grams -> (K,) uint64 (empty when shorter than n)."""
    if n < 1:
        raise RaytrainError(f"decontamination n-gram length must be >= 1, got {n}")
    return np.unique(window_hashes(token_hashes(tokenize(text)), n))


def build_eval_index(eval_texts: Iterable[str], n: int = DEFAULT_NGRAM) -> set[int]:
    """The set of n-gram hashes over all eval texts. Items shorter than ``n`` tokens contribute nothing."""
    index: set[int] = set()
    for text in eval_texts:
        index.update(ngram_hashes(text, n).tolist())
    return index


def build_sorted_index(hashes: Iterable[int]) -> np.ndarray:
    """An eval n-gram hash set as a sorted (K,) uint64 array: ~8 bytes per n-gram to broadcast, vectorized lookups."""
    return np.unique(np.fromiter(hashes, dtype=np.uint64))


def contamination_counts(texts: Iterable[str], sorted_index: np.ndarray, n: int = DEFAULT_NGRAM) -> list[int]:
    """Per text, how many of its distinct word n-grams are in the eval index (``build_sorted_index``); a row with
    any is contaminated."""
    if sorted_index.size == 0:
        return [0 for _ in texts]
    return [int(np.isin(ngram_hashes(t, n), sorted_index, assume_unique=True).sum()) for t in texts]


def _record_text(record: dict, fields: Sequence[str] | None, where: str) -> str:
    if fields is None:
        # Default: a "text" field, else question + answer (the usual QA eval layout).
        fields = ("text",) if "text" in record else ("question", "answer")
    missing = [f for f in fields if f not in record]
    if missing:
        raise RaytrainError(
            f"{where}: field(s) {missing} missing (record has {sorted(record)}). Fix: pass fields=[...] naming "
            "the eval text field(s), e.g. enrich.eval_fields."
        )
    return "\n".join(str(record[f]) for f in fields if record[f] is not None)


def eval_text(record: dict[str, Any] | str, fields: Sequence[str] | None, where: str) -> str:
    """The text of one eval item for the n-gram index: a plain-text line as is, a record's ``fields`` joined."""
    return record if isinstance(record, str) else _record_text(record, fields, where)


def iter_eval_records(paths: Sequence[str]) -> Iterator[tuple[str, dict[str, Any] | str]]:
    """(where, item) for every eval item: records from JSONL (``.jsonl``/``.json`` lines) and Parquet
    (``.parquet``), plain-text lines from any other extension. Raises RaytrainError naming the file (and line) on a
    missing file or bad JSON."""
    for path in paths:
        if not os.path.isfile(path):
            raise RaytrainError(f"eval set {path!r} does not exist. Fix: correct enrich.eval_sets.")
        ext = os.path.splitext(path)[1].lower()
        if ext in (".jsonl", ".json"):
            with open(path, encoding="utf-8") as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise RaytrainError(f"{path}:{lineno}: not valid JSON ({e.msg}). Fix: one object per line.") from e
                    if not isinstance(record, dict):
                        raise RaytrainError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
                    yield f"{path}:{lineno}", record
        elif ext == ".parquet":
            import pyarrow.parquet as pq

            for i, record in enumerate(pq.read_table(path).to_pylist()):
                yield f"{path} row {i}", record
        else:
            with open(path, encoding="utf-8") as f:
                for lineno, line in enumerate(f, 1):
                    if line.strip():
                        yield f"{path}:{lineno}", line.strip()
