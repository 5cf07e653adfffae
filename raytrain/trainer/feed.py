"""Turn a worker's view of the packed dataset into the micro-batches DeepSpeed's pipeline engine pulls.

Pure: takes any `epoch -> iterable of numpy batches` callable, so it is tested with plain lists and used with a
Ray Data iterator in the worker.

Loss normalization: the loss of an optimizer step is the mean over *every target token of the global batch* (all
m micro-batches of all dp replicas), as torchtune and transformers' ``num_items_in_batch`` do, not a mean of
per-micro-batch means (which weighs a token in a pack with few targets more than one in a full pack). Every reader
streams the whole fixed-order dataset, so it counts the targets of the step's dp * m micro-batches before yielding
its own m, each with ``loss_scale = dp * m / targets``. The loss function multiplies the micro-batch's summed
token loss by it; DeepSpeed then divides by m (gradient accumulation) and averages over dp, which leaves
sum / targets for both the reported loss and the gradients.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from raytrain.pipeline.model import IGNORE_INDEX
from raytrain.trainer.schedule import epoch_and_offset, micro_batches_per_step, owns_micro_batch

MODEL_COLUMNS = ("input_ids", "position_ids", "segment_ids", "labels")

# ((input_ids, position_ids, segment_ids), (labels, loss_scale)): (micro_batch_size, seq_len) int64 each, and a
# float32 scalar (see the module docstring)
MicroBatch = tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class FeedTrace:
    """What this worker consumed: global micro-batch index -> digest of its document ids (for audits and tests)."""

    consumed: list[tuple[int, str]] = field(default_factory=list)


def _digest(doc_ids: Iterable[str]) -> str:
    return hashlib.sha1("|".join(str(d) for d in doc_ids).encode()).hexdigest()[:16]


def count_targets(batch: dict[str, np.ndarray]) -> int:
    """Tokens with a training target (label != -100) in a numpy batch."""
    labels = np.asarray(batch["labels"])
    if labels.dtype == object:
        labels = np.stack(labels)
    return int(np.count_nonzero(labels != IGNORE_INDEX))


def to_micro_batch(batch: dict[str, np.ndarray], loss_scale: float) -> MicroBatch:
    def col(name: str) -> torch.Tensor:
        arr = np.asarray(batch[name])
        if arr.dtype == object:  # Parquet list columns come back as arrays of arrays
            arr = np.stack(arr)
        # copy: Arrow-backed arrays are read-only, and torch tensors must own writable memory
        return torch.from_numpy(np.array(arr, dtype=np.int64, copy=True))

    ids, pos, seg, labels = (col(c) for c in MODEL_COLUMNS)  # each (B, T)
    return (ids, pos, seg), (labels, torch.tensor(loss_scale, dtype=torch.float32))


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
    """Endless micro-batches for replica `dp_rank`, starting at global micro-batch `start_position` (a step boundary).

    `epoch_batches(epoch)` must yield the same micro-batches in the same order every time it is called (a fixed-order
    dataset); only its first `micro_batches_per_epoch` full batches count, so a short last batch is never used.
    A replica's m micro-batches of a step are yielded once the whole step (all replicas' micro-batches) has been
    read, each with the step's loss scale (module docstring).
    """
    per_step = micro_batches_per_step(dp, grad_accum_steps)
    if start_position % per_step:
        raise ValueError(f"start_position {start_position} is not a step boundary (multiple of dp * m = {per_step})")
    own: list[tuple[int, dict[str, np.ndarray]]] = []
    seen = targets = 0
    for global_index, batch in _stream(epoch_batches, start_position, micro_batches_per_epoch):
        targets += count_targets(batch)
        if owns_micro_batch(global_index, dp_rank, dp, grad_accum_steps):
            own.append((global_index, batch))
        seen += 1
        if seen < per_step:
            continue
        loss_scale = per_step / targets if targets else 0.0  # no target in the step: every loss sum is 0 anyway
        for own_index, own_batch in own:
            if trace is not None:
                trace.consumed.append((own_index, _digest(own_batch["doc_ids"])))
            yield to_micro_batch(own_batch, loss_scale)
        own, seen, targets = [], 0, 0


def _stream(epoch_batches: Callable[[int], Iterable[dict[str, np.ndarray]]], start_position: int,
            micro_batches_per_epoch: int) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
    """(global micro-batch index, batch) from `start_position` on, epoch after epoch."""
    epoch, offset = epoch_and_offset(start_position, micro_batches_per_epoch)
    while True:
        for index, batch in enumerate(epoch_batches(epoch)):
            if index >= micro_batches_per_epoch:
                break
            if index < offset:
                continue  # consumed before the checkpoint we resumed from
            yield epoch * micro_batches_per_epoch + index, batch
        epoch, offset = epoch + 1, 0
