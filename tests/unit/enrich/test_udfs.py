"""The per-batch functions Spark runs (raytrain.enrich.udfs), on pandas batches shaped as Spark's Arrow batches are,
checked against the pure reference functions, networkx, sentence-transformers and mistral-common."""

import json

import networkx as nx
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raytrain.enrich import udfs
from raytrain.enrich.conversation import Example, derive_example
from raytrain.enrich.decontam import build_eval_index, contaminated
from raytrain.enrich.dedup import estimated_jaccard, lsh_band_keys, minhash_signature
from raytrain.sample_data import write_sample_dataset


@pytest.fixture(scope="module")
def sample_batch(tmp_path_factory):
    m = write_sample_dataset(str(tmp_path_factory.mktemp("sample")), rows_per_split=20)
    table = pa.concat_tables([pq.read_table(p) for p in m.split_paths.values()])
    pdf = table.to_pandas()  # list columns arrive as numpy object arrays, as in mapInPandas
    pdf["row_id"] = np.arange(len(pdf), dtype=np.int64)
    pdf["split"] = "x"
    return pdf, table.to_pylist()


def _work_row(uuid, messages, **kw):
    ex = derive_example({"uuid": uuid, "license": "mit", "category": "chat", "messages": messages})
    assert isinstance(ex, Example), ex
    out = udfs.derive_batch(pd.DataFrame([{"uuid": uuid, "license": "mit", "category": "chat", "reasoning": "off",
                                           "messages": messages, "row_id": kw.get("row_id", 0), "split": "chat"}]),
                            max_chars=60_000)
    return out.drop(columns=["status", "detail"])


def test_derive_batch_matches_derive_example(sample_batch):
    pdf, rows = sample_batch
    out = udfs.derive_batch(pdf, max_chars=60_000)
    assert list(out.columns) == list(udfs.DERIVED_COLUMNS) and len(out) == len(rows)
    for got, row in zip(out.to_dict("records"), rows, strict=True):
        ref = derive_example(row)
        if isinstance(ref, Example):
            assert got["status"] == udfs.OK
            assert (got["uuid"], got["context"], got["question"], got["answer"], got["text"]) == \
                (ref.uuid, ref.context, ref.question, ref.answer, ref.full_text())
            assert json.loads(got["messages_json"]) == list(ref.messages)
            assert got["system_text"] == "\n\n".join(m["content"] for m in ref.messages if m["role"] == "system")
        else:
            uuid = None if pd.isna(got["uuid"]) else got["uuid"]  # pandas holds a missing string as NaN
            # same verdict; the detail's wording may differ (numpy arrays print differently from lists)
            assert (got["status"], uuid) == (ref.reason, ref.uuid) and got["detail"]


def test_minhash_batch_matches_dedup():
    pdf = pd.DataFrame({"row_id": [3, 7], "uuid": ["a", "b"], "text": ["the quick brown fox", ""]})
    out = udfs.minhash_batch(pdf, num_perm=32, bands=8, rows=4)
    for text, sig, keys in zip(pdf["text"], out["signature"], out["band_keys"], strict=True):
        ref = minhash_signature(text, num_perm=32, ngram=5)
        assert np.array_equal(np.frombuffer(sig, dtype=np.uint32), ref)
        assert keys == lsh_band_keys(ref, 8, 4).tolist()


def test_verify_bucket_matches_estimated_jaccard():
    rng = np.random.default_rng(0)
    base = rng.integers(0, 2**32, size=64, dtype=np.uint64).astype(np.uint32)
    sigs = []
    for changed in (0, 3, 10, 40, 6):
        s = base.copy()
        s[:changed] = rng.integers(0, 2**32, size=changed, dtype=np.uint64).astype(np.uint32)
        sigs.append(s)
    pdf = pd.DataFrame({"row_id": [5, 1, 2, 3, 4], "uuid": ["e", "b", "c", "d", "a"],
                        "signature": [s.tobytes() for s in sigs]})
    got = udfs.verify_bucket(pdf, threshold=0.8)
    want = set()
    for i in range(5):
        for j in range(5):
            a, b = pdf.iloc[i], pdf.iloc[j]
            if (a.uuid, a.row_id) < (b.uuid, b.row_id) and estimated_jaccard(sigs[i], sigs[j]) >= 0.8:
                want.add((int(a.row_id), a.uuid, int(b.row_id), b.uuid, estimated_jaccard(sigs[i], sigs[j])))
    assert set(map(tuple, got.itertuples(index=False))) == want
    assert len(want) >= 3


def test_near_duplicate_drops_are_connected_components_minus_smallest():
    rng = np.random.default_rng(1)
    ids = [(f"u{rng.integers(0, 10**6):06d}", i) for i in range(60)]
    edges = [(ids[a], ids[b], float(rng.uniform(0.8, 1.0))) for a, b in rng.integers(0, 60, size=(45, 2)) if a != b]
    drops = udfs.near_duplicate_drops(edges)
    g = nx.Graph()
    g.add_edges_from((a, b) for a, b, _ in edges)
    want = {x: min(c) for c in nx.connected_components(g) for x in c if x != min(c)}
    assert {x: d.kept for x, d in drops.items()} == want
    for x, d in drops.items():  # the neighbor is the best-scoring verified partner
        partners = [(j, b) for a, b, j in edges if a == x] + [(j, a) for a, b, j in edges if b == x]
        assert d.jaccard == max(j for j, _ in partners) and (d.jaccard, d.neighbor) in partners


def test_contamination_counts_match_decontam_contaminated():
    evals = ["the quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat today",
             "a completely different sentence about numbers one two three four five six seven eight nine ten"]
    texts = ["Intro. The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat! ok",
             "quick brown fox jumps over the lazy dog while the cat sleeps",  # 12 words of it
             "", "a completely different sentence about numbers one two three four five six seven eight nine"]
    index = build_eval_index(evals, 13)
    got = udfs.contamination_counts(texts, udfs.build_sorted_index(index), 13)
    assert got == [contaminated(t, index, 13)[1] for t in texts]
    assert got[0] > 0 and got[1] == 0
    assert udfs.contamination_counts(texts, udfs.build_sorted_index([]), 13) == [0, 0, 0, 0]


def test_select_batch_replaces_system_prompt_with_kept_sentences():
    from sentence_transformers import util

    from raytrain.enrich.relevance import load_embedder
    from raytrain.enrich.sentences import split_sentences

    system = ("You are a helpful assistant. Bananas are rich in potassium. The Eiffel Tower was finished in 1889. "
              "Penguins cannot fly. The stock market fell on Tuesday.")
    with_system = _work_row("a", [{"role": "system", "content": system},
                                  {"role": "user", "content": "When was the Eiffel Tower completed?"},
                                  {"role": "assistant", "content": "It was completed in 1889."}])
    no_system = _work_row("b", [{"role": "user", "content": "Hi there. How are you?"},
                                {"role": "assistant", "content": "Fine."},
                                {"role": "user", "content": "What is 2 + 2?"},
                                {"role": "assistant", "content": "4"}], row_id=1)
    batch = pd.concat([with_system, no_system], ignore_index=True)
    out = udfs.select_batch(batch, model_path="", batch_size=8, top_k=2, min_score=0.0, question_weight=0.5)
    a, b = out.to_dict("records")
    assert a["context_sentences"] == split_sentences(system)
    assert "The Eiffel Tower was finished in 1889." in a["kept_sentences"]
    assert "The stock market fell on Tuesday." not in a["kept_sentences"] and len(a["kept_sentences"]) == 2
    messages = json.loads(a["messages_json"])
    assert messages[0] == {"role": "system", "content": "Context:\n" + "\n".join(a["kept_sentences"]),
                           "tool_calls": []}
    assert [m["role"] for m in messages] == ["system", "user", "assistant"] and a["replaced_system_prompt"]
    model = load_embedder()
    sims = util.cos_sim(model.encode(a["context_sentences"], convert_to_tensor=True),
                        model.encode([a["question"], a["answer"]], convert_to_tensor=True)).numpy()  # (S, 2)
    np.testing.assert_allclose(a["question_scores"], sims[:, 0], atol=1e-5)
    np.testing.assert_allclose(a["sentence_scores"], 0.5 * sims[:, 0] + 0.5 * sims[:, 1], atol=1e-5)
    # no system prompt: earlier turns already stay whole, nothing to select, messages unchanged
    assert b["context_sentences"] == [] and b["kept_sentences"] == [] and not b["replaced_system_prompt"]
    assert json.loads(b["messages_json"]) == json.loads(no_system.iloc[0]["messages_json"])


def test_tokenize_check_batch_flags_what_mistral_refuses():
    from mistral_common.protocol.instruct.messages import AssistantMessage, UserMessage
    from mistral_common.protocol.instruct.request import ChatCompletionRequest

    from raytrain.dataset.tokenize import load_tokenizer

    good = [{"role": "user", "content": "Say hi.", "tool_calls": []},
            {"role": "assistant", "content": "Hi!", "tool_calls": []}]
    call = {"id": "abcdefghi", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    both = [good[0], {"role": "assistant", "content": "<think>x</think>", "tool_calls": [call]},
            {"role": "tool", "content": "1", "tool_calls": []}, {"role": "assistant", "content": "ok", "tool_calls": []}]
    pdf = pd.DataFrame({"uuid": ["g", "b"], "messages_json": [json.dumps(good), json.dumps(both)]})
    out = udfs.tokenize_check_batch(pdf, "v3", text_with_tool_calls="quarantine")
    ref = load_tokenizer("v3").encode_chat_completion(
        ChatCompletionRequest(messages=[UserMessage(content="Say hi."), AssistantMessage(content="Hi!")])).tokens
    assert out["num_tokens"].tolist() == [len(ref), -1]
    assert out["status"].tolist() == [udfs.OK, udfs.UNTOKENIZABLE]
    assert "both text content and tool_calls" in out["detail"][1]
    assert out["messages_json"].tolist() == pdf["messages_json"].tolist()

    # default policy: the text of the mixed turn is dropped, the call stays; messages_json says what is trained
    out = udfs.tokenize_check_batch(pdf, "v3")
    assert out["status"].tolist() == [udfs.OK, udfs.OK]
    assert out["dropped_text_turns"].tolist() == [0, 1]
    assert out["dropped_text_chars"].tolist() == [0, len("<think>x</think>")]
    trained = json.loads(out["messages_json"][1])
    assert trained[1]["content"] == "" and trained[1]["tool_calls"] == [call]
    assert [m for i, m in enumerate(trained) if i != 1] == [m for i, m in enumerate(both) if i != 1]
    assert out["messages_json"][0] == pdf["messages_json"][0]  # untouched rows keep their JSON byte for byte
