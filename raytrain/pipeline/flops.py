"""Model FLOPs per token, MFU and the pipeline bubble: the numbers a training log reports next to tokens/s.

Formula (PaLM, Chowdhery et al. 2022, appendix B), for one token of a training step (forward + backward):

    flops_per_token = 6 * N + 12 * L * n_heads * head_dim * T_ctx

* ``N``: parameters that take part in a matmul per token: every parameter except the input embedding (a table
  lookup, no FLOPs). The LM head is included (it is a (H x V) matmul). RMSNorm weights are included too; they are
  a rounding error (2 * H per layer). 6 = 2 (multiply-add) x 3 (forward, and backward for inputs and weights).
* ``12 * L * n_heads * head_dim * T_ctx``: QK^T and AV scores, 2 matmuls x 2 FLOPs x 3 passes, where ``T_ctx`` is
  the number of keys a query sees: ``seq_len``, capped by the sliding window. Like PaLM we count the full square,
  not the causal half, so MFU figures are comparable with published ones.

Activation recomputation is not counted: MFU measures useful model FLOPs, not hardware FLOPs.
"""

from __future__ import annotations

from raytrain.errors import RaytrainError
from raytrain.pipeline.model import MistralConfig, layer_parameter_counts


def matmul_parameters(cfg: MistralConfig) -> int:
    """Parameters used in a matmul per token: all but the input embedding (pipeline layer 0)."""
    return sum(layer_parameter_counts(cfg)[1:])


def flops_per_token(cfg: MistralConfig, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token at sequence length ``seq_len`` (module docstring)."""
    if seq_len <= 0:
        raise RaytrainError(f"seq_len must be positive, got {seq_len}")
    context = seq_len if cfg.sliding_window is None else min(seq_len, cfg.sliding_window)
    assert cfg.head_dim is not None
    attention = 12.0 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * context
    return 6.0 * matmul_parameters(cfg) + attention


def mfu(tokens_per_s: float, cfg: MistralConfig, seq_len: int, peak_flops: float) -> float:
    """Model FLOPs utilisation in [0, 1]: achieved model FLOP/s over ``peak_flops`` (FLOP/s of all devices used).

    ``tokens_per_s`` is the training throughput of the same devices whose peak is given.
    """
    if peak_flops <= 0:
        raise RaytrainError(f"peak_flops must be positive (FLOP/s, e.g. 989e12 for one H100 bf16), got {peak_flops}")
    if tokens_per_s < 0:
        raise RaytrainError(f"tokens_per_s must be >= 0, got {tokens_per_s}")
    return tokens_per_s * flops_per_token(cfg, seq_len) / peak_flops


def pipeline_bubble_fraction(num_micro_batches: int, num_stages: int) -> float:
    """Idle fraction of a GPipe/1F1B schedule: (p - 1) / (m + p - 1) for m micro-batches and p stages."""
    if num_micro_batches < 1 or num_stages < 1:
        raise RaytrainError(f"num_micro_batches ({num_micro_batches}) and num_stages ({num_stages}) must be >= 1")
    return (num_stages - 1) / (num_micro_batches + num_stages - 1)


__all__ = ["matmul_parameters", "flops_per_token", "mfu", "pipeline_bubble_fraction"]
