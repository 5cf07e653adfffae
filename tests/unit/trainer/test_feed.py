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
            segment_ids = np.zeros((mbs, SEQ), int)
            segment_ids[:, -1] = -1  # padding
            yield {"input_ids": np.full((mbs, SEQ), k), "position_ids": np.zeros((mbs, SEQ), int),
                   "segment_ids": segment_ids, "labels": labels,
                   "doc_ids": np.array([f"{k}-{j}" for j in range(mbs)], dtype=object)}
    return epoch_batches


def test_loss_scale_is_dp_times_m_over_the_targets_of_the_whole_step():
    """Every replica (and both data-reading stages of a pipeline) gets the same scale for a step, computed from all
    dp * m micro-batches of that step, including the ones other replicas train on; a step crossing the epoch
    boundary counts the micro-batches it really holds."""
    targets = [1, 8, 3, 5, 0, 2, 6]  # 7 micro-batches per epoch
    dp, m, steps = 2, 2, 3
    for rank in range(dp):
        trace = FeedTrace()
        feed = micro_batches(_uneven_dataset(targets), start_position=0, micro_batches_per_epoch=7, dp_rank=rank,
                             dp=dp, grad_accum_steps=m, trace=trace)
        scales = [float(mb[1][1]) for mb in itertools.islice(feed, steps * m)]
        step_targets = [1 + 8 + 3 + 5, 0 + 2 + 6 + 1, 8 + 3 + 5 + 0]  # global micro-batches 0-3, 4-7, 8-11
        assert scales == [pytest.approx(dp * m / t) for t in step_targets for _ in range(m)]
        assert trace.step_targets == step_targets
        assert trace.step_tokens == [dp * m * 2 * (SEQ - 1)] * steps  # the last column of every row is padding


def test_a_step_without_targets_has_scale_zero_and_resume_must_start_at_a_step():
    feed = micro_batches(_uneven_dataset([0, 0, 4]), start_position=0, micro_batches_per_epoch=3, dp_rank=0, dp=1,
                         grad_accum_steps=2)
    assert float(next(feed)[1][1]) == 0.0
    with pytest.raises(ValueError, match="step boundary"):
        next(micro_batches(_uneven_dataset([1] * 4), start_position=1, micro_batches_per_epoch=4, dp_rank=0, dp=1,
                           grad_accum_steps=2))


def test_validation_share_pads_the_short_micro_batch_and_weighs_every_token_once():
    """5 validation micro-batches (the last one short) over dp=2 replicas: replica 0 gets 3, replica 1 gets 2; with
    each replica's loss_scale, eval_batch's arithmetic (mean over own micro-batches, then mean over replicas) gives
    the token mean of the whole set."""
    from raytrain.trainer.feed import validation_micro_batches
    from raytrain.trainer.schedule import validation_micro_batches_of

    targets = [3, 8, 1, 6, 2]
    batches = list(_uneven_dataset(targets)(0))
    batches[-1] = {k: v[:1] for k, v in batches[-1].items()}  # the last micro-batch holds one row
    token_loss = 0.5  # pretend every target token costs the same, so a micro-batch's summed loss = 0.5 * targets
    replica_means = []
    for rank in range(2):
        own, total = validation_micro_batches(iter(batches), micro_batch_size=2, dp_rank=rank, dp=2)
        assert total == sum(targets) and len(own) == validation_micro_batches_of(rank, 2, 9, 2) == (3, 2)[rank]
        for (inputs, (labels, _scale)) in own:
            assert tuple(labels.shape) == tuple(inputs[0].shape) == (2, SEQ)
        sums = [token_loss * int((labels != -100).sum()) * float(scale) for _, (labels, scale) in own]
        replica_means.append(sum(sums) / len(own))
    assert sum(replica_means) / 2 == pytest.approx(token_loss)
    padded_inputs, (padded_labels, _) = validation_micro_batches(iter(batches), micro_batch_size=2, dp_rank=0,
                                                                 dp=2)[0][-1]
    assert (padded_labels[1] == -100).all() and (padded_inputs[2][1] == -1).all()  # padding row: no target
