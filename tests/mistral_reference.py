"""transformers' MistralForCausalLM as the reference for raytrain's plain-torch layers, and our layers holding the
same weights (tests/unit/pipeline)."""

import torch
import transformers

from raytrain.pipeline.model import MistralConfig, build_sequential, hf_prefix


def hf_model(cfg: MistralConfig, seed: int = 0) -> transformers.MistralForCausalLM:
    torch.manual_seed(seed)
    model = transformers.MistralForCausalLM._from_config(cfg.to_hf(), attn_implementation="eager")
    return model.eval()


def ours_from_hf(cfg: MistralConfig, hf: transformers.MistralForCausalLM) -> torch.nn.Sequential:
    seq = build_sequential(cfg, seed=123)  # different init, then overwritten: the copy must reach every tensor
    hf_state = hf.state_dict()
    with torch.no_grad():
        for i, layer in enumerate(seq):
            for name, param in layer.named_parameters():
                param.copy_(hf_state[hf_prefix(i, cfg) + name])
    return seq.eval()


def ours_from_layer_files(cfg: MistralConfig, tag_dir: str, seed: int) -> torch.nn.Sequential:
    """Our nn.Sequential built with ``seed`` (choose one the checkpoint was not trained from: every tensor must be
    overwritten), each pipeline layer loaded by torch.load from DeepSpeed's layer_XX file in ``tag_dir``; no
    raytrain loading code involved."""
    import os

    model = build_sequential(cfg, seed=seed)
    for index, layer in enumerate(model):
        state = torch.load(os.path.join(tag_dir, f"layer_{index:02d}-model_states.pt"), map_location="cpu",
                           weights_only=True)
        layer.load_state_dict(state, strict=True)
    return model.eval()
