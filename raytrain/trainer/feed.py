"""Turn a worker's view of the packed dataset into the micro-batches DeepSpeed's pipeline engine pulls.

Pure: takes any `epoch -> iterable of numpy batches` callable, so it is tested with plain lists and used with a
Ray Data iterator in the worker.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from raytrain.trainer.schedule import epoch_and_offset, owns_micro_batch

MODEL_COLUMNS = ("input_ids", "position_ids", "segment_ids", "labels")

# ((input_ids, position_ids, segment_ids), labels), each (micro_batch_size, seq_len) int64
MicroBatch = tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class FeedTrace:
    """What this worker consumed: global micro-batch index -> digest of its document ids (for audits and tests)."""

    consumed: list[tuple[int, str]] = field(default_factory=list)


def _digest(doc_ids: Iterable[str]) -> str:
    return hashlib.sha1("|".join(str(d) for d in doc_ids).encode()).hexdigest()[:16]


def to_micro_batch(batch: dict[str, np.ndarray]) -> MicroBatch:
    def col(name: str) -> torch.Tensor:
        arr = np.asarray(batch[name])
        if arr.dtype == object:  # Parquet list columns come back as arrays of arrays
            arr = np.stack(arr)
        # copy: Arrow-backed arrays are read-only, and torch tensors must own writable memory
        return torch.from_numpy(np.array(arr, dtype=np.int64, copy=True))

    ids, pos, seg, labels = (col(c) for c in MODEL_COLUMNS)  # each (B, T)
    return (ids, pos, seg), labels


def micro_batches(
    epoch_batches: Callable[[int], Iterable[dict[str, np.ndarray]]],
    *,
    start_position: int,
    micro_batches_per_epoch: int,
    dp_rank: int,
    dp: int,
    grad_accum_steps: int,
    trace: FeedTrace | None = None,
) -> Iterator[MicroBatch]:
    """Endless micro-batches for replica `dp_rank`, starting at global micro-batch `start_position`.

    `epoch_batches(epoch)` must yield the same micro-batches in the same order every time it is called (a fixed-order
    dataset); only its first `micro_batches_per_epoch` full batches count, so a short last batch is never used.
    """
    epoch, offset = epoch_and_offset(start_position, micro_batches_per_epoch)
    while True:
        for index, batch in enumerate(epoch_batches(epoch)):
            if index >= micro_batches_per_epoch:
                break
            if index < offset:
                continue  # consumed before the checkpoint we resumed from
            global_index = epoch * micro_batches_per_epoch + index
            if not owns_micro_batch(global_index, dp_rank, dp, grad_accum_steps):
                continue
            if trace is not None:
                trace.consumed.append((global_index, _digest(batch["doc_ids"])))
            yield to_micro_batch(batch)
        epoch, offset = epoch + 1, 0
