"""raytrain.pipeline.attention: segment and flex attention against the dense reference (fp32, tiny shapes).

The dense path is what DecoderLayerPipe has always computed, and test_pipeline_model.py ties it to transformers'
MistralForCausalLM, so equality with dense chains every implementation to the reference.
"""

import dataclasses

import pytest
import torch

from raytrain.errors import ConfigError
from raytrain.pipeline.attention import (
    ATTENTION_IMPLS,
    dense_attention,
    flex_attention_packed,
    flex_block_mask,
    packed_attention,
    segment_attention,
    segment_bounds,
)
from raytrain.pipeline.model import DecoderLayerPipe, MistralConfig, build_sequential, layer_constructors

TOL = dict(rtol=1e-5, atol=1e-5)
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 16


def _segments(*rows: list[tuple[int, int]]) -> torch.Tensor:
    """Rows of (segment_id, length) runs -> segment_ids (B, T)."""
    return torch.stack([torch.cat([torch.full((n,), s) for s, n in row]) for row in rows]).long()


# name -> (segment_ids (B, T), sliding_window)
CASES = {
    "one_document": (_segments([(0, 64)], [(0, 64)]), None),
    "several_documents": (_segments([(0, 10), (1, 30), (2, 24)], [(0, 50), (1, 1), (2, 13)]), None),
    "longer_than_window": (_segments([(0, 40), (1, 24)], [(0, 8), (1, 40), (2, 16)]), 16),
    "padding": (_segments([(0, 20), (1, 30), (-1, 14)], [(0, 60), (-1, 4)]), 32),
    # 128, not 96: torch 2.11's compiled flex found no kernel for a 96-token fp32 sequence on the H200
    # (NoValidChoicesError while lowering), a kernel-selection limit unrelated to the mask
    "window_cuts_single_document": (_segments([(0, 128)], [(0, 128)]), 16),
}


def _qkv(batch_size: int, seq_len: int, seed: int = 0, device: str = "cpu", requires_grad: bool = True):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch_size, NUM_HEADS, seq_len, HEAD_DIM, generator=generator)  # (B, nh, T, D)
    k = torch.randn(batch_size, NUM_KV_HEADS, seq_len, HEAD_DIM, generator=generator)  # (B, nkv, T, D)
    v = torch.randn(batch_size, NUM_KV_HEADS, seq_len, HEAD_DIM, generator=generator)
    return [t.to(device).requires_grad_(requires_grad) for t in (q, k, v)]


def _output_and_grads(fn, q, k, v):
    out = fn(q, k, v)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(9)).to(out.device)
    q_grad, k_grad, v_grad = torch.autograd.grad(out, (q, k, v), grad_out)
    return out, q_grad, k_grad, v_grad


def test_the_config_offers_exactly_these_implementations():
    from raytrain import config

    assert config.ATTENTION_IMPLS == ATTENTION_IMPLS


def test_segment_bounds_are_contiguous_runs():
    segment_ids = _segments([(0, 3), (1, 2), (-1, 2)], [(5, 7)])
    assert segment_bounds(segment_ids) == [[(0, 3), (3, 5), (5, 7)], [(0, 7)]]


@pytest.mark.parametrize("case", sorted(CASES))
def test_segment_equals_dense_forward_and_gradients(case):
    segment_ids, window = CASES[case]
    q, k, v = _qkv(*segment_ids.shape)
    expected = _output_and_grads(lambda q, k, v: dense_attention(q, k, v, segment_ids, window), q, k, v)
    for impl in ("segment", "packed"):  # packed_attention adds the single-document shortcut
        def fn(q, k, v, impl=impl):
            if impl == "segment":
                return segment_attention(q, k, v, segment_ids, window)
            return packed_attention(q, k, v, segment_ids, window, impl="segment")

        for name, got, want in zip(("out", "dq", "dk", "dv"), _output_and_grads(fn, q, k, v), expected, strict=True):
            torch.testing.assert_close(got, want, **TOL, msg=lambda m, name=name, impl=impl: f"{impl} {name}: {m}")


def test_dense_mask_really_differs_between_cases():
    """Guards the parity tests: documents and the window must change the result, or equality proves nothing."""
    segment_ids, _ = CASES["several_documents"]
    q, k, v = _qkv(*segment_ids.shape, requires_grad=False)
    one_doc = dense_attention(q, k, v, torch.zeros_like(segment_ids), None)
    assert (dense_attention(q, k, v, segment_ids, None) - one_doc).abs().max() > 1e-2
    assert (dense_attention(q, k, v, torch.zeros_like(segment_ids), 16) - one_doc).abs().max() > 1e-2


@pytest.mark.parametrize("case", sorted(CASES))
def test_flex_equals_dense_forward(case):
    segment_ids, window = CASES[case]
    q, k, v = _qkv(*segment_ids.shape, requires_grad=False)  # CPU flex has no backward: torch raises on grad
    expected = dense_attention(q, k, v, segment_ids, window)
    block_mask = flex_block_mask(segment_ids, window)
    torch.testing.assert_close(flex_attention_packed(q, k, v, block_mask), expected, **TOL)
    torch.testing.assert_close(packed_attention(q, k, v, segment_ids, window, "flex", block_mask), expected, **TOL)
    torch.testing.assert_close(packed_attention(q, k, v, segment_ids, window, "flex"), expected, **TOL)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention has no backward on CPU")
@pytest.mark.parametrize("case", sorted(CASES))
def test_flex_equals_dense_gradients_on_gpu(case):
    segment_ids, window = CASES[case]
    segment_ids = segment_ids.cuda()
    q, k, v = _qkv(*segment_ids.shape, device="cuda")
    block_mask = flex_block_mask(segment_ids, window)
    expected = _output_and_grads(lambda q, k, v: dense_attention(q, k, v, segment_ids, window), q, k, v)
    got = _output_and_grads(lambda q, k, v: flex_attention_packed(q, k, v, block_mask), q, k, v)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, expected, strict=True):
        # GPU kernels may use TF32-like accumulation orders; 1e-4 still catches any masking error (O(1e-1)).
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=lambda m, name=name: f"{name}: {m}")


def test_unknown_impl_is_an_error():
    segment_ids, window = CASES["one_document"]
    q, k, v = _qkv(*segment_ids.shape, requires_grad=False)
    with pytest.raises(ValueError, match="unknown attention impl"):
        packed_attention(q, k, v, segment_ids, window, impl="flash")
    with pytest.raises(ConfigError, match="attn_impl"):
        DecoderLayerPipe(MistralConfig.preset("tiny"), 0, attn_impl="flash")


def _tiny_cfg(window: int | None) -> MistralConfig:
    cfg = MistralConfig.preset("tiny")  # 4 heads, 2 kv heads, head_dim 16
    return dataclasses.replace(cfg, sliding_window=window)


def _layer_inputs(segment_ids: torch.Tensor, hidden_size: int):
    """hidden (B, T, H) requiring grad, position ids restarting at every segment, the segment ids."""
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    idx = torch.arange(segment_ids.shape[1]).expand_as(segment_ids)
    last_start = torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), dim=1).values
    position_ids = idx - last_start  # (B, T)
    generator = torch.Generator().manual_seed(5)
    hidden = torch.randn(*segment_ids.shape, hidden_size, generator=generator, requires_grad=True)
    return hidden, position_ids, segment_ids


@pytest.mark.parametrize("case", sorted(CASES))
def test_decoder_layer_segment_equals_dense_with_weight_gradients(case):
    segment_ids, window = CASES[case]
    cfg = _tiny_cfg(window)
    dense, segment = DecoderLayerPipe(cfg, 0, seed=3), DecoderLayerPipe(cfg, 0, seed=3, attn_impl="segment")
    assert dense.attn_impl == "dense"
    hidden, position_ids, segment_ids = _layer_inputs(segment_ids, cfg.hidden_size)
    results = []
    for layer in (dense, segment):
        out = layer((hidden, position_ids, segment_ids))[0]
        loss = (out ** 2).mean()
        grads = torch.autograd.grad(loss, [hidden, *layer.parameters()])
        results.append((out, grads))
    torch.testing.assert_close(results[1][0], results[0][0], **TOL)
    names = ["hidden"] + [n for n, _ in dense.named_parameters()]
    for name, got, want in zip(names, results[1][1], results[0][1], strict=True):
        torch.testing.assert_close(got, want, **TOL, msg=lambda m, name=name: f"grad {name}: {m}")


@pytest.mark.parametrize("case", ["several_documents", "padding"])
def test_decoder_layer_flex_equals_dense_forward(case):
    segment_ids, window = CASES[case]
    cfg = _tiny_cfg(window)
    dense, flex = DecoderLayerPipe(cfg, 0, seed=3), DecoderLayerPipe(cfg, 0, seed=3, attn_impl="flex")
    hidden, position_ids, segment_ids = _layer_inputs(segment_ids, cfg.hidden_size)
    block_mask = flex_block_mask(segment_ids, window)
    with torch.no_grad():
        expected = dense((hidden, position_ids, segment_ids))[0]
        got = flex((hidden, position_ids, segment_ids), block_mask=block_mask)[0]
    torch.testing.assert_close(got, expected, **TOL)


@pytest.mark.parametrize("case", ["several_documents", "longer_than_window", "padding"])
def test_whole_model_segment_logits_equal_dense(case):
    segment_ids, window = CASES[case]
    cfg = _tiny_cfg(window)
    dense = build_sequential(cfg, seed=11).eval()
    segment = torch.nn.Sequential(*[
        cls(*args, **({**kwargs, "attn_impl": "segment"} if cls is DecoderLayerPipe else kwargs))
        for cls, args, kwargs in layer_constructors(cfg, seed=11)]).eval()
    assert sum(isinstance(layer, DecoderLayerPipe) and layer.attn_impl == "segment" for layer in segment) == 2
    _, position_ids, segment_ids = _layer_inputs(segment_ids, cfg.hidden_size)
    input_ids = torch.randint(0, cfg.vocab_size, segment_ids.shape, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        expected = dense((input_ids, position_ids, segment_ids))
        got = segment((input_ids, position_ids, segment_ids))
    torch.testing.assert_close(got, expected, **TOL)
