"""Which packs global micro-batch g holds: the order of a packed set known up front (``FixedOrder``), or of one that
grows wave by wave while the enrichment runs (``WaveOrder``).

Fixed: epoch e trains the packs in ``epoch_order(num_packs, e, seed, shuffle)``, E = num_packs // mbs micro-batches.

Streamed (``enrich.wave_rows``): the packs are numbered in wave order (wave 0's packs, then wave 1's, ...).
Epoch 0 takes the waves in windows of ``train.shuffle_window_waves`` consecutive waves and trains each window's
packs in an order drawn from (seed, 0, window) before the next window's: a pure function of the config and of the
waves' pack counts, never of timing, so two runs of one config and a resumed run see the same micro-batches.
Epoch 0 ends where the last full micro-batch of all packs ends; epochs 1, 2, ... shuffle all packs (as the fixed
order does). A micro-batch whose window is not committed yet is not known: ``WaveOrder`` asks its ``Waves`` source
to wait for it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from raytrain.dataset.pack_reader import PackCounts
from raytrain.trainer.schedule import epoch_and_offset


def epoch_order(num_packs: int, epoch: int, seed: int, shuffle: bool) -> np.ndarray:
    """Pack indices of epoch ``epoch`` in training order: a permutation drawn from (seed, epoch) when shuffling, the
    written order otherwise. A pure function of its arguments: every stage and replica computes the same order, and
    a resumed run recomputes it exactly."""
    if not shuffle:
        return np.arange(num_packs, dtype=np.int64)
    return np.random.default_rng([seed, epoch]).permutation(num_packs).astype(np.int64)


def window_order(wave_packs: Sequence[int], window: int, seed: int, shuffle: bool, complete: bool) -> np.ndarray:
    """Epoch 0's pack order of a streamed run as far as the committed waves fix it.

    ``wave_packs``: packs of waves 0, 1, ... committed so far (pack indices count through them in wave order).
    Every full window of ``window`` waves contributes its packs, permuted by (seed, 0, window index) when shuffling;
    the last, partial window only once the enrichment is ``complete`` (no wave will join it)."""
    offsets = np.concatenate([[0], np.cumsum(np.asarray(wave_packs, dtype=np.int64))]).astype(np.int64)
    waves = len(wave_packs)
    windows = -(-waves // window) if complete else waves // window
    parts = []
    for j in range(windows):
        lo, hi = int(offsets[j * window]), int(offsets[min((j + 1) * window, waves)])
        if shuffle:
            parts.append(lo + np.random.default_rng([seed, 0, j]).permutation(hi - lo).astype(np.int64))
        else:
            parts.append(np.arange(lo, hi, dtype=np.int64))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


class _EpochOrders:
    """``epoch_order`` of all packs per epoch, computed once; the orders of epochs before the previous one dropped."""

    def __init__(self, num_packs: int, seed: int, shuffle: bool) -> None:
        self.num_packs, self.seed, self.shuffle = num_packs, seed, shuffle
        self._orders: dict[int, np.ndarray] = {}

    def __call__(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            for old in [e for e in self._orders if e < epoch - 1]:
                del self._orders[old]
            self._orders[epoch] = epoch_order(self.num_packs, epoch, self.seed, self.shuffle)
        return self._orders[epoch]


def _epochs_from(position: int, per_epoch: int) -> Iterator[range]:
    """The global micro-batches from ``position`` on, an epoch (of ``per_epoch``) at a time."""
    epoch, offset = epoch_and_offset(position, per_epoch)
    while True:
        first = epoch * per_epoch
        yield range(first + offset, first + per_epoch)
        epoch, offset = epoch + 1, 0


class FixedOrder:
    """Every epoch's order known up front (``epoch_order`` of all packs)."""

    def __init__(self, counts: PackCounts, micro_batch_size: int, seed: int, shuffle: bool) -> None:
        self.counts, self.mbs, self.seed, self.shuffle = counts, micro_batch_size, seed, shuffle
        self.per_epoch = counts.num_packs // micro_batch_size
        if self.per_epoch <= 0:
            raise ValueError(f"the dataset holds {counts.num_packs} packs, no full micro-batch of {micro_batch_size}")
        self._orders = _EpochOrders(counts.num_packs, seed, shuffle)

    def packs_of(self, global_index: int) -> np.ndarray:
        epoch, k = epoch_and_offset(global_index, self.per_epoch)
        return self._orders(epoch)[k * self.mbs:(k + 1) * self.mbs]

    def segments(self, start: int) -> Iterator[range]:
        """Runs of consecutive global micro-batches from ``start`` on, each read as one stream: an epoch each."""
        return _epochs_from(start, self.per_epoch)


@dataclass(frozen=True)
class WaveState:
    """What a streamed run's packed waves hold so far: packs per committed wave (in wave order), their counts
    concatenated, and whether the enrichment is complete (no wave will follow)."""

    wave_packs: tuple[int, ...]
    counts: PackCounts
    complete: bool


class WaveOrder:
    """The order of a streamed run (module docstring). ``wait(known)`` returns the waves' state once it holds more
    than ``known`` (a WaveState with more waves, or complete): it polls storage in a worker, and is a list in
    tests."""

    def __init__(self, wait: Callable[[WaveState | None], WaveState], micro_batch_size: int, window: int, seed: int,
                 shuffle: bool) -> None:
        self._wait, self.mbs, self.window, self.seed, self.shuffle = wait, micro_batch_size, window, seed, shuffle
        self.state = wait(None)
        self._first = window_order(self.state.wave_packs, window, seed, shuffle, self.state.complete)
        self._later: _EpochOrders | None = None

    @property
    def counts(self) -> PackCounts:
        return self.state.counts

    def _known(self) -> int:
        """Global micro-batches whose packs are fixed: epoch 0's so far, or every one once complete."""
        return len(self._first) // self.mbs

    def _grow(self) -> None:
        self.state = self._wait(self.state)
        self._first = window_order(self.state.wave_packs, self.window, self.seed, self.shuffle, self.state.complete)

    def packs_of(self, global_index: int) -> np.ndarray:
        while not self.state.complete and global_index >= self._known():
            self._grow()
        per_epoch = self._known()
        if per_epoch <= 0:
            raise ValueError(f"the streamed dataset holds {self.counts.num_packs} packs, no full micro-batch of "
                             f"{self.mbs}")
        epoch, k = epoch_and_offset(global_index, per_epoch)
        if epoch == 0:
            return self._first[k * self.mbs:(k + 1) * self.mbs]
        if self._later is None:  # complete: every pack is known
            self._later = _EpochOrders(self.counts.num_packs, self.seed, self.shuffle)
        return self._later(epoch)[k * self.mbs:(k + 1) * self.mbs]

    def segments(self, start: int) -> Iterator[range]:
        """Runs of global micro-batches from ``start`` on: in epoch 0 what the committed windows fix (waiting for
        the next when none is left), then an epoch each."""
        position = start
        while not self.state.complete:
            if position >= self._known():
                self._grow()
                continue
            end = self._known()
            yield range(position, end)
            position = end
        yield from _epochs_from(position, self._known())
