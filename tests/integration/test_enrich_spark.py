"""The enrichment on real Spark-on-Ray (RayDP), the real all-MiniLM-L6-v2 and the real Mistral v3 tokenizer, on the
sample dataset with its answer key (planted.json). The enrichment checked is the session's shared demo run
(tests/demo_run.py); the tests that enrich again (a schema error, a reused corpus table) share the module's Ray."""

import json
import os
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from mistral_common.protocol.instruct.messages import AssistantMessage, SystemMessage, UserMessage
from mistral_common.protocol.instruct.request import ChatCompletionRequest
from process_faults import run_with_deadline, spark_executor_processes, spark_jobs_started

from raytrain.config import load_job_config
from raytrain.dataset.tokenize import load_tokenizer, tokenize_conversation
from raytrain.enrich.context import context_block, final_answer, is_toggle_line
from raytrain.enrich.job import enrich_in_session, run_enrich
from raytrain.errors import RaytrainError
from raytrain.sample_data import load_corpus_key, load_planted, write_sample_dataset
from raytrain.storage import MANIFEST, RunPaths, resolve

DERIVE_REASONS = ("missing_uuid", "missing_messages", "bad_role", "undecodable_text", "empty_answer", "too_long")


@pytest.fixture(scope="module")
def out(demo_data, tmp_path_factory):
    """The demo run's enrichment (the session's shared run: Spark on Ray via the CLI), read back with pyarrow; the
    sample written again here is the one the run enriched (byte for byte: the generator is deterministic)."""
    sample = write_sample_dataset(str(tmp_path_factory.mktemp("enrich") / "sample"))
    job, run_root = demo_data.job(), demo_data.root
    for path in sample.all_files():
        run_input = os.path.join(run_root.join("data", "sample").path, os.path.relpath(path, sample.out_dir))
        assert open(path, "rb").read() == open(run_input, "rb").read(), path
    paths = RunPaths(run_root)
    raw = pa.concat_tables([pq.read_table(p) for p in sample.all_files()]).to_pylist()
    # the input order duplicates keep their first row in: input.splits in order, each split's files by name, uuid
    files = [f for split in job.input.splits for f in sorted(sample.split_files[split], key=os.path.basename)]
    order = {u: (i, u) for i, f in enumerate(files) for u in pq.read_table(f, columns=["uuid"])["uuid"].to_pylist()}
    return SimpleNamespace(
        job=job, run_root=run_root, enriched_loc=paths.enriched, sample=sample, raw=raw, order=order,
        planted=load_planted(sample.out_dir),
        report=json.loads(paths.reports.join("enrich_report.json").read_text()),
        enriched=pq.read_table(paths.enriched.path).to_pylist(),  # pyarrow, not our code, reads Spark's output
        quarantine=pq.read_table(paths.quarantine.path).to_pylist(),
    )


def _reasons(out) -> dict:
    counts: dict = {}
    for r in out.quarantine:
        counts[r["reason"]] = counts.get(r["reason"], 0) + 1
    return counts


def _mixed_turns(out, measure=lambda text: 1) -> dict:
    """uuid -> ``measure(text)`` summed over the assistant turns with both text and tool calls (v3 cannot hold both),
    found in the raw input, for the rows that pass the tokenization check: not planted for an earlier quarantine
    reason, not the dropped (later in input order) member of a planted duplicate pair, not longer than seq_len.
    Default: the number of turns."""
    p = out.planted
    earlier = {r["uuid"] for kind in ("quarantine", "disallowed_license", "contaminated") for r in p[kind]}
    earlier |= {max(r["uuid"], r["duplicate_of"], key=out.order.get) for kind in ("exact_duplicates", "near_duplicates")
                for r in p[kind]}
    earlier |= {q["uuid"] for q in out.quarantine if q["reason"] == "too_many_tokens"}  # longer than seq_len
    mixed = {row["uuid"]: sum(measure(m["content"]) for m in row["messages"] or []
                              if m["role"] == "assistant" and (m["content"] or "").strip() and m["tool_calls"])
             for row in out.raw}
    return {u: n for u, n in mixed.items() if n and u not in earlier}


def test_quarantine_counts_match_planted(out):
    p = out.planted
    expected = dict(p["quarantine_counts"])
    expected.update({"license": len(p["disallowed_license"]), "exact_duplicate": len(p["exact_duplicates"]),
                     "near_duplicate": len(p["near_duplicates"]), "contaminated": len(p["contaminated"])})
    # The long tail of the sample's lengths: rows over dataset.seq_len are dropped by the default length policy
    # (test_length_policy_counts_match_mistral_common checks each of them).
    too_long = _reasons(out).get("too_many_tokens", 0)
    assert too_long > 0, "the sample's long tail should exceed the demo's seq_len"
    expected["too_many_tokens"] = too_long
    assert _reasons(out) == expected
    assert out.report["quarantined"] == expected
    for r in p["quarantine"]:
        if r["uuid"]:
            assert {q["reason"] for q in out.quarantine if q["uuid"] == r["uuid"]} == {r["reason"]}
    assert {q["uuid"] for q in out.quarantine if q["reason"] == "license"} == {r["uuid"] for r in p["disallowed_license"]}
    assert not [q for q in out.quarantine if q["reason"] == "untokenizable"]


def test_text_with_tool_calls_kept_with_text_dropped_and_counted(out):
    """dataset.text_with_tool_calls=drop_text (default): rows whose assistant turn has a <think> trace and a tool
    call are kept (not quarantined), the trace dropped from that turn only, and counted per row and in the report."""
    mixed = _mixed_turns(out)
    assert mixed, "the sample data plants tool calls after <think> traces"
    by_uuid = {r["uuid"]: r for r in out.enriched}
    assert set(mixed) <= set(by_uuid)
    assert {u: r["dropped_text_turns"] for u, r in by_uuid.items() if r["dropped_text_turns"]} == mixed
    chars = _mixed_turns(out, measure=len)
    assert {u: r["dropped_text_chars"] for u, r in by_uuid.items() if r["dropped_text_chars"]} == chars
    for u in mixed:
        trained = json.loads(by_uuid[u]["messages_json"])
        assert not [m for m in trained if m["role"] == "assistant" and m["content"].strip() and m["tool_calls"]]
        assert any(m["tool_calls"] for m in trained)
    assert out.report["text_with_tool_calls"] == {"policy": "drop_text", "rows": len(mixed),
                                                  "turns_text_dropped": sum(mixed.values()),
                                                  "chars_text_dropped": sum(chars.values())}


@pytest.mark.parametrize("kind,reason", [("exact_duplicates", "exact_duplicate"), ("near_duplicates", "near_duplicate")])
def test_planted_duplicates_caught_keep_the_first_in_input_order(out, kind, reason):
    flagged = {q["uuid"]: q["detail"] for q in out.quarantine if q["reason"] == reason}
    assert any(sorted((p["uuid"], p["duplicate_of"])) != sorted((p["uuid"], p["duplicate_of"]), key=out.order.get)
               for p in out.planted[kind]), "the sample should plant a pair whose smaller uuid comes later"
    for pair in out.planted[kind]:
        keep, drop = sorted((pair["uuid"], pair["duplicate_of"]), key=out.order.get)
        assert drop in flagged and keep in flagged[drop], (pair, flagged.get(drop))
        assert keep not in flagged


def test_contaminated_rows_removed_and_listed(out):
    want = {r["uuid"] for r in out.planted["contaminated"]}
    assert {q["uuid"] for q in out.quarantine if q["reason"] == "contaminated"} == want
    assert {r["uuid"] for r in out.report["decontamination"]["rows"]} == want
    near_miss = {r["uuid"] for r in out.planted["not_contaminated"]}  # 12 words of an eval item: not a 13-gram
    assert near_miss <= {r["uuid"] for r in out.enriched}


def test_every_row_accounted_for(out):
    assert out.report["rows_in"] == len(out.raw) == len(out.enriched) + len(out.quarantine)
    assert out.report["rows_out"] == len(out.enriched)
    for step in out.report["steps"]:
        assert step["rows_in"] == step["rows_out"] + sum(step["quarantined"].values())
    seen = [r["uuid"] for r in out.enriched] + [q["uuid"] for q in out.quarantine if q["uuid"]]
    assert sorted(seen) == sorted(r["uuid"] for r in out.raw if r["uuid"])
    files = sorted(p for p in os.listdir(out.enriched_loc.path) if p.endswith(".parquet"))
    assert len(files) > 1  # hash-partitioned by uuid, no global sort: each file sorted, the files' order fixed
    for name in files:
        uuids = pq.read_table(os.path.join(out.enriched_loc.path, name), columns=["uuid"]).column("uuid").to_pylist()
        assert uuids == sorted(uuids), name


def _raw_by_uuid(out) -> dict:
    return {r["uuid"]: r for r in out.raw if r["uuid"]}


def _last_user(messages) -> int:
    return max(i for i, m in enumerate(messages) if m["role"] == "user")


def test_answering_sentence_kept_and_system_prompt_verbatim(out):
    by_uuid, raw = {r["uuid"]: r for r in out.enriched}, _raw_by_uuid(out)
    rows = [(k, by_uuid[k["uuid"]]) for k in out.planted["context_answers"] if k["uuid"] in by_uuid]
    assert len(rows) > 40
    for key, row in rows:
        assert key["answer_sentence"] in row["kept_sentences"], (key, row["kept_sentences"])
        assert len(row["kept_sentences"]) <= out.job.enrich.top_k
        assert any(d not in row["kept_sentences"] for d in key["distractors"])
        assert row["kept_sentences"] == [row["context_sentences"][i] for i in row["kept_indices"]]
        trained, original = json.loads(row["messages_json"]), raw[key["uuid"]]["messages"]
        # every system prompt reaches the tokenizer as it was; the kept sentences come as their own block
        assert [m["content"] for m in trained if m["role"] == "system"] == \
            [m["content"] for m in original if m["role"] == "system"]
        assert trained[_last_user(trained)]["content"] == context_block(row["kept_sentences"]) + "\n\n" + \
            original[_last_user(original)]["content"]


def test_reasoning_toggles_train_verbatim_like_mistral_common(out):
    """Rows whose system prompt is a reasoning toggle: token ids equal mistral-common's own encoding of the
    original messages, plus the context block in the last user turn when sentences were kept."""
    tokenizer, raw = load_tokenizer(out.job.dataset.tokenizer), _raw_by_uuid(out)
    seen = set()
    for row in out.enriched:
        original = raw[row["uuid"]]["messages"]
        system = [m["content"] for m in original if m["role"] == "system"]
        if len(system) != 1 or not is_toggle_line(system[0]) or any(m["tool_calls"] for m in original):
            continue
        seen.add(system[0].strip())
        last_user = _last_user(original)
        ref = [SystemMessage(content=system[0])]
        for i, m in enumerate(original[1:], start=1):
            text = m["content"]
            added = list(row["kept_sentences"]) or list(row["corpus_sentences"])  # own context, else the corpus's
            if i == last_user and added:
                text = context_block(added) + "\n\n" + text
            ref.append(UserMessage(content=text) if m["role"] == "user" else AssistantMessage(content=text))
        want = tokenizer.encode_chat_completion(ChatCompletionRequest(messages=ref)).tokens
        got = tokenize_conversation(json.loads(row["messages_json"]), tokenizer, verify=False).input_ids
        assert got == want, row["uuid"]
    assert seen >= {"detailed thinking on", "detailed thinking off", "/no_think"}, seen


def test_length_policy_counts_match_mistral_common(out):
    """dataset.length_policy=drop (default): kept rows fit seq_len whole (nothing is chunked), each dropped row
    is quarantined with its token count, and the report's per-split lengths agree with both."""
    seq_len, tokenizer, raw = out.job.dataset.seq_len, load_tokenizer(out.job.dataset.tokenizer), _raw_by_uuid(out)
    assert all(r["num_tokens"] <= seq_len and r["train_tokens"] == r["num_tokens"] and r["length_action"] == "keep"
               for r in out.enriched)
    dropped = {q["uuid"]: q for q in out.quarantine if q["reason"] == "too_many_tokens"}
    lengths: dict = {}
    for r in out.enriched:
        lengths.setdefault(r["split"], []).append(r["num_tokens"])
    checked = 0
    for uuid, q in dropped.items():
        n = int(q["detail"].split(" tokens")[0])
        assert n > seq_len and f"dataset.seq_len={seq_len}" in q["detail"]
        lengths.setdefault(q["split"], []).append(n)
        original = raw[uuid]["messages"]
        if [m["role"] for m in original] == ["user", "assistant"]:  # no context, no block: the raw row itself
            ref = [UserMessage(content=original[0]["content"]), AssistantMessage(content=original[1]["content"])]
            assert n == len(tokenizer.encode_chat_completion(ChatCompletionRequest(messages=ref)).tokens), uuid
            checked += 1
    assert checked, "no dropped single-turn row to check against mistral-common"
    report = out.report["length"]
    assert (report["policy"], report["seq_len"]) == ("drop", seq_len)
    for split, values in lengths.items():
        got = report["per_split"][split]
        assert got["tokens"]["count"] == len(values) and got["tokens"]["max"] == max(values)
        assert got["tokens"]["sum"] == sum(values)
        assert got["rows_dropped"] == sum(1 for q in dropped.values() if q["split"] == split)
        assert got["tokens_dropped"] == sum(v for v in values if v > seq_len)
        assert got["rows_truncated"] == got["rows_split"] == 0
    assert report["overall"]["rows_dropped"] == len(dropped)


def _check_cos_sim(out, rows, sentences: str, scores: str, question_scores: str, answer_scores: str) -> None:
    """Each row's stored scores equal sentence_transformers.util.cos_sim of its sentences with its question and
    final answer, combined with enrich.question_weight (to 1e-5)."""
    from sentence_transformers import SentenceTransformer, util

    from raytrain.enrich.relevance import default_model_path

    model = SentenceTransformer(default_model_path(), device="cpu")
    w = out.job.enrich.question_weight
    assert rows
    for r in rows:
        sent = model.encode(list(r[sentences]), convert_to_tensor=True)
        # the answer side embeds the final answer (after </think>): enrich.answer_text=final
        qa = model.encode([r["question"], final_answer(r["answer"])], convert_to_tensor=True)
        sims = util.cos_sim(sent, qa).numpy()  # (S, 2)
        np.testing.assert_allclose(r[question_scores], sims[:, 0], atol=1e-5)
        np.testing.assert_allclose(r[answer_scores], sims[:, 1], atol=1e-5)
        np.testing.assert_allclose(r[scores], w * sims[:, 0] + (1 - w) * sims[:, 1], atol=1e-5)


def test_scores_equal_sentence_transformers_cos_sim(out):
    rows = [r for r in out.enriched if r["context_sentences"] and not r["chunked_texts"]][:4]
    _check_cos_sim(out, rows, "context_sentences", "sentence_scores", "question_scores", "answer_scores")


def test_enriched_conversations_tokenize_like_mistral_common(out):
    tokenizer = load_tokenizer(out.job.dataset.tokenizer)
    for r in out.enriched:  # verify=True: the ids equal mistral-common's encode_chat_completion
        tokenized = tokenize_conversation(json.loads(r["messages_json"]), tokenizer, verify=True)
        assert len(tokenized.input_ids) == r["num_tokens"]
        assert r["input_ids"] == tokenized.input_ids and r["loss_mask"] == tokenized.loss_mask, r["uuid"]


def test_manifest_and_summary_written(out):
    loc = out.enriched_loc
    manifest = json.loads(loc.join(MANIFEST).read_text())
    assert manifest["config_hash"] == out.job.data_hash()
    assert manifest["enriched"]["files"] == sorted(n for n in os.listdir(loc.path) if n.endswith(".parquet"))
    assert manifest["enriched"]["rows"] == len(out.enriched)
    assert manifest["quarantine"]["rows"] == len(out.quarantine)
    summary = out.run_root.join("reports", "enrich_summary.txt").read_text()
    for reason in (*DERIVE_REASONS, "license", "exact_duplicate", "near_duplicate", "contaminated",
                   "too_many_tokens"):
        assert reason in summary
    # per split: input files and rows, kept, context coverage, token lengths and what the length policy did
    files = out.sample.split_files
    assert out.report["inputs"]["layout"] == "hub"
    assert out.report["inputs"]["files"] == {k: [os.path.basename(p) for p in v] for k, v in files.items()}
    assert out.report["inputs"]["files"]["tool_calling"][0].startswith("tool-")
    assert "length policy (drop, seq_len" in summary and "rows with context to select from" in summary
    kept_per_split: dict = {}
    for r in out.enriched:
        kept_per_split[r["split"]] = kept_per_split.get(r["split"], 0) + 1
    assert out.report["rows_out_per_split"] == kept_per_split
    for split, rows in out.report["rows_in_per_split"].items():
        assert rows == sum(pq.ParquetFile(p).metadata.num_rows for p in files[split])
        line = next(x for x in summary.splitlines() if x.startswith(f"{split} "))
        assert line.split()[1:4] == [str(len(files[split])), str(rows), str(kept_per_split[split])]
    assert out.report["similarity"]["rows_with_candidates"] == sum(1 for r in out.enriched if r["context_sentences"])
    assert out.report["similarity"]["rows_with_context_added"] == sum(1 for r in out.enriched if r["kept_sentences"])
    assert all(s >= out.job.enrich.min_score for r in out.enriched for s in
               [r["sentence_scores"][i] for i in r["kept_indices"]])
    sim = out.report["similarity"]["all_sentences"]
    assert sim["min"] <= sim["p50"] <= sim["p90"] <= sim["max"]


def test_hand_off_packs_without_error(out, ray_local, tmp_path):
    from raytrain.dataset.stream import load_packed, pack_enriched

    packed = pack_enriched(out.enriched_loc, resolve(str(tmp_path / "packed")), out.job.dataset, "h")
    held_out = packed.validation.num_real_tokens if packed.validation else 0  # the demo holds 5% out
    # every enriched row's tokens, in training or validation: nothing chunked, nothing cut, nothing lost
    assert packed.num_real_tokens + held_out == sum(r["num_tokens"] for r in out.enriched)
    # the same enriched rows always give the same packs (Ray Data keeps the files' row order through packing): the
    # demo run packed them too, in its own process
    again_packed = load_packed(RunPaths(out.run_root).packed, out.job.data_hash())
    assert again_packed is not None

    def packs_of(data):  # every pack's columns; sorted, as the written files' names differ per write
        return sorted(row for p in data.files for row in pq.read_table(p).to_pandas().astype(str).values.tolist())

    assert packs_of(packed) == packs_of(again_packed)
    assert packs_of(packed.validation) == packs_of(again_packed.validation)
    # packing the stored ids gives the packs that tokenizing the conversations again gives
    from raytrain.dataset.pack import PACK_COLUMNS, pack_batch, tokenize_frame

    rows = pd.DataFrame(out.enriched)
    stored = pack_batch(rows, out.job.dataset.seq_len, out.job.dataset.length_policy)
    again = pack_batch(tokenize_frame(rows[["uuid", "messages_json"]], out.job.dataset.tokenizer),
                       out.job.dataset.seq_len, out.job.dataset.length_policy)
    for name in (*PACK_COLUMNS, "doc_ids", "num_tokens", "num_targets"):
        np.testing.assert_array_equal(stored[name], again[name], err_msg=name)


def test_schema_error_names_column_and_file(out, ray_local, tmp_path):
    good = pq.read_table(out.sample.split_files["chat"][0])
    bad = good.set_column(good.schema.get_field_index("messages"), "messages",
                          pa.array(["not a list"] * good.num_rows))
    (tmp_path / "chat").mkdir()
    path = tmp_path / "chat" / "part-0.parquet"
    pq.write_table(bad, path)
    job = load_job_config("configs/demo.yaml", ["input.splits=[chat]"])
    with pytest.raises(RaytrainError, match=r"column messages has type string") as e:
        run_enrich(job, resolve(str(tmp_path)), resolve(str(tmp_path / "run")))
    assert str(path) in str(e.value)



# ---- context from a corpus (enrich.context_corpus=[sample] in the demo config) ------------------------------------
def _corpus_rows(out) -> dict:
    return {r["uuid"]: r for r in out.enriched if r["corpus_path"] == "added"}


def test_corpus_answering_sentence_retrieved_unrelated_not(out):
    """The sample corpus has exactly one document answering each of its rows: that sentence reaches the row's
    context block (document order, delimited), unrelated documents reach no row, rows with their own context are
    not searched, and every row's path is one of three."""
    key = load_corpus_key(out.sample.out_dir)
    by_uuid = {r["uuid"]: r for r in out.enriched}
    answered = [(k, by_uuid[k["uuid"]]) for k in key["answered"] if k["uuid"] in by_uuid]
    assert len(answered) >= 10
    for k, row in answered:
        assert row["corpus_path"] == "added" and k["sentence"] in row["corpus_sentences"], (k, row["corpus_sentences"])
        assert k["doc_id"] in row["corpus_doc_ids"]
        pairs = list(zip(row["corpus_doc_ids"], row["corpus_sentence_indices"], strict=True))
        assert pairs == sorted(pairs) and len(pairs) <= out.job.enrich.top_k
        assert min(row["corpus_scores"]) >= out.job.enrich.min_score
        trained = json.loads(row["messages_json"])
        assert trained[_last_user(trained)]["content"].startswith(context_block(row["corpus_sentences"]) + "\n\n")
    unrelated = {s for d in key["unrelated"] for s in d["sentences"]}
    assert not [s for r in out.enriched for s in r["corpus_sentences"] if s in unrelated]
    assert all(not r["corpus_sentences"] for r in out.enriched if r["context_sentences"])
    assert {r["corpus_path"] for r in out.enriched} <= {"own_context", "added", "below_min_score"}
    assert {r["corpus_path"] for r in out.enriched if r["context_sentences"]} == {"own_context"}


def test_corpus_scores_equal_sentence_transformers_cos_sim(out):
    _check_cos_sim(out, list(_corpus_rows(out).values())[:6], "corpus_sentences", "corpus_scores",
                   "corpus_question_scores", "corpus_answer_scores")


def test_corpus_sentence_with_eval_item_never_trained(out):
    key = load_corpus_key(out.sample.out_dir)
    (leak,) = key["contaminated"]
    eval_item = json.loads(open(out.sample.eval_path, encoding="utf-8").readline())
    assert leak["eval_id"] == eval_item["id"]
    for r in out.enriched:
        assert leak["sentence"] not in r["messages_json"] and eval_item["question"] not in r["messages_json"]
        assert leak["sentence"] not in r["corpus_sentences"]
    corpus = out.report["corpus"]
    assert corpus["contaminated_removed"] >= 1
    assert any(c["doc_id"] == leak["doc_id"] for c in corpus["contaminated"])


def test_corpus_rows_tokenize_like_mistral_common(out):
    """Token ids of rows given corpus context equal mistral-common's encoding of their final messages."""
    tokenizer = load_tokenizer(out.job.dataset.tokenizer)
    checked = 0
    for r in _corpus_rows(out).values():
        messages = json.loads(r["messages_json"])
        if any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
            continue
        ref = [SystemMessage(content=m["content"]) if m["role"] == "system" else UserMessage(content=m["content"])
               if m["role"] == "user" else AssistantMessage(content=m["content"]) for m in messages]
        want = tokenizer.encode_chat_completion(ChatCompletionRequest(messages=ref)).tokens
        got = tokenize_conversation(messages, tokenizer, verify=False).input_ids
        assert got == want and len(got) == r["num_tokens"], r["uuid"]
        checked += 1
    assert checked >= 5


def test_corpus_report(out):
    corpus, key = out.report["corpus"], load_corpus_key(out.sample.out_dir)
    assert corpus["method"] == "exact" and corpus["recall"] is None and not corpus["reused"]
    assert corpus["retrieve_seconds"] > 0  # the retrieval's task seconds inside pass 2 (a Spark accumulator)
    assert corpus["sentences_embedded_this_run"] == corpus["sentences"] > 0
    # the boilerplate sentence closes every answering document: collapsed to one
    assert corpus["duplicates_collapsed"] >= len(key["answered"]) - 1
    assert corpus["searchable"] == corpus["sentences"] - corpus["contaminated_removed"]
    by_split: dict = {}
    for r in out.enriched:
        by_split.setdefault(r["split"], {"own_context": 0, "added": 0, "below_min_score": 0})[r["corpus_path"]] += 1
    for split, paths in by_split.items():
        got = corpus["per_split"][split]
        assert {p: got[f"rows_{p}"] for p in paths} == paths
        assert got["rows"] == sum(paths.values())
    assert corpus["rows_added"] == len(_corpus_rows(out)) and corpus["scores"]["count"] == corpus["sentences_added"]
    used: dict = {}
    for r in out.enriched:
        for d in r["corpus_doc_ids"]:
            used[d] = used.get(d, 0) + 1
    assert [(d["doc_id"], d["sentences_added"]) for d in corpus["top_documents"]] == \
        sorted(used.items(), key=lambda kv: (-kv[1], kv[0]))[:10]
    summary = out.run_root.join("reports", "enrich_summary.txt").read_text()
    assert "context corpus" in summary and "removed as contaminated" in summary and "most-used documents" in summary


@pytest.fixture(scope="module")
def spark(ray_local):
    """One Spark session on the module's Ray for the tests that enrich again (the reused corpus table, the
    preference pairs): one JVM start instead of one per test."""
    from raytrain.enrich.spark import spark_session

    with spark_session(load_job_config("configs/demo.yaml", []).enrich) as session:
        yield session


def test_corpus_table_reused_and_approximate_search_equals_exact(out, spark, tmp_path):
    """A second run with the same corpus and model reads the embedded table (same files, nothing embedded) and,
    told to search approximately above 10 sentences, builds the faiss index: recall@k 1.0 on this small corpus,
    and the rows get the same corpus sentences as the exact search gave them."""
    import shutil

    table = out.report["corpus"]["table_uri"].replace("file://", "")
    run_root = tmp_path / "run2"
    shutil.copytree(out.run_root.join("data", "corpus").path, run_root / "data" / "corpus")  # the same run folder
    before = {p: os.stat(os.path.join(dp, p)).st_mtime_ns for dp, _, fs in os.walk(run_root / "data" / "corpus")
              for p in fs}
    job = load_job_config("configs/demo.yaml", ["input.splits=[chat]", "input.max_rows=24", "enrich.wave_rows=0",
                                                "enrich.num_partitions=1",
                                                "enrich.corpus_exact_max_sentences=10"])
    result = enrich_in_session(spark, job, resolve(out.sample.out_dir), resolve(str(run_root)),
                               eval_sets=(out.sample.eval_path,))
    corpus = result.report["corpus"]
    assert corpus["reused"] and corpus["sentences_embedded_this_run"] == 0
    assert os.path.basename(corpus["table_uri"]) == os.path.basename(table)
    after = {p: os.stat(os.path.join(dp, p)).st_mtime_ns for dp, _, fs in os.walk(run_root / "data" / "corpus")
             for p in fs}
    assert after == before  # the table's files untouched: not re-embedded, not rewritten
    assert corpus["method"] == "approximate" and corpus["recall"]["rows"] > 0 and corpus["recall"]["recall"] == 1.0
    first = {r["uuid"]: r for r in out.enriched}
    second = [r for r in pq.read_table(result.enriched.path).to_pylist() if r["uuid"] in first]
    assert [r for r in second if r["corpus_sentences"]]
    for r in second:
        assert r["corpus_sentences"] == first[r["uuid"]]["corpus_sentences"], r["uuid"]
        np.testing.assert_allclose(r["corpus_scores"], first[r["uuid"]]["corpus_scores"], atol=1e-6)


# ---- preference pairs (HelpSteer3-shaped sample) through the same Spark passes -------------------------------------
@pytest.fixture(scope="module")
def pairs(spark, tmp_path_factory):
    """The HelpSteer3-shaped sample enriched in the module's Spark session, read back with pyarrow."""
    import gzip

    from raytrain.enrich.pair_inputs import discover_pair_inputs
    from raytrain.enrich.pair_job import enrich_pairs_in_session
    from raytrain.enrich.plan import load_eval_texts
    from raytrain.sample_data.preference import write_preference_sample

    root = tmp_path_factory.mktemp("pairs")
    sample = write_preference_sample(str(root / "sample"))
    job = load_job_config("configs/demo.yaml", ["enrich.num_partitions=2"])
    input_root = resolve(str(root / "sample"))
    evals = load_eval_texts((sample.eval_path,), input_root, None)
    result = enrich_pairs_in_session(spark, job, discover_pair_inputs(input_root), evals, resolve(str(root / "run")))
    lines = {split: [json.loads(line) for line in gzip.open(path, "rt", encoding="utf-8")]
             for split, path in (("train", sample.train_path), ("validation", sample.validation_path))}
    return SimpleNamespace(job=job, sample=sample, result=result, lines=lines,
                           key=json.load(open(sample.planted_path)),
                           enriched=pq.read_table(result.enriched.path).to_pylist(),
                           quarantine=pq.read_table(result.quarantine.path).to_pylist())


def test_pairs_every_line_leaves_through_one_door_with_the_planted_reason(pairs):
    from raytrain.enrich.preference import derive_pair

    train = pairs.lines["train"]
    ids = [getattr(out, "pair_id", None) or out.uuid for out in map(derive_pair, train)]  # a pair, or Quarantined
    kept = {r["uuid"] for r in pairs.enriched}
    reason = {r["uuid"]: r["reason"] for r in pairs.quarantine}
    assert len(kept) + len(reason) == len(train) + len(pairs.lines["validation"])
    assert not kept & set(reason)
    planted = {e["line"]: e for e in pairs.key["planted"]}
    for line, pair_id in enumerate(ids):
        entry = planted.get(line)
        if entry is None:
            continue
        if entry["kind"] in ("exact_duplicate", "near_duplicate"):  # dedup keeps one of the two, the first
            pair = {pair_id, ids[entry["of_line"]]}
            assert len(pair & kept) == 1 and [reason[i] for i in pair - kept] == [entry["reason"]], entry
        else:
            assert reason[pair_id] == entry["reason"], entry
    assert len(reason) == len(planted)  # nothing else quarantined
    report = pairs.result.report
    assert report["rows_in"] == len(train) + len(pairs.lines["validation"])
    assert report["quarantined"] == {"bad_preference": 2, "bad_role": 1, "contaminated": 2, "exact_duplicate": 2,
                                     "missing_response": 1, "near_duplicate": 1, "tie": 2}
    assert report["per_split"]["validation"] == {"kept": len(pairs.lines["validation"]), "quarantined": 0}


def test_pairs_chosen_by_the_sign_and_tokenized_like_mistral_common(pairs):
    from raytrain.enrich.preference import derive_pair

    tokenizer = load_tokenizer(pairs.job.dataset.tokenizer)
    rows = {}
    for row in pairs.lines["train"] + pairs.lines["validation"]:
        pair = derive_pair(row)
        if hasattr(pair, "pair_id"):
            rows[pair.pair_id] = row
    checked = 0
    for out in pairs.enriched:
        row = rows[out["uuid"]]
        better, worse = ("response1", "response2") if row["overall_preference"] < 0 else ("response2", "response1")
        assert out["margin"] == abs(row["overall_preference"])
        context = row["context"] if isinstance(row["context"], list) else [{"role": "user", "content": row["context"]}]
        messages = [UserMessage(content=t["content"]) if t["role"] == "user" else AssistantMessage(content=t["content"])
                    for t in context]
        for response, ids in ((row[better], out["chosen_ids"]), (row[worse], out["rejected_ids"])):
            request = ChatCompletionRequest(messages=[*messages, AssistantMessage(content=response)])
            assert out["prompt_ids"] + ids == tokenizer.encode_chat_completion(request).tokens, out["uuid"]
        assert out["num_tokens"] == 2 * len(out["prompt_ids"]) + len(out["chosen_ids"]) + len(out["rejected_ids"])
        checked += 1
    assert checked == len(pairs.enriched) > 100


def test_pairs_report_counts_domains_and_languages_as_the_input_has_them(pairs):
    from collections import Counter

    report = pairs.result.report
    every = pairs.lines["train"] + pairs.lines["validation"]
    for key in ("domain", "language"):
        expected = Counter(row[key] for row in every)
        assert {name: v["kept"] + v["quarantined"] for name, v in report[f"per_{key}"].items()} == expected
        assert Counter(r[key] for r in pairs.enriched) == {n: v["kept"] for n, v in report[f"per_{key}"].items()
                                                           if v["kept"]}
    summary = RunPaths(resolve(pairs.result.enriched.uri.rsplit("/data/", 1)[0])).reports.join(
        "enrich_summary.txt").read_text()
    assert f"{report['rows_in']} rows in -> {report['rows_out']} kept" in summary
    manifest = json.loads(pairs.result.enriched.join(MANIFEST).read_text())
    assert manifest["enriched"]["rows"] == len(pairs.enriched) and manifest["kind"] == "preference_pairs"


def test_pairs_pack_with_ray_data_never_split_and_validation_apart(pairs, tmp_path):
    from raytrain.dataset.stream import pack_enriched_pairs

    packed = pack_enriched_pairs(pairs.result.enriched, resolve(str(tmp_path / "packed")), pairs.job.dataset, "h")
    by_id = {r["uuid"]: r for r in pairs.enriched}
    manifest = json.loads(packed.location.join(MANIFEST).read_text())
    for split, data in (("train", packed), ("validation", packed.validation)):
        rows = pq.read_table(list(data.files)).to_pylist()  # pyarrow reads what Ray Data wrote
        expected = {u for u, r in by_id.items() if r["split"] == split}
        seen = []
        for row in rows:
            segments = np.asarray(row["segment_ids"])
            ids = row["doc_ids"].split(",")
            table = np.asarray(row["pair_segments"]).reshape(-1, 2)
            assert row["num_pairs"] == len(ids) // 2 == int((table[:, 0] >= 0).sum())
            for slot in range(row["num_pairs"]):
                chosen, rejected = table[slot]
                assert (chosen, rejected) == (2 * slot, 2 * slot + 1)  # adjacent, chosen first: never split
                pair_id = ids[chosen]
                assert ids[rejected] == pair_id
                pair = by_id[pair_id]
                tokens = np.asarray(row["input_ids"])
                assert tokens[segments == chosen].tolist() == pair["prompt_ids"] + pair["chosen_ids"]
                assert tokens[segments == rejected].tolist() == pair["prompt_ids"] + pair["rejected_ids"]
                seen.append(pair_id)
            assert row["chosen_targets"] == sum(len(by_id[i]["chosen_ids"]) for i in ids[::2])
        assert sorted(seen) == sorted(expected)  # every pair of the split once, no other
        assert data.num_real_tokens == sum(by_id[u]["num_tokens"] for u in expected)
        assert (manifest if split == "train" else manifest["validation"])["pairs"] == len(expected)


# ---- waves (enrich.wave_rows): the input front to back in runs of whole row groups ---------------------------------
KILL_IN_WAVE = 2
"""The streamed enrichment's Spark executor JVM is SIGKILLed two Spark jobs into this wave."""
ENRICH_DEADLINE_S = 1200  # the streamed enrichment took ~3.5 min on the loaded 2-core machine; a hang fails


@dataclass
class ExecutorKill:
    killed: list[int] = field(default_factory=list)
    restarted: list[int] = field(default_factory=list)
    committed_at_kill: list[str] = field(default_factory=list)
    """The waves' commit records that existed when the executor was killed."""


def kill_executor_in_wave(spark, waves_folder: str, wave: int, done: threading.Event, kill: ExecutorKill) -> None:
    """Background thread: once wave `wave - 1` is committed and two Spark jobs of the next wave have started, SIGKILL
    the Spark executor JVM(s) of our Ray, then wait for RayDP to start a new one (its executor actors restart
    without limit; Spark re-runs the lost tasks and recomputes the lost persisted blocks)."""
    sc, deadline = spark.sparkContext, time.monotonic() + 900
    record, jobs_then = os.path.join(waves_folder, f"wave-{wave - 1:05d}.json"), None
    while time.monotonic() < deadline and not done.is_set():
        if jobs_then is None and os.path.exists(record):
            jobs_then = spark_jobs_started(sc)
        if jobs_then is not None and spark_jobs_started(sc) >= jobs_then + 2:
            break
        time.sleep(0.1)
    else:
        return
    kill.committed_at_kill = sorted(n for n in os.listdir(waves_folder) if n.endswith(".json"))
    for proc in spark_executor_processes():
        os.kill(proc.pid, signal.SIGKILL)
        kill.killed.append(proc.pid)
    while time.monotonic() < deadline and not done.is_set():
        fresh = [p.pid for p in spark_executor_processes() if p.pid not in kill.killed]
        if fresh:
            kill.restarted.extend(fresh)
            return
        time.sleep(0.5)


WAVE_ROWS, ROW_GROUP = 116, 8
"""The streamed enrichment's waves and the row groups its input's 64-row files are written in: three waves of 128,
120 and 72 rows, the stem file cut between its row groups (rows 0-56 in wave 1, 56-64 in wave 2), two planted
duplicate pairs across waves, two contaminated rows in the last wave."""


def _in_row_groups(sample_dir: str, folder: str) -> str:
    """A copy of the sample whose files of more than 32 rows are written again in row groups of ROW_GROUP rows,
    their rows sorted by uuid: the duplicate order (row group, uuid) then ranks every row as (file, uuid) ranks it
    in the sample itself, so the streamed run must decide every row as the one-wave run of the sample did."""
    shutil.copytree(sample_dir, folder)
    for name in os.listdir(os.path.join(folder, "data")):
        path = os.path.join(folder, "data", name)
        table = pq.read_table(path)
        if table.num_rows > 32:
            pq.write_table(table.sort_by("uuid"), path, row_group_size=ROW_GROUP)
    return folder


def _wave_of(waves) -> dict[str, int]:
    """uuid -> the wave that read it (its part of a file: rows start to stop)."""
    return {u: w.index for w in waves for p in w.parts
            for u in pq.read_table(p.file.loc.path, columns=["uuid"])["uuid"].to_pylist()[p.start:p.stop]}


def _row_groups(waves) -> set[tuple[str, int]]:
    """(uuid, the position of its row group in the input order) of every row, from pyarrow's reading of each row
    group."""
    out = set()
    for w in waves:
        for p in w.parts:
            f = pq.ParquetFile(p.file.loc.path)
            out |= {(u, p.file.first_group + g) for g in p.groups
                    for u in f.read_row_group(g, columns=["uuid"])["uuid"].to_pylist()}
    return out


@pytest.fixture(scope="module")
def streamed(out, spark, tmp_path_factory):
    """The demo's enrichment again in waves of WAVE_ROWS rows, in the module's Spark session, of the sample with its
    64-row files in row groups of ROW_GROUP (_in_row_groups): three waves, one file cut between two of them. Its Spark
    executor is SIGKILLed in wave 2 (kill_executor_in_wave): the tests below compare the result of that run with
    the undisturbed one-wave run of the sample."""
    import dataclasses

    from raytrain.enrich.plan import plan_enrichment
    from raytrain.enrich.waves import input_files, plan_waves

    job = dataclasses.replace(out.job, enrich=dataclasses.replace(out.job.enrich, wave_rows=WAVE_ROWS))
    folder = tmp_path_factory.mktemp("streamed")
    input_root = resolve(_in_row_groups(out.sample.out_dir, str(folder / "input")))
    plan = plan_enrichment(job, input_root, (out.sample.eval_path,))
    waves = plan_waves(input_files(plan.inputs.files, {k: v["file_row_groups"] for k, v in plan.footers.items()}),
                       job.wave_rows)
    run_root = resolve(str(folder / "run"))
    waves_folder = run_root.join("data", "waves").path
    done, kill = threading.Event(), ExecutorKill()
    killer = threading.Thread(target=kill_executor_in_wave, args=(spark, waves_folder, KILL_IN_WAVE, done, kill),
                              daemon=True)
    killer.start()
    try:
        result = run_with_deadline(lambda: enrich_in_session(spark, job, input_root, run_root, plan=plan),
                                   ENRICH_DEADLINE_S, "the streamed enrichment with an executor kill")
    finally:
        done.set()
        killer.join(timeout=10)
    return SimpleNamespace(job=job, input_root=input_root, run_root=run_root, result=result, kill=kill, waves=waves,
                           wave_of=_wave_of(waves), enriched=pq.read_table(result.enriched.path).to_pylist(),
                           quarantine=pq.read_table(result.quarantine.path).to_pylist())


def _assert_close(got, want, path="") -> None:
    """Equal trees, floats to 1e-5."""
    if isinstance(want, dict):
        assert sorted(got) == sorted(want), path
        for k in want:
            _assert_close(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, float):
        assert got == pytest.approx(want, abs=1e-5), path
    else:
        assert got == want, path


def _verdicts(rows) -> list[tuple]:
    return sorted((q["uuid"] or "", q["reason"], q["detail"]) for q in rows)


def test_waves_keep_quarantine_and_tokenize_exactly_as_one_wave(out, streamed):
    waves = streamed.result.report["waves"]
    assert [w["wave"] for w in waves] == [0, 1, 2]
    assert [w["files"] for w in waves] == [w.identity() for w in streamed.waves]
    cut = [f for w in waves for f in w["files"] if "#rows=" in f]
    assert [f.rsplit("/", 1)[-1] for f in cut] == ["stem-00000-of-00001.parquet#rows=0-56",
                                                   "stem-00000-of-00001.parquet#rows=56-64"]
    assert [w["rows_in"] for w in waves] == [128, 120, 72]
    # every row's group_index (the duplicate order) is its row group's, read by Spark by row index within the file
    state = pq.read_table(streamed.run_root.join("data", "waves", "dedup").path, columns=["uuid", "group_index"])
    pairs = set(zip(state["uuid"].to_pylist(), state["group_index"].to_pylist(), strict=True))
    assert len(pairs) > 200 and len({g for _, g in pairs}) > 20 and pairs <= _row_groups(streamed.waves)
    assert sum(w["rows_in"] for w in waves) == out.report["rows_in"] == len(out.raw)
    assert sum(w["kept"] for w in waves) == len(streamed.enriched) == len(out.enriched)
    assert {r["uuid"]: r["input_ids"] for r in streamed.enriched} == {r["uuid"]: r["input_ids"] for r in out.enriched}
    assert _verdicts(streamed.quarantine) == _verdicts(out.quarantine)  # same rows, reasons and details
    for key in ("rows_out", "quarantined", "steps", "tokens", "length"):
        assert streamed.result.report[key] == out.report[key], key
    # the same sentences kept (the tokens above); their scores embedded in other batches differ in the last digits
    _assert_close(streamed.result.report["similarity"], out.report["similarity"])
    same_eval_sets = [{k: v for k, v in e.items() if k != "uri"} for e in out.report["decontamination"]["eval_sets"]]
    assert streamed.result.report["decontamination"] == {**out.report["decontamination"], "eval_sets": [
        {**e, "uri": mine["uri"]} for e, mine in zip(same_eval_sets,
                                                     streamed.result.report["decontamination"]["eval_sets"],
                                                     strict=True)]}
    # the enriched files wave by wave, each wave's rows sorted by uuid in its files
    names = json.loads(streamed.result.enriched.join(MANIFEST).read_text())["enriched"]["files"]
    assert [n.split("/")[0] for n in names] == sorted(n.split("/")[0] for n in names) and "wave-00002" in names[-1]


def test_spark_executor_killed_mid_stream_is_replaced_and_changes_no_row(out, streamed):
    """The kill landed in wave 2, before its commit record (waves 0 and 1 committed); RayDP started a new executor
    JVM and the enrichment went on to the end: the kept rows and the quarantine's verdicts are the undisturbed
    one-wave run's (the test above compares everything else)."""
    kill = streamed.kill
    assert kill.killed, "no Spark executor process found to kill"
    assert kill.restarted, "no executor came back after the kill"
    assert kill.committed_at_kill == [f"wave-{w:05d}.json" for w in range(KILL_IN_WAVE)]
    assert sorted(r["uuid"] for r in streamed.enriched) == sorted(r["uuid"] for r in out.enriched)
    assert _verdicts(streamed.quarantine) == _verdicts(out.quarantine)
    print(f"[faults] killed Spark executor pid(s) {kill.killed} in wave {KILL_IN_WAVE}, restarted as "
          f"{kill.restarted}; {len(streamed.enriched)} rows kept as in the undisturbed run")


def test_waves_catch_duplicates_across_waves_and_contamination_in_the_last(out, streamed):
    wave_of = streamed.wave_of
    flagged = {q["uuid"]: (q["reason"], q["detail"]) for q in streamed.quarantine}
    across = 0
    for kind, reason in (("exact_duplicates", "exact_duplicate"), ("near_duplicates", "near_duplicate")):
        for pair in out.planted[kind]:
            first, later = sorted((pair["uuid"], pair["duplicate_of"]), key=out.order.get)
            if wave_of[first] != wave_of[later]:
                across += 1
                assert flagged[later][0] == reason and first in flagged[later][1]
                assert flagged.get(first, ("kept",))[0] not in ("exact_duplicate", "near_duplicate")
    assert across >= 2, "the waves should split a planted duplicate pair"
    last = max(wave_of.values())
    planted_last = [r["uuid"] for r in out.planted["contaminated"] if wave_of[r["uuid"]] == last]
    assert planted_last and all(flagged[u][0] == "contaminated" for u in planted_last)


def test_interrupted_waves_resume_at_the_first_uncommitted_wave(out, spark, streamed):
    """A run that stopped before wave 1's commit record: the enrichment again takes wave 0's record and files as they
    are and does wave 1 again, and wave 2 after it (its verdicts read wave 1's dedup state), with the same result."""
    waves = streamed.run_root.join("data", "waves")
    os.remove(waves.join("wave-00001.json").path)
    before = {n: os.stat(streamed.result.enriched.join(n).path).st_mtime_ns
              for n in os.listdir(streamed.result.enriched.path) if n.startswith("wave-0000")}
    result = enrich_in_session(spark, streamed.job, streamed.input_root, streamed.run_root,
                               eval_sets=(out.sample.eval_path,))
    after = {n: os.stat(result.enriched.join(n).path).st_mtime_ns for n in before}
    assert {n for n in before if after[n] != before[n]} == {"wave-00001", "wave-00002"}
    committed_at = [[w["committed_unix_s"] for w in r.report["waves"]] for r in (streamed.result, result)]
    assert committed_at[1][0] == committed_at[0][0] and committed_at[1][1] > committed_at[0][2]
    assert _verdicts(pq.read_table(result.quarantine.path).to_pylist()) == _verdicts(out.quarantine)
    assert sorted(r["uuid"] for r in pq.read_table(result.enriched.path, columns=["uuid"]).to_pylist()) == \
        sorted(r["uuid"] for r in out.enriched)
