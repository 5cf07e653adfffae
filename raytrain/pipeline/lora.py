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

import contextlib
import hashlib
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from raytrain.config import JobConfig, LoraConfig
from raytrain.errors import RaytrainError
from raytrain.pipeline.model import DecoderLayerPipe, EmbeddingPipe, MistralConfig, _layer_seed

LORA_SEED_SALT = 0x10_4A
"""Added to the model seed for the adapters' draws, so they are not the draws of the base layers' init."""
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


@contextlib.contextmanager
def adapters_disabled(module: nn.Module) -> Iterator[None]:
    """Run ``module`` as its base model: every peft LoRA layer's adapter off (peft's own ``enable_adapters``), each
    restored on exit, its adapters' requires_grad included. A LoRA run's DPO reference, as TRL takes it."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in module.modules() if isinstance(m, BaseTunerLayer)]
    were_disabled = [m.disable_adapters for m in layers]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer, disabled in zip(layers, were_disabled, strict=True):
            layer.enable_adapters(not disabled)


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


def adapter_parameter_count(cfg: MistralConfig, lora: LoraConfig) -> int:
    """Adapter parameters of the whole model: rank x (in + out features) per target projection per layer."""
    if lora.rank <= 0:
        return 0
    head_dim = cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
    q, kv, h, i = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim, cfg.hidden_size, \
        cfg.intermediate_size
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i),
              "up_proj": (h, i), "down_proj": (i, h)}
    return cfg.num_hidden_layers * sum(lora.rank * sum(shapes[t]) for t in lora.targets)


def model_parameter_counts(job: JobConfig) -> dict[str, int]:
    """The job's model's trainable and total parameters (LoRA: the adapters train, the base is frozen)."""
    from raytrain.pipeline.model import layer_parameter_counts, model_config

    cfg = model_config(job.model.preset, job.model.init_from)
    base, adapters = sum(layer_parameter_counts(cfg)), adapter_parameter_count(cfg, job.model.lora)
    return {"trainable": adapters if job.model.lora.rank else base, "total": base + adapters}


def base_identity(job: JobConfig) -> dict[str, Any]:
    """What the adapters of a LoRA run sit on, recorded in its checkpoints: ``model.init_from`` and a sha256 over
    its config.json and weight files (names and bytes), or, for a seeded base, the preset and the seed."""
    if not job.model.init_from:
        return {"preset": job.model.preset, "seed": job.train.seed}
    folder = job.model.init_from
    if not os.path.isdir(folder):
        return {"init_from": folder, "weights_sha256": None}  # not on the driver: the path alone names it
    digest = hashlib.sha256()
    names = sorted(n for n in os.listdir(folder) if n == "config.json" or n.endswith(".safetensors"))
    for name in names:
        digest.update(name.encode() + b"\0")
        with open(os.path.join(folder, name), "rb") as f:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                digest.update(chunk)
    return {"init_from": folder, "weights_sha256": digest.hexdigest()}


def check_resume_settings(saved_config: dict[str, Any], saved_base: dict[str, Any] | None, job: JobConfig,
                          base: dict[str, Any], where: str) -> None:
    """A checkpoint's adapters only fit the LoRA settings and the base they were trained with: resuming with other
    settings, onto another base, or a full fine-tune from adapters (or the reverse) is refused, both sides named."""
    saved_lora = dict(sorted(((saved_config.get("model") or {}).get("lora") or {"rank": 0}).items()))
    current = {k: list(v) if isinstance(v, tuple) else v for k, v in sorted(vars(job.model.lora).items())}
    if not saved_lora.get("rank") and not current["rank"]:
        return
    if saved_lora != current:
        raise RaytrainError(
            f"{where} was trained with model.lora {saved_lora}, this config has {current}: a checkpoint holds "
            "the weights its own settings train. Resume with the same model.lora, or start a new storage.run_name")
    if saved_base is not None and saved_base != base:
        raise RaytrainError(
            f"{where} holds LoRA adapters trained on the base {saved_base}; this config's base is {base}. Adapters "
            "only fit the weights they were trained on: set model.init_from (or train.seed) as that run had it, "
            "or start a new storage.run_name")


def _base_layers(cfg: MistralConfig, seed: int, init_from: str, layer_files: str = ""
                 ) -> Iterator[tuple[int, nn.Module]]:
    """(pipeline index, layer) of the base, one layer in memory at a time: seeded, loaded from ``init_from``, or
    from ``layer_files`` (a folder of DeepSpeed's per-layer files: another run's checkpoint)."""
    from raytrain.pipeline.hf_io import load_hf_into_layers, load_layer_file
    from raytrain.pipeline.model import layer_constructors

    for index, (cls, args, kwargs) in enumerate(layer_constructors(cfg, seed)):
        layer = cls(*args, **kwargs)
        if layer_files:
            load_layer_file(layer, layer_files, index)
        elif init_from:
            load_hf_into_layers([layer], index, cfg, init_from)
        yield index, layer


def export_lora(tag_dir: str, cfg: MistralConfig, lora: LoraConfig, out_dir: str, *, seed: int, init_from: str,
                tokenizer: str, base_layer_files: str = "") -> dict[str, str]:
    """Export a LoRA checkpoint (``tag_dir``: DeepSpeed's layer files, adapters only) as:

    - ``out_dir``: the merged model (each adapter merged into its projection by peft's ``merge``) with its
      tokenizer, a Hugging Face folder as a full fine-tune's export;
    - ``out_dir/adapter``: a PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``, names as
      on transformers' MistralForCausalLM) for ``PeftModel.from_pretrained`` or vLLM's LoRA loader;
    - ``out_dir/base``: the base the adapters were trained on, when there is no ``init_from`` to load them onto
      (its ``base_model_name_or_path`` in the adapter config): seeded, or another run's weights read from
      ``base_layer_files`` (that checkpoint's DeepSpeed layer files; a preference run from storage.init_from_run).

    One layer is in memory at a time. Returns the folders written, by name."""
    import tempfile

    from peft.tuners.lora import LoraLayer
    from safetensors.torch import save_file

    from raytrain.pipeline.hf_io import export_to_hf, layer_file_name

    out = {"merged": out_dir, "adapter": os.path.join(out_dir, "adapter")}
    adapters: dict[str, torch.Tensor] = {}
    with tempfile.TemporaryDirectory(prefix="raytrain-lora-export-") as tmp:
        merged_dir, base_dir = os.path.join(tmp, "merged"), os.path.join(tmp, "base")
        os.makedirs(merged_dir)
        os.makedirs(base_dir)
        for index, layer in _base_layers(cfg, seed, init_from, base_layer_files):
            name = layer_file_name(index)
            torch.save(layer.state_dict(), os.path.join(base_dir, name))
            trained = torch.load(os.path.join(tag_dir, name), map_location="cpu", weights_only=True)
            if isinstance(layer, DecoderLayerPipe):
                add_adapters(layer, lora, seed)
                load_adapter_state_dict(layer, {_hf_name(layer, k): v for k, v in trained.items()})
                adapters.update({k: v.clone().contiguous() for k, v in adapter_state_dict(layer).items()})
                for module in layer.modules():
                    if isinstance(module, LoraLayer):
                        module.merge(safe_merge=True)
                state = {k.replace(".base_layer.", "."): v for k, v in layer.state_dict().items() if ".lora_" not in k}
            elif trained:
                raise RaytrainError(f"{os.path.join(tag_dir, name)} holds {sorted(trained)[:3]}: a LoRA checkpoint "
                                    "saves nothing of the frozen embedding, norm and head")
            else:
                state = layer.state_dict()
            torch.save(state, os.path.join(merged_dir, name))
        export_to_hf(merged_dir, cfg, out_dir, tokenizer=tokenizer)
        if not init_from:
            out["base"] = os.path.join(out_dir, "base")
            export_to_hf(base_dir, cfg, out["base"], tokenizer=tokenizer)
    os.makedirs(out["adapter"], exist_ok=True)
    config = peft_config(lora)
    config.base_model_name_or_path = os.path.abspath(init_from or out["base"])
    config.save_pretrained(out["adapter"])
    save_file(adapters, os.path.join(out["adapter"], "adapter_model.safetensors"), metadata={"format": "pt"})
    from raytrain.dataset.hf_tokenizer import save_hf_tokenizer

    save_hf_tokenizer(tokenizer, out["adapter"])  # `raytrain generate <adapter>` and servers find it there
    return out


__all__ = ["adapter_parameter_count", "add_adapters", "adapter_state_dict", "base_identity", "check_resume_settings",
           "decoder_layers", "export_lora", "load_adapter_state_dict", "model_parameter_counts", "parameter_counts",
           "peft_config"]
