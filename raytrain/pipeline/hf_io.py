"""Weights in and out of Hugging Face format for the Mistral pipeline.

In: ``load_hf_into_stage`` reads, from a ``save_pretrained`` folder (one ``model.safetensors`` or shards listed in
``model.safetensors.index.json``), only the tensors of the layers this stage holds.
Out: ``export_to_hf`` merges DeepSpeed's per-layer files (``layer_XX-model_states.pt``, one per pipeline layer,
written by every stage's ``engine.save_checkpoint``) into a folder ``MistralForCausalLM.from_pretrained`` loads.
Both are a rename by pipeline layer index: ``hf_key = hf_prefix(i, cfg) + local_name``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from raytrain.errors import RaytrainError
from raytrain.pipeline.deepspeed_import import PipelineModule
from raytrain.pipeline.model import MistralConfig, build_sequential, hf_prefix
from raytrain.pipeline.module import stage_range

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"


def _key_to_file(hf_dir: Path) -> dict[str, Path]:
    """HF tensor name -> safetensors file holding it, for a single-file or sharded checkpoint."""
    single = hf_dir / SAFETENSORS_FILE
    index = hf_dir / SAFETENSORS_INDEX_FILE
    if single.is_file():
        with safe_open(str(single), framework="pt", device="cpu") as f:
            return {key: single for key in f.keys()}
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {key: hf_dir / filename for key, filename in weight_map.items()}
    raise RaytrainError(f"{hf_dir} holds neither {SAFETENSORS_FILE} nor {SAFETENSORS_INDEX_FILE}; point hf_dir at a "
                        "folder written by save_pretrained(..., safe_serialization=True)")


def check_hf_config(hf_dir: str | os.PathLike, cfg: MistralConfig) -> None:
    """Every field that changes the math (shapes, rope_theta, sliding_window, rms_norm_eps, ...) must agree."""
    config_path = Path(hf_dir) / "config.json"
    if not config_path.is_file():
        return  # weights only: shapes are still checked tensor by tensor
    theirs, ours = MistralConfig.from_hf_config(hf_dir).math_fields(), cfg.math_fields()
    mismatched = {f: (theirs[f], ours[f]) for f in ours if theirs[f] != ours[f]}
    if mismatched:
        detail = ", ".join(f"{f}: checkpoint {a} vs config {b}" for f, (a, b) in mismatched.items())
        raise RaytrainError(f"{config_path} does not match the model config ({detail}); use model.preset=hf to take "
                            "the architecture from the checkpoint, or a checkpoint of this architecture")


@torch.no_grad()
def load_hf_into_layers(layers: Sequence[nn.Module], first_layer_index: int, cfg: MistralConfig,
                        hf_dir: str | os.PathLike) -> list[str]:
    """Copy HF tensors into ``layers`` (pipeline layers ``first_layer_index, first_layer_index+1, ...``).

    Opens only the safetensors files that hold these layers and reads only their keys. Casts to each parameter's
    dtype and device. Returns the HF keys loaded. Raises RaytrainError naming a missing key or a shape mismatch.
    """
    hf_path = Path(hf_dir)
    check_hf_config(hf_path, cfg)
    key_to_file = _key_to_file(hf_path)
    wanted: dict[Path, list[tuple[str, torch.Tensor]]] = {}
    for offset, layer in enumerate(layers):
        layer_index = first_layer_index + offset
        for local_name, tensor in layer.state_dict(keep_vars=True).items():
            hf_key = hf_prefix(layer_index, cfg) + local_name
            if hf_key not in key_to_file:
                raise RaytrainError(f"{hf_path} has no tensor {hf_key!r} (pipeline layer {layer_index}); is it a "
                                    "MistralForCausalLM checkpoint with the same number of layers?")
            wanted.setdefault(key_to_file[hf_key], []).append((hf_key, tensor))
    loaded: list[str] = []
    for path, entries in wanted.items():
        if not path.is_file():
            raise RaytrainError(f"safetensors shard {path} listed in {SAFETENSORS_INDEX_FILE} is missing")
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for hf_key, target in entries:
                source = f.get_tensor(hf_key)
                if tuple(source.shape) != tuple(target.shape):
                    raise RaytrainError(f"{path}: tensor {hf_key!r} has shape {tuple(source.shape)}, the model "
                                        f"expects {tuple(target.shape)}")
                target.copy_(source.to(dtype=target.dtype, device=target.device))
                loaded.append(hf_key)
    return loaded


def load_hf_into_stage(module: PipelineModule, hf_dir: str | os.PathLike) -> list[str]:
    """Load this process's stage of ``module`` from a Hugging Face Mistral folder; returns the HF keys read."""
    start, stop = stage_range(module)
    layers = list(module.forward_funcs)
    if len(layers) != stop - start:
        raise RaytrainError(f"stage holds {len(layers)} layers but its partition is {start}..{stop}")
    cfg = layers[0].cfg  # every pipeline layer carries the MistralConfig it was built from
    return load_hf_into_layers(layers, start, cfg, hf_dir)


def layer_file_name(layer_index: int) -> str:
    """DeepSpeed's pipeline file of one layer's weights, inside a checkpoint's tag folder."""
    return f"layer_{layer_index:02d}-model_states.pt"


def _layer_file(tag_dir: Path, layer_index: int) -> Path:
    return tag_dir / layer_file_name(layer_index)


def load_layer_file(layer: torch.nn.Module, tag_dir: str | Path, layer_index: int) -> None:
    """Load pipeline layer ``layer_index`` from its file in a checkpoint's tag folder, strict: the file must hold
    exactly the layer's parameters."""
    path = _layer_file(Path(tag_dir), layer_index)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: the checkpoint does not hold pipeline layer {layer_index}")
    layer.load_state_dict(torch.load(path, map_location="cpu", weights_only=True), strict=True)


def _check_layer_files(tag_dir: Path, cfg: MistralConfig) -> None:
    if not tag_dir.is_dir():
        raise RaytrainError(f"DeepSpeed checkpoint folder {tag_dir} does not exist; pass <save_dir>/<tag>")
    for layer_index in range(cfg.num_pipeline_layers):
        path = _layer_file(tag_dir, layer_index)
        if path.is_file():
            continue
        if list(tag_dir.glob(f"layer_{layer_index:02d}-model_*-model_states.pt")):
            raise RaytrainError(f"{tag_dir} holds tensor-parallel shards for layer {layer_index}; export only "
                                "supports pipeline + data parallel checkpoints")
        raise RaytrainError(
            f"{path} is missing: pipeline layer {layer_index} ({hf_prefix(layer_index, cfg)}*) was not saved. "
            "Every pipeline stage must call engine.save_checkpoint with the same tag, and all stage files must be "
            "gathered into one folder before export.")


def _checked_tensors(tag_dir: Path, cfg: MistralConfig, expected: Any, dtype: torch.dtype | None
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face key, contiguous tensor) of every pipeline layer file in order, one file in memory at a time;
    RaytrainError naming the file when its names or shapes are not the model config's."""
    for layer_index in range(cfg.num_pipeline_layers):
        path = _layer_file(tag_dir, layer_index)
        state = torch.load(path, map_location="cpu", weights_only=True)
        want = dict(expected[layer_index].state_dict())
        if set(state) != set(want):
            raise RaytrainError(f"{path} holds {sorted(state)}, expected {sorted(want)} for pipeline layer "
                                f"{layer_index}; was the checkpoint written with a different model config?")
        for local_name in sorted(state):
            tensor = state[local_name]
            if tuple(tensor.shape) != tuple(want[local_name].shape):
                raise RaytrainError(f"{path}: {local_name} has shape {tuple(tensor.shape)}, expected "
                                    f"{tuple(want[local_name].shape)}")
            if dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(dtype)
            yield hf_prefix(layer_index, cfg) + local_name, tensor.contiguous()
        del state


def _publish_shards(out_path: Path, shard_paths: list[Path], weight_map: dict[str, int], total_bytes: int) -> None:
    """Give the written temp shards their Hugging Face names: one ``model.safetensors``, or numbered shards and
    their index."""
    if len(shard_paths) == 1:
        shard_paths[0].rename(out_path / SAFETENSORS_FILE)
        return
    names = [f"model-{k + 1:05d}-of-{len(shard_paths):05d}.safetensors" for k in range(len(shard_paths))]
    for tmp, name in zip(shard_paths, names, strict=True):
        tmp.rename(out_path / name)
    index = {"metadata": {"total_size": total_bytes},
             "weight_map": {key: names[k] for key, k in sorted(weight_map.items())}}
    (out_path / SAFETENSORS_INDEX_FILE).write_text(json.dumps(index, indent=2))


def export_to_hf(ds_checkpoint_tag_dir: str | os.PathLike, cfg: MistralConfig, out_dir: str | os.PathLike, *,
                 dtype: torch.dtype | None = None, max_shard_bytes: int = 5 * 2**30,
                 tokenizer: str | None = None) -> Path:
    """Write ``config.json``, ``generation_config.json`` and safetensors weights that MistralForCausalLM loads.

    ``tokenizer`` ("v1" | "v3"): also write that tokenizer's files (``raytrain.dataset.hf_tokenizer``), so
    ``AutoTokenizer.from_pretrained(out_dir)`` loads it and its chat template encodes as training did.

    ``ds_checkpoint_tag_dir`` is ``<save_dir>/<tag>`` holding ``layer_XX-model_states.pt`` for all L+3 pipeline
    layers. ``dtype`` casts floating tensors (default: keep). Weights above ``max_shard_bytes`` are split into
    ``model-0000k-of-0000n.safetensors`` with an index, as Hugging Face does. Only one shard is held in memory.
    Refuses an ``out_dir`` that already holds a model. Returns ``out_dir``.
    """
    tag_dir, out_path = Path(ds_checkpoint_tag_dir), Path(out_dir)
    _check_layer_files(tag_dir, cfg)
    out_path.mkdir(parents=True, exist_ok=True)
    existing = sorted(p.name for p in out_path.iterdir() if p.name == "config.json" or p.suffix == ".safetensors"
                      or p.name == SAFETENSORS_INDEX_FILE)
    if existing:
        raise RaytrainError(f"{out_path} already holds {existing}; export into an empty folder")
    with torch.device("meta"):
        expected = build_sequential(cfg)  # names and shapes per layer, no memory

    shard_paths: list[Path] = []
    weight_map: dict[str, int] = {}  # HF key -> shard number
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = total_bytes = 0

    def flush() -> None:
        nonlocal shard, shard_bytes
        if shard:
            path = out_path / f".shard-{len(shard_paths):05d}.safetensors.tmp"
            save_file(shard, str(path), metadata={"format": "pt"})
            shard_paths.append(path)
            shard, shard_bytes = {}, 0

    for hf_key, tensor in _checked_tensors(tag_dir, cfg, expected, dtype):
        num_bytes = tensor.numel() * tensor.element_size()
        if shard and shard_bytes + num_bytes > max_shard_bytes:
            flush()
        shard[hf_key] = tensor
        weight_map[hf_key] = len(shard_paths)
        shard_bytes += num_bytes
        total_bytes += num_bytes
    flush()
    _publish_shards(out_path, shard_paths, weight_map, total_bytes)

    from transformers import GenerationConfig  # heavy import, only needed here

    hf_config = cfg.to_hf()
    hf_config.architectures = ["MistralForCausalLM"]
    if dtype is not None:
        hf_config.dtype = dtype
    GenerationConfig.from_model_config(hf_config).save_pretrained(out_path)
    if tokenizer is not None:
        from raytrain.dataset.hf_tokenizer import save_hf_tokenizer

        save_hf_tokenizer(tokenizer, out_path)
    hf_config.save_pretrained(out_path)  # config.json last: a folder without it is visibly incomplete
    return out_path


__all__ = ["check_hf_config", "load_hf_into_layers", "load_hf_into_stage", "export_to_hf"]
