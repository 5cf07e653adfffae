"""Exact and near-duplicate detection: normalized-text keys, MinHash signatures, LSH band keys, verification.

Every hash here is a fixed function of the bytes (sha1, blake2b, splitmix64), never Python's per-process
salted ``hash()``, so Spark workers on different machines agree. The Spark job computes ``exact_key``,
``minhash_signature`` and ``lsh_band_keys`` in its first pass (batches.prepare_batch), groups rows by band key and
verifies each bucket with ``verified_pairs`` (batches.verify_bucket); the later row of a verified pair in input
order is the near duplicate (passes.duplicates). The same rule in one process, for tests and the benchmark's
baseline, is tests/near_dedup_reference.py.

The MinHash and the banding are ours, not datasketch's: the Spark job needs band keys it can explode and group
by (docs/decisions.md, 'MinHash and LSH of our own, not datasketch').
"""

from __future__ import annotations

import functools
import hashlib
import math
import re
import unicodedata
from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from raytrain.errors import RaytrainError

_WS = re.compile(r"\s+")
_MASK64 = (1 << 64) - 1
_MAX_HASH32 = np.uint32(0xFFFFFFFF)
# Shingle hashes are processed in chunks so a 100k-character text does not build a (num_perm, 100k) matrix.
_CHUNK = 4096


def normalize_text(s: str) -> str:
    """NFKC, case-folded, whitespace runs collapsed to one space, stripped. Punctuation is kept."""
    return _WS.sub(" ", unicodedata.normalize("NFKC", s).casefold()).strip()


def exact_key(text: str) -> str:
    """sha1 hex digest of the normalized text: equal keys = duplicates up to case and whitespace."""
    return hashlib.sha1(normalize_text(text).encode("utf-8")).hexdigest()


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finalizer, elementwise on uint64 (a bijection with good avalanche; wraps mod 2**64)."""
    z = np.asarray(x, dtype=np.uint64)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def token_hashes(tokens: Sequence[str]) -> np.ndarray:
    """Stable 64-bit hash of each token (blake2b-64 of its UTF-8) -> (len(tokens),) uint64."""
    return np.fromiter(
        (int.from_bytes(hashlib.blake2b(t.encode("utf-8"), digest_size=8).digest(), "little") for t in tokens),
        dtype=np.uint64,
        count=len(tokens),
    )


def window_hashes(units: np.ndarray, n: int) -> np.ndarray:
    """Hash every window of ``n`` consecutive uint64 ``units`` -> (max(len - n + 1, 0),) uint64.

    A polynomial in the (mixed) units with odd multipliers, wrapping mod 2**64, then mixed once more.
    Sequences shorter than ``n`` give no windows.
    """
    units = splitmix64(np.asarray(units, dtype=np.uint64))  # (L,)
    if units.size < n:
        return np.zeros(0, dtype=np.uint64)
    # Fixed odd multipliers, one per window position, from splitmix64 of the position (no RNG state involved).
    mults = splitmix64(np.arange(1, n + 1, dtype=np.uint64)) | np.uint64(1)  # (n,)
    windows = sliding_window_view(units, n)  # (L - n + 1, n), a view, no copy
    with np.errstate(over="ignore"):
        return splitmix64((windows * mults).sum(axis=1, dtype=np.uint64))


def shingle_hashes(text: str, ngram: int = 5, unit: str = "char") -> np.ndarray:
    """Distinct stable hashes of the text's shingles: ``ngram`` characters or words of the normalized text.

    Text shorter than one shingle is a single shingle of itself; empty text has none.
    """
    norm = normalize_text(text)
    if unit == "char":
        units = np.frombuffer(norm.encode("utf-32-le"), dtype=np.uint32).astype(np.uint64)  # code points
    elif unit == "word":
        units = token_hashes(norm.split(" ") if norm else [])
    else:
        raise RaytrainError(f"shingle unit must be 'char' or 'word', got {unit!r}")
    if units.size == 0:
        return np.zeros(0, dtype=np.uint64)
    hashes = window_hashes(units, min(ngram, units.size))
    return np.unique(hashes)


def _perm_params(num_perm: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Odd multipliers and offsets of the num_perm multiply-shift hash functions, from splitmix64 of the seed."""
    base = (seed * 0x9E3779B97F4A7C15) & _MASK64  # python ints: no numpy scalar overflow warning
    ab = splitmix64(np.arange(2 * num_perm, dtype=np.uint64) + np.uint64(base))  # (2P,)
    return (ab[:num_perm] | np.uint64(1))[:, None], ab[num_perm:][:, None]  # (P, 1) each


def minhash_signature(
    text: str, num_perm: int = 128, ngram: int = 5, seed: int = 0, unit: str = "char"
) -> np.ndarray:
    """MinHash signature of the text's shingle set -> (num_perm,) uint32.

    Permutation i is the multiply-shift hash x -> top 32 bits of (a_i * x + b_i) mod 2**64 (a_i odd) on the
    already well-mixed 64-bit shingle hashes; the fraction of equal entries between two
    signatures estimates the Jaccard similarity of the shingle sets. Empty text: all entries 0xFFFFFFFF.
    The same (text, num_perm, ngram, seed, unit) gives the same signature in every process.
    """
    if num_perm < 1:
        raise RaytrainError(f"num_perm must be >= 1, got {num_perm}")
    if ngram < 1:
        raise RaytrainError(f"ngram must be >= 1, got {ngram}")
    return hashes_signature(shingle_hashes(text, ngram, unit), num_perm, seed)


def hashes_signature(hashes: np.ndarray, num_perm: int = 128, seed: int = 0) -> np.ndarray:
    """MinHash signature of a set of well-mixed 64-bit shingle hashes (K,) uint64 -> (num_perm,) uint32; see
    minhash_signature. Repeated hashes count once (a minimum is a minimum)."""
    sig = np.full(num_perm, _MAX_HASH32, dtype=np.uint32)
    mult, add = _perm_params(num_perm, seed)  # (P, 1) each
    for start in range(0, hashes.size, _CHUNK):
        chunk = hashes[None, start : start + _CHUNK]  # (1, C)
        permuted = chunk * mult  # (P, C), wraps mod 2**64
        permuted += add
        np.minimum(sig, (permuted >> np.uint64(32)).min(axis=1).astype(np.uint32), out=sig)
    return sig


def minhash_signatures(texts: Sequence[str], **kwargs) -> np.ndarray:
    """minhash_signature for each text -> (len(texts), num_perm) uint32 (a pandas-UDF batch)."""
    num_perm = kwargs.get("num_perm", 128)
    out = np.empty((len(texts), num_perm), dtype=np.uint32)
    for i, t in enumerate(texts):
        out[i] = minhash_signature(t, **kwargs)
    return out


@functools.lru_cache(maxsize=64)
def lsh_params(threshold: float, num_perm: int = 128, fn_weight: float = 0.9) -> tuple[int, int]:
    """(bands, rows) with bands * rows <= num_perm minimising the weighted area of false positives and false
    negatives around ``threshold`` (datasketch MinHashLSH's objective). Recall is weighted up by default:
    every candidate pair is verified against the threshold afterwards, so a false positive only costs a
    comparison while a false negative keeps a duplicate."""
    if not 0.0 < threshold <= 1.0:
        raise RaytrainError(f"threshold must be in (0, 1], got {threshold}")
    if not 0.0 <= fn_weight <= 1.0:
        raise RaytrainError(f"fn_weight must be in [0, 1], got {fn_weight}")
    xs = np.linspace(0.0, 1.0, 1001)
    best, best_err = (1, num_perm), math.inf
    for b in range(1, num_perm + 1):
        for r in range(1, num_perm // b + 1):
            p = 1.0 - (1.0 - xs**r) ** b  # probability two sets of Jaccard x share a band
            fp = np.trapezoid(np.where(xs < threshold, p, 0.0), xs)
            fn = np.trapezoid(np.where(xs >= threshold, 1.0 - p, 0.0), xs)
            err = (1.0 - fn_weight) * fp + fn_weight * fn
            if err < best_err:
                best, best_err = (b, r), err
    return best


def lsh_band_keys(sig: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """One int64 key per band -> (bands,) int64; two signatures share key j iff their band j rows are equal
    (up to 64-bit hash collisions). The band index is mixed in, so keys of different bands never meet.
    Also accepts a batch (N, num_perm) -> (N, bands). Spark: explode the keys, group by them."""
    sig = np.asarray(sig, dtype=np.uint32)
    if sig.shape[-1] < bands * rows:
        raise RaytrainError(f"signature has {sig.shape[-1]} entries < bands * rows = {bands} * {rows}")
    banded = sig[..., : bands * rows].reshape(*sig.shape[:-1], bands, rows).astype(np.uint64)  # (..., B, R)
    key = np.broadcast_to(splitmix64(np.arange(bands, dtype=np.uint64) + np.uint64(1)), banded.shape[:-1]).copy()
    with np.errstate(over="ignore"):
        for r in range(rows):
            key = splitmix64(key * np.uint64(0x100000001B3) + banded[..., r])
    return key.view(np.int64)


def verified_pairs(sigs: np.ndarray, threshold: float) -> list[tuple[int, int, float]]:
    """The pairs (i, j, estimated Jaccard), i < j, of a bucket's signatures (M, num_perm) whose estimated Jaccard
    (the fraction of equal signature entries) is >= ``threshold``. Blocks of rows keep a huge bucket within ~4M
    booleans."""
    sigs = np.asarray(sigs, dtype=np.uint32)
    out: list[tuple[int, int, float]] = []
    if not len(sigs):
        return out
    block = max(1, (1 << 22) // (len(sigs) * sigs.shape[1]))
    for start in range(0, len(sigs), block):
        sim = (sigs[start : start + block, None, :] == sigs[None, :, :]).mean(axis=2)  # (b, M)
        for a, b in zip(*np.nonzero(sim >= threshold), strict=True):
            i, j = start + int(a), int(b)
            if i < j:
                out.append((i, j, float(sim[a, b])))
    return out
