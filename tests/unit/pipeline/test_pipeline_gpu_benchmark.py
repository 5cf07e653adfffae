"""benchmarks/gpu_stage_mfu.py on a CPU machine: it imports only what the GPU machine has, counts FLOPs like
raytrain.pipeline.flops, times raytrain's own layers end to end in its CPU dry run, and exits cleanly without CUDA."""

import ast
import importlib.util
import os

import pytest
import torch
from fresh_imports import loaded_by

from raytrain.pipeline.flops import flops_per_token
from raytrain.pipeline.model import MistralConfig, layer_parameter_counts

BENCHMARK = os.path.join(os.path.dirname(__file__), "..", "..", "..", "benchmarks", "gpu_stage_mfu.py")
# The GPU machine has torch, numpy, pyyaml and transformers, none of raytrain's other dependencies.
ALLOWED_IMPORTS = {"__future__", "argparse", "copy", "dataclasses", "sys", "time", "torch", "numpy",
                   "raytrain.pipeline.model", "raytrain.pipeline.attention"}


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("gpu_stage_mfu", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_imports_only_torch_and_raytrain_pipeline_model():
    with open(BENCHMARK, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module)
    assert imported <= ALLOWED_IMPORTS, imported - ALLOWED_IMPORTS
    assert {"raytrain.pipeline.model", "raytrain.pipeline.attention"} <= imported  # times OUR layers


def test_raytrain_pipeline_model_pulls_in_nothing_heavy():
    """What the benchmark imports from raytrain must not bring deepspeed, ray or transformers onto the GPU box."""
    assert loaded_by(["raytrain.pipeline.model", "raytrain.pipeline.attention"],
                     ["deepspeed", "ray", "transformers", "pyarrow", "yaml"]) == []


def test_stage_flops_agree_with_raytrain_flops(bench):
    cfg = MistralConfig.preset("mistral-7b")
    per_layer = layer_parameter_counts(cfg)[1]  # one DecoderLayerPipe, as the benchmark counts it
    whole_stack = bench.stage_flops_per_token(cfg, 32, 4096, per_layer)
    head_and_norm = 6.0 * (cfg.vocab_size * cfg.hidden_size + cfg.hidden_size)
    assert whole_stack + head_and_norm == flops_per_token(cfg, 4096)


def test_cpu_dry_run_times_every_impl_and_checks_parity(bench, capsys):
    args = ["--device", "cpu", "--preset", "tiny", "--layers", "1", "--seq-len", "64", "--iters", "1",
            "--warmup", "0"]
    assert bench.main(args) == 0
    out = capsys.readouterr().out
    for pack in ("4x16", "1x64"):
        for impl in ("dense", "segment"):
            assert f"pack={pack:9s} impl={impl:7s}" in out and "ms/iter" in out
        assert f"pack={pack:9s} impl=flex     skipped" in out
    for impl in ("segment", "flex"):
        line = next(line for line in out.splitlines() if line.startswith(f"check {impl} vs dense"))
        output_diff = float(line.split("output ")[1].split(",")[0])
        assert output_diff < 1e-4, line  # a masking error would be O(1)
    assert out.count("bf16 vs fp32") == 3


def test_rejects_unknown_impl(bench):
    with pytest.raises(SystemExit):
        bench.parse_args(["--impl", "dense,flash"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA exit path")
def test_exits_with_message_without_cuda(bench, capsys):
    assert bench.parse_args(["--layers", "2", "--impl", "segment"]).impls == ["segment"]
    assert bench.main(["--iters", "1"]) == 2
    assert "no CUDA device" in capsys.readouterr().out
