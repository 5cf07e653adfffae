"""The held-out validation split: chosen by a hash of the uuid, so it is the same on every rerun, resume and machine,
whatever the row order, and never overlaps training."""

from __future__ import annotations

import pytest

from raytrain.config import DatasetConfig
from raytrain.dataset.stream import validation_fraction, validation_mask


def test_the_split_depends_on_the_uuid_only():
    uuids = [f"row-{i}" for i in range(4000)]
    mask = validation_mask(uuids, 0.1)
    assert 0.08 < mask.mean() < 0.12
    by_uuid = dict(zip(uuids, mask, strict=True))
    reordered = list(reversed(uuids))
    assert [by_uuid[u] for u in reordered] == list(validation_mask(reordered, 0.1))
    # a larger fraction holds out a superset: raising it never moves a held-out row back into training
    assert (validation_mask(uuids, 0.2) >= mask).all()
    assert not validation_mask(uuids, 0.0).any()


def test_the_cap_lowers_the_fraction():
    cfg = DatasetConfig(validation_fraction=0.1, validation_max_rows=50)
    assert validation_fraction(cfg, 100) == pytest.approx(0.1)
    assert validation_fraction(cfg, 10_000) == pytest.approx(0.005)
    assert validation_fraction(cfg, 0) == 0.0
    assert validation_fraction(DatasetConfig(), 10_000) == 0.0  # off by default
