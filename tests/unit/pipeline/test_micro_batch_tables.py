"""RoPE tables and attention masks are built once per micro-batch per stage, not once per decoder layer, and the
reuse changes no number."""

import pytest
import torch

import raytrain.pipeline.model as model
from raytrain.pipeline.model import MistralConfig, build_sequential


@pytest.mark.parametrize("impl", ["dense", "segment"])
def test_tables_are_built_once_per_micro_batch_and_outputs_are_unchanged(impl, monkeypatch):
    cfg = MistralConfig.preset("tiny-4l")
    net = build_sequential(cfg, seed=1, attn_impl=impl).eval()
    calls = {"rope": 0, "attention": 0}
    real_rope, real_prepare = model.rope_cos_sin, model.prepare_attention

    def rope(*args, **kwargs):
        calls["rope"] += 1
        return real_rope(*args, **kwargs)

    def prepare(*args, **kwargs):
        calls["attention"] += 1
        return real_prepare(*args, **kwargs)

    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(10), torch.arange(14)]).expand(2, 24)
    segments = torch.cat([torch.zeros(10, dtype=torch.long), torch.ones(14, dtype=torch.long)]).expand(2, 24)
    with torch.no_grad():
        reference = net((ids, positions.clone(), segments.clone()))  # before counting
        monkeypatch.setattr(model, "rope_cos_sin", rope)
        monkeypatch.setattr(model, "prepare_attention", prepare)
        first = net((ids, positions.clone(), segments.clone()))
        assert calls == {"rope": 1, "attention": 1}  # 4 decoder layers, one build each
        second = net((ids, positions.clone(), segments.clone()))  # the next micro-batch: fresh tensors, rebuilt
        assert calls == {"rope": 2, "attention": 2}
    torch.testing.assert_close(first, reference, rtol=0, atol=0)
    torch.testing.assert_close(second, reference, rtol=0, atol=0)


def test_a_different_micro_batch_never_sees_stale_tables():
    cfg = MistralConfig.preset("tiny-4l")
    net = build_sequential(cfg, seed=1, attn_impl="segment").eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))
    one_doc = (ids, torch.arange(16)[None], torch.zeros(1, 16, dtype=torch.long))
    two_docs = (ids, torch.cat([torch.arange(8), torch.arange(8)])[None],
                torch.cat([torch.zeros(8, dtype=torch.long), torch.ones(8, dtype=torch.long)])[None])
    with torch.no_grad():
        alone = build_sequential(cfg, seed=1, attn_impl="segment").eval()(two_docs)
        net(one_doc)
        torch.testing.assert_close(net(two_docs), alone, rtol=0, atol=0)
