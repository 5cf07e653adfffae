"""The order of a streamed run's packs (raytrain.trainer.pack_order): windows of waves in epoch 0, a function of the
config and the waves' pack counts only; waiting for a wave that is not committed yet."""

import numpy as np
import pytest

from raytrain.dataset.pack_reader import PackCounts
from raytrain.trainer.feed import FeedTrace, in_memory_packs, micro_batches
from raytrain.trainer.pack_order import FixedOrder, WaveOrder, WaveState, epoch_order, window_order

WAVES = (5, 7, 3, 6, 4)  # packs per wave


def _counts(n: int) -> PackCounts:
    return PackCounts(np.arange(1, n + 1, dtype=np.int64) * 10, np.arange(1, n + 1, dtype=np.int64))


def _states(waves=WAVES):
    """What a Waves source reports, one wave more at each wait, then complete."""
    states = [WaveState(tuple(waves[:k]), _counts(sum(waves[:k])), False) for k in range(1, len(waves) + 1)]
    return [*states, WaveState(tuple(waves), _counts(sum(waves)), True)]


class _Source:
    def __init__(self, states):
        self.states, self.waits = list(states), 0

    def __call__(self, known):
        if known is not None:
            self.waits += 1
        assert self.states, "waited after the enrichment was complete"
        return self.states.pop(0)


@pytest.mark.parametrize("shuffle", [True, False])
def test_each_window_holds_its_own_waves_packs_and_complete_windows_never_change(shuffle):
    order = window_order(WAVES, 2, seed=3, shuffle=shuffle, complete=True)
    assert sorted(order.tolist()) == list(range(sum(WAVES)))
    offsets = np.cumsum((0, *WAVES))
    for j, (lo, hi) in enumerate(((0, 2), (2, 4), (4, 5))):
        part = order[offsets[lo]:offsets[hi]]
        assert sorted(part.tolist()) == list(range(offsets[lo], offsets[hi])), j  # no pack crosses its window
    assert (order.tolist() == list(range(sum(WAVES)))) is not shuffle
    # while waves are still coming, only full windows are fixed, and they are a prefix of the final order
    for waves in range(len(WAVES)):
        partial = window_order(WAVES[:waves], 2, seed=3, shuffle=shuffle, complete=False)
        assert len(partial) == offsets[waves - waves % 2]
        np.testing.assert_array_equal(partial, order[:len(partial)])


def test_the_order_depends_on_seed_and_pack_counts_only():
    a = window_order(WAVES, 2, seed=1, shuffle=True, complete=True)
    np.testing.assert_array_equal(a, window_order(list(WAVES), 2, seed=1, shuffle=True, complete=True))
    assert not np.array_equal(a, window_order(WAVES, 2, seed=2, shuffle=True, complete=True))
    assert not np.array_equal(a, window_order((5, 7, 3, 6, 5), 2, seed=1, shuffle=True, complete=True)[:25])


def test_wave_order_waits_for_the_window_a_micro_batch_needs_then_shuffles_all_packs_in_later_epochs():
    mbs, total = 2, sum(WAVES)
    source = _Source(_states())
    order = WaveOrder(source, mbs, window=2, seed=7, shuffle=True)
    final = window_order(WAVES, 2, seed=7, shuffle=True, complete=True)
    np.testing.assert_array_equal(order.packs_of(0), final[:2])
    assert source.waits == 1  # the first window (waves 0 and 1) was needed
    np.testing.assert_array_equal(order.packs_of(5), final[10:12])  # still inside waves 0-1 (12 packs)
    assert source.waits == 1
    np.testing.assert_array_equal(order.packs_of(6), final[12:14])  # needs the second window
    assert source.waits == 3
    per_epoch = total // mbs  # 12: pack final[24] is left over in epoch 0
    np.testing.assert_array_equal(order.packs_of(per_epoch - 1), final[22:24])
    assert order.counts.num_packs == total and order.state.complete
    later = epoch_order(total, 1, 7, True)
    np.testing.assert_array_equal(order.packs_of(per_epoch), later[:2])  # epoch 1: every pack shuffled


def test_segments_cover_every_micro_batch_once_in_order():
    mbs = 2
    order = WaveOrder(_Source(_states()), mbs, window=2, seed=0, shuffle=True)
    seen = []
    for segment in order.segments(4):
        seen.extend(segment)
        if len(seen) > 30:
            break
    assert seen[:31] == list(range(4, 35))


def test_a_resumed_order_equals_the_uninterrupted_one():
    """A worker that starts mid-stream (resume) sees the same packs as one that ran from the start."""
    first = WaveOrder(_Source(_states()), 2, window=1, seed=5, shuffle=True)
    expected = [first.packs_of(g).tolist() for g in range(30)]
    later = WaveOrder(_Source(_states()[2:]), 2, window=1, seed=5, shuffle=True)  # three waves in when it starts
    assert [later.packs_of(g).tolist() for g in range(14, 30)] == expected[14:]


def test_streamed_micro_batches_read_the_windows_packs_and_scale_by_the_steps_targets():
    """micro_batches over a WaveOrder: each micro-batch holds its packs (checked by the reader) and the loss scale
    counts the targets of the whole step, as with a fixed order."""
    n, seq = sum(WAVES), 4
    labels = np.where(np.arange(seq)[None, :] < (np.arange(n)[:, None] % 3 + 1), 1, -100)
    packs = {"input_ids": np.ones((n, seq), np.int64), "position_ids": np.tile(np.arange(seq), (n, 1)),
             "segment_ids": np.zeros((n, seq), np.int64), "labels": labels,
             "doc_ids": np.array([f"doc{i}" for i in range(n)], dtype=object)}
    counts, read = in_memory_packs(packs)
    states = [WaveState(s.wave_packs, PackCounts(counts.num_tokens[:s.counts.num_packs],
                                                 counts.num_targets[:s.counts.num_packs]), s.complete)
              for s in _states()]
    trace = FeedTrace()
    order = WaveOrder(_Source(states), 2, window=2, seed=1, shuffle=True)
    stream = micro_batches(counts, read, micro_batch_size=2, start_position=0, dp_rank=0, dp=1, grad_accum_steps=2,
                           trace=trace, order=order)
    final = window_order(WAVES, 2, seed=1, shuffle=True, complete=True)
    for step in range(6):
        for m in range(2):
            (ids, _, _), (_, scale) = next(stream)
            g = step * 2 + m
            targets = int(counts.num_targets[final[step * 4:step * 4 + 4]].sum())
            assert float(scale) == pytest.approx(2 / targets)
            assert trace.consumed[-1][0] == g
    assert len(trace.consumed) == 12


def test_fixed_order_is_epoch_order():
    order = FixedOrder(_counts(9), 2, seed=4, shuffle=True)
    np.testing.assert_array_equal(order.packs_of(5), epoch_order(9, 1, 4, True)[2:4])
    assert next(iter(order.segments(5))) == range(5, 8)
