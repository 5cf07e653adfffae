"""Attention over packed sequences: the one place the attention kernel is chosen.

A pack holds several documents in one row; ``segment_ids`` (B, T) names each token's document, padding is -1.
A query may attend to a key when it is causal (key <= query), in the same segment, and within the sliding window
(``query - key < sliding_window``, the query itself included, as in Hugging Face). Three implementations compute
exactly that:

* ``dense``: a (B, 1, T, T) boolean mask per call and K/V repeated for grouped-query attention -- the reference
  (what ``DecoderLayerPipe`` has always done, bit for bit). T^2 memory per layer, never a flash kernel.
* ``segment``: one SDPA call per contiguous segment of each row with ``is_causal=True`` and ``enable_gqa=True``,
  so CUDA can take its flash kernel and no (T, T) mask or repeated K/V exists. Exact, forward and backward, on
  CPU and GPU. Costs one host sync per call (segment boundaries) and one kernel launch per segment.
* ``flex``: FlexAttention with a ``BlockMask`` (document + causal + window) built once per micro-batch by
  :func:`flex_block_mask`; fully masked tiles are skipped. Forward only on CPU (torch raises on CPU backward);
  compiled on CUDA.

q is (B, nh, T, D); k and v are (B, nkv, T, D) with nkv dividing nh; every function returns (B, nh, T, D).
Segments are taken to be contiguous runs of equal ids (what the packer writes). ``dense`` also joins
non-contiguous runs of one id; the others treat each run as its own document.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

ATTENTION_IMPLS = ("dense", "segment", "flex")
"""The implementations; raytrain.config.ATTENTION_IMPLS (model.attn_impl) names the same (a test checks): this
module stays importable without the config's dependencies, for benchmarks/gpu_stage_mfu.py on a bare GPU box."""


def attention_mask(segment_ids: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """Boolean mask (B, 1, T, T), True = may attend: causal AND same segment AND within the sliding window.

    The window counts the query itself, as in Hugging Face (``kv_idx > q_idx - sliding_window``). Every query sees
    at least itself, so no row is fully masked (which would make softmax NaN).
    """
    seq_len = segment_ids.shape[1]
    idx = torch.arange(seq_len, device=segment_ids.device)
    allowed = idx[None, :] <= idx[:, None]  # (T, T) [query, key]
    if sliding_window is not None:
        allowed = allowed & (idx[:, None] - idx[None, :] < sliding_window)
    same_segment = segment_ids[:, :, None] == segment_ids[:, None, :]  # (B, T, T)
    return (same_segment & allowed)[:, None]  # (B, 1, T, T)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segment_ids: torch.Tensor,
                    sliding_window: int | None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: dense (B, 1, T, T) mask from ``attention_mask``, K/V repeated per query group, SDPA.

    In: q (B, nh, T, D), k and v (B, nkv, T, D), segment_ids (B, T) int, ``mask`` that mask when already built.
    Out: (B, nh, T, D).
    """
    if mask is None:
        mask = attention_mask(segment_ids, sliding_window)  # (B, 1, T, T)
    groups = q.shape[1] // k.shape[1]
    if groups > 1:  # repeat each kv head for its query group: (B, nkv, T, D) -> (B, nh, T, D)
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, nh, T, D)


def segment_bounds(segment_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """[start, end) of each contiguous run of equal ids, per row: one host sync for the whole batch.

    In: segment_ids (B, T). Out: B lists of (start, end) covering 0..T in order.
    """
    batch_size, seq_len = segment_ids.shape
    changes = segment_ids[:, 1:] != segment_ids[:, :-1]  # (B, T-1): True where a new run starts at t+1
    rows, cols = changes.nonzero(as_tuple=True)
    starts: list[list[int]] = [[0] for _ in range(batch_size)]
    for row, col in zip(rows.tolist(), cols.tolist(), strict=True):  # nonzero is row-major: starts come sorted
        starts[row].append(col + 1)
    return [list(zip(s, s[1:] + [seq_len], strict=True)) for s in starts]


def _band_mask(length: int, sliding_window: int, device: torch.device) -> torch.Tensor:
    """(L, L) bool, True = may attend: causal and ``query - key < sliding_window``."""
    idx = torch.arange(length, device=device)
    diff = idx[:, None] - idx[None, :]  # (L, L) query - key
    return (diff >= 0) & (diff < sliding_window)


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segment_ids: torch.Tensor,
                      sliding_window: int | None) -> torch.Tensor:
    """Exact packed attention by slicing: SDPA per contiguous segment of each row, no (T, T) mask.

    A segment no longer than the window (or with no window) is plain causal attention of its own tokens
    (``is_causal=True``, ``enable_gqa=True``: the flash kernel on CUDA in bf16/fp16). A longer one gets a banded
    causal mask of its own length only, with its K/V repeated per query group: CUDA's memory-efficient kernel takes
    a mask but not GQA, and SDPA would otherwise fall back to the math kernel (scores materialised).

    In: q (B, nh, T, D), k and v (B, nkv, T, D), segment_ids (B, T) int. Out: (B, nh, T, D).
    """
    return _attend_segments(q, k, v, segment_bounds(segment_ids), sliding_window)


def _attend_segments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds_per_row: list[list[tuple[int, int]]],
                     sliding_window: int | None) -> torch.Tensor:
    """segment_attention with the boundaries already computed (see segment_bounds)."""
    groups = q.shape[1] // k.shape[1]
    rows = []
    for b, bounds in enumerate(bounds_per_row):
        pieces = []
        for start, end in bounds:
            q_s = q[b:b + 1, :, start:end]  # (1, nh, L, D), a view
            k_s, v_s = k[b:b + 1, :, start:end], v[b:b + 1, :, start:end]  # (1, nkv, L, D)
            length = end - start
            if sliding_window is None or length <= sliding_window:
                out = F.scaled_dot_product_attention(q_s, k_s, v_s, is_causal=True, enable_gqa=True)
            else:
                if groups > 1:
                    k_s = k_s.repeat_interleave(groups, dim=1)  # (1, nh, L, D)
                    v_s = v_s.repeat_interleave(groups, dim=1)
                band = _band_mask(length, sliding_window, q.device)  # (L, L)
                out = F.scaled_dot_product_attention(q_s, k_s, v_s, attn_mask=band)
            pieces.append(out)  # (1, nh, L, D)
        rows.append(pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=2))  # (1, nh, T, D)
    return rows[0] if len(rows) == 1 else torch.cat(rows, dim=0)  # (B, nh, T, D)


def flex_block_mask(segment_ids: torch.Tensor, sliding_window: int | None) -> Any:
    """FlexAttention ``BlockMask`` for document + causal + sliding window, for every layer of one micro-batch.

    Build it once per micro-batch (it costs a pass over (B, T, T) in tiles) and pass it to every layer.
    In: segment_ids (B, T) int. Out: BlockMask with B = batch, H = None (shared by all heads).
    """
    from torch.nn.attention.flex_attention import create_block_mask

    batch_size, seq_len = segment_ids.shape

    def mask_mod(b, h, q_idx, kv_idx):  # scalars per (batch, head, query, key); True = may attend
        allowed = (segment_ids[b, q_idx] == segment_ids[b, kv_idx]) & (kv_idx <= q_idx)
        if sliding_window is not None:
            allowed = allowed & (q_idx - kv_idx < sliding_window)
        return allowed

    return create_block_mask(mask_mod, batch_size, None, seq_len, seq_len, device=segment_ids.device)


@functools.cache
def _compiled_flex() -> Callable[..., torch.Tensor]:
    # Compiled once per process, lazily: uncompiled flex_attention materialises the scores (no speed, no memory
    # saving), and importing dynamo at module import would slow every `import raytrain.pipeline.model`.
    from torch.nn.attention.flex_attention import flex_attention

    # dynamic=False: one static kernel per shape. With dynamic shapes (dynamo marks the sequence length dynamic after
    # a second shape) torch 2.11 failed to lower flex decoding for short sequences (NoValidChoicesError, seen on H200).
    return torch.compile(flex_attention, dynamic=False)


def flex_attention_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Any) -> torch.Tensor:
    """FlexAttention under ``block_mask`` (from :func:`flex_block_mask`), GQA without repeating K/V.

    Compiled on CUDA; eager elsewhere (CPU: forward only, inputs must not require grad -- torch raises otherwise).
    In: q (B, nh, T, D), k and v (B, nkv, T, D). Out: (B, nh, T, D).
    """
    if q.is_cuda:
        return _compiled_flex()(q, k, v, block_mask=block_mask, enable_gqa=True)
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)


def is_single_document(segment_ids: torch.Tensor, sliding_window: int | None) -> bool:
    """True when every row is one segment and the window cuts nothing: plain causal attention (one host sync)."""
    seq_len = segment_ids.shape[1]
    if sliding_window is not None and seq_len > sliding_window:
        return False
    return bool((segment_ids == segment_ids[:, :1]).all())


CAUSAL = "causal"
"""``prepare_attention``'s answer when every row is one document the window does not cut: SDPA's causal path."""


def prepare_attention(segment_ids: torch.Tensor, sliding_window: int | None, impl: str) -> Any:
    """What ``packed_attention`` needs besides q, k, v, derived from the segment ids once per micro-batch (every
    decoder layer of a stage reuses it, raytrain.pipeline.model): "dense" the (B, 1, T, T) mask; "segment" each
    row's segment bounds; "flex" a BlockMask; ``CAUSAL`` for "segment" and "flex" when every row is one document
    the window does not cut."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}; choose one of {list(ATTENTION_IMPLS)}")
    if impl == "dense":
        return attention_mask(segment_ids, sliding_window)
    if impl == "segment":
        window_cuts = sliding_window is not None and segment_ids.shape[1] > sliding_window
        bounds = segment_bounds(segment_ids)  # the one host sync
        return CAUSAL if not window_cuts and all(len(row) == 1 for row in bounds) else bounds
    return CAUSAL if is_single_document(segment_ids, sliding_window) else flex_block_mask(segment_ids, sliding_window)


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segment_ids: torch.Tensor,
                     sliding_window: int | None, impl: str = "dense", prepared: Any = None) -> torch.Tensor:
    """Attention of a packed batch with the implementation ``impl`` ("dense" | "segment" | "flex").

    "dense" is always the reference path. ``prepared``: ``prepare_attention``'s result for these segment ids (for
    "flex" a BlockMask from ``flex_block_mask`` also works); built here when not given.
    In: q (B, nh, T, D), k and v (B, nkv, T, D), segment_ids (B, T). Out: (B, nh, T, D).
    """
    if prepared is None:
        prepared = prepare_attention(segment_ids, sliding_window, impl)
    if impl == "dense":
        return dense_attention(q, k, v, segment_ids, sliding_window, mask=prepared)
    if isinstance(prepared, str) and prepared == CAUSAL:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    if impl == "segment":
        return _attend_segments(q, k, v, prepared, sliding_window)
    return flex_attention_packed(q, k, v, prepared)


__all__ = [
    "ATTENTION_IMPLS", "dense_attention", "segment_bounds", "segment_attention", "flex_block_mask",
    "flex_attention_packed", "is_single_document", "packed_attention", "prepare_attention", "CAUSAL",
]
