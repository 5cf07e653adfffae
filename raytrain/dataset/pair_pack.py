"""Tokenized preference pairs -> fixed-length packs in which a pair is never split.

A pair is a prompt and two responses. It goes into a pack as two adjacent segments, ``prompt + chosen`` then
``prompt + rejected`` (the prompt twice: each segment attends only to itself, as ``raytrain.dataset.pack`` lays
segments out), labels on the response tokens only. Each pack row carries a table of its pairs: ``pair_segments``
(max_pairs, 2) holds the segment numbers of each pair's chosen and rejected sequence, -1 -1 for an empty slot, which
is what the DPO loss (raytrain.pipeline.dpo) gathers by.

Packing is next-fit in the input order: a pair joins the open pack when its two sequences fit and a slot is free,
else the open pack is emitted and a new one starts. A pair longer than ``seq_len`` is an error: the length policy
decides about such pairs before packing, on the longer of the two sequences.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from raytrain.dataset.pack import Pack, build_pack
from raytrain.dataset.tokenize import TokenizedPair
from raytrain.errors import RaytrainError


@dataclass
class PairPack:
    """A pack row and the table of the pairs it holds."""

    pack: Pack
    pair_segments: np.ndarray
    """(max_pairs, 2) int64 segment numbers of each pair's chosen and rejected sequence; -1 for an empty slot."""
    pair_ids: list[str]
    """The pairs' ids in slot order."""


def _segments(pair: TokenizedPair) -> list[tuple[str, list[int], list[bool]]]:
    prompt = list(pair.prompt)
    return [(pair.pair_id, prompt + list(response), [False] * len(prompt) + [True] * len(response))
            for response in (pair.chosen, pair.rejected)]


def _emit(pairs: list[TokenizedPair], seq_len: int, max_pairs: int, pad_id: int) -> PairPack:
    segments = [segment for pair in pairs for segment in _segments(pair)]
    table = np.full((max_pairs, 2), -1, dtype=np.int64)
    table[: len(pairs)] = np.arange(2 * len(pairs), dtype=np.int64).reshape(-1, 2)
    return PairPack(pack=build_pack(segments, seq_len, pad_id), pair_segments=table,
                    pair_ids=[pair.pair_id for pair in pairs])


def pack_pairs(pairs: Iterable[TokenizedPair], seq_len: int, max_pairs: int, pad_id: int = 0) -> Iterator[PairPack]:
    """Pack ``pairs`` into rows of exactly ``seq_len`` tokens with at most ``max_pairs`` pairs each, in order."""
    if max_pairs < 1:
        raise RaytrainError(f"max_pairs must be >= 1, got {max_pairs}.")
    open_pairs: list[TokenizedPair] = []
    open_tokens = 0
    for pair in pairs:
        if not pair.chosen or not pair.rejected:
            raise RaytrainError(f"pair {pair.pair_id!r}: a response has no tokens; the enrichment quarantines such "
                                "pairs (missing_response), so this input did not come through it.")
        if pair.num_tokens > seq_len:
            raise RaytrainError(
                f"pair {pair.pair_id!r} takes {pair.num_tokens} tokens (prompt {len(pair.prompt)} twice, chosen "
                f"{len(pair.chosen)}, rejected {len(pair.rejected)}) > seq_len={seq_len}; a pair is never split, so "
                "the length policy must drop or truncate it first (dataset.length_policy), or raise seq_len.")
        if open_pairs and (open_tokens + pair.num_tokens > seq_len or len(open_pairs) == max_pairs):
            yield _emit(open_pairs, seq_len, max_pairs, pad_id)
            open_pairs, open_tokens = [], 0
        open_pairs.append(pair)
        open_tokens += pair.num_tokens
    if open_pairs:
        yield _emit(open_pairs, seq_len, max_pairs, pad_id)
