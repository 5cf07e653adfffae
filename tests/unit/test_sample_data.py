"""The sample dataset: laid out as the hub publishes Nemotron-Post-Training-Dataset-v1, readable with the declared
schema, shaped like the real rows (reasoning traces, system prompts, tool calls, card-proportional lengths),
deterministic, and its answer key matches what the enrichment logic detects on it."""

import collections
import filecmp
import json
import os
import re
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pyarrow.parquet as pq
import pytest
from near_dedup_reference import near_duplicate_groups

from raytrain.config import SPLITS, EnrichConfig
from raytrain.enrich.conversation import Example, derive_example
from raytrain.enrich.decontam import build_eval_index, build_sorted_index, contamination_counts
from raytrain.enrich.dedup import exact_key, minhash_signature
from raytrain.enrich.plan import load_eval_texts
from raytrain.enrich.schema import NEMOTRON_V1_SCHEMA, validate_schema
from raytrain.sample_data import CARD_BYTES_PER_ROW, load_planted, write_sample_dataset
from raytrain.sample_data.similarity import SeenRows, _jaccard, _shingle_hashes, _shingles
from raytrain.sample_data.spec import MAX_ROW_SIMILARITY
from raytrain.storage import resolve

FILE_NAME = re.compile(r"data/(chat|code|math|stem|tool)-(\d{5})-of-(\d{5})\.parquet")
ON_TOGGLES = ("detailed thinking on", "/think")
OFF_TOGGLES = ("detailed thinking off", "/no_think")


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("sample") / "data")
    start = time.perf_counter()
    manifest = write_sample_dataset(out, seed=0)
    seconds = time.perf_counter() - start
    files = {os.path.relpath(p, out): pq.read_table(p).to_pylist() for p in manifest.all_files()}
    rows = {s: [r for p in manifest.split_files[s] for r in files[os.path.relpath(p, out)]] for s in SPLITS}
    return SimpleNamespace(manifest=manifest, files=files, rows=rows, planted=load_planted(out), seconds=seconds)


@pytest.fixture(scope="module")
def derived(sample):
    return {s: [derive_example(r, max_chars=sample.planted["max_chars"]) for r in sample.rows[s]] for s in SPLITS}


def _examples(derived, splits=SPLITS):
    return [e for s in splits for e in derived[s] if isinstance(e, Example)]


def _num_chars(messages) -> int:
    return sum(len(m["content"] or "") + sum(len(c["function"]["arguments"]) for c in m["tool_calls"] or [])
               for m in messages)


def test_layout_schema_and_size(sample):
    manifest, planted = sample.manifest, sample.planted
    on_disk = sorted(os.path.relpath(os.path.join(d, f), manifest.out_dir)
                     for d, _, fs in os.walk(os.path.join(manifest.out_dir, "data")) for f in fs)
    assert on_disk == sorted(sample.files) == [os.path.relpath(p, manifest.out_dir) for p in manifest.all_files()]
    assert sorted(manifest.split_files) == sorted(SPLITS)
    for split in SPLITS:
        names = [os.path.relpath(p, manifest.out_dir) for p in manifest.split_files[split]]
        assert names == sorted(names) == planted["files"][split]
        parsed = [FILE_NAME.fullmatch(n) for n in names]
        assert all(parsed), names
        assert {m.group(1) for m in parsed} == {"tool" if split == "tool_calling" else split}
        assert [int(m.group(2)) for m in parsed] == list(range(len(names)))
        assert {int(m.group(3)) for m in parsed} == {len(names)}
        for path in manifest.split_files[split]:
            validate_schema(pq.read_schema(path), path)
            assert pq.read_table(path).schema.equals(NEMOTRON_V1_SCHEMA)
            assert pq.read_metadata(path).num_rows > 0
        assert len(sample.rows[split]) == manifest.rows_per_split == 64
    assert sum(len(manifest.split_files[s]) == 2 for s in SPLITS) >= 2
    assert os.path.isfile(os.path.join(manifest.out_dir, "eval", "eval_set.jsonl"))
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(manifest.out_dir) for f in fs)
    assert total == manifest.num_bytes < 1_000_000  # the 1M-character too_long rows compress to almost nothing
    assert planted["max_chars"] == EnrichConfig().max_chars
    assert tuple(planted["allowed_licenses"]) == EnrichConfig().licenses
    print(f"sample written in {sample.seconds:.2f}s")  # timing is printed, never asserted (noisy machines)


def test_same_seed_same_bytes_other_seed_differs(tmp_path, sample):
    manifest = sample.manifest
    again = write_sample_dataset(str(tmp_path / "again"), seed=0)
    other = write_sample_dataset(str(tmp_path / "other"), seed=1)
    for a, b, c in zip(manifest.all_files(), again.all_files(), other.all_files(), strict=True):
        assert filecmp.cmp(a, b, shallow=False)
        assert not filecmp.cmp(a, c, shallow=False)
    assert filecmp.cmp(manifest.planted_path, again.planted_path, shallow=False)
    assert filecmp.cmp(manifest.eval_path, again.eval_path, shallow=False)


def test_seen_rows_agree_with_comparing_every_set(sample):
    """SeenRows (MinHash candidates, then exact) gives the verdict of comparing a row's 5-gram set with every earlier
    row's, row by row over each split in file order (the planted duplicates are the rows too close to an earlier
    one), and compares few sets exactly."""
    total_pairs = compared = close = 0
    for split in SPLITS:
        rows = [{"messages": [{**m, "tool_calls": m["tool_calls"] or []} for m in r["messages"]]}
                for r in sample.rows[split] if r["messages"]]
        seen, sets = SeenRows(), []
        for row in rows:
            shingles = _shingles(row)
            assert _shingle_hashes(row).size == len(shingles)  # one hash per distinct 5-gram
            want = any(_jaccard(shingles, other) >= MAX_ROW_SIMILARITY for other in sets)
            got, hashes, sig = seen.check(row)
            assert got == want
            close += want
            seen.add(hashes, sig)
            sets.append(shingles)
        total_pairs += len(rows) * (len(rows) - 1) // 2
        compared += seen.compared
    assert close >= len(sample.planted["exact_duplicates"]) + len(sample.planted["near_duplicates"])
    assert compared < 0.05 * total_pairs


def test_planted_entries_point_at_their_file_and_row(sample):
    planted = sample.planted
    kinds = ("quarantine", "exact_duplicates", "near_duplicates", "contaminated", "not_contaminated",
             "disallowed_license", "context_answers")
    for kind in kinds:
        assert planted[kind], kind
        for entry in planted[kind]:
            row = sample.files[entry["file"]][entry["row"]]
            assert entry["file"] in planted["files"][entry["split"]]
            assert row["uuid"] == entry["uuid"] and row["category"] == entry["split"]


def test_row_variety(sample):
    rows = sample.rows
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
               if json.loads(r["metadata"])["template"] == "tool_calling")


def test_metadata_is_json_for_every_row(sample):
    for split in SPLITS:
        for r in sample.rows[split]:
            meta = json.loads(r["metadata"])
            assert set(meta) == {"source", "difficulty", "template"}, meta
            assert r["category"] == split and r["version"] == "v1"


def test_reasoning_on_rows_end_in_a_think_trace_off_rows_have_none(derived):
    on = off = 0
    for e in _examples(derived):
        final = e.messages[-1]["content"]
        if e.reasoning == "on":
            on += 1
            assert re.fullmatch(r"<think>\n.+\n</think>\n\n\S.*", final, re.DOTALL), final[:200]
            assert final.count("<think>") == final.count("</think>") == 1
        else:
            off += 1
            assert not any("<think>" in m["content"] for m in e.messages), e.uuid
    assert on > 50 and off > 50


def test_system_prompts_are_toggles_empty_or_tool_lists(sample, derived):
    firsts = collections.Counter()
    no_system = 0
    tool_lists = 0
    for split in SPLITS:
        for e in _examples(derived, [split]):
            system = [m["content"] for m in e.messages if m["role"] == "system"]
            if not system:
                no_system += 1
                continue
            lines = system[0].split("\n")
            firsts[lines[0]] += 1
            if lines[0] in ON_TOGGLES + OFF_TOGGLES:  # a toggle agrees with the row's reasoning flag
                assert lines[0] in (ON_TOGGLES if e.reasoning == "on" else OFF_TOGGLES), (e.reasoning, lines[0])
            if split == "tool_calling":
                tools = json.loads(lines[-1])  # the tool list, as JSON, on the prompt's last line
                assert all(set(t) == {"name", "description", "parameters"} for t in tools)
                listed = {t["name"] for t in tools}
                called = {c["function"]["name"] for m in e.messages for c in m["tool_calls"]}
                assert called and called <= listed
                tool_lists += 1
    assert all(firsts[t] > 0 for t in ON_TOGGLES + OFF_TOGGLES), firsts
    assert firsts[""] > 10 and no_system > 10 and tool_lists > 50


def test_context_rows_have_a_background_paragraph(sample, derived):
    by_uuid = {e.uuid: e for e in _examples(derived)}
    splits = collections.Counter()
    for key in sample.planted["context_answers"]:
        e = by_uuid[key["uuid"]]
        splits[e.category] += 1
        system = e.messages[0]
        assert system["role"] == "system"
        toggle, _, background = system["content"].rpartition("\n\n")
        assert toggle in ("",) + ON_TOGGLES + OFF_TOGGLES and background.startswith("Background:\n")
        assert key["answer_sentence"] in background
    assert set(splits) == {"chat", "stem"}


def test_chat_has_single_and_multi_turn_rows(derived):
    users = collections.Counter(sum(m["role"] == "user" for m in e.messages) for e in _examples(derived, ["chat"]))
    assert users[1] > sum(users.values()) / 2
    assert sum(users[k] for k in (2, 3, 4)) >= 5 and max(users) <= 4


def test_tool_turns_answer_tool_calls(derived):
    with_text = 0
    for e in _examples(derived, ["tool_calling"]):
        msgs = e.messages
        i = 0
        while i < len(msgs):
            m = msgs[i]
            if m["role"] == "assistant" and m["tool_calls"]:
                replies = msgs[i + 1 : i + 1 + len(m["tool_calls"])]
                assert [r["role"] for r in replies] == ["tool"] * len(m["tool_calls"]), e.uuid
                assert all(isinstance(json.loads(r["content"]), dict) for r in replies)
                assert all(json.loads(c["function"]["arguments"]) for c in m["tool_calls"])
                if e.reasoning == "on":  # reasoning rows think in the turn that calls the tool too
                    assert m["content"].startswith("<think>\n") and m["content"].endswith("\n</think>")
                    with_text += 1
                i += 1 + len(m["tool_calls"])
                continue
            assert m["role"] != "tool", e.uuid
            i += 1
        assert msgs[-1]["role"] == "assistant" and not msgs[-1]["tool_calls"]
    assert with_text > 10


def _mean_chars(derived) -> dict:
    return {s: float(np.mean([_num_chars(e.messages) for e in _examples(derived, [s])])) for s in SPLITS}


def test_lengths_follow_the_dataset_card_with_a_long_tail(sample, derived):
    scale = sample.manifest.size_scale
    means = _mean_chars(derived)
    print("mean characters per row:", {s: round(v) for s, v in means.items()})
    assert means["code"] > means["math"] > means["tool_calling"] > means["stem"] > means["chat"]
    for split, mean in means.items():
        # chat and tool_calling end above their share: their templated rows are longer than the drawn length
        assert 0.7 < mean / (CARD_BYTES_PER_ROW[split] * scale) < 3.0, (split, mean)
    code = [_num_chars(e.messages) for e in _examples(derived, ["code"])]
    p50, p99 = np.percentile(code, [50, 99])
    assert p99 / p50 >= 3, (p50, p99)


def test_size_scale_scales_the_lengths(tmp_path):
    small = write_sample_dataset(str(tmp_path / "small"), size_scale=0.02)
    large = write_sample_dataset(str(tmp_path / "large"), size_scale=0.08)

    def means(m):
        rows = {s: [r for p in m.split_files[s] for r in pq.read_table(p).to_pylist()] for s in SPLITS}
        return _mean_chars({s: [derive_example(r, max_chars=EnrichConfig().max_chars) for r in rows[s]]
                            for s in SPLITS})

    a, b = means(small), means(large)
    for split in ("code", "math"):
        assert 3.0 < b[split] / a[split] < 5.0, (split, a[split], b[split])
    assert all(b[s] > a[s] for s in SPLITS)


def test_quarantine_counts_match_exactly(sample):
    planted = sample.planted
    found = collections.Counter()
    where = set()
    for name, rows in sample.files.items():
        for i, row in enumerate(rows):
            out = derive_example(row, max_chars=planted["max_chars"])
            if not isinstance(out, Example):
                found[out.reason] += 1
                where.add((name, i, out.reason))
    assert dict(found) == planted["quarantine_counts"]
    assert where == {(q["file"], q["row"], q["reason"]) for q in planted["quarantine"]}
    too_long = [sample.files[q["file"]][q["row"]] for q in planted["quarantine"] if q["reason"] == "too_long"]
    assert too_long and all(_num_chars(r["messages"]) > EnrichConfig().max_chars for r in too_long)


def test_licenses(sample, derived):
    allowed = set(sample.planted["allowed_licenses"])
    bad = {e.uuid for e in _examples(derived) if e.license.lower() not in allowed}
    assert bad == {x["uuid"] for x in sample.planted["disallowed_license"]}


def test_exact_and_near_duplicates_match_answer_key(sample, derived):
    planted = sample.planted
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
    planted = sample.planted
    index = build_eval_index(load_eval_texts((sample.manifest.eval_path,), resolve("/"), None).texts, planted["ngram"])
    examples = _examples(derived)
    counts = contamination_counts([e.full_text() for e in examples], build_sorted_index(index), planted["ngram"])
    hits = {e.uuid for e, n in zip(examples, counts, strict=True) if n}
    assert hits == {x["uuid"] for x in planted["contaminated"]}
    assert not hits & {x["uuid"] for x in planted["not_contaminated"]}


def test_context_answer_key_points_at_a_real_sentence(sample, derived):
    planted = sample.planted
    by_uuid = {e.uuid: e for e in _examples(derived)}
    assert len(planted["context_answers"]) > 50
    for key in planted["context_answers"]:
        e = by_uuid[key["uuid"]]
        assert e.question == key["question"] and key["answer_sentence"] in e.context
        assert all(d in e.context for d in key["distractors"])


def test_cli_entry(tmp_path):
    out = tmp_path / "cli"
    proc = subprocess.run([sys.executable, "-m", "raytrain.sample_data", str(out), "--rows-per-split", "25",
                           "--size-scale", "0.02"],
                          capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert proc.returncode == 0, proc.stderr
    chat = sorted((out / "data").glob("chat-*-of-00002.parquet"))
    assert len(chat) == 2 and sum(pq.read_metadata(p).num_rows for p in chat) == 25
    assert pq.read_metadata(out / "data" / "tool-00000-of-00001.parquet").num_rows == 25
    assert load_planted(str(out))["size_scale"] == 0.02


def test_real_embedder_picks_the_planted_answer_sentence(sample, derived):
    from raytrain.enrich.relevance import load_embedder, score_batch
    from raytrain.enrich.sentences import split_sentences

    keys = sample.planted["context_answers"]
    by_uuid = {e.uuid: e for e in _examples(derived)}
    examples = [by_uuid[k["uuid"]] for k in keys]
    contexts = [split_sentences(e.context) for e in examples]
    sels = score_batch(contexts, [e.question for e in examples], [e.answer for e in examples], load_embedder(),
                       top_k=1)
    for key, sents, sel in zip(keys, contexts, sels, strict=True):
        assert key["answer_sentence"] in sents and all(d in sents for d in key["distractors"])
        assert sel.kept(sents) == [key["answer_sentence"]]
