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
