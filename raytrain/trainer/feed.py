"""Turn the packed dataset into the micro-batches DeepSpeed's pipeline engine pulls, for one replica.

Pure: takes per-pack token counts and any "pack indices -> numpy batches" reader, so it is tested with in-memory
packs and used with Ray Data tasks reading the packed Parquet in the worker.

Order: each epoch trains the packs in ``epoch_order`` (a permutation drawn from ``train.seed`` and the epoch when
``train.shuffle``; a streamed run's first epoch goes window of waves by window: raytrain.trainer.pack_order), cut
into micro-batches and dealt out to replicas step by step (raytrain.trainer.schedule). The
order is a pure function of (seed, epoch, number of packs), so both data-reading stages of a pipeline see the same
micro-batches and a resumed run continues exactly where its checkpoint left off. Each replica reads only its own
micro-batches' packs.

Loss normalization: the loss of an optimizer step is the mean over *every target token of the global batch* (all
m micro-batches of all dp replicas), as torchtune and transformers' ``num_items_in_batch`` do, not a mean of
per-micro-batch means (which weighs a token in a pack with few targets more than one in a full pack). Every reader
knows every pack's target count (a small column read once), so it counts the targets of the step's dp * m
micro-batches and gives each of its own m ``loss_scale = dp * m / targets``. The loss function multiplies the micro-batch's summed
token loss by it; DeepSpeed then divides by m (gradient accumulation) and averages over dp, which leaves
sum / targets for both the reported loss and the gradients.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from raytrain.dataset.labels import IGNORE_INDEX, PAD_SEGMENT_ID
from raytrain.dataset.pack_reader import PackCounts
from raytrain.dataset.pair_pack import pair_counts
from raytrain.trainer.pack_order import FixedOrder, WaveOrder
from raytrain.trainer.schedule import micro_batches_per_step, owns_micro_batch

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
    """Tokens with a training target (label != IGNORE_INDEX) in a numpy batch."""
    return int(np.count_nonzero(_column(batch, "labels") != IGNORE_INDEX))


def to_micro_batch(batch: dict[str, np.ndarray], loss_scale: float) -> MicroBatch:
    def col(name: str) -> torch.Tensor:
        # copy: Arrow-backed arrays are read-only, and torch tensors must own writable memory
        return torch.from_numpy(np.array(_column(batch, name), dtype=np.int64, copy=True))

    ids, pos, seg, labels = (col(c) for c in MODEL_COLUMNS)  # each (B, T)
    return (ids, pos, seg), (labels, torch.tensor(loss_scale, dtype=torch.float32))


PAIR_COLUMNS = ("pair_segments", "ref_logps")
"""A preference pack's pair table beside MODEL_COLUMNS: (max_pairs * 2,) int64 segment numbers of each pair's
chosen and rejected sequence (-1 for an empty slot) and float32 reference log-probabilities of the same."""


def to_pair_micro_batch(batch: dict[str, np.ndarray], pair_scale: float, sft_scale: float):
    """A micro-batch of preference packs for ``raytrain.pipeline.dpo.DpoLoss``: the inputs as ``to_micro_batch``'s,
    labels ``(labels, segment_ids, pair_segments (B, P, 2), ref_logps (B, P, 2), [pair_scale, sft_scale])``."""
    (ids, pos, seg), (labels, _) = to_micro_batch(batch, 0.0)
    pairs = torch.from_numpy(np.array(_column(batch, "pair_segments"), dtype=np.int64, copy=True))
    ref = torch.from_numpy(np.array(_column(batch, "ref_logps"), dtype=np.float32, copy=True))
    rows = ids.shape[0]
    return (ids, pos, seg), (labels, seg, pairs.view(rows, -1, 2), ref.view(rows, -1, 2),
                             torch.tensor([pair_scale, sft_scale], dtype=torch.float32))


ReadMicroBatches = Callable[[list[np.ndarray]], Iterable[dict[str, np.ndarray]]]
"""Given micro-batches as arrays of pack indices, yield each one's numpy batch in that order (a ``PackReader`` in
this process, or Ray Data tasks: ``raytrain.dataset.stream.stream_micro_batches``)."""


def in_memory_packs(packs: dict[str, np.ndarray]) -> tuple[PackCounts, ReadMicroBatches]:
    """Packs held in memory (one numpy batch of every pack, in the fixed order): their counts and a reader for
    ``micro_batches``. For tests and the in-memory feed of benchmarks/bench_pipeline.py."""
    columns = {name: np.asarray(column) if name != "doc_ids" else np.asarray(column, dtype=object)
               for name, column in packs.items()}
    counts = PackCounts(num_tokens=(_column(columns, "segment_ids") != PAD_SEGMENT_ID).sum(axis=1).astype(np.int64),
                        num_targets=(_column(columns, "labels") != IGNORE_INDEX).sum(axis=1).astype(np.int64))

    def read(own: list[np.ndarray]) -> Iterator[dict[str, np.ndarray]]:
        for packs_of_batch in own:
            yield {**{name: column[packs_of_batch] for name, column in columns.items()}, "pack_index": packs_of_batch}

    return counts, read


def micro_batches(
    counts: PackCounts,
    read: ReadMicroBatches,
    *,
    micro_batch_size: int,
    start_position: int,
    dp_rank: int,
    dp: int,
    grad_accum_steps: int,
    seed: int = 0,
    shuffle: bool = False,
    trace: FeedTrace | None = None,
    ref_logps: np.ndarray | None = None,
    order: FixedOrder | WaveOrder | None = None,
) -> Iterator[MicroBatch]:
    """Endless micro-batches for replica ``dp_rank``, starting at global micro-batch ``start_position`` (a step
    boundary).

    Global micro-batch g holds the packs ``order.packs_of(g)`` gives: by default ``FixedOrder`` of ``counts``
    (g = epoch * E + k, E = num_packs // micro_batch_size, packs ``epoch_order[k * mbs : (k + 1) * mbs]``; the packs
    left over by the last full micro-batch of an epoch are not trained that epoch), or a streamed run's
    ``WaveOrder`` (raytrain.trainer.pack_order), which waits for a wave its micro-batch needs. Only this replica's
    micro-batches are read; the step's loss scale comes from the target counts of all dp * m micro-batches
    (``order.counts``), so every replica and both data-reading stages of a pipeline use the same one (module
    docstring).

    Preference packs (``ref_logps``: every pack's reference log-probabilities, (num_packs, 2 * max_pairs)): each
    micro-batch is ``to_pair_micro_batch``'s, scaled by the step's pairs and chosen target tokens (``counts``), so a
    step's loss is the mean over the global batch's pairs.
    """
    order = order or FixedOrder(counts, micro_batch_size, seed, shuffle)
    per_step = micro_batches_per_step(dp, grad_accum_steps)
    if start_position % per_step:
        raise ValueError(f"start_position {start_position} is not a step boundary (multiple of dp * m = {per_step})")
    packs_of = order.packs_of

    def own_batches() -> Iterator[dict[str, np.ndarray]]:
        for segment in order.segments(start_position):
            yield from read([packs_of(g) for g in segment if owns_micro_batch(g, dp_rank, dp, grad_accum_steps)])

    own = own_batches()
    position = start_position
    while True:
        step_packs = [packs_of(g) for g in range(position, position + per_step)]
        every = np.concatenate(step_packs)
        counts = order.counts  # a streamed order's grows as waves commit
        targets = int(counts.num_targets[every].sum())
        loss_scale = per_step / targets if targets else 0.0  # no target in the step: every loss sum is 0 anyway
        if ref_logps is not None:
            pair_scale, sft_scale = _pair_scales(per_step, int(counts.num_pairs[every].sum()),
                                                 int(counts.chosen_targets[every].sum()))
        if trace is not None:
            trace.step_tokens.append(int(counts.num_tokens[every].sum()))
            trace.step_targets.append(targets)
        for g, packs in zip(range(position, position + per_step), step_packs, strict=True):
            if not owns_micro_batch(g, dp_rank, dp, grad_accum_steps):
                continue
            batch = next(own)
            if "pack_index" in batch and not np.array_equal(np.asarray(batch["pack_index"]), packs):
                raise RuntimeError(f"micro-batch {g}: read packs {list(batch['pack_index'])}, expected {list(packs)}")
            if trace is not None:
                trace.consumed.append((g, _digest(batch["doc_ids"])))
            if ref_logps is not None:
                yield to_pair_micro_batch({**batch, "ref_logps": ref_logps[np.asarray(batch["pack_index"])]},
                                          pair_scale, sft_scale)
            else:
                yield to_micro_batch(batch, loss_scale)
        position += per_step


def _pair_scales(per_step: int, pairs: int, chosen_targets: int) -> tuple[float, float]:
    """(pair_scale, sft_scale) of a set of dp * m micro-batches (``per_step``) holding ``pairs`` pairs and
    ``chosen_targets`` chosen target tokens: DeepSpeed's averaging then leaves the mean over the pairs."""
    return (per_step / pairs if pairs else 0.0), (per_step / chosen_targets if chosen_targets else 0.0)


def validation_micro_batches(batches: Iterable[dict[str, np.ndarray]], *, micro_batch_size: int, dp_rank: int,
                             dp: int, ref_logps: np.ndarray | None = None) -> tuple[list[MicroBatch], int]:
    """This replica's share of the whole validation set for DeepSpeed's ``eval_batch``, and the set's target count.

    ``batches``: the validation packs in their fixed order, ``micro_batch_size`` rows each (the last may be short).
    Micro-batch k goes to replica k % dp; a short one is filled with padding rows (no targets) so every micro-batch
    has the training shape. Each carries ``loss_scale = n * dp / targets`` (n = this replica's micro-batches,
    targets = the whole set's): ``eval_batch`` averages the n losses and then the dp replicas, which leaves the
    token mean over the whole validation set, whatever n each replica got. Preference packs (``ref_logps`` by pack
    index): the pair micro-batches of ``to_pair_micro_batch``, scaled the same way by the set's pairs.
    """
    own: list[dict[str, np.ndarray]] = []
    targets, pairs, chosen = 0, 0, 0
    for index, batch in enumerate(batches):
        targets += count_targets(batch)
        if ref_logps is not None:
            batch = {**batch, "ref_logps": ref_logps[np.asarray(batch["pack_index"])]}
            batch_pairs, batch_chosen = pair_counts(_column(batch, "pair_segments"), _column(batch, "segment_ids"),
                                                    _column(batch, "labels"))
            pairs, chosen = pairs + int(batch_pairs.sum()), chosen + int(batch_chosen.sum())
        if index % dp == dp_rank:
            own.append(pad_rows(batch, micro_batch_size))
    if ref_logps is not None:
        pair_scale, sft_scale = _pair_scales(len(own) * dp, pairs, chosen)
        return [to_pair_micro_batch(batch, pair_scale, sft_scale) for batch in own], targets
    loss_scale = len(own) * dp / targets if targets else 0.0
    return [to_micro_batch(batch, loss_scale) for batch in own], targets


def pad_rows(batch: dict[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
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
    for name, value in (("pair_segments", -1), ("ref_logps", 0.0)):  # preference packs: empty pair slots
        if name in batch:
            column = np.asarray(_column(batch, name))
            padded[name] = np.concatenate([column, np.full((rows - have, column.shape[1]), value, dtype=column.dtype)])
    return padded
