"""The enrichment on real Spark-on-Ray (RayDP), the real all-MiniLM-L6-v2 and the real Mistral v3 tokenizer, on the
sample dataset with its answer key (planted.json). One Ray, one Spark session, one enrich run for the module."""

import json
import os
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raytrain.config import load_job_config
from raytrain.dataset.tokenize import load_tokenizer, tokenize_conversation
from raytrain.enrich.job import MANIFEST, run_enrich
from raytrain.errors import RaytrainError
from raytrain.runner import Run
from raytrain.sample_data import load_planted, write_sample_dataset
from raytrain.storage import resolve

DERIVE_REASONS = ("missing_uuid", "missing_messages", "bad_role", "undecodable_text", "empty_answer", "too_long")


@pytest.fixture(scope="module")
def out(ray_local, tmp_path_factory):
    root = tmp_path_factory.mktemp("enrich")
    sample = write_sample_dataset(str(root / "sample"))
    job = load_job_config("configs/demo.yaml", [f"storage.root={root / 'runs'}", "storage.user=ci",
                                                "enrich.num_partitions=2"])
    run_root = resolve(str(root / "runs" / "ci" / "demo" / "enrich"))
    result = run_enrich(job, resolve(sample.out_dir), run_root, eval_sets=(sample.eval_path,))
    raw = pa.concat_tables([pq.read_table(p) for p in sample.split_paths.values()]).to_pylist()
    return SimpleNamespace(
        job=job, run_root=run_root, result=result, report=result.report, raw=raw, sample=sample,
        planted=load_planted(sample.out_dir),
        enriched=pq.read_table(result.enriched.path).to_pylist(),  # pyarrow, not our code, reads Spark's output
        quarantine=pq.read_table(result.quarantine.path).to_pylist(),
    )


def _reasons(out) -> dict:
    counts: dict = {}
    for r in out.quarantine:
        counts[r["reason"]] = counts.get(r["reason"], 0) + 1
    return counts


def _mixed_turns(out, measure=lambda text: 1) -> dict:
    """uuid -> ``measure(text)`` summed over the assistant turns with both text and tool calls (v3 cannot hold both),
    found in the raw input, for the rows that reach the tokenization check: not planted for an earlier quarantine
    reason, and not the dropped (larger-uuid) member of a planted duplicate pair. Default: the number of turns."""
    p = out.planted
    earlier = {r["uuid"] for kind in ("quarantine", "disallowed_license", "contaminated") for r in p[kind]}
    earlier |= {max(r["uuid"], r["duplicate_of"]) for kind in ("exact_duplicates", "near_duplicates") for r in p[kind]}
    mixed = {row["uuid"]: sum(measure(m["content"]) for m in row["messages"] or []
                              if m["role"] == "assistant" and (m["content"] or "").strip() and m["tool_calls"])
             for row in out.raw}
    return {u: n for u, n in mixed.items() if n and u not in earlier}


def test_quarantine_counts_match_planted(out):
    p = out.planted
    expected = dict(p["quarantine_counts"])
    expected.update({"license": len(p["disallowed_license"]), "exact_duplicate": len(p["exact_duplicates"]),
                     "near_duplicate": len(p["near_duplicates"]), "contaminated": len(p["contaminated"])})
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
def test_planted_duplicates_caught_keep_smallest_uuid(out, kind, reason):
    flagged = {q["uuid"]: q["detail"] for q in out.quarantine if q["reason"] == reason}
    for pair in out.planted[kind]:
        keep, drop = sorted((pair["uuid"], pair["duplicate_of"]))
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
    assert [r["uuid"] for r in out.enriched] == sorted(r["uuid"] for r in out.enriched)


def test_answering_sentence_kept_and_system_prompt_not_repeated(out):
    by_uuid = {r["uuid"]: r for r in out.enriched}
    rows = [(k, by_uuid[k["uuid"]]) for k in out.planted["context_answers"] if k["uuid"] in by_uuid]
    assert len(rows) > 50
    for key, row in rows:
        assert key["answer_sentence"] in row["kept_sentences"], (key, row["kept_sentences"])
        assert len(row["kept_sentences"]) <= out.job.enrich.top_k
        assert any(d not in row["kept_sentences"] for d in key["distractors"])
        messages = json.loads(row["messages_json"])
        systems = [m["content"] for m in messages if m["role"] == "system"]
        assert systems == ["Context:\n" + "\n".join(row["kept_sentences"])]
        assert row["kept_sentences"] == [row["context_sentences"][i] for i in row["kept_indices"]]


def test_scores_equal_sentence_transformers_cos_sim(out):
    from sentence_transformers import SentenceTransformer, util

    from raytrain.enrich.relevance import default_model_path

    model = SentenceTransformer(default_model_path(), device="cpu")
    w = out.job.enrich.question_weight
    rows = [r for r in out.enriched if r["context_sentences"]][:4]
    for r in rows:
        sent = model.encode(r["context_sentences"], convert_to_tensor=True)
        qa = model.encode([r["question"], r["answer"]], convert_to_tensor=True)
        sims = util.cos_sim(sent, qa).numpy()  # (S, 2)
        np.testing.assert_allclose(r["question_scores"], sims[:, 0], atol=1e-5)
        np.testing.assert_allclose(r["answer_scores"], sims[:, 1], atol=1e-5)
        np.testing.assert_allclose(r["sentence_scores"], w * sims[:, 0] + (1 - w) * sims[:, 1], atol=1e-5)


def test_enriched_conversations_tokenize_like_mistral_common(out):
    tokenizer = load_tokenizer(out.job.dataset.tokenizer)
    for r in out.enriched:
        ids = tokenize_conversation(json.loads(r["messages_json"]), tokenizer, verify=True).input_ids
        assert len(ids) == r["num_tokens"]


def test_manifest_and_summary_written(out):
    loc = out.result.enriched
    manifest = json.loads(loc.join(MANIFEST).read_text())
    assert manifest["config_hash"] == Run(out.job, out.run_root).data_hash
    assert manifest["enriched"]["files"] == sorted(n for n in os.listdir(loc.path) if n.endswith(".parquet"))
    assert manifest["enriched"]["rows"] == len(out.enriched)
    assert manifest["quarantine"]["rows"] == len(out.quarantine)
    summary = out.run_root.join("reports", "enrich_summary.txt").read_text()
    for reason in (*DERIVE_REASONS, "license", "exact_duplicate", "near_duplicate", "contaminated"):
        assert reason in summary
    sim = out.report["similarity"]["all_sentences"]
    assert sim["min"] <= sim["p50"] <= sim["p90"] <= sim["max"]


def test_hand_off_packs_without_error(out):
    from raytrain.dataset.stream import tokenize_and_pack

    packed = tokenize_and_pack(out.result.enriched, out.run_root.join("data", "packed"), out.job.dataset, "h")
    assert packed.num_real_tokens == sum(r["num_tokens"] for r in out.enriched)


def test_schema_error_names_column_and_file(out, tmp_path):
    good = pq.read_table(out.sample.split_paths["chat"])
    bad = good.set_column(good.schema.get_field_index("messages"), "messages",
                          pa.array(["not a list"] * good.num_rows))
    (tmp_path / "chat").mkdir()
    path = tmp_path / "chat" / "part-0.parquet"
    pq.write_table(bad, path)
    job = load_job_config("configs/demo.yaml", ["data.splits=[chat]"])
    with pytest.raises(RaytrainError, match=r"column messages has type string") as e:
        run_enrich(job, resolve(str(tmp_path)), resolve(str(tmp_path / "run")))
    assert str(path) in str(e.value)

