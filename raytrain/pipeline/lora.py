"""LoRA adapters on the pipeline's decoder layers, made of peft's own LoRA layers.

Our decoder layers name their projections as transformers' Mistral does (``self_attn.q_proj``, ``mlp.down_proj``,
...), so peft's injection API (``inject_adapter_in_model``) wraps them with ``peft.tuners.lora.Linear`` as it would
wrap ``MistralForCausalLM``: the forward, the scaling (alpha / rank), dropout and the merge are peft's. Each decoder
layer is injected on its own, its adapter initialized from (seed, layer index) as the base weights are, so the
adapters do not depend on how many stages the model is cut into. Every other parameter is frozen.

A frozen embedding gives activations that need no gradient; a reentrant activation checkpoint around the next
decoder layer would then return outputs without a graph, and that stage's adapters would never train. As
transformers' ``enable_input_require_grads`` does, the embedding's output is marked to require a gradient.

Names: ``adapter_state_dict`` gives a stage's adapter weights under the names of a PEFT adapter file
(``base_model.model.model.layers.<k>.self_attn.q_proj.lora_A.weight``), which peft's
``set_peft_model_state_dict`` / ``PeftModel.from_pretrained`` load onto transformers' ``MistralForCausalLM``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from raytrain.config import LoraConfig
from raytrain.pipeline.model import DecoderLayerPipe, EmbeddingPipe, _layer_seed

LORA_SEED_SALT = 0x10_4A
"""Added to the model seed for the adapters' draws, so they never repeat a base layer's."""
PEFT_PREFIX = "base_model.model."
"""What a PeftModel puts before transformers' parameter names in its adapter files."""


def peft_config(lora: LoraConfig) -> Any:
    """The same settings as peft's LoraConfig (what PeftModel and vLLM read from adapter_config.json)."""
    import peft

    return peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                           target_modules=list(lora.targets), bias="none", task_type="CAUSAL_LM")


def decoder_layers(module: nn.Module) -> list[DecoderLayerPipe]:
    """The decoder layers ``module`` holds (a stage's PipelineModule, or a Sequential of our layers)."""
    return [m for m in module.modules() if isinstance(m, DecoderLayerPipe)]


def add_adapters(module: nn.Module, lora: LoraConfig, seed: int) -> None:
    """Freeze every parameter of ``module`` and put a trainable adapter on each target projection of its decoder
    layers (in place). The global RNG is left as it was."""
    from peft import inject_adapter_in_model

    if lora.rank <= 0:
        raise ValueError(f"add_adapters needs lora.rank > 0, got {lora.rank}")
    module.requires_grad_(False)
    config = peft_config(lora)
    for layer in decoder_layers(module):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_layer_seed(seed + LORA_SEED_SALT, layer.layer_idx))
            inject_adapter_in_model(config, layer)
    for name, param in module.named_parameters():
        param.requires_grad_(".lora_" in name)
    for embedding in (m for m in module.modules() if isinstance(m, EmbeddingPipe)):
        embedding.register_forward_hook(_hidden_requires_grad)


def _hidden_requires_grad(_module: nn.Module, _inputs: Any, output: tuple[torch.Tensor, ...]) -> None:
    """Forward hook on a frozen embedding: its hidden states start the adapters' graph."""
    output[0].requires_grad_(True)


def _hf_name(layer: DecoderLayerPipe, name: str) -> str:
    """``self_attn.q_proj.lora_A.default.weight`` of decoder layer k -> the PEFT file's name."""
    return f"{PEFT_PREFIX}model.layers.{layer.layer_idx}.{name.replace('.default.', '.')}"


def adapter_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter weights ``module`` holds, under PEFT adapter-file names (detached; on their device)."""
    return {_hf_name(layer, name): p.detach() for layer in decoder_layers(module)
            for name, p in layer.named_parameters() if ".lora_" in name}


def load_adapter_state_dict(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy adapter weights named as ``adapter_state_dict`` names them into ``module``'s adapters (every adapter
    of the module must be in ``state``)."""
    params = {_hf_name(layer, name): p for layer in decoder_layers(module)
              for name, p in layer.named_parameters() if ".lora_" in name}
    missing = sorted(set(params) - set(state))
    if missing:
        raise KeyError(f"adapter weights missing for {len(missing)} tensors, e.g. {missing[:3]}")
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(state[name])


def parameter_counts(module: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts of ``module``."""
    params = list(module.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


__all__ = ["add_adapters", "adapter_state_dict", "decoder_layers", "load_adapter_state_dict", "parameter_counts",
           "peft_config"]
