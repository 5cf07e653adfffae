"""Context from a corpus, the pure parts (raytrain.enrich.corpus, corpus_batches): input checks before Spark, the
cache key, documents -> sentences, exact and approximate search, retrieval with the selection's score (checked
against sentence_transformers.util.cos_sim), the block's eval check, and the sample corpus."""

import json

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raytrain.enrich.context import context_block, final_answer
from raytrain.enrich.corpus import (
    CorpusIndex,
    ann_top_k,
    build_ann,
    check_corpus,
    corpus_key,
    document_sentences,
    exact_top_k,
    recall_at_k,
    retrieve,
)
from raytrain.enrich.decontam import build_eval_index, build_sorted_index
from raytrain.errors import RaytrainError
from raytrain.storage import resolve


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


# ---- inputs, checked before Spark --------------------------------------------------------------------------------
def test_check_corpus_reads_jsonl_parquet_and_folders(tmp_path):
    _write_jsonl(tmp_path / "a.jsonl", [{"id": 1, "text": "One."}, {"id": 2, "text": "Two."}])
    pq.write_table(pa.table({"doc": ["x"], "body": ["Three."]}), tmp_path / "b.parquet")
    files = check_corpus([str(tmp_path / "a.jsonl")], "id", "text")
    assert [(f.fmt, f.records) for f in files] == [("json", 2)]
    files = check_corpus([f"file://{tmp_path / 'b.parquet'}"], "doc", "body")
    assert [(f.fmt, f.records) for f in files] == [("parquet", 1)]
    (tmp_path / "folder").mkdir()
    _write_jsonl(tmp_path / "folder" / "c.jsonl", [{"id": "c", "text": "Four."}])
    (tmp_path / "folder" / "notes.txt").write_text("not a corpus file")
    assert [f.loc.name for f in check_corpus([str(tmp_path / "folder")], "id", "text")] == ["c.jsonl"]


@pytest.mark.parametrize("case,match", [
    ("missing", r"does not exist. Fix: point enrich.context_corpus"),
    ("field", r"b.jsonl:2: field\(s\) \['text'\] missing .* Fix: set enrich.corpus_id_field"),
    ("parquet_field", r"has no field\(s\) \['text'\] \(it has \['id', 'body'\]\)"),
    ("empty", r"no documents in .* Fix: point it at a non-empty corpus"),
    ("extension", r"neither .parquet nor .jsonl"),
    ("bad_json", r"b.jsonl:1: not valid JSON"),
    ("empty_folder", r"holds no .parquet, .jsonl or .json files"),
    ("not_parquet", r"b.parquet is not a readable Parquet file"),
    ("not_utf8", r"cannot read .*b.jsonl .* Fix: check the path, its permissions and encoding"),
])
def test_check_corpus_errors_name_the_path_and_fix(tmp_path, case, match):
    spec = str(tmp_path / "b.jsonl")
    if case == "field":
        _write_jsonl(tmp_path / "b.jsonl", [{"id": 1, "text": "x"}, {"id": 2, "body": "y"}])
    elif case == "parquet_field":
        pq.write_table(pa.table({"id": [1], "body": ["x"]}), tmp_path / "b.parquet")
        spec = str(tmp_path / "b.parquet")
    elif case == "empty":
        (tmp_path / "b.jsonl").write_text("\n")
    elif case == "extension":
        (tmp_path / "b.csv").write_text("id,text\n")
        spec = str(tmp_path / "b.csv")
    elif case == "bad_json":
        (tmp_path / "b.jsonl").write_text("{nope\n")
    elif case == "not_parquet":
        (tmp_path / "b.parquet").write_text("id,text\n1,x\n")
        spec = str(tmp_path / "b.parquet")
    elif case == "not_utf8":
        (tmp_path / "b.jsonl").write_bytes(b'{"id": 1, "text": "\xff\xfe"}\n')
    elif case == "empty_folder":
        (tmp_path / "docs").mkdir()
        spec = str(tmp_path / "docs")
    with pytest.raises(RaytrainError, match=match) as e:
        check_corpus([spec], "id", "text")
    assert "enrich.context_corpus" in str(e.value)


def test_corpus_key_follows_content_fields_and_model(tmp_path):
    a = _write_jsonl(tmp_path / "a.jsonl", [{"id": 1, "text": "One."}])
    files = check_corpus([a], "id", "text")
    key = corpus_key(files, "id", "text", "m1")
    assert key == corpus_key(check_corpus([a], "id", "text"), "id", "text", "m1")
    assert key != corpus_key(files, "id", "text", "m2")
    assert key != corpus_key(files, "id", "body", "m1")
    _write_jsonl(tmp_path / "a.jsonl", [{"id": 1, "text": "One!"}])
    assert key != corpus_key(check_corpus([a], "id", "text"), "id", "text", "m1")


def test_sample_corpus_spec_resolves_under_the_input(tmp_path):
    (tmp_path / "corpus").mkdir()
    _write_jsonl(tmp_path / "corpus" / "documents.jsonl", [{"id": "d", "text": "Some words here."}])
    (f,) = check_corpus(["sample"], "id", "text", input_root=resolve(str(tmp_path)))
    assert f.loc.path == str(tmp_path / "corpus" / "documents.jsonl")


def test_document_sentences_keep_prose_with_their_position():
    text = "The archive opened in 1901.\n{\"json\": 1}\nShort one.\nIt holds ninety ledgers of maps."
    assert document_sentences(text) == [(0, "The archive opened in 1901."), (3, "It holds ninety ledgers of maps.")]
    assert document_sentences(None) == [] == document_sentences("")


# ---- search ------------------------------------------------------------------------------------------------------
def test_exact_top_k_equals_a_full_sort_across_blocks():
    rng = np.random.default_rng(0)
    emb, queries = _unit(rng.normal(size=(1000, 16))), _unit(rng.normal(size=(7, 16)))
    scores, idx = exact_top_k(queries, emb, 5, block_rows=128)
    full = queries @ emb.T
    want = np.argsort(-full, axis=1, kind="stable")[:, :5]
    np.testing.assert_array_equal(idx, want)
    np.testing.assert_allclose(scores, np.take_along_axis(full, want, axis=1), rtol=1e-6)
    assert exact_top_k(queries, emb[:2], 5)[1].shape == (7, 2)  # fewer rows than k


def test_approximate_index_equals_exact_on_a_small_corpus_and_reports_recall_on_a_larger_one():
    rng = np.random.default_rng(1)
    small, queries = _unit(rng.normal(size=(300, 32))), _unit(rng.normal(size=(50, 32)))
    _, exact = exact_top_k(queries, small, 3)
    _, approx = ann_top_k(queries, build_ann(small), "small", 3)
    assert recall_at_k(exact, approx) == 1.0
    np.testing.assert_array_equal(np.sort(exact, axis=1), np.sort(approx, axis=1))
    large = _unit(rng.normal(size=(20_000, 32)))
    _, exact = exact_top_k(queries, large, 10)
    _, approx = ann_top_k(queries, build_ann(large), "large", 10)
    recall = recall_at_k(exact, approx)
    print(f"HNSW recall@10 on 20,000 random 32-d vectors: {recall:.3f}")  # reported, not a timing
    assert 0.5 < recall <= 1.0


def test_retrieve_scores_are_the_selection_score_in_document_order():
    rng = np.random.default_rng(2)
    emb = _unit(rng.normal(size=(40, 8)))
    q, a = _unit(rng.normal(size=(3, 8))), _unit(rng.normal(size=(3, 8)))
    index = CorpusIndex(doc_ids=[f"d{i:02d}" for i in range(40)], sentence_indices=np.zeros(40, np.int64),
                        texts=[f"s{i}" for i in range(40)], emb=emb, key="k")
    w = 0.3
    for row, got in enumerate(retrieve(index, q, a, top_k=4, min_score=-1.0, question_weight=w)):
        combined = w * (emb @ q[row]) + (1 - w) * (emb @ a[row])
        assert list(got.indices) == sorted(np.argsort(-combined)[:4].tolist())  # top 4, in document order
        np.testing.assert_allclose(got.scores, combined[list(got.indices)], atol=1e-6)
        np.testing.assert_allclose(got.q_scores, emb[list(got.indices)] @ q[row], atol=1e-6)
    high = retrieve(index, q, a, top_k=4, min_score=0.5, question_weight=w)
    assert all(s >= 0.5 for r in high for s in r.scores)


# ---- the Spark body, with the real embedding model ---------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    from raytrain.enrich.relevance import load_embedder

    return load_embedder(None)


def _index(model, texts):
    from raytrain.enrich.relevance import embed_texts

    emb, _ = embed_texts(texts, model)
    return CorpusIndex(doc_ids=[f"doc-{i}" for i in range(len(texts))], sentence_indices=np.arange(len(texts)),
                       texts=list(texts), emb=emb, key="t")


def _rows(rows):
    out = []
    for i, (question, answer, context) in enumerate(rows):
        messages = [{"role": "user", "content": question, "tool_calls": []},
                    {"role": "assistant", "content": answer, "tool_calls": []}]
        out.append({"row_id": i, "uuid": f"u{i}", "question": question, "answer": answer,
                    "context_sentences": np.asarray(context, dtype=object), "messages_json": json.dumps(messages)})
    return pd.DataFrame(out)


def test_corpus_context_batch_adds_the_answering_sentence(model):
    from sentence_transformers import util

    from raytrain.enrich.corpus_batches import corpus_context_batch

    corpus = ["The Ostvik ferry leaves the north pier at seven every morning.",
              "Bakers in Quillan use rye flour from the valley mills.",
              "The observatory at Carrow opens its dome on clear Friday nights."]
    index = _index(model, corpus)
    pdf = _rows([("When does the Ostvik ferry leave?", "<think>\nmorning\n</think>\n\nIt leaves at seven.", []),
                 ("What do Quillan bakers use?", "Rye flour.", ["Own context sentence here."]),
                 ("How do I fix a flat tyre?", "Patch the tube.", [])])
    out = corpus_context_batch(pdf, index=index, eval_index=build_sorted_index(set()), ngram=13, model_path="",
                               batch_size=8, top_k=1, min_score=0.4, question_weight=0.5)
    assert list(out["corpus_path"]) == ["added", "own_context", "below_min_score"]
    assert list(out["corpus_sentences"][0]) == [corpus[0]] and list(out["corpus_doc_ids"][0]) == ["doc-0"]
    q, a = model.encode(["When does the Ostvik ferry leave?", final_answer(pdf["answer"][0])], convert_to_tensor=True)
    s = model.encode([corpus[0]], convert_to_tensor=True)
    cq, ca = float(util.cos_sim(s, q)), float(util.cos_sim(s, a))
    np.testing.assert_allclose(out["corpus_question_scores"][0], [cq], atol=1e-5)
    np.testing.assert_allclose(out["corpus_answer_scores"][0], [ca], atol=1e-5)
    np.testing.assert_allclose(out["corpus_scores"][0], [0.5 * cq + 0.5 * ca], atol=1e-5)
    trained = json.loads(out["messages_json"][0])
    assert trained[0]["content"] == context_block([corpus[0]]) + "\n\nWhen does the Ostvik ferry leave?"
    assert out["messages_json"][1] == pdf["messages_json"][1] and out["messages_json"][2] == pdf["messages_json"][2]


def test_block_eval_check_drops_sentences_that_join_into_an_eval_ngram(model):
    from raytrain.enrich.corpus_batches import corpus_context_batch

    item = "one two three four five six seven eight nine ten eleven twelve thirteen"
    corpus = ["The ferry counts one two three four five six seven.", "Eight nine ten eleven twelve thirteen follow."]
    index = _index(model, corpus)
    evals = build_sorted_index(build_eval_index([item], 13))
    pdf = _rows([("How does the ferry count?", "The ferry counts one two three four five six seven eight.", [])])
    out = corpus_context_batch(pdf, index=index, eval_index=evals, ngram=13, model_path="", batch_size=8, top_k=2,
                               min_score=-1.0, question_weight=0.5)
    assert len(out["corpus_sentences"][0]) == 1 and out["corpus_dropped_for_eval"][0] == 1


def test_sample_corpus_has_one_answering_document_per_row(tmp_path):
    from raytrain.sample_data import load_corpus_key, write_sample_dataset

    m = write_sample_dataset(str(tmp_path / "s"), rows_per_split=20)
    key = load_corpus_key(m.out_dir)
    docs = [json.loads(line) for line in open(tmp_path / "s" / "corpus" / "documents.jsonl", encoding="utf-8")]
    sentences = [s for d in docs for _, s in document_sentences(d["text"])]
    assert key["answered"] and len(sentences) < 500
    for k in key["answered"]:
        assert sum(k["sentence"] in d["text"] for d in docs if not d["id"].startswith("doc-x")) == 1
    assert key["contaminated"][0]["sentence"] in sentences  # one unit: removed whole by the eval filter
