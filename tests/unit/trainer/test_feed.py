import itertools

import numpy as np

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
