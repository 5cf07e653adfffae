"""A stage takes another run's weights from that run's checkpoint (preference training from storage.init_from_run):
the per-layer files a real DeepSpeed pipeline engine saved, loaded into a freshly seeded stage before its engine
exists, give back exactly the trained weights; a file that does not fit its layer is refused."""

import os

import deepspeed
import pytest
import torch

from raytrain.pipeline.engine import DS_TAG, load_layer_files
from raytrain.pipeline.hf_io import layer_file_name
from raytrain.pipeline.model import MistralConfig
from raytrain.pipeline.module import build_pipeline_module

CFG = MistralConfig.preset("tiny")
CONFIG = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10_000,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}


def _trained_checkpoint(step_dir: str) -> dict[str, torch.Tensor]:
    """A seeded stage, one optimizer step on random tokens, saved by DeepSpeed under step_dir/ds; its weights."""
    module = build_pipeline_module(CFG, num_stages=1, seed=0)
    engine, _, _, _ = deepspeed.initialize(model=module, config=CONFIG, model_parameters=module.parameters())
    ids = torch.randint(1, CFG.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    inputs = (ids, torch.arange(16).view(1, -1), torch.zeros(1, 16, dtype=torch.long))
    engine.train_batch(iter([(inputs, ids.roll(-1, dims=1))]))
    engine.save_checkpoint(step_dir, tag=DS_TAG, save_latest=False)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_a_fresh_stage_takes_the_checkpoints_weights(gloo_group, tmp_path):
    trained = _trained_checkpoint(str(tmp_path))
    fresh = build_pipeline_module(CFG, num_stages=1, seed=0)
    assert any(not torch.equal(v, trained[k]) for k, v in fresh.state_dict().items())  # the step changed weights
    assert all(os.path.exists(tmp_path / DS_TAG / layer_file_name(i)) for i in range(len(fresh.forward_funcs)))
    load_layer_files(fresh, str(tmp_path))
    loaded = fresh.state_dict()
    assert sorted(loaded) == sorted(trained)
    for name, tensor in trained.items():
        torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0, msg=name)


def test_a_missing_or_foreign_layer_file_is_refused(gloo_group, tmp_path):
    _trained_checkpoint(str(tmp_path))
    fresh = build_pipeline_module(CFG, num_stages=1, seed=0)
    first, second = (f"{DS_TAG}/{layer_file_name(i)}" for i in (1, 2))  # two decoder layers
    os.replace(tmp_path / second, tmp_path / "moved.pt")
    with pytest.raises(FileNotFoundError, match="layer_02-model_states.pt is missing: the checkpoint does not hold pipeline layer 2"):
        load_layer_files(fresh, str(tmp_path))
    torch.save({"weight": torch.zeros(3)}, tmp_path / second)  # not a decoder layer's parameters
    with pytest.raises(RuntimeError, match="Missing key"):
        load_layer_files(fresh, str(tmp_path))
    assert first.endswith("layer_01-model_states.pt")
