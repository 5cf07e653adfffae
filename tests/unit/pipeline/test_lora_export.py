"""Export of a LoRA checkpoint whose base is a Hugging Face folder (model.init_from): raytrain.pipeline.lora's
export_lora against transformers and peft, in one process (the Ray Train runs with a seeded base are exported in
tests/integration/test_lora.py)."""

import os

import torch
import transformers

from raytrain.config import LoraConfig
from raytrain.pipeline.hf_io import load_hf_into_layers
from raytrain.pipeline.lora import add_adapters, export_lora
from raytrain.pipeline.model import MistralConfig, build_sequential

CFG = MistralConfig.preset("tiny")
LORA = LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "down_proj"))


def test_export_onto_an_init_from_base_gives_the_pipelines_logits(tmp_path):
    import peft

    torch.manual_seed(0)
    base_dir = tmp_path / "Mistral-base"
    transformers.MistralForCausalLM._from_config(CFG.to_hf(), attn_implementation="eager").save_pretrained(base_dir)
    # our layers on that base with trained adapters, and their layer files as a LoRA checkpoint holds them (the
    # trainable parameters only: DeepSpeed's exclude_frozen_parameters)
    ours = build_sequential(CFG, seed=3)
    load_hf_into_layers(list(ours), 0, CFG, base_dir)
    add_adapters(ours, LORA, seed=3)
    generator = torch.Generator().manual_seed(1)
    tag = tmp_path / "ds"
    tag.mkdir()
    with torch.no_grad():
        for index, layer in enumerate(ours):
            for param in layer.parameters():
                if param.requires_grad:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
            torch.save({n: p.detach().clone() for n, p in layer.named_parameters() if p.requires_grad},
                       tag / f"layer_{index:02d}-model_states.pt")

    out = tmp_path / "export"
    written = export_lora(str(tag), CFG, LORA, str(out), seed=3, init_from=str(base_dir), tokenizer="v3")
    assert set(written) == {"merged", "adapter"}  # the base is init_from itself: no copy of it
    config = peft.PeftConfig.from_pretrained(written["adapter"])
    assert config.base_model_name_or_path == os.path.abspath(base_dir)
    assert set(config.target_modules) == {"q_proj", "v_proj", "down_proj"}

    input_ids = torch.randint(0, CFG.vocab_size, (2, 20), generator=generator)
    position_ids = torch.arange(20).expand(2, 20)
    with torch.no_grad():
        expected = ours.eval()((input_ids, position_ids, torch.zeros_like(input_ids)))
        merged = transformers.AutoModelForCausalLM.from_pretrained(out).eval()(input_ids=input_ids).logits
        adapted = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base_dir),
                                                 written["adapter"]).eval()(input_ids=input_ids).logits
        plain = transformers.AutoModelForCausalLM.from_pretrained(base_dir).eval()(input_ids=input_ids).logits
    torch.testing.assert_close(merged, expected, rtol=0, atol=2e-5)
    torch.testing.assert_close(adapted, expected, rtol=0, atol=2e-5)
    assert (plain - expected).abs().max() > 1e-3  # the adapters change the model: the check above can fail
