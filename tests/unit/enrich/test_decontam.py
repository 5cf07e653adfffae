"""n-gram decontamination: hashes checked against the literal n-gram tuples, loaders against pyarrow/json."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raytrain.enrich.decontam import (
    build_eval_index,
    build_sorted_index,
    contamination_counts,
    eval_text,
    iter_eval_records,
    ngram_hashes,
    tokenize,
)
from raytrain.enrich.plan import load_eval_texts
from raytrain.errors import RaytrainError
from raytrain.storage import resolve

EVAL = ("A cyclist leaves Arden at 7 in the morning riding at 20 kilometres per hour toward Brill, which is 60 "
        "kilometres away; when does the cyclist arrive?")


def ngrams(text: str, n: int) -> list[tuple[str, ...]]:
    """The literal word n-grams: the reference the hashes are checked against."""
    words = tokenize(text)
    return [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]


def count(text: str, index: set[int], n: int = 13) -> int:
    return contamination_counts([text], build_sorted_index(index), n)[0]


def test_tokenize_and_ngrams():
    assert tokenize("Hello, WORLD!  It's 3.14") == ["hello", "world", "it", "s", "3", "14"]
    assert ngrams("a b c d", 3) == [("a", "b", "c"), ("b", "c", "d")]
    assert ngrams("a b", 3) == []


def test_hash_count_equals_distinct_ngram_count():
    text = "a b c a b c a b c d"
    assert len(ngram_hashes(text, 3)) == len(set(ngrams(text, 3)))


def test_contamination_at_13_words_not_12():
    index = build_eval_index([EVAL], 13)
    words = EVAL.split()
    thirteen = "My homework: " + " ".join(words[3:16]) + " -- what now?"
    twelve = "My homework: " + " ".join(words[3:15]) + " -- what now?"
    assert count(thirteen, index) == 1
    assert count(twelve, index) == 0
    # case, punctuation and spacing do not hide a copy
    assert count("Q: " + EVAL.upper().replace(" ", "   "), index) == len(set(ngrams(EVAL, 13)))


def test_contamination_counts_equal_the_literal_ngrams_shared():
    evals = ["the quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat today",
             "a completely different sentence about numbers one two three four five six seven eight nine ten"]
    texts = ["Intro. The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat! ok",
             "quick brown fox jumps over the lazy dog while the cat sleeps",  # 12 words of it
             "", "a completely different sentence about numbers one two three four five six seven eight nine"]
    got = contamination_counts(texts, build_sorted_index(build_eval_index(evals, 13)), 13)
    shared = set().union(*(ngrams(e, 13) for e in evals))
    assert got == [len(set(ngrams(t, 13)) & shared) for t in texts]
    assert got[0] > 0 and got[1] == 0
    assert contamination_counts(texts, build_sorted_index([]), 13) == [0, 0, 0, 0]


def test_short_eval_items_add_nothing():
    assert build_eval_index(["too short to matter"], 13) == set()


def test_eval_sets_from_jsonl_parquet_text(tmp_path):
    """The product's reader (plan.load_eval_texts) over the three formats; eval_text's `fields` picks other columns."""
    jl = tmp_path / "e.jsonl"
    jl.write_text(json.dumps({"question": "Q1?", "answer": "A1"}) + "\n\n" + json.dumps({"text": "T2"}) + "\n")
    pqf = tmp_path / "e.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "P3", "x": 1}]), pqf)
    txt = tmp_path / "e.txt"
    txt.write_text("line one\n\nline two\n")
    root = resolve(str(tmp_path))
    got = load_eval_texts((str(jl), str(txt)), root, None)
    assert got.texts == ["Q1?\nA1", "T2", "line one", "line two"] and [s["items"] for s in got.sources] == [2, 2]
    assert [eval_text(r, ("prompt",), w) for w, r in iter_eval_records([str(pqf)])] == ["P3"]
    with pytest.raises(RaytrainError, match=r"e\.parquet row 0.*'question'"):
        load_eval_texts((str(pqf),), root, None)
    (tmp_path / "bad.jsonl").write_text("{not json}\n")
    with pytest.raises(RaytrainError, match=r"bad\.jsonl:1"):
        load_eval_texts((str(tmp_path / "bad.jsonl"),), root, None)
    with pytest.raises(RaytrainError, match=r"eval_sets\[0\].*missing\.jsonl is not a file"):
        load_eval_texts((str(tmp_path / "missing.jsonl"),), root, None)
    with pytest.raises(RaytrainError, match="does not exist"):
        list(iter_eval_records([str(tmp_path / "missing.jsonl")]))
