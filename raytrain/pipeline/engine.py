"""The DeepSpeed pipeline engine for one worker: process group, PipelineModule, optimizer, checkpoints.

Thin on purpose: the model lives in `model.py`, the partition in `module.py`, the config in `ds_config.py`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from raytrain.config import LoraConfig
from raytrain.dataset.labels import IGNORE_INDEX, PAD_SEGMENT_ID
from raytrain.errors import RaytrainError
from raytrain.pipeline.deepspeed_import import PipeDataParallelTopology, PipelineModule, deepspeed
from raytrain.pipeline.model import MistralConfig
from raytrain.pipeline.module import build_pipeline_module

log = logging.getLogger(__name__)

DS_TAG = "ds"  # DeepSpeed's tag folder inside each of our step directories


@dataclass
class StageEngine:
    """One worker's pipeline stage; where it sits comes from DeepSpeed's grid (``engine.grid``)."""

    engine: Any  # deepspeed.runtime.pipe.engine.PipelineEngine
    stage: int
    dp_rank: int
    num_stages: int
    num_replicas: int  # data-parallel pipeline replicas
    world_rank: int
    adapters_only: bool = False
    """LoRA: checkpoints hold the trainable parameters (the adapters) and their optimizer state, not the frozen
    base, which every launch builds or loads from model.init_from."""

    @classmethod
    def of(cls, engine: Any, adapters_only: bool = False) -> StageEngine:
        """The stage a DeepSpeed PipelineEngine runs, placed by its grid (PipelineParallelGrid)."""
        grid = engine.grid
        return cls(engine=engine, stage=grid.get_stage_id(), dp_rank=grid.get_data_parallel_id(),
                   num_stages=grid.get_pipe_parallel_world_size(), num_replicas=grid.get_data_parallel_world_size(),
                   world_rank=grid.get_global_rank(), adapters_only=adapters_only)

    def train_batch(self, data_iter: Iterator[tuple[tuple[torch.Tensor, ...], torch.Tensor]] | None) -> float:
        """One optimizer step over grad_accum_steps micro-batches; returns the mean loss (same on every stage)."""
        loss = self.engine.train_batch(data_iter=data_iter)
        return float(loss.item()) if torch.is_tensor(loss) else float(loss)

    def eval_loss(self, data_iter: Iterator[tuple[tuple[torch.Tensor, ...], Any]] | None,
                  num_micro_batches: int) -> float:
        """Forward only over ``num_micro_batches`` micro-batches (DeepSpeed's pipeline eval schedule, all stages in
        step), their losses averaged, then averaged over dp replicas; the same value on every stage."""
        loss = self.engine.eval_batch(data_iter, reduce_output="avg", bcast_loss=True,
                                      num_micro_batches=num_micro_batches)
        return float(loss.item()) if torch.is_tensor(loss) else float(loss)

    def greedy_generate(self, prompts: list[list[int]] | None, *, num_prompts: int, micro_batch_size: int,
                        seq_len: int, max_new_tokens: int, eos_id: int) -> list[list[int]]:
        """Greedy continuations of ``num_prompts`` (<= micro_batch_size) prompts through the pipeline; the new token
        ids per prompt, the same on every rank.

        Each new token costs one eval forward of the whole micro-batch (no KV cache) at one width: the longest
        prompt plus ``max_new_tokens``, at most ``seq_len``. DeepSpeed's pipeline keeps the activation shape it
        first sent between stages, so the shape is reset before generating and again after (training's
        ``seq_len``). Prompts sit at the start of their row as one document (segment 0), the rest is padding
        (segment -1), and causal attention makes the logits at a row's last token independent of what follows.
        ``prompts``: on the data-reading stages (first and last), None elsewhere; world rank 0 (a first stage)
        broadcasts their lengths, the last stage of replica 0 (DeepSpeed's grid names its rank) its argmax tokens,
        so every replica and stage steps alike. A row stops at ``eos_id``, at ``max_new_tokens`` or at ``seq_len``.
        """
        import torch.distributed as dist

        device = self.engine.device
        src_rank = self.engine.grid.topology().get_rank(pipe=self.num_stages - 1, data=0)
        lengths = torch.zeros(num_prompts, dtype=torch.long, device=device)
        if prompts is not None:
            lengths[:] = torch.tensor([len(p) for p in prompts[:num_prompts]], dtype=torch.long)
        dist.broadcast(lengths, src=0)
        cur = lengths.tolist()
        ids = torch.zeros(micro_batch_size, min(seq_len, max(cur) + max_new_tokens), dtype=torch.long)
        pos = torch.zeros_like(ids)
        seg = torch.full_like(ids, PAD_SEGMENT_ID)
        for r, n in enumerate(cur):
            if prompts is not None:
                ids[r, :n] = torch.tensor(prompts[r], dtype=torch.long)
            pos[r, :n] = torch.arange(n)
            seg[r, :n] = 0
        labels = torch.full_like(ids, IGNORE_INDEX)  # no target: the loss is 0 and unused
        generated: list[list[int]] = [[] for _ in range(num_prompts)]
        done = [n >= seq_len for n in cur]
        self.engine.reset_activation_shape()
        try:
            for _ in range(max_new_tokens):
                if all(done):
                    break
                batch = ((ids.clone(), pos.clone(), seg.clone()), (labels, torch.tensor(0.0)))
                _, logits = self.engine.eval_batch(iter([batch]) if prompts is not None else None,
                                                   return_logits=True, bcast_loss=False, num_micro_batches=1)
                tokens = torch.zeros(num_prompts, dtype=torch.long, device=device)
                if self.stage == self.num_stages - 1:  # (micro_batch_size, width, vocab) on the last stage only
                    tokens[:] = torch.stack([logits[r, cur[r] - 1].argmax() for r in range(num_prompts)])
                dist.broadcast(tokens, src=src_rank)
                for r, token in enumerate(tokens.tolist()):
                    if done[r]:
                        continue
                    generated[r].append(token)
                    if token == eos_id or len(generated[r]) >= max_new_tokens or cur[r] >= seq_len:
                        done[r] = True
                        continue
                    ids[r, cur[r]], pos[r, cur[r]], seg[r, cur[r]] = token, cur[r], 0
                    cur[r] += 1
        finally:
            self.engine.reset_activation_shape()
        return generated

    def lr(self) -> float:
        return float(self.engine.get_lr()[0])

    def grad_norm(self) -> float | None:
        """Global 2-norm of the last step's gradients before clipping, over every stage (same on all ranks);
        None when DeepSpeed did not compute one (fp32 without gradient clipping)."""
        norm = self.engine.get_global_grad_norm()
        return None if norm is None else float(norm)

    def save(self, directory: str, client_state: dict[str, Any]) -> None:
        """Every rank writes its own layer and optimizer files under directory/ds/."""
        self.engine.save_checkpoint(directory, tag=DS_TAG, client_state=client_state, save_latest=False,
                                    exclude_frozen_parameters=self.adapters_only)

    def checkpoint_files(self, names: list[str]) -> tuple[list[str], list[str]]:
        """Which of a checkpoint's files (paths relative to the step dir, e.g. ``ds/layer_03-model_states.pt``)
        this rank's ``load`` opens, and which it only needs to see listed. Returns ``(opened, listed)``.

        Opened: its stage's layer files, its model-parallel rank's ``mp_rank_XX_model_states.pt`` and, with ZeRO,
        its own optimizer partition (every dp rank's with elastic checkpoints, which DeepSpeed then reads). Listed:
        the other ranks' ``mp_rank_XX_model_states.pt``, which DeepSpeed globs and counts; of those it opens only the
        first, for its ``mp_world_size`` (``write_stand_ins``). Files of a kind not named here are opened by every
        rank."""
        engine = self.engine
        mp = engine.checkpoint_mp_rank
        layers = range(engine.module._local_start, engine.module._local_stop)
        own_layer = tuple(f"{DS_TAG}/layer_{i:02d}-" for i in layers)
        dp_ranks = range(self.num_replicas) if engine.zero_elastic_checkpoint() else (self.dp_rank,)
        own_optim = tuple(f"zero_pp_rank_{dp}_mp_rank_{mp:02d}" for dp in dp_ranks)
        model_states = _model_states(names)
        opened, listed = [], []
        for rel in names:
            base = rel.rsplit("/", 1)[-1]
            if base.startswith("layer_") and base.endswith("model_states.pt"):
                keep = rel.startswith(own_layer)
            elif base.endswith("optim_states.pt"):
                keep = any(part in base for part in own_optim) if "zero_pp_rank_" in base \
                    else f"mp_rank_{mp:02d}" in base
            elif rel in model_states:
                keep = base == f"mp_rank_{mp:02d}_model_states.pt"
                if not keep:
                    listed.append(rel)
            else:
                keep = True
            if keep:
                opened.append(rel)
        return opened, listed

    @staticmethod
    def write_stand_ins(directory: str, listed: list[str], names: list[str]) -> None:
        """Stand-ins under ``directory`` for the ``listed`` files (``checkpoint_files``) a rank did not fetch.
        DeepSpeed's loader (``SDLoaderBase.check_ckpt_list``) opens the first ``mp_rank_XX_model_states.pt`` only to
        check ``mp_world_size`` against the count of such files; that one gets a file holding just that count, the
        others are empty (globbed, never opened)."""
        model_states = _model_states(names)
        for rel in listed:
            path = os.path.join(directory, *rel.split("/"))
            if rel == model_states[0]:
                torch.save({"mp_world_size": len(model_states)}, path)
            else:
                open(path, "wb").close()

    def load(self, directory: str) -> dict[str, Any]:
        """Load this rank's share of a checkpoint; returns its client state. With ``adapters_only`` the layer
        files hold only the adapters: every adapter must be in them, and the base keeps the weights it was built
        or loaded with."""
        path, client_state = self.engine.load_checkpoint(
            directory, tag=DS_TAG, load_optimizer_states=True, load_lr_scheduler_states=True,
            load_module_strict=not self.adapters_only)
        if path is None:
            raise FileNotFoundError(f"DeepSpeed found no checkpoint under {os.path.join(directory, DS_TAG)}")
        if self.adapters_only:
            self._check_adapters_loaded(os.path.join(directory, DS_TAG))
        return client_state or {}

    def _check_adapters_loaded(self, tag_dir: str) -> None:
        """DeepSpeed's non-strict load skips names it does not find: make sure each of this stage's layer files
        held exactly the layer's trainable parameters."""
        module = self.engine.module
        for offset, layer in enumerate(module.forward_funcs):
            if not hasattr(layer, "state_dict"):
                continue
            path = module.ckpt_layer_path_list(tag_dir, offset)[0]  # the file DeepSpeed's load just read
            saved = set(torch.load(path, map_location="cpu", weights_only=True))
            trainable = {n for n, p in layer.named_parameters() if p.requires_grad}
            if saved != trainable:
                raise RaytrainError(f"{path} holds {sorted(saved)[:4]}... but the layer trains "
                                    f"{sorted(trainable)[:4]}...: it was not written by a run with the same "
                                    "model.lora settings")


def keep_fp32_grad_norm(engine: Any) -> None:
    """Clip the fp32 path's gradients by their norm over every stage of the pipeline, and keep that norm for
    ``engine.get_global_grad_norm()``.

    DeepSpeed's bf16/fp16/ZeRO optimizers record the global norm they clip with. The plain fp32 path calls
    ``deepspeed.runtime.utils.clip_grad_norm_``, which counts only the parameters of model-parallel rank 0 (a rule
    for tensor-parallel copies) and the pipeline grid makes every stage after the first a model-parallel rank > 0:
    with pp > 1 it clipped all stages by the first stage's norm and dropped the value (measured: a pp=2 step
    reported 0.2489, the first stage's norm, against 0.2725 over both). Here each stage sums its own squared
    gradient norms, the sum is all-reduced over the stages of its pipeline (data-parallel replicas already hold
    averaged gradients), and every stage scales by max_norm / (norm + 1e-6) when that is below 1, as DeepSpeed's
    clipping does.
    """
    import torch.distributed as dist

    def clip_fp32_gradients() -> None:
        grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
        squares = torch.stack([g.detach().float().pow(2).sum() for g in grads]).sum() if grads \
            else torch.zeros((), device=engine.device)
        dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=engine.grid.get_model_parallel_group())
        norm = float(squares.sqrt())
        engine._global_grad_norm = norm
        coef = engine.gradient_clipping() / (norm + 1e-6)
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)

    engine.clip_fp32_gradients = clip_fp32_gradients


def optimizer_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """What the stage's optimizer holds: its trainable parameters. A LoRA stage whose layers hold no adapter (a
    partition that gives it only the final norm and the LM head, say) has none, and DeepSpeed cannot build an
    optimizer over nothing (DeepSpeed #5071, "optimizer got an empty parameter list"): the module gets a one-element
    placeholder parameter (``lora_placeholder``; ZeRO maps every optimized parameter to a module name, and the bf16
    optimizer needs a gradient to take a norm of), added times zero to the stage's first activations: its gradient
    is zero, so it never changes, and no layer file holds it. The stage still runs its forward and its backward,
    which carries the gradient to the stages before it."""
    params = [p for p in module.parameters() if p.requires_grad]
    if params:
        return params
    placeholder = torch.nn.Parameter(torch.zeros(1))
    module.register_parameter("lora_placeholder", placeholder)

    def touch(_layer: torch.nn.Module, _inputs: Any, output: Any) -> Any:
        if isinstance(output, tuple):
            return (output[0] + placeholder * 0, *output[1:])
        return output + placeholder * 0

    module.forward_funcs[0].register_forward_hook(touch)
    return [placeholder]


def init_distributed(backend: str) -> None:
    """Reuse the process group Ray Train created (gloo on CPU, nccl on GPU); DeepSpeed wraps it.

    DeepSpeed's shared-memory all-reduce op is left unbuilt: only its inference engine calls it, and on a CPU
    machine DeepSpeed would compile it (C++, 25-45 s) at the first launch, under a file lock that a worker killed
    mid-build leaves for every later launch to wait on. Marking the op incompatible in the dict DeepSpeed consults
    (``deepspeed.ops.__compatible_ops__``) makes its backend skip it; training's collectives go through the
    process group either way."""
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        deepspeed.ops.__compatible_ops__[builder.NAME] = False
    deepspeed.init_distributed(dist_backend=backend)


def build_stage_engine(model_cfg: MistralConfig, ds_config: dict[str, Any], *, pp: int, dp: int,
                       partition_method: str, activation_checkpoint_interval: int, seed: int,
                       init_from: str = "", attn_impl: str = "dense",
                       activation_checkpoint_reentrant: bool = False, lora: LoraConfig | None = None,
                       loss_fn: Any = None, start_weights: Callable[[PipelineModule], None] | None = None
                       ) -> StageEngine:
    """This process's stage in a DeepSpeed engine: built, loaded from ``init_from`` (a Hugging Face folder) when
    given, with LoRA adapters on a frozen base when ``lora.rank`` > 0 (only the adapters reach the optimizer).
    ``loss_fn``: the last stage's loss (``raytrain.pipeline.dpo.DpoLoss`` for preference training; None = the
    fine-tune's token loss). ``start_weights``: loads the stage's weights from elsewhere (another run's
    checkpoint: ``load_layer_files``) before the engine exists."""
    topology = PipeDataParallelTopology(num_pp=pp, num_dp=dp)
    module = build_pipeline_module(model_cfg, pp, topology=topology, partition_method=partition_method,
                                   activation_checkpoint_interval=activation_checkpoint_interval, seed=seed,
                                   attn_impl=attn_impl, activation_checkpoint_reentrant=activation_checkpoint_reentrant,
                                   **({"loss_fn": loss_fn} if loss_fn is not None else {}))
    if init_from:
        from raytrain.pipeline.hf_io import load_hf_into_stage

        load_hf_into_stage(module, init_from)
    if start_weights is not None:
        start_weights(module)
    if lora is not None and lora.rank > 0:
        from raytrain.pipeline.lora import add_adapters

        add_adapters(module, lora, seed)
    engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=optimizer_parameters(module),
                                           config=ds_config)
    keep_fp32_grad_norm(engine)
    return StageEngine.of(engine, adapters_only=lora is not None and lora.rank > 0)


def load_layer_files(module: PipelineModule, step_dir: str) -> None:
    """Load ``module``'s layers from a checkpoint's per-layer files under ``step_dir`` (DeepSpeed's pipeline writes
    one per layer, so any pp reads any other pp's checkpoint), strict: each file must hold exactly its layer's
    parameters."""
    from raytrain.pipeline.hf_io import load_layer_file

    for offset, layer in enumerate(module.forward_funcs):
        if hasattr(layer, "load_state_dict"):
            load_layer_file(layer, os.path.join(step_dir, DS_TAG), module._local_start + offset)


def _model_states(names: list[str]) -> list[str]:
    """The checkpoint's ``mp_rank_XX_model_states.pt`` files among ``names``, sorted (DeepSpeed's glob order)."""
    return sorted(rel for rel in names if rel.rsplit("/", 1)[-1].startswith("mp_rank_")
                  and rel.endswith("_model_states.pt"))
