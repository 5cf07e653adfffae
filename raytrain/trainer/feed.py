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

from raytrain.dataset.pack import PAD_SEGMENT_ID
from raytrain.pipeline.model import IGNORE_INDEX
from raytrain.trainer.schedule import epoch_and_offset, micro_batches_per_step, owns_micro_batch

MODEL_COLUMNS = ("input_ids", "position_ids", "segment_ids", "labels")

# ((input_ids, position_ids, segment_ids), (labels, loss_scale)): (micro_batch_size, seq_len) int64 each, and a
# float32 scalar (see the module docstring)
MicroBatch = tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class FeedTrace:
    """What this worker consumed: global micro-batch index -> digest of its document ids (for audits and tests),
    and per optimizer step the real (non-padding) tokens and the target tokens of the whole global batch."""

    consumed: list[tuple[int, str]] = field(default_factory=list)
    step_tokens: list[int] = field(default_factory=list)
    step_targets: list[int] = field(default_factory=list)


def _digest(doc_ids: Iterable[str]) -> str:
    return hashlib.sha1("|".join(str(d) for d in doc_ids).encode()).hexdigest()[:16]


def _column(batch: dict[str, np.ndarray], name: str) -> np.ndarray:
    arr = np.asarray(batch[name])
    return np.stack(arr) if arr.dtype == object else arr  # Parquet list columns come back as arrays of arrays


def count_targets(batch: dict[str, np.ndarray]) -> int:
    """Tokens with a training target (label != -100) in a numpy batch."""
    return int(np.count_nonzero(_column(batch, "labels") != IGNORE_INDEX))


def count_real_tokens(batch: dict[str, np.ndarray]) -> int:
    """Tokens that are not padding (segment id != PAD_SEGMENT_ID) in a numpy batch."""
    return int(np.count_nonzero(_column(batch, "segment_ids") != PAD_SEGMENT_ID))


def to_micro_batch(batch: dict[str, np.ndarray], loss_scale: float) -> MicroBatch:
    def col(name: str) -> torch.Tensor:
        # copy: Arrow-backed arrays are read-only, and torch tensors must own writable memory
        return torch.from_numpy(np.array(_column(batch, name), dtype=np.int64, copy=True))

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
    seen = targets = tokens = 0
    for global_index, batch in _stream(epoch_batches, start_position, micro_batches_per_epoch):
        targets += count_targets(batch)
        tokens += count_real_tokens(batch)
        if owns_micro_batch(global_index, dp_rank, dp, grad_accum_steps):
            own.append((global_index, batch))
        seen += 1
        if seen < per_step:
            continue
        loss_scale = per_step / targets if targets else 0.0  # no target in the step: every loss sum is 0 anyway
        if trace is not None:
            trace.step_tokens.append(tokens)
            trace.step_targets.append(targets)
        for own_index, own_batch in own:
            if trace is not None:
                trace.consumed.append((own_index, _digest(own_batch["doc_ids"])))
            yield to_micro_batch(own_batch, loss_scale)
        own, seen, targets, tokens = [], 0, 0, 0


def validation_micro_batches(batches: Iterable[dict[str, np.ndarray]], *, micro_batch_size: int, dp_rank: int,
                             dp: int) -> tuple[list[MicroBatch], int]:
    """This replica's share of the whole validation set for DeepSpeed's ``eval_batch``, and the set's target count.

    ``batches``: the validation packs in their fixed order, ``micro_batch_size`` rows each (the last may be short).
    Micro-batch k goes to replica k % dp; a short one is filled with padding rows (no targets) so every micro-batch
    has the training shape. Each carries ``loss_scale = n * dp / targets`` (n = this replica's micro-batches,
    targets = the whole set's): ``eval_batch`` averages the n losses and then the dp replicas, which leaves the
    token mean over the whole validation set, whatever n each replica got.
    """
    own: list[dict[str, np.ndarray]] = []
    targets = 0
    for index, batch in enumerate(batches):
        targets += count_targets(batch)
        if index % dp == dp_rank:
            own.append(_pad_rows(batch, micro_batch_size))
    loss_scale = len(own) * dp / targets if targets else 0.0
    return [to_micro_batch(batch, loss_scale) for batch in own], targets


def _pad_rows(batch: dict[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
    """Fill a short batch up to ``rows`` with padding rows: pad id 0, position 0, segment -1, no target."""
    have = len(batch["doc_ids"])
    if have >= rows:
        return batch
    fill = {"input_ids": 0, "position_ids": 0, "segment_ids": PAD_SEGMENT_ID, "labels": IGNORE_INDEX}
    padded = {name: np.concatenate([_column(batch, name), np.full((rows - have, _column(batch, name).shape[1]),
                                                                  value, dtype=np.int64)])
              for name, value in fill.items()}
    padded["doc_ids"] = np.concatenate([np.asarray(batch["doc_ids"], dtype=object),
                                        np.array([""] * (rows - have), dtype=object)])
    return padded


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
