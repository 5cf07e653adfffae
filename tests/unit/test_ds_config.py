import json

import pytest

from raytrain.config import TrainConfig
from raytrain.errors import ConfigError
from raytrain.pipeline.ds_config import derive_ds_config, load_ds_config

SHIPPED = "configs/ds_config.json"


def test_shipped_ds_config_derives_batch_sizes_from_the_job():
    tc = TrainConfig(pp=2, dp=2, micro_batch_size=3, grad_accum_steps=4, max_steps=50, lr=1e-4, warmup_steps=5)
    ds = derive_ds_config(load_ds_config(SHIPPED), tc)
    assert ds["train_micro_batch_size_per_gpu"] == 3
    assert ds["gradient_accumulation_steps"] == 4
    assert ds["train_batch_size"] == 3 * 4 * 2  # micro x accum x dp (stages don't multiply it)
    assert ds["optimizer"]["params"]["lr"] == 1e-4
    assert ds["optimizer"]["params"]["torch_adam"] is True  # CPU: no fused Adam
    assert ds["scheduler"]["params"]["total_num_steps"] == 50
    assert ds["scheduler"]["params"]["warmup_num_steps"] == 5
    assert ds["bf16"]["enabled"] is False
    assert "auto" not in json.dumps(ds)


def test_deepspeed_accepts_the_derived_batch_sizes(monkeypatch):
    """DeepSpeed's own config parser checks train_batch = micro x accum x world(dp) — use it as the reference."""
    import deepspeed.runtime.config as ds_runtime_config
    from deepspeed.runtime.config import DeepSpeedConfig

    # No process group in a unit test: DeepSpeed would fall back to world size 1 unless get_rank answers.
    monkeypatch.setattr(ds_runtime_config.dist, "get_rank", lambda *a, **k: 0)

    tc = TrainConfig(pp=2, dp=2, micro_batch_size=2, grad_accum_steps=3)
    ds = derive_ds_config(load_ds_config(SHIPPED), tc)

    class _Mpu:  # the data-parallel world DeepSpeed divides by is dp, not pp*dp
        def get_data_parallel_world_size(self):
            return tc.dp

        def get_model_parallel_world_size(self):
            return 1

    parsed = DeepSpeedConfig(ds, mpu=_Mpu())
    assert parsed.world_size == tc.dp
    assert parsed.train_batch_size == 12
    assert parsed.gradient_accumulation_steps == 3


def test_gpu_turns_on_bf16_with_fp32_grad_accumulation():
    ds = derive_ds_config(load_ds_config(SHIPPED), TrainConfig(use_gpu=True))
    assert ds["bf16"]["enabled"] is True
    assert ds["data_types"]["grad_accum_dtype"] == "fp32"
    assert ds["optimizer"]["params"]["torch_adam"] is False


def test_mismatched_batch_size_is_an_error_naming_both_sides():
    ds = {"train_batch_size": 64, "train_micro_batch_size_per_gpu": "auto"}
    with pytest.raises(ConfigError, match=r"train_batch_size = 64 disagrees with .*micro_batch_size"):
        derive_ds_config(ds, TrainConfig(micro_batch_size=2, grad_accum_steps=2, dp=1), ds_path="x.json")


def test_equal_explicit_values_are_fine():
    ds = {"train_batch_size": 4, "gradient_accumulation_steps": 2, "optimizer": {"type": "AdamW",
                                                                                 "params": {"lr": 0.001}}}
    out = derive_ds_config(ds, TrainConfig(micro_batch_size=2, grad_accum_steps=2, dp=1, lr=1e-3))
    assert out["train_batch_size"] == 4


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_2_and_3_refused_with_pipeline(stage):
    with pytest.raises(ConfigError, match="ZeRO stage 0 or 1"):
        derive_ds_config({"zero_optimization": {"stage": stage}}, TrainConfig())


def test_bad_ds_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_ds_config(str(tmp_path / "nope.json"))
    p = tmp_path / "bad.json"
    p.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_ds_config(str(p))
