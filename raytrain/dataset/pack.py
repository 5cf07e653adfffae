"""Tokenized documents -> fixed-length packs of ``seq_len`` tokens with pre-shifted labels.

Conventions the model relies on (all arrays int64, shape ``(seq_len,)``):
  - ``labels[t] = input_ids[t + 1]`` when token ``t + 1`` is in the same segment as ``t`` and is a
    loss-mask (assistant) token, else ``-100``. Labels are already shifted: the loss is
    ``cross_entropy(logits[t], labels[t])`` with no further shift, and never crosses a document boundary.
  - ``position_ids`` restart at 0 at the start of every segment.
  - ``segment_ids`` are 0, 1, 2, ... per segment in the pack; padding has segment ``PAD_SEGMENT_ID`` (-1)
    and position 0, so an attention mask "same segment and causal" never lets a real token see padding
    (padding tokens only see padding, so no attention row is empty).

Packing is greedy first-fit over a bounded window of open packs (``max_open_packs``): each document goes
into the first open pack with room, else opens a new pack, first emitting the fullest open pack when
``max_open_packs`` are already open. First-fit fills the holes that sequential packing leaves when a long
document follows a short one, while the bounded window keeps it streaming (memory
O(max_open_packs * seq_len)) and deterministic. ``max_open_packs=1`` is plain sequential packing.

Before packing, ``pack_batch`` applies ``dataset.length_policy`` (raytrain.dataset.length): under
"truncate" a long conversation keeps its prompt and the first tokens of its answer, under "drop" none reaches
packing (the enrichment quarantined them). Under "split" (opt-in), a document longer than ``seq_len`` is cut
into consecutive chunks of ``seq_len`` tokens plus a remainder;
each chunk is its own segment (positions restart at 0, it attends only to itself) and full chunks are
emitted as packs of their own at once. The cost: at each cut the target of the chunk's last token is
dropped (it lies in the next chunk), and the next chunk starts without its earlier context. No token is
dropped or duplicated: the sum of document lengths equals the sum of ``num_real_tokens``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from raytrain.dataset.labels import IGNORE_INDEX, PAD_SEGMENT_ID
from raytrain.dataset.length import apply_length
from raytrain.dataset.tokenize import load_tokenizer, tokenize_conversation
from raytrain.errors import RaytrainError


@dataclass
class Pack:
    """One training row of exactly ``seq_len`` tokens holding one or more document segments."""

    input_ids: np.ndarray
    """(seq_len,) int64 token ids; padding is ``pad_id``."""
    labels: np.ndarray
    """(seq_len,) int64 next-token targets aligned with positions, ``IGNORE_INDEX`` where no loss."""
    position_ids: np.ndarray
    """(seq_len,) int64 position within the segment, 0 at each segment start and on padding."""
    segment_ids: np.ndarray
    """(seq_len,) int64 segment number 0, 1, ... in the pack; ``PAD_SEGMENT_ID`` on padding."""
    doc_ids: list[str] = field(default_factory=list)
    """Id of the document of each segment, in segment order (a split document's id recurs across packs)."""
    num_real_tokens: int = 0
    """Tokens that are not padding."""


@dataclass
class _OpenPack:
    """A pack being filled: its segments as (doc_id, token ids, loss mask)."""

    segments: list[tuple[str, Sequence[int], Sequence[bool]]] = field(default_factory=list)
    num_tokens: int = 0


def build_pack(segments: list[tuple[str, Sequence[int], Sequence[bool]]], seq_len: int, pad_id: int) -> Pack:
    """One pack of exactly ``seq_len`` tokens from its ``(doc_id, input_ids, loss_mask)`` segments (which fit)."""
    input_ids = np.full(seq_len, pad_id, dtype=np.int64)
    labels = np.full(seq_len, IGNORE_INDEX, dtype=np.int64)
    position_ids = np.zeros(seq_len, dtype=np.int64)
    segment_ids = np.full(seq_len, PAD_SEGMENT_ID, dtype=np.int64)
    start = 0
    for segment_index, (_, ids, mask) in enumerate(segments):
        ids_arr = np.asarray(ids, dtype=np.int64)  # (n,)
        mask_arr = np.asarray(mask, dtype=bool)  # (n,)
        end = start + len(ids_arr)
        input_ids[start:end] = ids_arr
        # Token t predicts t+1 inside the segment; the segment's last token predicts nothing (stays -100).
        labels[start : end - 1] = np.where(mask_arr[1:], ids_arr[1:], IGNORE_INDEX)
        position_ids[start:end] = np.arange(len(ids_arr), dtype=np.int64)
        segment_ids[start:end] = segment_index
        start = end
    return Pack(
        input_ids=input_ids,
        labels=labels,
        position_ids=position_ids,
        segment_ids=segment_ids,
        doc_ids=[doc_id for doc_id, _, _ in segments],
        num_real_tokens=start,
    )


def pack_documents(
    docs: Iterable[tuple[str, Sequence[int], Sequence[bool]]],
    seq_len: int,
    pad_id: int = 0,
    max_open_packs: int = 8,
) -> Iterator[Pack]:
    """Pack ``(doc_id, input_ids, loss_mask)`` documents into ``Pack``s of exactly ``seq_len`` tokens.

    Greedy first-fit within ``max_open_packs`` open packs (see module docstring); documents longer than
    ``seq_len`` are split into ``seq_len`` chunks, each its own segment. Empty documents contribute
    nothing and are skipped. Packs come out in a deterministic order for a given input order.
    """
    if seq_len < 2:
        raise RaytrainError(f"seq_len must be >= 2 (a label needs a next token), got {seq_len}.")
    if max_open_packs < 1:
        raise RaytrainError(f"max_open_packs must be >= 1, got {max_open_packs}.")
    open_packs: list[_OpenPack] = []
    for doc_id, ids, mask in docs:
        if len(ids) != len(mask):
            raise RaytrainError(f"document {doc_id!r}: input_ids has {len(ids)} tokens but loss_mask has {len(mask)}.")
        for start in range(0, len(ids), seq_len):
            chunk = (doc_id, ids[start : start + seq_len], mask[start : start + seq_len])
            num_tokens = len(chunk[1])
            if num_tokens == seq_len:  # a full chunk is a full pack: no need to hold it open
                yield build_pack([chunk], seq_len, pad_id)
                continue
            target = next((p for p in open_packs if p.num_tokens + num_tokens <= seq_len), None)
            if target is None:
                if len(open_packs) == max_open_packs:  # make room: the fullest pack wastes the least padding
                    fullest = max(open_packs, key=lambda p: p.num_tokens)
                    open_packs.remove(fullest)
                    yield build_pack(fullest.segments, seq_len, pad_id)
                target = _OpenPack()
                open_packs.append(target)
            target.segments.append(chunk)
            target.num_tokens += num_tokens
            if target.num_tokens == seq_len:
                open_packs.remove(target)
                yield build_pack(target.segments, seq_len, pad_id)
    for open_pack in open_packs:
        yield build_pack(open_pack.segments, seq_len, pad_id)


PACK_COLUMNS = ("input_ids", "labels", "position_ids", "segment_ids")
"""The (num_packs, seq_len) int64 array columns of ``pack_batch``'s output."""
TOKENIZED_COLUMNS = ("uuid", "input_ids", "loss_mask")
"""What ``pack_batch`` reads: the enrichment stores them (raytrain.enrich.batches.tokenize_batch), ``tokenize_frame``
makes them for conversations that did not come through it (the benchmark set)."""


def tokenize_frame(frame: pd.DataFrame, tokenizer_version: str) -> pd.DataFrame:
    """(``uuid``, ``messages_json``) conversations -> (``uuid``, ``input_ids``, ``loss_mask``) rows, tokenized
    by mistral-common (tokenize.tokenize_conversation). Raises RaytrainError naming the uuid and row of a
    conversation that cannot be tokenized."""
    tokenizer = load_tokenizer(tokenizer_version)
    rows = []
    for row, (uuid, messages_json) in enumerate(zip(frame["uuid"], frame["messages_json"], strict=True)):
        try:
            tokenized = tokenize_conversation(json.loads(messages_json), tokenizer)
        except (RaytrainError, json.JSONDecodeError, TypeError) as exc:
            raise RaytrainError(f"conversation uuid={uuid!r} (row {row}): {exc}") from exc
        rows.append((str(uuid), tokenized.input_ids, tokenized.loss_mask))
    return pd.DataFrame(rows, columns=list(TOKENIZED_COLUMNS))


def pack_batch(
    batch: pd.DataFrame,
    seq_len: int,
    length_policy: str,
    pad_id: int = 0,
    max_open_packs: int = 8,
) -> dict[str, np.ndarray]:
    """Pack a batch of tokenized conversations; the function to give Ray Data ``map_batches``.

    In:  ``batch`` with TOKENIZED_COLUMNS: ``uuid`` (str), ``input_ids`` (token ids) and ``loss_mask`` (bools,
         True on assistant-generated tokens), as the enrichment stored them.
    Out: ``input_ids``, ``labels``, ``position_ids``, ``segment_ids``: (num_packs, seq_len) int64;
         ``doc_ids``: (num_packs,) object array of comma-joined uuids (one per segment, in segment order;
         uuids must not contain commas);
         ``num_tokens``: (num_packs,) int64 count of real (non-padding) tokens;
         ``num_targets``: (num_packs,) int64 count of tokens with a training target (label != -100).

    ``length_policy`` (drop | truncate | split) is applied to each conversation first (raytrain.dataset.length);
    a conversation "drop" would refuse is an error naming its uuid.

    Stateless per batch: the last open packs of a batch are padded and emitted rather than carried into
    the next batch, so each batch costs up to ``max_open_packs`` partly filled packs; keep batches large
    (thousands of conversations) relative to ``max_open_packs`` to make that padding small.
    """
    missing = [c for c in TOKENIZED_COLUMNS if c not in batch.columns]
    if missing:
        raise RaytrainError(f"batch is missing column(s) {missing}; it has {list(batch.columns)}. Enriched data "
                            "written before token ids were stored: re-run the enrichment (a new storage.run_name).")

    def documents() -> Iterator[tuple[str, list[int], list[bool]]]:
        for row, (uuid, ids, mask) in enumerate(zip(batch["uuid"], batch["input_ids"], batch["loss_mask"],
                                                     strict=True)):
            try:
                ids, mask = apply_length(list(ids), [bool(m) for m in mask], seq_len, length_policy, str(uuid))
            except RaytrainError as exc:
                raise RaytrainError(f"conversation uuid={uuid!r} (batch row {row}): {exc}") from exc
            yield str(uuid), ids, mask

    return pack_arrays(list(pack_documents(documents(), seq_len, pad_id=pad_id, max_open_packs=max_open_packs)),
                       seq_len)


def pack_arrays(packs: list[Pack], seq_len: int) -> dict[str, np.ndarray]:
    """``packs`` as the columns of a packed batch (``pack_batch``'s Out): PACK_COLUMNS (num_packs, seq_len),
    ``doc_ids``, ``num_tokens`` and ``num_targets``."""
    out: dict[str, np.ndarray] = {
        name: (
            np.stack([getattr(p, name) for p in packs]) if packs else np.zeros((0, seq_len), dtype=np.int64)
        )  # (num_packs, seq_len)
        for name in PACK_COLUMNS
    }
    out["doc_ids"] = np.array([",".join(p.doc_ids) for p in packs], dtype=object)
    out["num_tokens"] = np.array([p.num_real_tokens for p in packs], dtype=np.int64)
    out["num_targets"] = (out["labels"] != IGNORE_INDEX).sum(axis=1).astype(np.int64)
    return out
