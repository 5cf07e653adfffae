"""The HelpSteer3-shaped sample (raytrain.sample_data.preference) read back through the preference row logic: its
answer key agrees with what derive_pair decides, and it has the shape the issue names."""

import gzip
import json
from collections import Counter

import pytest

from raytrain.enrich.conversation import Quarantined
from raytrain.enrich.dedup import normalize_text
from raytrain.enrich.preference import PreferenceExample, derive_pair
from raytrain.sample_data.preference import write_preference_sample

ANSWER_MARKS = {"general": "left:", "code": "```", "stem": "km/h", "multilingual": ("ist", "font", "es")}


def read_jsonl_gz(path: str) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    out = tmp_path_factory.mktemp("pref")
    written = write_preference_sample(str(out))
    key = json.load(open(written.planted_path))
    return written, read_jsonl_gz(written.train_path), read_jsonl_gz(written.validation_path), key


def test_same_seed_same_bytes(sample, tmp_path):
    written = sample[0]
    again = write_preference_sample(str(tmp_path))
    for a, b in ((written.train_path, again.train_path), (written.validation_path, again.validation_path)):
        assert open(a, "rb").read() == open(b, "rb").read()


def test_derive_pair_quarantines_exactly_the_planted_malformed_rows_and_ties(sample):
    _, train, validation, key = sample
    by_line = {entry["line"]: entry for entry in key["planted"]}
    decided_at_derive = {line: e["reason"] for line, e in by_line.items() if e["kind"] in ("tie", "malformed")}
    outcomes = [derive_pair(row) for row in train]
    quarantined = {line: out.reason for line, out in enumerate(outcomes) if isinstance(out, Quarantined)}
    assert quarantined == decided_at_derive
    assert Counter(decided_at_derive.values()) == {"tie": 2, "bad_preference": 2, "missing_response": 1, "bad_role": 1}
    assert all(isinstance(derive_pair(row), PreferenceExample) for row in validation)
    assert (len(train), len(validation)) == (key["rows"], key["validation_rows"])


def test_the_chosen_response_is_the_one_that_answers(sample):
    _, train, validation, key = sample
    planted = {entry["line"] for entry in key["planted"]}
    pairs = [derive_pair(row) for line, row in enumerate(train) if line not in planted] + \
        [derive_pair(row) for row in validation]
    for pair in pairs:
        marks = ANSWER_MARKS[pair.domain]
        marks = marks if isinstance(marks, tuple) else (marks,)
        assert any(f" {m} " in f" {pair.chosen} " or m in pair.chosen for m in marks), pair
        assert not any(f" {m} " in f" {pair.rejected} " for m in marks) and "```" not in pair.rejected, pair
    assert {pair.margin for pair in pairs} == {1.0, 2.0, 3.0}
    rows = train + validation
    assert {row["overall_preference"] < 0 for row in rows if isinstance(row["overall_preference"], int)
            and row["overall_preference"]} == {True, False}  # both response1 and response2 are chosen somewhere


def test_domains_languages_and_turns_as_helpsteer3_has_them(sample):
    _, train, _, _ = sample
    assert {row["domain"] for row in train} == {"general", "code", "multilingual", "stem"}
    languages = {row["language"] for row in train}
    assert {"english", "german", "french", "spanish", "python"} <= languages
    assert any(isinstance(row["context"], str) for row in train)
    assert any(isinstance(row["context"], list) and len(row["context"]) >= 3 for row in train)
    assert all(set(row) == {"domain", "language", "context", "response1", "response2", "overall_preference",
                            "individual_preference"} for row in train)


def test_planted_duplicates_and_contamination_are_what_the_key_says(sample):
    written, train, _, key = sample
    eval_questions = [json.loads(line)["question"] for line in open(written.eval_path)]

    def text(row: dict) -> str:
        pair = derive_pair(row)
        return normalize_text(pair.full_text())

    for entry in key["planted"]:
        row = train[entry["line"]]
        if entry["kind"] == "exact_duplicate":
            assert text(row) == text(train[entry["of_line"]])
        elif entry["kind"] == "near_duplicate":
            assert text(row) != text(train[entry["of_line"]])
        elif entry["kind"] == "contaminated":
            assert any(q in json.dumps(row, ensure_ascii=False) for q in eval_questions)
    assert Counter(e["kind"] for e in key["planted"]) == {"tie": 2, "malformed": 4, "exact_duplicate": 2,
                                                          "near_duplicate": 1, "contaminated": 2}
