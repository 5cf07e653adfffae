"""The plain-torch Mistral layers against transformers' MistralForCausalLM (eager attention, fp32)."""

import dataclasses

import pytest
import torch
import transformers
from fresh_imports import loaded_by
from mistral_reference import hf_model, ours_from_hf

from raytrain.errors import ConfigError, RaytrainError
from raytrain.pipeline.model import (
    DecoderLayerPipe,
    MistralConfig,
    build_sequential,
    causal_lm_loss,
    hf_prefix,
    layer_parameter_counts,
)


def shift_hf_labels(labels: torch.Tensor) -> torch.Tensor:
    """HF shifts inside the loss; our packer hands over next-token targets aligned with positions."""
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)


def single_doc_inputs(input_ids: torch.Tensor):
    batch_size, seq_len = input_ids.shape
    position_ids = torch.arange(seq_len).expand(batch_size, seq_len)
    return input_ids, position_ids, torch.zeros_like(input_ids)


def test_mistral_7b_parameter_count_matches_transformers():
    cfg = MistralConfig.preset("mistral-7b")
    with torch.device("meta"):
        reference = transformers.MistralForCausalLM(cfg.to_hf())
    hf_count = sum(p.numel() for p in reference.parameters())
    assert sum(layer_parameter_counts(cfg)) == hf_count
    assert hf_count == 7_241_732_096  # Mistral-7B-v0.1 built on meta with transformers 5.24 (docs/decisions.md)


def test_hf_names_cover_transformers_state_dict_exactly():
    cfg = MistralConfig.preset("tiny")
    with torch.device("meta"):
        seq = build_sequential(cfg)
        reference = transformers.MistralForCausalLM(cfg.to_hf())
    ours = {hf_prefix(i, cfg) + n: tuple(p.shape) for i, layer in enumerate(seq) for n, p in layer.named_parameters()}
    theirs = {n: tuple(p.shape) for n, p in reference.named_parameters()}
    assert ours == theirs


def test_config_validation_names_the_field():
    base = MistralConfig.preset("tiny")
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        dataclasses.replace(base, num_key_value_heads=3)
    with pytest.raises(ConfigError, match="tie_word_embeddings"):
        dataclasses.replace(base, tie_word_embeddings=True)
    with pytest.raises(ConfigError, match="sliding_window"):
        dataclasses.replace(base, sliding_window=0)
    with pytest.raises(ConfigError, match="unknown model preset"):
        MistralConfig.preset("mistral-8x7b")
    with pytest.raises(ConfigError, match="hidden_sizee"):
        MistralConfig.from_dict({**base.to_dict(), "hidden_sizee": 1})
    assert MistralConfig.from_dict(base.to_dict()) == base
    assert base.head_dim == 16
    with pytest.raises(RaytrainError, match="out of range"):
        hf_prefix(base.num_hidden_layers + 3, base)


def test_to_hf_matches_transformers_fields():
    cfg = MistralConfig.preset("mistral-7b")
    hf = cfg.to_hf()
    reference = transformers.MistralConfig()  # transformers' defaults are Mistral-7B-v0.1
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "sliding_window", "tie_word_embeddings", "hidden_act"):
        assert getattr(hf, field) == getattr(reference, field), field
    assert hf.rope_parameters["rope_theta"] == 10000.0


def test_seeded_init_is_deterministic_and_independent_of_layout():
    cfg = MistralConfig.preset("tiny")
    a, b, c = build_sequential(cfg, seed=7), build_sequential(cfg, seed=7), build_sequential(cfg, seed=8)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        if not name.endswith("layernorm.weight") and name != f"{cfg.num_hidden_layers + 1}.weight":
            assert not torch.equal(pa, pc), name
    alone = DecoderLayerPipe(cfg, 1, seed=7)  # built on its own, as on a pipeline stage
    for pa, pb in zip(alone.parameters(), a[2].parameters(), strict=True):
        assert torch.equal(pa, pb)
    # Same statistics as HF's init: N(0, initializer_range) for matmul weights.
    assert abs(a[0].weight.std().item() - cfg.initializer_range) < 1e-3


@pytest.mark.parametrize("sliding_window", [None, 4])
def test_loss_and_logits_match_transformers(sliding_window):
    cfg = dataclasses.replace(MistralConfig.preset("tiny"), sliding_window=sliding_window)
    hf = hf_model(cfg)
    ours = ours_from_hf(cfg, hf)
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=generator)
    labels = input_ids.clone()
    labels[0, :5] = -100  # a masked prompt
    with torch.no_grad():
        reference = hf(input_ids=input_ids, labels=labels)
        logits = ours(single_doc_inputs(input_ids))
    torch.testing.assert_close(logits, reference.logits, rtol=1e-5, atol=1e-5)
    loss = causal_lm_loss(logits, shift_hf_labels(labels))
    torch.testing.assert_close(loss, reference.loss, rtol=1e-5, atol=0.0)


def test_sliding_window_changes_the_result():
    """Guards the parity test above: with seq 16 a window of 4 must actually mask something."""
    cfg = MistralConfig.preset("tiny")
    full = ours_from_hf(dataclasses.replace(cfg, sliding_window=None), hf_model(cfg))
    windowed = ours_from_hf(dataclasses.replace(cfg, sliding_window=4), hf_model(cfg))
    inputs = single_doc_inputs(torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(2)))
    with torch.no_grad():
        a, b = full(inputs), windowed(inputs)
    torch.testing.assert_close(a[:, :4], b[:, :4], rtol=1e-5, atol=1e-5)  # the first 4 queries see <= 4 keys
    assert (a[:, 4:] - b[:, 4:]).abs().max() > 1e-3


def test_segment_ids_isolate_packed_documents():
    cfg = MistralConfig.preset("tiny")
    hf = hf_model(cfg)
    ours = ours_from_hf(cfg, hf)
    generator = torch.Generator().manual_seed(3)
    doc1 = torch.randint(0, cfg.vocab_size, (5,), generator=generator)
    doc2 = torch.randint(0, cfg.vocab_size, (7,), generator=generator)
    packed_ids = torch.cat([doc1, doc2])[None]  # (1, 12)
    position_ids = torch.cat([torch.arange(5), torch.arange(7)])[None]
    segment_ids = torch.cat([torch.zeros(5), torch.ones(7)]).long()[None]
    with torch.no_grad():
        packed = ours((packed_ids, position_ids, segment_ids))
        alone = ours(single_doc_inputs(doc2[None]))
        reference_doc1 = hf(input_ids=doc1[None]).logits
        reference_doc2 = hf(input_ids=doc2[None]).logits
        leaky = ours((packed_ids, position_ids, torch.zeros_like(segment_ids)))  # no segment boundary
    torch.testing.assert_close(packed[:, 5:], alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed[:, 5:], reference_doc2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed[:, :5], reference_doc1, rtol=1e-5, atol=1e-5)
    assert (leaky[:, 5:] - reference_doc2).abs().max() > 1e-3


def test_causal_lm_loss_matches_torch_cross_entropy_and_ignores_minus_100():
    generator = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 6, 11, generator=generator)
    labels = torch.randint(0, 11, (2, 6), generator=generator)
    labels[1, 3:] = -100
    keep = labels != -100
    expected = torch.nn.functional.cross_entropy(logits[keep], labels[keep])
    torch.testing.assert_close(causal_lm_loss(logits, labels), expected)
    assert causal_lm_loss(logits.bfloat16(), labels).dtype == torch.float32
    assert causal_lm_loss(logits, torch.full_like(labels, -100)).item() == 0.0


def test_model_module_does_not_import_deepspeed():
    """Only raytrain/pipeline's module.py and hf_io.py may pull in DeepSpeed; the model math stays plain torch."""
    assert loaded_by(["raytrain.pipeline.model", "raytrain.pipeline.flops"], ["deepspeed"]) == []
