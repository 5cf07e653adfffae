"""Exact keys, MinHash and LSH: estimates checked against exact Jaccard computed with python sets."""

import hashlib
import json
import random
import subprocess
import sys

import numpy as np
import pytest
from near_dedup_reference import near_duplicate_groups, near_duplicates_in_order

from raytrain.enrich.dedup import (
    exact_key,
    lsh_band_keys,
    lsh_params,
    minhash_signature,
    minhash_signatures,
    normalize_text,
)
from raytrain.errors import RaytrainError

WORDS = ("river stone maple quiet orbit lantern velvet copper meadow signal harbor thistle canyon ember falcon "
         "prism willow glacier saffron tundra").split()


def estimated_jaccard(sig_a: np.ndarray, sig_b: np.ndarray) -> float:
    """The MinHash estimate of the Jaccard similarity: the fraction of equal signature entries."""
    return float(np.mean(np.asarray(sig_a) == np.asarray(sig_b)))


def _text(rng, n=80):
    return " ".join(rng.choice(WORDS) + str(rng.randint(0, 99)) for _ in range(n))


def _jaccard(a, b, n=5):
    a, b = normalize_text(a), normalize_text(b)
    sa, sb = {a[i : i + n] for i in range(len(a) - n + 1)}, {b[i : i + n] for i in range(len(b) - n + 1)}
    return len(sa & sb) / len(sa | sb)


def test_normalize_and_exact_key():
    assert normalize_text("  Hello\tWORLD \n again ") == "hello world again"
    assert exact_key("Hello  World") == exact_key("hello world") == hashlib.sha1(b"hello world").hexdigest()
    assert exact_key("hello world!") != exact_key("hello world")


def test_minhash_estimates_exact_jaccard():
    rng = random.Random(1)
    for _ in range(5):
        a = _text(rng)
        words = a.split()
        for i in rng.sample(range(len(words)), rng.randint(1, 40)):
            words[i] = rng.choice(WORDS) + "x"
        b = " ".join(words)
        est = estimated_jaccard(minhash_signature(a, num_perm=512), minhash_signature(b, num_perm=512))
        assert abs(est - _jaccard(a, b)) < 4 * np.sqrt(0.25 / 512)  # 4 sigma of the estimator


def test_minhash_is_deterministic_across_processes_and_seeded():
    text = "The quick brown fox jumps over the lazy dog."
    code = ("import sys; sys.path.insert(0, '.'); from raytrain.enrich.dedup import minhash_signature; "
            f"print(minhash_signature({text!r}, num_perm=16, seed=7).tolist())")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": "123"}).stdout
    assert json.loads(other) == minhash_signature(text, num_perm=16, seed=7).tolist()
    assert not np.array_equal(minhash_signature(text, seed=1), minhash_signature(text, seed=2))
    sig = minhash_signature(text)
    assert sig.dtype == np.uint32 and sig.shape == (128,)
    assert np.array_equal(minhash_signatures([text, text]), np.stack([sig, sig]))


def test_word_shingles_and_edge_cases():
    a = "one two three four five six seven eight"
    b = "one two three four five six seven nine"
    est = estimated_jaccard(minhash_signature(a, ngram=2, unit="word", num_perm=256),
                            minhash_signature(b, ngram=2, unit="word", num_perm=256))
    assert abs(est - 6 / 8) < 0.15  # 7 bigrams each, 6 shared -> Jaccard 6/8
    assert np.all(minhash_signature("") == 0xFFFFFFFF)
    assert np.array_equal(minhash_signature("abc"), minhash_signature("ABC"))  # shorter than one shingle
    with pytest.raises(RaytrainError):
        minhash_signature("x", unit="byte")


def test_band_keys_equal_iff_band_rows_equal():
    rng = np.random.default_rng(0)
    sig = rng.integers(0, 2**32, size=128, dtype=np.uint64).astype(np.uint32)
    other = sig.copy()
    other[5] ^= 1  # band 0 (rows 0..7) differs
    k1, k2 = lsh_band_keys(sig, 16, 8), lsh_band_keys(other, 16, 8)
    assert k1.dtype == np.int64 and k1.shape == (16,)
    assert k1[0] != k2[0] and np.array_equal(k1[1:], k2[1:])
    assert len(set(k1.tolist())) == 16  # band index mixed in
    batch = lsh_band_keys(np.stack([sig, other]), 16, 8)
    assert np.array_equal(batch, np.stack([k1, k2]))


def test_lsh_params_fit_and_favour_recall():
    b, r = lsh_params(0.8, 128)
    assert b * r <= 128
    assert 1 - (1 - 0.9**r) ** b > 0.99  # pairs at Jaccard 0.9 nearly always become candidates


def test_near_duplicates_in_order_drop_every_later_row_of_a_pair():
    rng = random.Random(3)
    base = [_text(rng, 120) for _ in range(6)]
    texts, ids = list(base), list(range(10, 16))
    for k, (src, new_id) in enumerate([(0, 3), (0, 20), (2, 30)]):  # id 3 comes after 10 in input order
        words = texts[src].split()
        words[rng.randrange(len(words))] = f"changed{k}"
        texts.append(" ".join(words))
        ids.append(new_id)
    sigs = np.stack([minhash_signature(t) for t in texts])
    groups = near_duplicate_groups(ids, sigs, 0.8)
    assert groups == [[3, 10, 20], [12, 30]]
    # every pair in a group really is similar, every other pair really is not
    by_id = dict(zip(ids, texts, strict=True))
    assert all(_jaccard(by_id[g[0]], by_id[x]) > 0.8 for g in groups for x in g[1:])
    assert near_duplicates_in_order(ids, sigs, 0.8) == [3, 20, 30]  # the first in input order stays, not the smallest
    with pytest.raises(RaytrainError, match="unique"):
        near_duplicates_in_order([1, 1], sigs[:2], 0.8)


def test_candidates_are_verified_not_just_bucketed():
    # one shared band but otherwise different signatures: a candidate, rejected by the Jaccard check
    a = np.arange(128, dtype=np.uint32)
    b = a + 1000
    b[:8] = a[:8]
    assert near_duplicates_in_order(["a", "b"], np.stack([a, b]), 0.8, bands=16, rows=8) == []
    assert near_duplicates_in_order(["a", "b"], np.stack([a, a]), 0.8, bands=16, rows=8) == ["b"]
