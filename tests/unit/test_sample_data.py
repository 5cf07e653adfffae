"""The sample dataset: readable with the declared schema, deterministic, and its answer key matches what the
enrichment logic detects on it."""

import collections
import filecmp
import json
import os
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest

from raytrain.config import EnrichConfig
from raytrain.enrich.conversation import Example, derive_example
from raytrain.enrich.decontam import build_eval_index, contaminated, load_eval_sets
from raytrain.enrich.dedup import exact_key, minhash_signature, near_duplicate_groups
from raytrain.enrich.schema import NEMOTRON_V1_SCHEMA, SPLITS, validate_schema
from raytrain.sample_data import load_planted, write_sample_dataset


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("sample") / "data")
    manifest = write_sample_dataset(out, seed=0)
    rows = {s: pq.read_table(manifest.split_paths[s]).to_pylist() for s in SPLITS}
    return manifest, rows, load_planted(out)


@pytest.fixture(scope="module")
def derived(sample):
    manifest, rows, planted = sample
    return {s: [derive_example(r, max_chars=planted["max_chars"]) for r in rows[s]] for s in SPLITS}


def test_layout_schema_and_size(sample):
    manifest, rows, planted = sample
    for split in SPLITS:
        path = os.path.join(manifest.out_dir, split, "part-00000.parquet")
        assert manifest.split_paths[split] == path
        validate_schema(pq.read_schema(path), path)
        assert pq.read_table(path).schema.equals(NEMOTRON_V1_SCHEMA)
        assert len(rows[split]) == 60
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(manifest.out_dir) for f in fs)
    assert total == manifest.num_bytes < 1_000_000
    assert planted["max_chars"] == EnrichConfig().max_chars
    assert tuple(planted["allowed_licenses"]) == EnrichConfig().licenses


def test_same_seed_same_bytes_other_seed_differs(tmp_path, sample):
    manifest = sample[0]
    again = write_sample_dataset(str(tmp_path / "again"), seed=0)
    other = write_sample_dataset(str(tmp_path / "other"), seed=1)
    for split in SPLITS:
        assert filecmp.cmp(manifest.split_paths[split], again.split_paths[split], shallow=False)
        assert not filecmp.cmp(manifest.split_paths[split], other.split_paths[split], shallow=False)
    assert filecmp.cmp(manifest.planted_path, again.planted_path, shallow=False)
    assert filecmp.cmp(manifest.eval_path, again.eval_path, shallow=False)


def test_row_variety(sample):
    _, rows, _ = sample
    roles = collections.Counter()
    reasoning = collections.Counter(r["reasoning"] for s in SPLITS for r in rows[s])
    multi_user = 0
    for split in SPLITS:
        for r in rows[split]:
            msgs = r["messages"] or []
            roles.update(m["role"] for m in msgs)
            multi_user += sum(m["role"] == "user" for m in msgs) > 1
    assert reasoning["on"] > 20 and reasoning["off"] > 20
    assert roles["tool"] > 10 and multi_user > 10
    assert all(any(m["tool_calls"] for m in r["messages"] or []) for r in rows["tool_calling"]
               if r["metadata"] and json.loads(r["metadata"])["template"] == "tool_calling")


def test_quarantine_counts_match_exactly(sample, derived):
    _, _, planted = sample
    found = collections.Counter()
    where = set()
    for split in SPLITS:
        for i, out in enumerate(derived[split]):
            if not isinstance(out, Example):
                found[out.reason] += 1
                where.add((split, i, out.reason))
    assert dict(found) == planted["quarantine_counts"]
    assert where == {(q["split"], q["row"], q["reason"]) for q in planted["quarantine"]}


def _examples(derived):
    return [e for s in SPLITS for e in derived[s] if isinstance(e, Example)]


def test_licenses(sample, derived):
    allowed = set(sample[2]["allowed_licenses"])
    bad = {e.uuid for e in _examples(derived) if e.license.lower() not in allowed}
    assert bad == {x["uuid"] for x in sample[2]["disallowed_license"]}


def test_exact_and_near_duplicates_match_answer_key(sample, derived):
    planted = sample[2]
    examples = _examples(derived)
    by_key = collections.defaultdict(list)
    for e in examples:
        by_key[exact_key(e.full_text())].append(e.uuid)
    exact_groups = sorted(sorted(g) for g in by_key.values() if len(g) > 1)
    assert exact_groups == sorted(sorted([x["uuid"], x["duplicate_of"]]) for x in planted["exact_duplicates"])
    kept = [e for e in examples if e.uuid == min(by_key[exact_key(e.full_text())])]
    sigs = np.stack([minhash_signature(e.full_text()) for e in kept])
    groups = near_duplicate_groups([e.uuid for e in kept], sigs, planted["near_dup_threshold"])
    assert groups == sorted(sorted([x["uuid"], x["duplicate_of"]]) for x in planted["near_duplicates"])


def test_contamination_matches_answer_key(sample, derived):
    manifest, _, planted = sample
    index = build_eval_index(load_eval_sets([manifest.eval_path]), planted["ngram"])
    hits = {e.uuid for e in _examples(derived) if contaminated(e.full_text(), index, planted["ngram"])[0]}
    assert hits == {x["uuid"] for x in planted["contaminated"]}
    assert not hits & {x["uuid"] for x in planted["not_contaminated"]}


def test_context_answer_key_points_at_a_real_sentence(sample, derived):
    planted = sample[2]
    by_uuid = {e.uuid: e for e in _examples(derived)}
    assert len(planted["context_answers"]) > 50
    for key in planted["context_answers"]:
        e = by_uuid[key["uuid"]]
        assert e.question == key["question"] and key["answer_sentence"] in e.context
        assert all(d in e.context for d in key["distractors"])


def test_cli_entry(tmp_path):
    out = tmp_path / "cli"
    proc = subprocess.run([sys.executable, "-m", "raytrain.sample_data", str(out), "--rows-per-split", "25"],
                          capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert proc.returncode == 0, proc.stderr
    assert pq.read_table(out / "chat" / "part-00000.parquet").num_rows == 25


def test_real_embedder_picks_the_planted_answer_sentence(sample, derived):
    from raytrain.enrich.relevance import load_embedder, score_batch
    from raytrain.enrich.sentences import split_sentences

    keys = sample[2]["context_answers"]
    by_uuid = {e.uuid: e for e in _examples(derived)}
    examples = [by_uuid[k["uuid"]] for k in keys]
    contexts = [split_sentences(e.context) for e in examples]
    sels = score_batch(contexts, [e.question for e in examples], [e.answer for e in examples], load_embedder(),
                       top_k=1)
    for key, sents, sel in zip(keys, contexts, sels, strict=True):
        assert key["answer_sentence"] in sents and all(d in sents for d in key["distractors"])
        assert sel.kept(sents) == [key["answer_sentence"]]
