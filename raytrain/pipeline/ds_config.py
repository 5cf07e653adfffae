"""Derive the DeepSpeed config from `configs/ds_config.json` and the job's train section, in one place.

The JSON holds DeepSpeed's own settings (optimizer kind, ZeRO stage, precision, ...). Values the job config owns
(batch sizes, lr, warmup, clipping, weight decay) are written as "auto" or left out in the JSON and filled from the
job config here; a value in the JSON that disagrees with the job config is an error, never a silent override.
Pure: no deepspeed import, so it is unit-tested without a process group.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any

from raytrain.config import TrainConfig
from raytrain.errors import ConfigError

AUTO = "auto"


def load_ds_config(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise ConfigError(f"train.ds_config: file not found: {path} (the default is configs/ds_config.json)")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"train.ds_config: {path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"train.ds_config: {path} must hold a JSON object")
    return data


def _fill(ds: dict[str, Any], path: tuple[str, ...], value: Any, source: str, ds_path: str) -> None:
    """Set ds[path] = value when absent or "auto"; raise when present with another value."""
    node = ds
    for key in path[:-1]:
        node = node.setdefault(key, {})
    key = path[-1]
    current = node.get(key, AUTO)
    if current == AUTO:
        node[key] = value
        return
    same = current == value
    if isinstance(current, int | float) and isinstance(value, int | float) and not isinstance(current, bool):
        same = abs(float(current) - float(value)) <= 1e-12 * max(1.0, abs(float(value)))
    if not same:
        dotted = ".".join(path)
        raise ConfigError(
            f"{ds_path}: {dotted} = {current!r} disagrees with {source} = {value!r}. "
            f'Set it to "auto" (or remove it) in {ds_path} and change {source} in the job config instead.'
        )


def derive_ds_config(ds: dict[str, Any], train: TrainConfig, *, ds_path: str = "ds_config.json") -> dict[str, Any]:
    """Return a complete DeepSpeed config for a pipeline run; the input dict is not modified.

    global batch = micro_batch_size * grad_accum_steps * dp (DeepSpeed's train_batch_size counts every data-parallel
    replica, not the pipeline stages).
    """
    out = copy.deepcopy(ds)
    _fill(out, ("train_micro_batch_size_per_gpu",), train.micro_batch_size, "train.micro_batch_size", ds_path)
    _fill(out, ("gradient_accumulation_steps",), train.grad_accum_steps, "train.grad_accum_steps", ds_path)
    _fill(out, ("train_batch_size",), train.global_batch_size,
          "train.micro_batch_size * train.grad_accum_steps * train.dp", ds_path)
    _fill(out, ("gradient_clipping",), train.grad_clip, "train.grad_clip", ds_path)

    stage = out.setdefault("zero_optimization", {}).get("stage", 0)
    if stage not in (0, 1):
        raise ConfigError(
            f"{ds_path}: zero_optimization.stage = {stage!r}; DeepSpeed's pipeline engine supports only ZeRO stage 0 "
            "or 1 (stages 2/3 partition gradients/parameters across the data-parallel group, which pipeline "
            "parallelism does not support). Use 0 or 1."
        )

    # Precision: bf16 on GPUs, fp32 on CPU (CPU bf16 matmuls are slow and the gloo path is tested in fp32).
    bf16 = out.setdefault("bf16", {})
    if bf16.get("enabled", AUTO) == AUTO:
        bf16["enabled"] = bool(train.use_gpu)
    if out.get("fp16", {}).get("enabled") is True:
        raise ConfigError(f"{ds_path}: fp16 is not supported for Mistral training here; use bf16 (GPU) or fp32")
    if bf16["enabled"]:
        # bf16 + ZeRO-1 + pipe accumulates gradients in fp32 (DeepSpeed refuses bf16 accumulation with pipe).
        out.setdefault("data_types", {}).setdefault("grad_accum_dtype", "fp32")

    opt = out.setdefault("optimizer", {"type": "AdamW"})
    params = opt.setdefault("params", {})
    _fill(out, ("optimizer", "params", "lr"), train.lr, "train.lr", ds_path)
    _fill(out, ("optimizer", "params", "weight_decay"), train.weight_decay, "train.weight_decay", ds_path)
    if params.get("torch_adam", AUTO) == AUTO:
        # DeepSpeed's fused Adam needs CUDA; on CPU use torch's AdamW (same math).
        params["torch_adam"] = not train.use_gpu

    sched = out.setdefault("scheduler", {"type": "WarmupCosineLR"})
    if sched.get("type") == "WarmupCosineLR":
        sp = sched.setdefault("params", {})
        _fill(out, ("scheduler", "params", "total_num_steps"), train.max_steps, "train.max_steps", ds_path)
        # DeepSpeed requires warmup_num_steps >= 1; one step of warmup from 0 is the nearest to "no warmup".
        _fill(out, ("scheduler", "params", "warmup_num_steps"), max(1, train.warmup_steps), "train.warmup_steps",
              ds_path)
        _fill(out, ("scheduler", "params", "cos_min_ratio"), train.min_lr_ratio, "train.min_lr_ratio", ds_path)
        sp.setdefault("warmup_min_ratio", 0.0)
        sp.setdefault("warmup_type", "linear")

    if train.activation_checkpoint_interval:
        out.setdefault("activation_checkpointing", {}).setdefault("partition_activations", False)
    out.setdefault("steps_per_print", 10**9)  # we log per step ourselves
    out.setdefault("wall_clock_breakdown", False)
    return out
