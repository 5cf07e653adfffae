"""Character 5-gram shingles and their Jaccard similarity, the measure the near-duplicate checks use.

The row factory keeps ordinary rows below ``MAX_ROW_SIMILARITY`` of each other with it, and the planted
near-duplicates are kept only when they are clearly above the dedup threshold.
"""

from __future__ import annotations

from raytrain.sample_data.spec import MAX_ROW_SIMILARITY


def _shingles(row: dict, n: int = 5) -> set[str]:
    """The row's character n-grams: message text and tool-call arguments, lower-cased, whitespace collapsed."""
    parts = [m["content"] or "" for m in row["messages"]]
    parts += [c["function"]["arguments"] for m in row["messages"] for c in m["tool_calls"]]
    text = " ".join(" ".join(parts).lower().split())
    return {text[i : i + n] for i in range(len(text) - n + 1)}


def _jaccard(sa: set[str], sb: set[str]) -> float:
    if min(len(sa), len(sb)) < MAX_ROW_SIMILARITY * max(len(sa), len(sb)):
        return 0.0  # too different in size to be similar: skip the set operations
    both = len(sa & sb)
    return both / max(1, len(sa) + len(sb) - both)


def _char_jaccard(a: dict, b: dict) -> float:
    """Exact Jaccard of the two rows' character 5-gram sets."""
    return _jaccard(_shingles(a), _shingles(b))
