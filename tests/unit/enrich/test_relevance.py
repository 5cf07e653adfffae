"""Sentence relevance with the real all-MiniLM-L6-v2 (bundled, offline), checked against sentence-transformers."""

import numpy as np
import pytest
import torch
from sentence_transformers import util

from raytrain.enrich.relevance import (
    chunk_text,
    cosine_similarity_matrix,
    embed_texts,
    load_embedder,
    max_word_pieces,
    score_batch,
    select_sentences,
)
from raytrain.enrich.sentences import split_sentences
from raytrain.errors import RaytrainError

ROWS = [
    ("The Louvre is a large museum. Bananas are rich in potassium. The Eiffel Tower was finished in 1889. "
     "Penguins cannot fly.", "When was the Eiffel Tower completed?", "The Eiffel Tower was completed in 1889."),
    ("Photosynthesis turns light into chemical energy. The stock market fell on Tuesday. "
     "Chlorophyll absorbs mostly red and blue light.", "Which colours of light does chlorophyll absorb?",
     "Chlorophyll absorbs mainly red and blue light."),
    ("", "What is 2 + 2?", "4"),
]


@pytest.fixture(scope="module")
def model():
    return load_embedder()


class CountingEmbedder:
    def __init__(self, inner):
        self.inner, self.calls, self.texts = inner, 0, []
        self.tokenizer, self.max_seq_length = inner.tokenizer, inner.max_seq_length

    def encode(self, texts, **kw):
        self.calls += 1
        self.texts.append(list(texts))
        return self.inner.encode(texts, **kw)


def test_cosine_matrix_matches_sentence_transformers():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(5, 16)).astype(np.float32), rng.normal(size=(3, 16)).astype(np.float32)
    ref = util.cos_sim(torch.from_numpy(a), torch.from_numpy(b)).numpy()
    np.testing.assert_allclose(cosine_similarity_matrix(a, b), ref, atol=1e-6)
    a[0] = 0.0
    assert np.all(cosine_similarity_matrix(a, b)[0] == 0.0)
    with pytest.raises(RaytrainError):
        cosine_similarity_matrix(a, b[:, :4])


def test_select_sentences_top_k_threshold_and_order():
    # 2-d embeddings with known angles to q = (1, 0) and a = (0, 1)
    emb = np.array([[1, 0], [0, 1], [1, 1], [-1, 0], [1, 0.1]], dtype=np.float32)
    q, a = np.array([1, 0], np.float32), np.array([0, 1], np.float32)
    ref_q = util.cos_sim(torch.from_numpy(emb), torch.from_numpy(q[None])).numpy()[:, 0]
    ref_a = util.cos_sim(torch.from_numpy(emb), torch.from_numpy(a[None])).numpy()[:, 0]
    sel = select_sentences(list("abcde"), emb, q, a, top_k=2, threshold=0.0, question_weight=0.75)
    np.testing.assert_allclose(sel.scores, 0.75 * ref_q + 0.25 * ref_a, atol=1e-6)
    best_two = sorted(np.argsort(-(0.75 * ref_q + 0.25 * ref_a), kind="stable")[:2].tolist())
    assert sel.kept_indices == tuple(best_two) == (0, 4)  # original order, not score order
    assert sel.kept(list("abcde")) == ["a", "e"]
    everything = select_sentences(list("abcde"), emb, q, a, top_k=None, threshold=-1.0, question_weight=0.5)
    assert everything.kept_indices == (0, 1, 2, 3, 4)
    nothing = select_sentences(list("abcde"), emb, q, a, top_k=3, threshold=0.99, question_weight=0.5)
    assert nothing.kept_indices == ()
    with pytest.raises(RaytrainError, match="question_weight"):
        select_sentences(["x"], emb[:1], q, a, question_weight=1.5)


def test_load_embedder_is_cached_per_process(model):
    assert load_embedder() is model
    assert type(model).__name__ == "SentenceTransformer"
    with pytest.raises(RaytrainError, match="does not exist"):
        load_embedder("/nonexistent/model")


def test_real_model_keeps_answering_sentence_and_drops_unrelated(model):
    contexts = [split_sentences(c) for c, _, _ in ROWS]
    counting = CountingEmbedder(model)
    sels = score_batch(contexts, [r[1] for r in ROWS], [r[2] for r in ROWS], counting, batch_size=4, top_k=1,
                       threshold=0.2, question_weight=0.5)
    assert counting.calls == 1  # the whole batch in one encode call
    assert sels[0].kept(contexts[0]) == ["The Eiffel Tower was finished in 1889."]
    assert sels[1].kept(contexts[1]) == ["Chlorophyll absorbs mostly red and blue light."]
    assert sels[2].kept_indices == () and sels[2].scores.shape == (0,)
    unrelated = [contexts[0].index("Penguins cannot fly."), contexts[1].index("The stock market fell on Tuesday.")]
    assert sels[0].scores[unrelated[0]] < 0.2 and sels[1].scores[unrelated[1]] < 0.2


def test_scores_equal_sentence_transformers_cos_sim(model):
    contexts = [split_sentences(c) for c, _, _ in ROWS[:2]]
    sels = score_batch(contexts, [r[1] for r in ROWS[:2]], [r[2] for r in ROWS[:2]], model, batch_size=3,
                       top_k=2, threshold=-1.0, question_weight=0.3)
    for sents, (_, q, a), sel in zip(contexts, ROWS, sels, strict=False):
        s_emb = model.encode(sents, convert_to_tensor=True)
        q_ref = util.cos_sim(s_emb, model.encode([q], convert_to_tensor=True)).numpy()[:, 0]
        a_ref = util.cos_sim(s_emb, model.encode([a], convert_to_tensor=True)).numpy()[:, 0]
        np.testing.assert_allclose(sel.q_scores, q_ref, atol=1e-5)
        np.testing.assert_allclose(sel.a_scores, a_ref, atol=1e-5)
        np.testing.assert_allclose(sel.scores, 0.3 * q_ref + 0.7 * a_ref, atol=1e-5)
        # and the batch path agrees with the single-row function on the same embeddings
        single = select_sentences(sents, s_emb.numpy(), model.encode(q), model.encode(a), top_k=2, threshold=-1.0,
                                  question_weight=0.3)
        assert single.kept_indices == sel.kept_indices


def test_score_batch_embeds_repeated_texts_once(model):
    counting = CountingEmbedder(model)
    shared = ["Shared system sentence.", "Another shared one."]
    score_batch([shared, shared], ["q1", "q2"], ["a", "a"], counting, top_k=1)
    assert sorted(counting.texts[0]) == sorted(set(shared + ["q1", "q2", "a"]))
    with pytest.raises(RaytrainError, match="differ in length"):
        score_batch([shared], ["q1", "q2"], ["a"], model)


def test_rows_without_candidates_are_not_embedded(model):
    counting = CountingEmbedder(model)
    score_batch([["One sentence here."], []], ["q1", "q2"], ["a1", "a2"], counting, top_k=1)
    assert sorted(counting.texts[0]) == ["One sentence here.", "a1", "q1"]


def _long_text(words: int) -> str:
    rng = np.random.default_rng(0)
    vocab = ("reactor", "coolant", "pressure", "turbine", "valve", "sensor", "boron", "uranium", "steam", "pump",
             "extraordinarily", "thermodynamically", "x7", "Q-factor", "(see", "note)")
    return " ".join(rng.choice(vocab, size=words))


def test_chunks_fit_the_model_and_cover_the_text(model):
    limit = max_word_pieces(model)
    assert limit == 254  # all-MiniLM-L6-v2: max_seq_length 256 less [CLS] and [SEP]
    text = _long_text(700)
    chunks = chunk_text(text, model.tokenizer, limit)
    assert len(chunks) >= 3
    for piece, count in chunks:
        assert count == len(model.tokenizer(piece, add_special_tokens=False)["input_ids"]) <= limit
    assert " ".join(p for p, _ in chunks) == text  # cut between words, nothing lost or repeated
    assert sum(c for _, c in chunks) == len(model.tokenizer(text, add_special_tokens=False)["input_ids"])
    short = "A short sentence."
    assert chunk_text(short, model.tokenizer, limit) == [(short, 4)]


def test_chunked_embedding_is_the_piece_weighted_mean_of_encode(model):
    text, short = _long_text(700), "The turbine spins when steam flows."
    emb, chunks = embed_texts([text, short], model, batch_size=16)
    pieces = chunk_text(text, model.tokenizer, max_word_pieces(model))
    assert chunks.tolist() == [len(pieces), 1]
    # Reference: sentence-transformers' own encode of each chunk, combined as relevance's docstring says.
    ref = model.encode([p for p, _ in pieces], convert_to_tensor=True)  # (C, d)
    ref = torch.nn.functional.normalize(ref, dim=1)
    weights = torch.tensor([float(c) for _, c in pieces])[:, None]
    mean = (weights * ref).sum(dim=0)
    np.testing.assert_allclose(emb[0], (mean / mean.norm()).numpy(), atol=1e-5)
    np.testing.assert_allclose(emb[1], model.encode(short, normalize_embeddings=True), atol=1e-5)
    # encode alone would have read only the first 254 word pieces: the chunked embedding differs from that
    assert util.cos_sim(torch.tensor(emb[0]), model.encode(text, convert_to_tensor=True)).item() < 0.999


def test_score_batch_counts_chunked_texts(model):
    long_answer = _long_text(600)
    (sel,) = score_batch([["The reactor coolant pump failed.", "Bananas are yellow."]], ["What failed?"],
                         [long_answer], model, top_k=1)
    assert sel.chunked_texts == 1
