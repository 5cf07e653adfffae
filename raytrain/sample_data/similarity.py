"""Character 5-gram shingles and their Jaccard similarity, the measure the near-duplicate checks use.

The row factory keeps ordinary rows below ``MAX_ROW_SIMILARITY`` of each other with it (``SeenRows``), and the
planted near-duplicates are kept only when they are clearly above the dedup threshold.
"""

from __future__ import annotations

import numpy as np

from raytrain.enrich.dedup import hashes_signature, window_hashes
from raytrain.sample_data.spec import MAX_ROW_SIMILARITY

NUM_PERM = 128
CANDIDATE_ESTIMATE = 0.3
"""SeenRows compares 5-gram sets exactly only for the earlier rows whose MinHash estimate of the Jaccard is at least
this. A pair at MAX_ROW_SIMILARITY (0.5) estimates below 0.3 with probability ~3e-6 (4.5 standard deviations of a
128-permutation estimate); the sample's ordinary rows sit at 0.17-0.34 (99th percentile) of each other."""


def _shingle_text(row: dict) -> str:
    """What the shingles are taken from: message text and tool-call arguments, lower-cased, whitespace collapsed."""
    parts = [m["content"] or "" for m in row["messages"]]
    parts += [c["function"]["arguments"] for m in row["messages"] for c in m["tool_calls"]]
    return " ".join(" ".join(parts).lower().split())


def _shingles(row: dict, n: int = 5) -> set[str]:
    """The row's character n-grams (of _shingle_text)."""
    text = _shingle_text(row)
    return {text[i : i + n] for i in range(len(text) - n + 1)}


def _shingle_hashes(row: dict, n: int = 5) -> np.ndarray:
    """The row's character n-grams as sorted distinct 64-bit hashes (K,) uint64: the set _shingles gives, one hash
    per n-gram (dedup.window_hashes over the code points; a collision among a row's ~10^4 n-grams has probability
    ~10^-11)."""
    units = np.frombuffer(_shingle_text(row).encode("utf-32-le"), dtype=np.uint32).astype(np.uint64)
    return np.unique(window_hashes(units, n))


def _common(a: np.ndarray, b: np.ndarray) -> int:
    """How many values two sorted distinct arrays share: binary search of the shorter in the longer (np.intersect1d
    would sort both again)."""
    short, long = (a, b) if a.size <= b.size else (b, a)
    if not short.size:
        return 0
    at = np.searchsorted(long, short)  # (S,)
    at[at == long.size] = 0
    return int((long[at] == short).sum())


class SeenRows:
    """The 5-gram sets of a split's rows so far, to tell whether a new row is at least ``MAX_ROW_SIMILARITY`` like
    one of them, without comparing it with every one: a MinHash signature per row picks the candidates (estimate
    >= CANDIDATE_ESTIMATE, sizes within the ratio a Jaccard that high needs), and only they are compared exactly.
    Comparing every set would be quadratic in the split's rows (benchmarks/RESULTS.md, 'Sample generation')."""

    def __init__(self) -> None:
        self._hashes: list[np.ndarray] = []  # each row's sorted distinct 5-gram hashes
        self._sigs = np.empty((64, NUM_PERM), dtype=np.uint32)  # (capacity, P); the first len(self) rows used
        self._sizes = np.empty(64, dtype=np.int64)
        self.compared = 0  # exact set comparisons made so far

    def __len__(self) -> int:
        return len(self._hashes)

    def too_close(self, hashes: np.ndarray, sig: np.ndarray) -> bool:
        """Whether the row with these 5-gram ``hashes`` and signature ``sig`` is at least MAX_ROW_SIMILARITY like
        an earlier row (exact Jaccard of the sets)."""
        n = len(self)
        if not n:
            return False
        agree = (self._sigs[:n] == sig).sum(axis=1)  # (n,) equal signature entries
        sizes = self._sizes[:n]
        sized = np.minimum(sizes, hashes.size) >= MAX_ROW_SIMILARITY * np.maximum(sizes, hashes.size)
        for i in np.flatnonzero((agree >= CANDIDATE_ESTIMATE * NUM_PERM) & sized):
            self.compared += 1
            both = _common(hashes, self._hashes[i])
            if both / max(1, hashes.size + self._hashes[i].size - both) >= MAX_ROW_SIMILARITY:
                return True
        return False

    def add(self, hashes: np.ndarray, sig: np.ndarray) -> None:
        n = len(self)
        if n == len(self._sizes):
            self._sigs = np.concatenate([self._sigs, np.empty_like(self._sigs)])
            self._sizes = np.concatenate([self._sizes, np.empty_like(self._sizes)])
        self._sigs[n], self._sizes[n] = sig, hashes.size
        self._hashes.append(hashes)

    def check(self, row: dict) -> tuple[bool, np.ndarray, np.ndarray]:
        """(too_close, hashes, signature) of ``row``: pass the last two to ``add`` once the row is kept."""
        hashes = _shingle_hashes(row)
        sig = hashes_signature(hashes, NUM_PERM)
        return self.too_close(hashes, sig), hashes, sig


def _jaccard(sa: set[str], sb: set[str]) -> float:
    if min(len(sa), len(sb)) < MAX_ROW_SIMILARITY * max(len(sa), len(sb)):
        return 0.0  # too different in size to be similar: skip the set operations
    both = len(sa & sb)
    return both / max(1, len(sa) + len(sb) - both)


def _char_jaccard(a: dict, b: dict) -> float:
    """Exact Jaccard of the two rows' character 5-gram sets."""
    return _jaccard(_shingles(a), _shingles(b))
