"""Checkpoint names and retention (pure)."""

import math
import random

import pytest

from raytrain.checkpoint.layout import (
    best_step,
    committed_steps,
    parse_partial_dir_name,
    parse_step_dir_name,
    partial_dir_name,
    partial_names,
    plan_retention,
    step_dir_name,
)
from raytrain.errors import RaytrainError


def test_names_round_trip_and_format():
    rng = random.Random(0)
    for step in [0, 1, 10, 99_999_999, 123_456_789] + [rng.randrange(10**9) for _ in range(200)]:
        name = step_dir_name(step)
        assert name == f"step_{step:08d}" and parse_step_dir_name(name) == step
        assert partial_dir_name(step) == name + ".partial" and parse_partial_dir_name(partial_dir_name(step)) == step
        assert parse_partial_dir_name(name) is None and parse_step_dir_name(partial_dir_name(step)) is None
    assert step_dir_name(10) == "step_00000010"


@pytest.mark.parametrize("bad", [-1, 1.5, "3", True, None])
def test_bad_step_rejected(bad):
    with pytest.raises(RaytrainError, match="step="):
        step_dir_name(bad)


@pytest.mark.parametrize(
    "name", ["step_10", "step_0000001x", "latest", "manifest.json", ".trash-step_00000010-ab", "Step_00000010", ""]
)
def test_foreign_names_are_not_steps(name):
    assert parse_step_dir_name(name) is None


def test_ordering_is_numeric_not_lexicographic():
    steps = [5, 100_000_000, 99_999_999, 20, 0]
    names = [step_dir_name(s) for s in steps] + [partial_dir_name(7), "latest", ".trash-step_00000003-x"]
    assert sorted(names) != sorted(names, key=lambda n: parse_step_dir_name(n) or -1)  # strings alone would mis-sort
    assert committed_steps(names) == sorted(steps)
    assert partial_names(names) == sorted([partial_dir_name(7), ".trash-step_00000003-x"])


def test_best_step_modes_and_non_finite():
    metrics = {10: 2.0, 20: 1.0, 30: float("nan"), 40: 1.0, 50: math.inf}
    assert best_step(metrics, "min") == 40  # tie -> newer
    assert best_step(metrics, "max") == 10
    assert best_step({1: float("nan")}, "min") is None
    with pytest.raises(RaytrainError, match="mode="):
        best_step(metrics, "lowest")


def test_retention_keeps_last_best_and_protected():
    rng = random.Random(1)
    for _ in range(300):
        steps = sorted(rng.sample(range(1000), rng.randint(0, 12)))
        keep_last = rng.choice([None, 1, 2, 3, 5])
        best = rng.choice(steps + [None]) if steps else None
        protected = set(rng.sample(steps, min(len(steps), rng.randint(0, 2))))
        plan = plan_retention(steps, keep_last=keep_last, best=best, protected=protected)
        # Reference: the rule written out directly.
        expect = (
            set(steps if keep_last is None else steps[-keep_last:])
            | protected
            | ({best} if best is not None else set())
        )
        assert set(plan.keep) == expect
        assert set(plan.keep) | set(plan.delete) == set(steps) and not set(plan.keep) & set(plan.delete)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_keep_last_validated(bad):
    with pytest.raises(RaytrainError, match="keep_last="):
        plan_retention([1], keep_last=bad)
