"""The per-batch functions Spark runs (raytrain.enrich.batches), on pandas batches shaped as Spark's Arrow batches are,
checked against the pure reference functions, sentence-transformers and mistral-common."""

import json

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raytrain.config import EnrichConfig
from raytrain.enrich import batches
from raytrain.enrich.conversation import Example, derive_example
from raytrain.enrich.decontam import build_eval_index, build_sorted_index, tokenize
from raytrain.enrich.dedup import exact_key, lsh_band_keys, minhash_signature
from raytrain.sample_data import write_sample_dataset


def estimated_jaccard(sig_a: np.ndarray, sig_b: np.ndarray) -> float:
    """The MinHash estimate of the Jaccard similarity: the fraction of equal signature entries."""
    return float(np.mean(np.asarray(sig_a) == np.asarray(sig_b)))


@pytest.fixture(scope="module")
def sample_batch(tmp_path_factory):
    m = write_sample_dataset(str(tmp_path_factory.mktemp("sample")), rows_per_split=20)
    table = pa.concat_tables([pq.read_table(p) for p in m.all_files()])
    pdf = table.to_pandas()  # list columns arrive as numpy object arrays, as in mapInPandas
    pdf["row_id"] = np.arange(len(pdf), dtype=np.int64)
    pdf["split"] = "x"
    return pdf, table.to_pylist()


def _ngrams(text: str, n: int = 13) -> set[tuple[str, ...]]:
    """The literal word n-grams (the hashes' independent reference)."""
    words = tokenize(text)
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


PREPARE = {"max_chars": EnrichConfig().max_chars, "licenses": ["MIT", "cc-by-4.0"], "num_perm": 32, "bands": 8,
           "rows": 4, "shingle_chars": 5, "ngram": 13}


def _work_row(uuid, messages, **kw):
    ex = derive_example({"uuid": uuid, "license": "mit", "category": "chat", "messages": messages})
    assert isinstance(ex, Example), ex
    out = batches.prepare_batch(pd.DataFrame([{"uuid": uuid, "license": "mit", "category": "chat", "reasoning": "off",
                                            "messages": messages, "row_id": kw.get("row_id", 0), "split": "chat"}]),
                             eval_index=build_sorted_index([]), **PREPARE)
    assert out["status"].tolist() == [batches.OK]
    return out[list(batches.ROW.names)]


def test_prepare_batch_matches_the_reference_functions(sample_batch):
    pdf, rows = sample_batch
    texts = [ex.full_text() for ex in (derive_example(r) for r in rows) if isinstance(ex, Example)]
    eval_hashes = build_eval_index(texts[:2], 13)  # two rows' text as the eval set: those two are contaminated
    eval_ngrams = set().union(*(_ngrams(t) for t in texts[:2]))
    out = batches.prepare_batch(pdf, eval_index=build_sorted_index(eval_hashes), **PREPARE)
    assert list(out.columns) == batches.PREPARED.names and len(out) == len(rows)
    pa.Table.from_pandas(out, schema=batches.PREPARED, preserve_index=False)  # the schema Spark is told holds
    verdicts = set()
    for got, row in zip(out.to_dict("records"), rows, strict=True):
        ref = derive_example(row)
        if isinstance(ref, Example) and ref.license.strip().lower() in ("mit", "cc-by-4.0"):
            assert got["status"] == batches.OK
            assert (got["uuid"], got["context"], got["question"], got["answer"]) == \
                (ref.uuid, ref.context, ref.question, ref.answer)
            assert json.loads(got["messages_json"]) == list(ref.messages)
            assert got["exact_key"] == exact_key(ref.full_text())
            sig = minhash_signature(ref.full_text(), num_perm=32, ngram=5)
            assert np.array_equal(np.frombuffer(got["signature"], dtype=np.uint32), sig)
            assert list(got["band_keys"]) == lsh_band_keys(sig, 8, 4).tolist()
            assert got["eval_ngrams"] == len(_ngrams(ref.full_text()) & eval_ngrams)
        elif isinstance(ref, Example):
            assert got["status"] == batches.LICENSE and f"license '{ref.license}'" in got["detail"]
        else:
            uuid = None if pd.isna(got["uuid"]) else got["uuid"]  # pandas holds a missing string as NaN
            # same verdict; the detail's wording may differ (numpy arrays print differently from lists)
            assert (got["status"], uuid) == (ref.reason, ref.uuid) and got["detail"]
            assert (got["messages_json"], got["signature"], list(got["band_keys"])) == ("", b"", [])
        verdicts.add(got["status"])
    assert {batches.OK, batches.LICENSE} < verdicts and len(verdicts) >= 4
    assert (out["eval_ngrams"] > 0).sum() >= 2


def test_verify_bucket_orders_each_pair_by_input_order():
    """a is before b in (group_index, uuid, row_id): the row group decides before the uuid, and b is the near
    duplicate."""
    rng = np.random.default_rng(0)
    base = rng.integers(0, 2**32, size=64, dtype=np.uint64).astype(np.uint32)
    sigs = []
    for changed in (0, 3, 10, 40, 6):
        s = base.copy()
        s[:changed] = rng.integers(0, 2**32, size=changed, dtype=np.uint64).astype(np.uint32)
        sigs.append(s)
    pdf = pd.DataFrame({"row_id": [5, 1, 2, 3, 4], "group_index": [0, 1, 1, 0, 2], "uuid": ["e", "b", "c", "d", "a"],
                        "signature": [s.tobytes() for s in sigs]})
    got = batches.verify_bucket(pdf, threshold=0.8)
    want = set()
    for i in range(5):
        for j in range(5):
            a, b = pdf.iloc[i], pdf.iloc[j]
            if (a.group_index, a.uuid, a.row_id) < (b.group_index, b.uuid, b.row_id) \
                    and estimated_jaccard(sigs[i], sigs[j]) >= 0.8:
                want.add((int(a.row_id), int(a.group_index), a.uuid, int(b.row_id), int(b.group_index), b.uuid,
                          estimated_jaccard(sigs[i], sigs[j])))
    assert set(map(tuple, got.itertuples(index=False))) == want
    assert len(want) >= 3
    assert ("a", "e") not in {(r.a_uuid, r.b_uuid) for r in got.itertuples()}  # a is in a later file than e


def _select(batch, **kw):
    args = {"model_path": "", "batch_size": 8, "top_k": 2, "min_score": 0.0, "question_weight": 0.5, **kw}
    return batches.select_batch(batch, **args).to_dict("records")


SYSTEM = ("Bananas are rich in potassium. The Eiffel Tower was finished in 1889. Penguins cannot fly. "
          "The stock market fell on Tuesday.")


def test_select_batch_keeps_system_prompt_and_adds_a_context_block():
    from sentence_transformers import util

    from raytrain.enrich.context import context_block
    from raytrain.enrich.relevance import load_embedder

    original = [{"role": "system", "content": "detailed thinking on\n" + SYSTEM},
                {"role": "user", "content": "When was the Eiffel Tower completed?"},
                {"role": "assistant", "content": "<think>\nRecall the tower.\n</think>\n\nIt was completed in 1889."}]
    with_system = _work_row("a", original)
    no_context = _work_row("b", [{"role": "system", "content": "/no_think"},
                                 {"role": "user", "content": "What is 2 + 2?"},
                                 {"role": "assistant", "content": "4"}], row_id=1)
    a, b = _select(pd.concat([with_system, no_context], ignore_index=True))
    assert a["context_sentences"] == ["Bananas are rich in potassium.", "The Eiffel Tower was finished in 1889.",
                                      "Penguins cannot fly.", "The stock market fell on Tuesday."]
    assert "The Eiffel Tower was finished in 1889." in a["kept_sentences"]
    assert "The stock market fell on Tuesday." not in a["kept_sentences"] and len(a["kept_sentences"]) == 2
    messages = json.loads(a["messages_json"])
    assert messages[0]["content"] == original[0]["content"]  # the toggle and the whole prompt, verbatim
    assert messages[1]["content"] == context_block(a["kept_sentences"]) + "\n\n" + original[1]["content"]
    assert messages[2]["content"] == original[2]["content"]
    assert a["system_prompt_chars_removed"] == 0 and a["chunked_texts"] == 0
    model = load_embedder()
    sims = util.cos_sim(model.encode(a["context_sentences"], convert_to_tensor=True),
                        model.encode([a["question"], "It was completed in 1889."], convert_to_tensor=True)).numpy()
    np.testing.assert_allclose(a["question_scores"], sims[:, 0], atol=1e-5)
    np.testing.assert_allclose(a["answer_scores"], sims[:, 1], atol=1e-5)  # the final answer, not the trace
    np.testing.assert_allclose(a["sentence_scores"], 0.5 * sims[:, 0] + 0.5 * sims[:, 1], atol=1e-5)
    # a toggle-only system prompt is no context: nothing to select, messages unchanged
    assert b["context_sentences"] == [] and b["kept_sentences"] == []
    assert json.loads(b["messages_json"]) == json.loads(no_context.iloc[0]["messages_json"])


def test_select_batch_select_mode_trims_long_prose_prompts_only():
    tool_call = {"id": "abcdefghi", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    prose = _work_row("a", [{"role": "system", "content": "/no_think\n" + SYSTEM},
                            {"role": "user", "content": "When was the Eiffel Tower completed?"},
                            {"role": "assistant", "content": "In 1889."}])
    tools = _work_row("b", [{"role": "system", "content": SYSTEM},
                            {"role": "user", "content": "When was the Eiffel Tower completed?"},
                            {"role": "assistant", "content": "", "tool_calls": [tool_call]},
                            {"role": "tool", "content": "1889"},
                            {"role": "assistant", "content": "In 1889."}], row_id=1)
    short = _work_row("c", [{"role": "system", "content": "Penguins cannot fly. Bananas are yellow."},
                            {"role": "user", "content": "Can penguins fly?"},
                            {"role": "assistant", "content": "No."}], row_id=2)
    a, b, c = _select(pd.concat([prose, tools, short], ignore_index=True), system_prompt="select")
    system = json.loads(a["messages_json"])[0]["content"]
    assert system == "/no_think\n\n" + "\n".join(a["kept_sentences"])
    assert "The Eiffel Tower was finished in 1889." in a["kept_sentences"]
    assert a["system_prompt_chars_removed"] == len("/no_think\n" + SYSTEM) - len(system) > 0
    for row, work in ((b, tools), (c, short)):  # a tool list, and a prompt no longer than top_k: untouched
        assert row["context_sentences"] == [] and row["system_prompt_chars_removed"] == 0
        assert json.loads(row["messages_json"]) == json.loads(work.iloc[0]["messages_json"])


def test_final_answer_decides_when_the_trace_is_unrelated():
    """The answer side embeds the text after </think>: a row whose trace talks of something else entirely but
    whose final answer matches one sentence keeps that sentence; embedding the whole turn would not."""
    context = ("Cold fronts often bring sudden thunderstorms. The harbour crane lifts forty tonnes. "
               "Saffron is harvested by hand from crocus flowers. Glaciers carve U-shaped valleys.")
    trace = " ".join(f"Let me think about thunderstorm {i}, cold fronts and weather radar over the sea."
                     for i in range(40))  # ~780 word pieces: embedded in 4 chunks under answer_text=full
    row = _work_row("a", [{"role": "system", "content": context},
                          {"role": "user", "content": "Tell me one thing you know."},
                          {"role": "assistant", "content": f"<think>\n{trace}\n</think>\n\nSaffron is picked by "
                                                           "hand from crocus flowers."}])
    (final,) = _select(row, top_k=1, question_weight=0.0)
    (full,) = _select(row, top_k=1, question_weight=0.0, answer_text="full")
    assert final["kept_sentences"] == ["Saffron is harvested by hand from crocus flowers."]
    assert full["kept_sentences"] == ["Cold fronts often bring sudden thunderstorms."]
    assert (final["chunked_texts"], full["chunked_texts"]) == (0, 1)


def test_tokenize_batch_stores_mistral_commons_ids_and_flags_what_it_refuses():
    from mistral_common.protocol.instruct.messages import AssistantMessage, UserMessage
    from mistral_common.protocol.instruct.request import ChatCompletionRequest

    from raytrain.dataset.tokenize import load_tokenizer

    good = [{"role": "user", "content": "Say hi.", "tool_calls": []},
            {"role": "assistant", "content": "Hi!", "tool_calls": []}]
    call = {"id": "abcdefghi", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    both = [good[0], {"role": "assistant", "content": "<think>x</think>", "tool_calls": [call]},
            {"role": "tool", "content": "1", "tool_calls": []}, {"role": "assistant", "content": "ok", "tool_calls": []}]
    pdf = pd.DataFrame({"uuid": ["g", "b"], "messages_json": [json.dumps(good), json.dumps(both)]})
    out = batches.tokenize_batch(pdf, "v3", seq_len=64, text_with_tool_calls="quarantine")
    ref = load_tokenizer("v3").encode_chat_completion(
        ChatCompletionRequest(messages=[UserMessage(content="Say hi."), AssistantMessage(content="Hi!")])).tokens
    assert out["num_tokens"].tolist() == [len(ref), -1]
    assert list(out["input_ids"][0]) == ref and list(out["input_ids"][1]) == []  # stored: packing reads them
    inner = load_tokenizer("v3").instruct_tokenizer.tokenizer
    trained = [t for t, m in zip(out["input_ids"][0], out["loss_mask"][0], strict=True) if m]
    assert trained == [*inner.encode("Hi!", bos=False, eos=False), inner.eos_id]  # the loss mask: the reply only
    assert out["status"].tolist() == [batches.OK, batches.UNTOKENIZABLE]
    assert "both text content and tool_calls" in out["detail"][1]
    assert out["messages_json"].tolist() == pdf["messages_json"].tolist()

    # default policy: the text of the mixed turn is dropped, the call stays; messages_json says what is trained
    out = batches.tokenize_batch(pdf, "v3", seq_len=64)
    assert out["status"].tolist() == [batches.OK, batches.OK]
    assert out["dropped_text_turns"].tolist() == [0, 1]
    assert out["dropped_text_chars"].tolist() == [0, len("<think>x</think>")]
    trained = json.loads(out["messages_json"][1])
    assert trained[1]["content"] == "" and trained[1]["tool_calls"] == [call]
    assert [m for i, m in enumerate(trained) if i != 1] == [m for i, m in enumerate(both) if i != 1]
    assert out["messages_json"][0] == pdf["messages_json"][0]  # untouched rows keep their JSON byte for byte

    # the length policy: seq_len just below the good row's length drops it with its count, truncate keeps it cut
    n = len(ref)
    dropped = batches.tokenize_batch(pdf.iloc[:1], "v3", seq_len=n - 1)
    assert dropped["status"].tolist() == ["too_many_tokens"] and dropped["num_tokens"].tolist() == [n]
    assert dropped["train_tokens"].tolist() == [0] and f"{n} tokens > dataset.seq_len={n - 1}" in dropped["detail"][0]
    cut = batches.tokenize_batch(pdf.iloc[:1], "v3", seq_len=n - 1, length_policy="truncate")
    assert cut["status"].tolist() == [batches.OK] and cut["length_action"].tolist() == ["truncate"]
    assert (cut["num_tokens"].tolist(), cut["train_tokens"].tolist()) == ([n], [n - 1])


def test_finish_batch_runs_the_kept_rows_and_passes_the_others_through_in_order():
    good = [{"role": "system", "content": "Paris is the capital of France. Cats sleep a lot.", "tool_calls": []},
            {"role": "user", "content": "What is the capital of France?", "tool_calls": []},
            {"role": "assistant", "content": "Paris.", "tool_calls": []}]
    rows = pd.concat([_work_row("z", good, row_id=1), _work_row("a", good, row_id=2)], ignore_index=True)
    rows.loc[1, ["status", "detail"]] = [batches.EXACT_DUPLICATE, "duplicate of z (same normalized text)"]
    scoring = batches.Scoring(model_path="", batch_size=16, top_k=1, min_score=0.0, question_weight=0.5)
    out = batches.finish_batch(rows, scoring=scoring, tokenize=batches.Tokenizing("v3", 256))
    assert list(out.columns) == batches.finished_schema(False).names
    pa.Table.from_pandas(out, schema=batches.finished_schema(False), preserve_index=False)  # what Spark is told
    assert out["uuid"].tolist() == ["z", "a"] and out["status"].tolist() == [batches.OK, batches.EXACT_DUPLICATE]
    kept, passed = out.iloc[0], out.iloc[1]
    assert list(kept["kept_sentences"]) == ["Paris is the capital of France."] and kept["num_tokens"] > 0
    assert len(kept["input_ids"]) == kept["num_tokens"] == len(kept["loss_mask"])
    assert passed["detail"] == "duplicate of z (same normalized text)" and passed["num_tokens"] == -1
    assert (passed["messages_json"], list(passed["input_ids"]), list(passed["kept_sentences"])) == ("", [], [])


def test_finish_batch_quarantines_a_row_too_long_before_any_context_without_embedding_it(monkeypatch):
    long_answer = "Paris is the capital of France. " * 60  # ~400 tokens
    messages = [{"role": "system", "content": "Paris is the capital of France. Cats sleep a lot.", "tool_calls": []},
                {"role": "user", "content": "What is the capital of France?", "tool_calls": []},
                {"role": "assistant", "content": long_answer, "tool_calls": []}]
    short = [*messages[:2], {"role": "assistant", "content": "Paris.", "tool_calls": []}]
    rows = pd.concat([_work_row("long", messages, row_id=1), _work_row("short", short, row_id=2)], ignore_index=True)
    scoring = batches.Scoring(model_path="", batch_size=16, top_k=1, min_score=0.0, question_weight=0.5)
    tokenize = batches.Tokenizing("v3", 256)

    embedded: list[list[str]] = []  # the uuids each selection call saw: the long row must not be among them
    real_select = batches.select_batch
    monkeypatch.setattr(batches, "select_batch", lambda pdf, **kw: embedded.append(pdf["uuid"].tolist())
                        or real_select(pdf, **kw))
    out = batches.finish_batch(rows, scoring=scoring, tokenize=tokenize)
    assert embedded == [["short"]]
    assert out["uuid"].tolist() == ["long", "short"]
    assert out["status"].tolist() == ["too_many_tokens", batches.OK]
    pa.Table.from_pandas(out, schema=batches.finished_schema(False), preserve_index=False)
    # the same verdict as tokenizing it without context: the count is the conversation's as it stands
    alone = batches.tokenize_batch(rows.iloc[:1], "v3", 256)
    assert out["num_tokens"][0] == alone["num_tokens"][0] > 256
    assert out["detail"][0].startswith(alone["detail"][0]) and "before any context" in out["detail"][0]
    assert list(out["kept_sentences"][0]) == [] and list(out["input_ids"][0]) == []

    # and the full path (selection, then tokenization with the context block) reaches the same verdict for it
    monkeypatch.setattr(batches, "refused_before_context", lambda pdf, tokenize, system_prompt: pdf.iloc[:0])
    full = batches.finish_batch(rows, scoring=scoring, tokenize=tokenize)
    assert full["status"].tolist() == out["status"].tolist()
    assert full["num_tokens"][0] >= out["num_tokens"][0]
    assert [list(x) for x in full["input_ids"]] == [list(x) for x in out["input_ids"]]

    # "select" may shrink the system prompt: nothing is decided before selection then
    embedded.clear()
    batches.finish_batch(rows, scoring=scoring, tokenize=tokenize, system_prompt="select")
    assert embedded == [["long", "short"]]


def test_prepare_batch_quarantines_the_rows_spark_refused_without_deriving_them():
    """Rows row_guard refused in the JVM arrive with a reason and without their text: they leave with that reason,
    their uuid, category and detail; the rows beside them (guard_reason null, NaN in pandas) are derived as usual."""
    messages = [{"role": "user", "content": "Why is the sky blue?", "tool_calls": None},
                {"role": "assistant", "content": "Rayleigh scattering.", "tool_calls": None}]
    pdf = pd.DataFrame([
        {"uuid": "kept", "license": "mit", "category": "chat", "reasoning": "off", "messages": messages,
         "row_id": 0, "split": "chat", "guard_reason": None, "guard_detail": None},
        {"uuid": "bad\ufffd", "license": None, "category": "chat", "reasoning": None, "messages": None,
         "row_id": 1, "split": "chat", "guard_reason": "undecodable_text",
         "guard_detail": "messages[].content holds bytes that are not valid UTF-8 (the row was not decoded)"},
        {"uuid": "long", "license": None, "category": None, "reasoning": None, "messages": None,
         "row_id": 2, "split": "chat", "guard_reason": "too_long", "guard_detail": "5 characters > max_chars=4"},
    ])
    out = batches.prepare_batch(pdf, eval_index=build_sorted_index([]), **PREPARE)
    assert out["status"].tolist() == [batches.OK, "undecodable_text", "too_long"]
    assert out["uuid"].tolist() == ["kept", "bad\ufffd", "long"]
    assert out["category"].tolist() == ["chat", "chat", ""]
    assert out["detail"].tolist()[1:] == [pdf["guard_detail"][1], "5 characters > max_chars=4"]
    assert out["messages_json"].tolist()[1:] == ["", ""] and out["row_id"].tolist() == [0, 1, 2]
    assert out["question"][0] == "Why is the sky blue?"


def test_settings_are_read_from_the_config_by_name():
    from raytrain.config import load_job_config

    job = load_job_config("configs/demo.yaml", ["enrich.top_k=7", "enrich.min_score=0.25", "dataset.seq_len=96"])
    cfg, ds = job.enrich, job.dataset
    assert batches.Scoring.from_config(cfg, num_threads=3) == batches.Scoring(
        model_path=cfg.embedding_model, batch_size=cfg.embed_batch_size, top_k=7, min_score=0.25,
        question_weight=cfg.question_weight, answer_text=cfg.answer_text, num_threads=3)
    assert batches.Tokenizing.from_config(ds) == batches.Tokenizing(
        tokenizer_version=ds.tokenizer, seq_len=96, length_policy=ds.length_policy,
        text_with_tool_calls=ds.text_with_tool_calls)
