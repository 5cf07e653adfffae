import itertools

import numpy as np
import pytest

from raytrain.trainer.feed import FeedTrace, in_memory_packs, micro_batches
from raytrain.trainer.pack_order import epoch_order
from raytrain.trainer.schedule import data_position

SEQ = 4


def _packs(num_packs, targets=None):
    """In-memory packs: pack k has input ids filled with k, doc 'doc-k', and ``targets[k]`` target tokens (default
    SEQ - 1); the last position of every pack is padding."""
    targets = targets if targets is not None else [SEQ - 1] * num_packs
    labels = np.full((num_packs, SEQ), -100)
    for k, t in enumerate(targets):
        labels[k, :t] = 7
    segment_ids = np.zeros((num_packs, SEQ), int)
    segment_ids[:, -1] = -1
    return in_memory_packs({
        "input_ids": np.repeat(np.arange(num_packs)[:, None], SEQ, axis=1), "position_ids": np.zeros_like(labels),
        "segment_ids": segment_ids, "labels": labels, "doc_ids": [f"doc-{k}" for k in range(num_packs)]})


def _take(n, num_packs=14, mbs=2, shuffle=False, seed=0, reads=None, **kw):
    """The first n micro-batches of a replica: the packs of each (lists of pack ids) and the trace."""
    counts, read = _packs(num_packs)

    def recording_read(own):
        if reads is not None:
            reads.append([p.tolist() for p in own])
        return read(own)

    trace = FeedTrace()
    it = micro_batches(counts, recording_read, micro_batch_size=mbs, trace=trace, shuffle=shuffle, seed=seed, **kw)
    return [mb[0][0][:, 0].tolist() for mb in itertools.islice(it, n)], trace


@pytest.mark.parametrize("shuffle", [False, True])
def test_replicas_partition_the_stream_and_stages_agree(shuffle):
    dp, m, steps = 2, 3, 4
    seen = {}
    for r in range(dp):
        ids, trace = _take(steps * m, start_position=0, dp_rank=r, dp=dp, grad_accum_steps=m, shuffle=shuffle)
        seen[r] = [g for g, _ in trace.consumed]
        # a second "stage" of the same replica sees exactly the same micro-batches
        ids2, trace2 = _take(steps * m, start_position=0, dp_rank=r, dp=dp, grad_accum_steps=m, shuffle=shuffle)
        assert (ids2, trace2.consumed) == (ids, trace.consumed)
    everything = sorted(seen[0] + seen[1])
    assert everything == list(range(data_position(steps, dp, m)))  # nothing skipped, nothing twice


def test_resume_continues_with_next_unseen_micro_batch():
    dp, m = 1, 2
    full, _ = _take(10, num_packs=7, mbs=1, start_position=0, dp_rank=0, dp=dp, grad_accum_steps=m)
    first, _ = _take(6, num_packs=7, mbs=1, start_position=0, dp_rank=0, dp=dp, grad_accum_steps=m)
    rest, _ = _take(4, num_packs=7, mbs=1, start_position=data_position(3, dp, m), dp_rank=0, dp=dp,
                    grad_accum_steps=m)
    assert first + rest == full
    # without shuffling: crosses the epoch boundary (7 micro-batches per epoch) in the written order
    assert full == [[0], [1], [2], [3], [4], [5], [6], [0], [1], [2]]


def test_shuffle_is_a_new_permutation_each_epoch_the_same_on_every_stage_and_exact_on_resume():
    """15 packs, micro-batches of 2: 7 per epoch (one pack left over each epoch, a different one). The order comes
    from (seed, epoch) only: two stages agree, a resume from any step boundary continues bit-exactly, and another
    seed gives another order."""
    dp, m, mbs, per_epoch = 1, 1, 2, 7
    full, trace = _take(3 * per_epoch, num_packs=15, mbs=mbs, shuffle=True, seed=5, start_position=0, dp_rank=0,
                        dp=dp, grad_accum_steps=m)
    epochs = [sum(full[e * per_epoch:(e + 1) * per_epoch], []) for e in range(3)]
    for packs in epochs:
        assert len(set(packs)) == 14 and set(packs) <= set(range(15))  # each pack at most once per epoch
    assert epochs[0] != epochs[1] != epochs[2] and epochs[0] != list(range(14))
    again, _ = _take(3 * per_epoch, num_packs=15, mbs=mbs, shuffle=True, seed=5, start_position=0, dp_rank=0,
                     dp=dp, grad_accum_steps=m)
    assert again == full  # the other data-reading stage of the pipeline
    for resume_at in (3, per_epoch, per_epoch + 4):
        rest, _ = _take(3 * per_epoch - resume_at, num_packs=15, mbs=mbs, shuffle=True, seed=5,
                        start_position=resume_at, dp_rank=0, dp=dp, grad_accum_steps=m)
        assert rest == full[resume_at:]
    other_seed, _ = _take(per_epoch, num_packs=15, mbs=mbs, shuffle=True, seed=6, start_position=0, dp_rank=0,
                          dp=dp, grad_accum_steps=m)
    assert other_seed != full[:per_epoch]
    assert epoch_order(15, 1, 5, True).tolist() == sum(full[per_epoch:2 * per_epoch], []) + [
        next(p for p in range(15) if p not in epochs[1])]


def test_a_replica_reads_only_its_own_packs():
    """dp=2: replica r asks the reader for exactly the micro-batches it trains, nothing of the other replica's."""
    dp, m, steps = 2, 2, 3
    read_by = {}
    for r in range(dp):
        reads = []
        ids, _ = _take(steps * m, num_packs=24, start_position=0, dp_rank=r, dp=dp, grad_accum_steps=m,
                       shuffle=True, reads=reads)
        read_by[r] = {p for batch in reads[0][:steps * m] for p in batch}
        assert reads[0][:steps * m] == ids  # what was read is what was trained, in order
    assert not read_by[0] & read_by[1]
    assert len(read_by[0] | read_by[1]) == steps * dp * m * 2


def test_loss_scale_is_dp_times_m_over_the_targets_of_the_whole_step():
    """Every replica (and both data-reading stages of a pipeline) gets the same scale for a step, computed from all
    dp * m micro-batches of that step, including the ones other replicas train on; a step crossing the epoch
    boundary counts the micro-batches it really holds."""
    targets = [1, 3, 2, 3, 0, 2, 1]  # 7 micro-batches of one pack per epoch
    dp, m, steps = 2, 2, 3
    for rank in range(dp):
        trace = FeedTrace()
        counts, read = _packs(7, targets)
        feed = micro_batches(counts, read, micro_batch_size=1, start_position=0, dp_rank=rank, dp=dp,
                             grad_accum_steps=m, trace=trace)
        scales = [float(mb[1][1]) for mb in itertools.islice(feed, steps * m)]
        step_targets = [1 + 3 + 2 + 3, 0 + 2 + 1 + 1, 3 + 2 + 3 + 0]  # global micro-batches 0-3, 4-7, 8-11
        assert scales == [pytest.approx(dp * m / t) for t in step_targets for _ in range(m)]
        assert trace.step_targets == step_targets
        assert trace.step_tokens == [dp * m * (SEQ - 1)] * steps  # the last column of every pack is padding


def test_a_step_without_targets_has_scale_zero_and_resume_must_start_at_a_step():
    counts, read = _packs(3, [0, 0, 3])
    feed = micro_batches(counts, read, micro_batch_size=1, start_position=0, dp_rank=0, dp=1, grad_accum_steps=2)
    assert float(next(feed)[1][1]) == 0.0
    counts, read = _packs(4)
    with pytest.raises(ValueError, match="step boundary"):
        next(micro_batches(counts, read, micro_batch_size=1, start_position=1, dp_rank=0, dp=1, grad_accum_steps=2))


def test_a_reader_returning_other_packs_is_caught():
    counts, read = _packs(4)
    feed = micro_batches(counts, lambda own: read(own[::-1]), micro_batch_size=1, start_position=0, dp_rank=0,
                         dp=1, grad_accum_steps=2)
    with pytest.raises(RuntimeError, match="expected"):
        next(feed)


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
