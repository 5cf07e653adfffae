"""Mistral as a DeepSpeed PipelineModule, and the stage partition it will use, computed without building it.

``stage_layer_ranges`` reproduces ``PipelineModule._partition_layers`` with the same DeepSpeed helpers
(``partition_uniform`` / ``partition_balanced``), so callers (checkpoint layout, export, logging) can know which
pipeline layers a stage owns before any process group exists.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch

from raytrain.errors import ConfigError
from raytrain.pipeline.deepspeed_import import LayerSpec, PipelineModule, checkpointing, ds_utils
from raytrain.pipeline.model import (
    DecoderLayerPipe,
    MistralConfig,
    causal_lm_loss,
    check_num_stages,
    layer_constructors,
    layer_parameter_counts,
)

DEFAULT_PARTITION_METHOD = "type:DecoderLayerPipe"
PARTITION_METHODS = ("type:DecoderLayerPipe", "parameters", "uniform")


def stage_layer_ranges(cfg: MistralConfig, num_stages: int,
                       partition_method: str = DEFAULT_PARTITION_METHOD) -> list[tuple[int, int]]:
    """Per stage, the half-open range ``(start, stop)`` of pipeline layer indices it owns (0 .. L+2).

    Same result as ``PipelineModule(...).parts`` for the layers of ``build_pipeline_module``: 'uniform' splits the
    layer count evenly, 'parameters' balances trainable parameter counts, 'type:<regex>' balances the number of
    layers whose class name matches (case-insensitive), all via DeepSpeed's own partition helpers.
    Raises ConfigError for an unknown method, too many stages, or a partition that leaves a stage empty.
    """
    check_num_stages(cfg, num_stages)
    method = partition_method.lower()
    names = [cls.__name__ for cls, _args, _kwargs in layer_constructors(cfg)]
    if method == "uniform":
        parts = ds_utils.partition_uniform(num_items=len(names), num_parts=num_stages)
    elif method == "parameters":
        parts = ds_utils.partition_balanced(weights=layer_parameter_counts(cfg), num_parts=num_stages)
    elif method.startswith("type:"):
        pattern = re.compile(method.split(":")[1], re.IGNORECASE)
        weights = [1 if pattern.search(name) else 0 for name in names]
        if not any(weights):
            raise ConfigError(f"partition_method {partition_method!r} matches no layer class; classes are "
                              f"{sorted(set(names))}")
        parts = ds_utils.partition_balanced(weights=weights, num_parts=num_stages)
    else:
        raise ConfigError(f"unknown partition_method {partition_method!r}; use one of {list(PARTITION_METHODS)}")
    ranges = [(int(parts[s]), int(parts[s + 1])) for s in range(num_stages)]
    empty = [s for s, (start, stop) in enumerate(ranges) if stop <= start]
    if empty:
        raise ConfigError(f"partition_method {partition_method!r} leaves stage(s) {empty} of {num_stages} without "
                          f"layers (ranges {ranges}); use fewer stages or partition_method 'uniform'")
    return ranges


def build_pipeline_module(cfg: MistralConfig, num_stages: int, *, topology=None,
                          partition_method: str = DEFAULT_PARTITION_METHOD, activation_checkpoint_interval: int = 0,
                          seed: int = 0, attn_impl: str = "dense",
                          activation_checkpoint_reentrant: bool = False,
                          loss_fn: Callable[[torch.Tensor, Any], torch.Tensor] = causal_lm_loss) -> PipelineModule:
    """The Mistral PipelineModule for this process's stage (needs ``deepspeed.init_distributed`` first).

    Layers are LayerSpecs, so a process only allocates its own stage. Each layer draws its init from
    (seed, layer index), so the weights do not depend on ``num_stages`` or the partition. ``topology`` (a DeepSpeed
    ProcessTopology) overrides the default pipe x data layout and must have ``num_stages`` on its 'pipe' axis.
    ``attn_impl`` picks every decoder layer's attention kernel (raytrain.pipeline.attention).
    Activation checkpointing (every ``activation_checkpoint_interval`` layers; 1 = each decoder layer) only wraps
    decoder layers, with DeepSpeed's non-reentrant checkpoint (torch's recommended form: no re-entry into autograd,
    inputs need not require grad) unless ``activation_checkpoint_reentrant``, DeepSpeed's classic reentrant one
    (which would cut the embedding off from its gradient: its inputs are integer ids).
    ``loss_fn`` runs on the last stage on (logits, the micro-batch's labels): the fine-tune's token loss by default,
    ``raytrain.pipeline.dpo.DpoLoss`` for preference training.
    """
    stage_layer_ranges(cfg, num_stages, partition_method)  # validates before any process-group work
    if topology is not None and topology.get_dim("pipe") != num_stages:
        raise ConfigError(f"topology has {topology.get_dim('pipe')} pipeline stages but num_stages={num_stages}; "
                          "make them agree")
    if activation_checkpoint_interval < 0:
        raise ConfigError(f"activation_checkpoint_interval must be >= 0, got {activation_checkpoint_interval}")
    specs = [LayerSpec(cls, *args, **kwargs) for cls, args, kwargs in layer_constructors(cfg, seed, attn_impl)]
    return PipelineModule(
        layers=specs,
        num_stages=None if topology is not None else num_stages,
        topology=topology,
        loss_fn=loss_fn,
        partition_method=partition_method,
        activation_checkpoint_interval=activation_checkpoint_interval,
        activation_checkpoint_func=(checkpointing.checkpoint if activation_checkpoint_reentrant
                                    else checkpointing.non_reentrant_checkpoint),
        checkpointable_layers=[DecoderLayerPipe.__name__],
    )


def stage_range(module: PipelineModule) -> tuple[int, int]:
    """Half-open range of pipeline layer indices that ``module`` (one stage) holds."""
    return int(module.parts[module.stage_id]), int(module.parts[module.stage_id + 1])


__all__ = ["DEFAULT_PARTITION_METHOD", "PARTITION_METHODS", "stage_layer_ranges", "build_pipeline_module",
           "stage_range"]
