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
import pandas as pd

from raytrain.dataset.labels import IGNORE_INDEX
from raytrain.dataset.pack import Pack, build_pack, pack_arrays
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


MAX_PAIRS_PER_PACK = 16
"""The width of a pack's pair table (``pair_segments``): packing closes a pack at this many pairs."""
PAIR_TOKEN_COLUMNS = ("uuid", "prompt_ids", "chosen_ids", "rejected_ids")
"""What ``pair_pack_batch`` reads: the enriched pairs' columns (raytrain.enrich.pair_passes.ENRICHED_COLUMNS)."""


def pair_pack_batch(batch: pd.DataFrame, seq_len: int, max_pairs: int = MAX_PAIRS_PER_PACK,
                    pad_id: int = 0) -> dict[str, np.ndarray]:
    """Pack a batch of enriched pairs; the function to give Ray Data ``map_batches``.

    Out: ``pack_batch``'s columns (the sequences, ``doc_ids`` one pair id per segment, ``num_tokens``,
    ``num_targets``) and the pair table: ``pair_segments`` (num_packs, 2 * max_pairs) int64 (chosen and rejected
    segment of each slot, -1 for an empty one), ``num_pairs`` and ``chosen_targets`` (the chosen responses' target
    tokens, what the optional NLL term is averaged over) per pack."""
    pairs = (TokenizedPair(str(uuid), list(prompt), list(chosen), list(rejected)) for uuid, prompt, chosen, rejected
             in zip(*(batch[c] for c in PAIR_TOKEN_COLUMNS), strict=True))
    rows = list(pack_pairs(pairs, seq_len, max_pairs, pad_id))
    out = pack_arrays([row.pack for row in rows], seq_len)
    out["pair_segments"] = (np.stack([row.pair_segments.reshape(-1) for row in rows]) if rows
                            else np.zeros((0, 2 * max_pairs), dtype=np.int64))
    out["num_pairs"], out["chosen_targets"] = pair_counts(out["pair_segments"], out["segment_ids"], out["labels"])
    return out


def pair_counts(pair_segments: np.ndarray, segment_ids: np.ndarray, labels: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray]:
    """Per pack row, its pairs and its chosen responses' target tokens, each (B,) int64, from the pair table
    (B, 2 * max_pairs) and the rows' segment ids and labels (B, seq_len)."""
    table = np.asarray(pair_segments).reshape(len(pair_segments), -1, 2)  # (B, P, 2)
    chosen = [int((np.isin(segment_ids[row], table[row, :, 0][table[row, :, 0] >= 0])
                   & (labels[row] != IGNORE_INDEX)).sum()) for row in range(len(table))]
    return (table[:, :, 0] >= 0).sum(axis=1).astype(np.int64), np.array(chosen, dtype=np.int64)
