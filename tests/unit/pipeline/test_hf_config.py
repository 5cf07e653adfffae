"""Importing real Hugging Face Mistral checkpoints: the architecture comes from their config.json (model.preset=hf),
every field that changes the math is checked against the model config, and the loaded layers compute what
transformers computes with the same folder (a v0.3-shaped tiny checkpoint: vocab 32768, rope_theta 1e6, no sliding
window; and a tiny sliding window that the test sequence is longer than)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from raytrain.config import load_job_config
from raytrain.errors import ConfigError, RaytrainError
from raytrain.pipeline.hf_io import load_hf_into_layers
from raytrain.pipeline.model import MistralConfig, build_sequential, model_config

SEQ_LEN = 40


def _hf_checkpoint(path, **overrides) -> transformers.MistralForCausalLM:
    fields = dict(vocab_size=32768, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-5, tie_word_embeddings=False)
    config = transformers.MistralConfig(**{**fields, **overrides})
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM._from_config(config, attn_implementation="eager").eval()
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("rope_theta,sliding_window", [(1e6, None), (1e4, 8)], ids=["v0.3-shape", "window-8"])
def test_preset_hf_reads_the_checkpoint_and_matches_transformers_logits(tmp_path, rope_theta, sliding_window):
    reference = _hf_checkpoint(tmp_path, rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
                               sliding_window=sliding_window)
    cfg = model_config("hf", str(tmp_path))
    assert (cfg.rope_theta, cfg.sliding_window, cfg.vocab_size, cfg.head_dim) == (rope_theta, sliding_window, 32768, 16)
    model = build_sequential(cfg, seed=1)
    load_hf_into_layers(list(model), 0, cfg, tmp_path)
    input_ids = torch.randint(0, cfg.vocab_size, (2, SEQ_LEN), generator=torch.Generator().manual_seed(3))
    position_ids = torch.arange(SEQ_LEN).expand(2, SEQ_LEN)
    with torch.no_grad():
        ours = model((input_ids, position_ids, torch.zeros_like(input_ids)))
        theirs = reference(input_ids=input_ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_release_config_files_with_top_level_rope_theta(tmp_path):
    """Mistral's own config.json files put rope_theta at the top level (Mistral-7B-Instruct-v0.3: 1e6, no window)."""
    release = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": 32768,
               "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
               "num_key_value_heads": 8, "max_position_embeddings": 32768, "rms_norm_eps": 1e-05,
               "rope_theta": 1000000.0, "sliding_window": None, "hidden_act": "silu", "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(release))
    cfg = MistralConfig.from_hf_config(tmp_path)
    assert (cfg.rope_theta, cfg.sliding_window, cfg.head_dim, cfg.vocab_size) == (1e6, None, 128, 32768)
    assert cfg.math_fields() == {**MistralConfig.preset("mistral-7b").math_fields(), "vocab_size": 32768,
                                 "rope_theta": 1e6, "sliding_window": None}


def test_a_checkpoint_that_disagrees_with_the_preset_names_each_field(tmp_path):
    _hf_checkpoint(tmp_path, rope_parameters={"rope_type": "default", "rope_theta": 1e6}, sliding_window=None,
                   rms_norm_eps=1e-6)
    cfg = MistralConfig.preset("tiny")  # rope_theta 1e4, sliding_window 4096, rms_norm_eps 1e-5
    with pytest.raises(RaytrainError, match=r"rms_norm_eps: checkpoint 1e-06 vs config 1e-05.*rope_theta: checkpoint "
                                            r"1000000.0 vs config 10000.0.*sliding_window: checkpoint None vs config "
                                            r"4096.*model.preset=hf"):
        load_hf_into_layers(list(build_sequential(cfg)), 0, cfg, tmp_path)


@pytest.mark.parametrize("change,message", [
    ({"model_type": "llama"}, "model_type is 'llama'"),
    ({"hidden_act": "gelu"}, "hidden_act is 'gelu'"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "RoPE scaling"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings"),
])
def test_what_the_model_does_not_implement_is_refused(tmp_path, change, message):
    _hf_checkpoint(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("rope_parameters", None)
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ConfigError, match=message):
        MistralConfig.from_hf_config(tmp_path)


def test_preset_hf_needs_init_from(tmp_path):
    with pytest.raises(ConfigError, match=r"model\.preset: 'hf'.*model\.init_from"):
        load_job_config("configs/demo.yaml", ["model.preset=hf"])
    with pytest.raises(ConfigError, match="config.json"):
        model_config("hf", str(tmp_path))
