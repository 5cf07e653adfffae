"""Direct preference optimization (DPO) on packed sequences: the log-probability of each response, the pair losses
and the metrics, with TRL's formulas and metric names (tests/unit/pipeline/test_dpo.py checks them against TRL's
DPOTrainer on transformers' MistralForCausalLM).

A pair is two segments of one packed row, ``prompt + chosen`` and ``prompt + rejected``, whose labels hold the
response tokens only (the prompt's are -100): ``pair_logps`` sums each segment's target log-probabilities, so
many pairs fit one sequence and document masking keeps them apart. The reference log-probabilities come in as
numbers computed once before training; the policy's are recomputed every step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from raytrain.config import DpoConfig
from raytrain.dataset.labels import IGNORE_INDEX, PAD_SEGMENT_ID
from raytrain.pipeline.model import LOSS_CHUNK_TOKENS, causal_lm_loss, over_chunks


def _chunk_token_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return -F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="none")


def token_logps(logits: torch.Tensor, labels: torch.Tensor, chunk_tokens: int = LOSS_CHUNK_TOKENS,
                recompute: bool | None = None) -> torch.Tensor:
    """fp32 log-probability of each target token, 0 where the label is -100: (B, T, V), (B, T) -> (B, T).

    As ``model.causal_lm_loss``, the logits are upcast ``chunk_tokens`` at a time (``model.over_chunks``)."""
    batch_size, seq_len, vocab_size = logits.shape
    flat_logits = logits.reshape(-1, vocab_size)
    flat_labels = labels.reshape(-1).to(flat_logits.device)
    chunks = over_chunks(_chunk_token_logps, flat_logits, flat_labels, chunk_tokens, recompute)
    return (chunks[0] if len(chunks) == 1 else torch.cat(chunks)).view(batch_size, seq_len)


def segment_sums(values: torch.Tensor, segment_ids: torch.Tensor, num_segments: int) -> torch.Tensor:
    """Sum of ``values`` (B, T) over each segment of each row: (B, num_segments). Padding (segment id -1) and
    segments past ``num_segments`` are not counted."""
    batch_size = values.shape[0]
    segment_ids = segment_ids.to(values.device)
    keep = (segment_ids != PAD_SEGMENT_ID) & (segment_ids < num_segments)
    index = torch.where(keep, segment_ids, 0) + num_segments * torch.arange(batch_size, device=values.device)[:, None]
    out = values.new_zeros(batch_size * num_segments)
    out = out.index_add(0, index.reshape(-1), torch.where(keep, values, 0).reshape(-1))
    return out.view(batch_size, num_segments)


@dataclass
class PairLosses:
    """Per pair (P,): the loss and the implicit rewards beta * (policy - reference) log-prob of each response."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def pair_losses(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, ref_chosen_logps: torch.Tensor,
                ref_rejected_logps: torch.Tensor, settings: DpoConfig, *,
                chosen_tokens: torch.Tensor | None = None, rejected_tokens: torch.Tensor | None = None) -> PairLosses:
    """The pair loss of ``settings.loss`` for P pairs of summed response log-probabilities (each (P,)).

    ``chosen_tokens`` / ``rejected_tokens`` (P,): the responses' target-token counts, which the ipo loss divides
    the log ratios by (as TRL does); the other losses do not need them."""
    chosen_ratio = chosen_logps - ref_chosen_logps.to(chosen_logps)
    rejected_ratio = rejected_logps - ref_rejected_logps.to(rejected_logps)
    beta = settings.beta
    if settings.loss == "sigmoid":
        losses = -F.logsigmoid(beta * (chosen_ratio - rejected_ratio))
    elif settings.loss == "robust":
        eps, delta = settings.label_smoothing, beta * (chosen_ratio - rejected_ratio)
        losses = (-(1 - eps) * F.logsigmoid(delta) + eps * F.logsigmoid(-delta)) / (1 - 2 * eps)
    else:  # ipo
        if chosen_tokens is None or rejected_tokens is None:
            raise ValueError("the ipo loss needs chosen_tokens and rejected_tokens")
        per_token = (chosen_ratio / chosen_tokens.to(chosen_ratio).clamp(min=1)
                     - rejected_ratio / rejected_tokens.to(rejected_ratio).clamp(min=1))
        losses = (per_token - 1 / (2 * beta)) ** 2
    return PairLosses(losses=losses, chosen_rewards=beta * chosen_ratio.detach(),
                      rejected_rewards=beta * rejected_ratio.detach())


METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")
"""TRL's DPO metric names, each a mean over the pairs."""


def pair_metric_sums(pairs: PairLosses, chosen_logps: torch.Tensor, rejected_logps: torch.Tensor
                     ) -> dict[str, float]:
    """Sums over the pairs of each of METRICS (divide by the number of pairs for TRL's means): sums add up across
    micro-batches and replicas, means do not."""
    chosen, rejected = pairs.chosen_rewards.float(), pairs.rejected_rewards.float()
    return {
        "rewards/chosen": chosen.sum().item(),
        "rewards/rejected": rejected.sum().item(),
        "rewards/accuracies": (chosen > rejected).float().sum().item(),
        "rewards/margins": (chosen - rejected).sum().item(),
        "logps/chosen": chosen_logps.detach().float().sum().item(),
        "logps/rejected": rejected_logps.detach().float().sum().item(),
    }


@dataclass
class PackedPairs:
    """The pairs of a micro-batch of packed rows, beside the rows' labels."""

    labels: torch.Tensor
    """(B, T) next-token targets: the responses' tokens, -100 elsewhere (prompts, padding)."""
    segment_ids: torch.Tensor
    """(B, T) segment of each position, -1 on padding."""
    pair_segments: torch.Tensor
    """(B, P, 2) int64: the segments holding a pair's chosen and rejected sequence, -1 -1 for an empty slot."""
    ref_logps: torch.Tensor
    """(B, P, 2) fp32: the reference model's summed response log-probabilities of the same segments."""


def pair_logps(logits: torch.Tensor, labels: torch.Tensor, segment_ids: torch.Tensor, pair_segments: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each pair's summed response log-probabilities and response token counts, both (B, P, 2) [chosen, rejected];
    0 for empty slots. The reference pass stores the first; the loss recomputes it for the policy."""
    labels = labels.to(logits.device)
    pair_segments = pair_segments.to(logits.device)
    num_segments = max(int(pair_segments.max().item()) + 1, 1)
    per_token = token_logps(logits, labels)  # (B, T)
    per_segment = segment_sums(per_token, segment_ids, num_segments)  # (B, S)
    tokens = segment_sums((labels != IGNORE_INDEX).to(per_token.dtype), segment_ids, num_segments)
    empty = pair_segments < 0  # (B, P, 2)
    index = pair_segments.clamp(min=0).reshape(pair_segments.shape[0], -1)  # (B, P*2)
    gathered = [torch.gather(values, 1, index).view(pair_segments.shape).masked_fill(empty, 0)
                for values in (per_segment, tokens)]
    return gathered[0], gathered[1]


def micro_batch_loss(logits: torch.Tensor, pairs: PackedPairs, settings: DpoConfig, *,
                     pair_scale: float | torch.Tensor, sft_scale: float | torch.Tensor = 0.0
                     ) -> tuple[torch.Tensor, dict[str, float]]:
    """The DPO loss of one micro-batch: the sum of its pair losses times ``pair_scale``, plus ``sft_weight`` times
    the chosen responses' summed token NLL times ``sft_scale``; and the sums of METRICS over its pairs (with
    ``pairs`` and ``tokens``, the counts to divide by).

    With ``pair_scale = 1 / pairs of the batch`` and ``sft_scale = 1 / chosen tokens of the batch`` this is TRL's
    loss of the batch; the training feed sets them from the global batch so that DeepSpeed's accumulation and dp
    averaging give the mean over the global batch's pairs."""
    logps, tokens = pair_logps(logits, pairs.labels, pairs.segment_ids, pairs.pair_segments)  # (B, P, 2)
    valid = (pairs.pair_segments[..., 0] >= 0).to(logits.device)  # (B, P)
    chosen_logps, rejected_logps = logps[valid].unbind(-1)
    chosen_tokens, rejected_tokens = tokens[valid].unbind(-1)
    ref = pairs.ref_logps.to(logits.device, torch.float32)[valid]  # (P_valid, 2)
    result = pair_losses(chosen_logps, rejected_logps, ref[:, 0], ref[:, 1], settings,
                         chosen_tokens=chosen_tokens, rejected_tokens=rejected_tokens)
    loss = result.losses.sum() * pair_scale
    if settings.sft_weight:
        loss = loss - settings.sft_weight * chosen_logps.sum() * sft_scale
    sums = pair_metric_sums(result, chosen_logps, rejected_logps)
    sums["pairs"] = float(chosen_logps.shape[0])
    sums["tokens/chosen"] = chosen_tokens.sum().item()
    return loss, sums


class DpoLoss:
    """The pipeline's loss function for DPO (``build_pipeline_module(loss_fn=DpoLoss(settings))``), on the last stage.

    A micro-batch's labels are ``(labels, segment_ids, pair_segments, ref_logps, scales)`` as
    ``raytrain.trainer.feed.to_pair_micro_batch`` makes them, ``scales`` = [pair_scale, sft_scale]. Each call adds
    its micro-batch's metric sums to ``sums``; ``take_sums`` hands them over (and starts again) after a training
    step or an evaluation, for the loop to add up over dp and report as means. ``recording`` turns it into the
    reference pass."""

    def __init__(self, settings: DpoConfig) -> None:
        self.settings = settings
        self.sums: dict[str, float] = {}
        self.recorded: list[torch.Tensor] | None = None

    def __call__(self, logits: torch.Tensor, labels: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if len(labels) == 2:  # a fine-tune micro-batch (labels, loss_scale): the generations' forwards send them
            return causal_lm_loss(logits, labels)
        targets, segment_ids, pair_segments, ref_logps, scales = labels
        if self.recorded is not None:  # the reference pass: keep each micro-batch's pair log-probabilities
            logps, _ = pair_logps(logits, targets, segment_ids, pair_segments)
            self.recorded.append(logps.detach().float().cpu())
            return logps.new_zeros(())
        loss, sums = micro_batch_loss(logits, PackedPairs(targets, segment_ids, pair_segments, ref_logps),
                                      self.settings, pair_scale=scales[0].to(logits.device),
                                      sft_scale=scales[1].to(logits.device))
        for name, value in sums.items():
            self.sums[name] = self.sums.get(name, 0.0) + value
        return loss

    def take_sums(self) -> dict[str, float]:
        sums, self.sums = self.sums, {}
        return sums

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[torch.Tensor]]:
        """The reference pass: inside, each micro-batch the stage evaluates appends its (B, P, 2) pair
        log-probabilities (chosen, rejected; 0 for empty slots) to the yielded list, in order, and its loss is 0.
        Run it with the starting weights (for a LoRA run, under ``lora.adapters_disabled``)."""
        self.recorded = []
        try:
            yield self.recorded
        finally:
            self.recorded = None
