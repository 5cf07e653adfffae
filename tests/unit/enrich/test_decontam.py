"""n-gram decontamination: hashes checked against the literal n-gram tuples, loaders against pyarrow/json."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raytrain.enrich.decontam import (
    build_eval_index,
    contaminated,
    load_eval_sets,
    ngram_hashes,
    ngrams,
    tokenize,
)
from raytrain.errors import RaytrainError

EVAL = ("A cyclist leaves Arden at 7 in the morning riding at 20 kilometres per hour toward Brill, which is 60 "
        "kilometres away; when does the cyclist arrive?")


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
    assert contaminated(thirteen, index, 13) == (True, 1)
    assert contaminated(twelve, index, 13) == (False, 0)
    # case, punctuation and spacing do not hide a copy
    hit, count = contaminated("Q: " + EVAL.upper().replace(" ", "   "), index, 13)
    assert hit and count == len(set(ngrams(EVAL, 13)))
    assert contaminated(thirteen, index, 13, min_overlap=2) == (False, 1)


def test_short_eval_items_add_nothing():
    assert build_eval_index(["too short to matter"], 13) == set()


def test_load_eval_sets_jsonl_parquet_text(tmp_path):
    jl = tmp_path / "e.jsonl"
    jl.write_text(json.dumps({"question": "Q1?", "answer": "A1"}) + "\n\n" + json.dumps({"text": "T2"}) + "\n")
    pqf = tmp_path / "e.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "P3", "x": 1}]), pqf)
    txt = tmp_path / "e.txt"
    txt.write_text("line one\n\nline two\n")
    assert load_eval_sets([str(jl)]) == ["Q1?\nA1", "T2"]
    assert load_eval_sets([str(pqf), str(txt)], fields="prompt") == ["P3", "line one", "line two"]
    with pytest.raises(RaytrainError, match=r"e\.parquet row 0.*'question'"):
        load_eval_sets([str(pqf)])
    (tmp_path / "bad.jsonl").write_text("{not json}\n")
    with pytest.raises(RaytrainError, match=r"bad\.jsonl:1"):
        load_eval_sets([str(tmp_path / "bad.jsonl")])
    with pytest.raises(RaytrainError, match="does not exist"):
        load_eval_sets([str(tmp_path / "missing.jsonl")])
