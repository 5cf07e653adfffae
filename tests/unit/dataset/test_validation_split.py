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


def test_mixture_weights_repeat_and_sample_training_rows_by_split():
    import pandas as pd

    from raytrain.dataset.stream import _rows_of_role, mixture_copies

    uuids = [f"u{i}" for i in range(4000)]
    splits = ["math", "chat", "code", "stem"] * 1000
    weights = {"math": 2.0, "chat": 0.5, "code": 0.0}
    copies = mixture_copies(uuids, splits, weights)
    by_split = {s: copies[[i for i, x in enumerate(splits) if x == s]] for s in ("math", "chat", "code", "stem")}
    assert (by_split["math"] == 2).all() and (by_split["code"] == 0).all() and (by_split["stem"] == 1).all()
    assert set(by_split["chat"].tolist()) == {0, 1} and 0.45 < by_split["chat"].mean() < 0.55
    assert (mixture_copies(uuids[::-1], splits[::-1], weights) == copies[::-1]).all()  # per uuid, not per position

    batch = pd.DataFrame({"uuid": uuids[:400], "split": splits[:400], "messages_json": ["[]"] * 400})
    train = _rows_of_role(batch, 0.1, validation=False, weights=weights)
    held_out = _rows_of_role(batch, 0.1, validation=True, weights=weights)
    kept = ~validation_mask(batch["uuid"], 0.1)
    assert len(train) == int(mixture_copies(batch["uuid"][kept], batch["split"][kept], weights).sum())
    assert train["uuid"].value_counts().max() == 2 and not set(train["uuid"]) & set(held_out["uuid"])
    assert len(held_out) == int((~kept).sum())  # validation rows are never weighted


def test_split_weights_config_is_checked():
    from raytrain.config import load_job_config
    from raytrain.errors import ConfigError

    assert load_job_config(None, ["dataset.split_weights=[math=2, chat=0.5]"]).dataset.weights() == {
        "math": 2.0, "chat": 0.5}
    for bad in ("[maths=2]", "[math=-1]", "[math]", "[math=1, math=2]",
                "[chat=0, code=0, math=0, stem=0, tool_calling=0]"):
        with pytest.raises(ConfigError, match="dataset.split_weights"):
            load_job_config(None, [f"dataset.split_weights={bad}"])
