"""benchmarks/gpu_stage_mfu.py on a CPU machine: it parses, counts FLOPs like raytrain.pipeline.flops, and exits
cleanly without CUDA."""

import importlib.util
import os

import pytest
import torch
import transformers

from raytrain.pipeline.flops import flops_per_token
from raytrain.pipeline.model import MistralConfig

BENCHMARK = os.path.join(os.path.dirname(__file__), "..", "..", "..", "benchmarks", "gpu_stage_mfu.py")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("gpu_stage_mfu", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_stage_flops_agree_with_raytrain_flops(bench):
    cfg = MistralConfig.preset("mistral-7b")
    hf_cfg = transformers.MistralConfig()
    with torch.device("meta"):
        layer = transformers.models.mistral.modeling_mistral.MistralDecoderLayer(hf_cfg, 0)
    per_layer = sum(p.numel() for p in layer.parameters())
    whole_stack = bench.stage_flops_per_token(hf_cfg, 32, 4096, per_layer)
    head_and_norm = 6.0 * (cfg.vocab_size * cfg.hidden_size + cfg.hidden_size)
    assert whole_stack + head_and_norm == flops_per_token(cfg, 4096)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA exit path")
def test_exits_with_message_without_cuda(bench, capsys):
    assert bench.parse_args(["--layers", "2", "--mask", "explicit"]).layers == 2
    assert bench.main(["--iters", "1"]) == 2
    assert "no CUDA device" in capsys.readouterr().out
