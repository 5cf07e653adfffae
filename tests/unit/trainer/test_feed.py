import itertools

import numpy as np
import pytest

from raytrain.trainer.feed import FeedTrace, micro_batches
from raytrain.trainer.schedule import data_position

SEQ = 4


def _dataset(num_batches, mbs=2):
    """A fixed-order fake dataset: batch k holds docs 'k-0', 'k-1' and input ids filled with k."""
    def epoch_batches(epoch):
        for k in range(num_batches):
            yield {
                "input_ids": np.full((mbs, SEQ), k), "position_ids": np.zeros((mbs, SEQ), int),
                "segment_ids": np.zeros((mbs, SEQ), int), "labels": np.full((mbs, SEQ), -100),
                "doc_ids": np.array([f"{k}-{j}" for j in range(mbs)], dtype=object),
            }
    return epoch_batches


def _take(n, **kw):
    trace = FeedTrace()
    it = micro_batches(_dataset(7), micro_batches_per_epoch=7, trace=trace, **kw)
    out = [int(mb[0][0][0, 0]) for mb in itertools.islice(it, n)]
    return out, trace


def test_replicas_partition_the_stream_and_stages_agree():
    dp, m, steps = 2, 3, 4
    seen = {}
    for r in range(dp):
        ids, trace = _take(steps * m, start_position=0, dp_rank=r, dp=dp, grad_accum_steps=m)
        seen[r] = [g for g, _ in trace.consumed]
        # a second "stage" of the same replica sees exactly the same micro-batches
        ids2, trace2 = _take(steps * m, start_position=0, dp_rank=r, dp=dp, grad_accum_steps=m)
        assert trace2.consumed == trace.consumed
    everything = sorted(seen[0] + seen[1])
    assert everything == list(range(data_position(steps, dp, m)))  # nothing skipped, nothing twice


def test_resume_continues_with_next_unseen_micro_batch():
    dp, m = 1, 2
    full, _ = _take(10, start_position=0, dp_rank=0, dp=dp, grad_accum_steps=m)
    first, _ = _take(6, start_position=0, dp_rank=0, dp=dp, grad_accum_steps=m)
    rest, _ = _take(4, start_position=data_position(3, dp, m), dp_rank=0, dp=dp, grad_accum_steps=m)
    assert first + rest == full
    # crosses the epoch boundary (7 micro-batches per epoch) in a fixed order
    assert full == [0, 1, 2, 3, 4, 5, 6, 0, 1, 2]


def _uneven_dataset(targets_per_batch, mbs=2):
    """Batch k holds targets_per_batch[k] target tokens (labels != -100) spread over its rows."""
    def epoch_batches(epoch):
        for k, targets in enumerate(targets_per_batch):
            labels = np.full((mbs, SEQ), -100)
            labels.reshape(-1)[:targets] = 7
            yield {"input_ids": np.full((mbs, SEQ), k), "position_ids": np.zeros((mbs, SEQ), int),
                   "segment_ids": np.zeros((mbs, SEQ), int), "labels": labels,
                   "doc_ids": np.array([f"{k}-{j}" for j in range(mbs)], dtype=object)}
    return epoch_batches


def test_loss_scale_is_dp_times_m_over_the_targets_of_the_whole_step():
    """Every replica (and both data-reading stages of a pipeline) gets the same scale for a step, computed from all
    dp * m micro-batches of that step, including the ones other replicas train on; a step crossing the epoch
    boundary counts the micro-batches it really holds."""
    targets = [1, 8, 3, 5, 0, 2, 6]  # 7 micro-batches per epoch
    dp, m, steps = 2, 2, 3
    for rank in range(dp):
        feed = micro_batches(_uneven_dataset(targets), start_position=0, micro_batches_per_epoch=7, dp_rank=rank,
                             dp=dp, grad_accum_steps=m)
        scales = [float(mb[1][1]) for mb in itertools.islice(feed, steps * m)]
        step_targets = [1 + 8 + 3 + 5, 0 + 2 + 6 + 1, 8 + 3 + 5 + 0]  # global micro-batches 0-3, 4-7, 8-11
        assert scales == [pytest.approx(dp * m / t) for t in step_targets for _ in range(m)]


def test_a_step_without_targets_has_scale_zero_and_resume_must_start_at_a_step():
    feed = micro_batches(_uneven_dataset([0, 0, 4]), start_position=0, micro_batches_per_epoch=3, dp_rank=0, dp=1,
                         grad_accum_steps=2)
    assert float(next(feed)[1][1]) == 0.0
    with pytest.raises(ValueError, match="step boundary"):
        next(micro_batches(_uneven_dataset([1] * 4), start_position=1, micro_batches_per_epoch=4, dp_rank=0, dp=1,
                           grad_accum_steps=2))
