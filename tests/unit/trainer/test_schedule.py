import pytest

from raytrain.errors import RaytrainError
from raytrain.trainer.schedule import (
    Topology,
    check_data_order,
    check_enough_packs,
    check_resume_position,
    data_position,
    epoch_and_offset,
    owns_micro_batch,
)


@pytest.mark.parametrize("dp,m", [(1, 1), (1, 4), (2, 2), (3, 2)])
def test_every_micro_batch_has_exactly_one_owner(dp, m):
    steps = 5
    n = data_position(steps, dp, m)
    owners = [[r for r in range(dp) if owns_micro_batch(i, r, dp, m)] for i in range(n)]
    assert all(len(o) == 1 for o in owners)
    # each replica gets m micro-batches per step
    for r in range(dp):
        assert sum(o == [r] for o in owners) == steps * m


def test_middle_stages_do_not_read_data():
    roles = [Topology(pp=4, dp=1, stage=r, dp_rank=0, world_rank=r).needs_data for r in range(4)]
    assert roles == [True, False, False, True]


def test_epoch_and_offset():
    assert epoch_and_offset(0, 7) == (0, 0)
    assert epoch_and_offset(15, 7) == (2, 1)
    with pytest.raises(ValueError):
        epoch_and_offset(3, 0)


def test_resume_under_a_changed_batch_layout_names_the_fields_and_the_saved_values():
    recorded = data_position(10, dp=2, grad_accum_steps=4)  # saved at step 10 with dp 2, m 4: 80 micro-batches
    check_resume_position(recorded, 10, 2, 4, "ckpt/step_10")
    with pytest.raises(RaytrainError, match=r"train\.dp=1, train\.grad_accum_steps=4\) cannot reach \(it was saved "
                                            r"with train\.dp=2, train\.grad_accum_steps=4\)") as info:
        check_resume_position(recorded, 10, 1, 4, "ckpt/step_10", saved_with={"dp": 2, "grad_accum_steps": 4})
    assert "set train.dp and train.grad_accum_steps back" in str(info.value)


def test_resume_with_other_order_settings_is_refused_naming_them():
    from raytrain.config import TrainConfig

    now = vars(TrainConfig(shuffle_window_waves=2))
    saved = dict(now)
    check_data_order(saved, now, streamed=True, checkpoint="ckpt/step_4")
    # the window only decides a streamed run's order
    check_data_order({**saved, "shuffle_window_waves": 1}, now, streamed=False, checkpoint="ckpt/step_4")
    with pytest.raises(RaytrainError, match=r"checkpoint ckpt/step_4 was trained on the packs in the order of "
                                            r"train\.shuffle_window_waves=1 \(now 2\): .* Set them back"):
        check_data_order({**saved, "shuffle_window_waves": 1}, now, streamed=True, checkpoint="ckpt/step_4")
    with pytest.raises(RaytrainError, match=r"train\.seed=7 \(now 0\), train\.shuffle=False \(now True\)"):
        check_data_order({**saved, "seed": 7, "shuffle": False}, {**now, "seed": 0, "shuffle": True}, False, "c")
    with pytest.raises(RaytrainError, match=r"train\.micro_batch_size=4 \(now 2\)"):
        check_data_order({**saved, "micro_batch_size": 4}, {**now, "micro_batch_size": 2}, False, "c")
    # a checkpoint of an older version that did not record a setting: not compared
    old = {k: v for k, v in saved.items() if k != "shuffle_window_waves"}
    check_data_order(old, now, streamed=True, checkpoint="c")


def test_too_few_packs_for_one_step_names_the_fields():
    check_enough_packs(num_packs=8, micro_batch_size=2, dp=2, grad_accum_steps=2)  # 4 micro-batches: one step
    with pytest.raises(RaytrainError, match=r"7 sequences = 3 micro-batches of train\.micro_batch_size=2.*"
                                            r"train\.dp=2 x train\.grad_accum_steps=2"):
        check_enough_packs(num_packs=7, micro_batch_size=2, dp=2, grad_accum_steps=2)


def test_topology_refuses_a_place_outside_the_grid():
    with pytest.raises(ValueError, match="outside pp 2 x dp 1"):
        Topology(pp=2, dp=1, stage=2, dp_rank=0, world_rank=2)
