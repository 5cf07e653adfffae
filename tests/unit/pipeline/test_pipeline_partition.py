"""stage_layer_ranges against DeepSpeed's own PipelineModule._partition_layers, and the flops helpers."""

import pytest
import torch
from deepspeed.pipe import LayerSpec, PipelineModule
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

from raytrain.errors import ConfigError
from raytrain.pipeline.flops import flops_per_token, matmul_parameters, mfu, pipeline_bubble_fraction
from raytrain.pipeline.model import MistralConfig, layer_constructors
from raytrain.pipeline.module import PARTITION_METHODS, stage_layer_ranges

CFG = MistralConfig.preset("tiny-4l")


def deepspeed_parts(cfg: MistralConfig, num_stages: int, method: str) -> list[int]:
    """Run DeepSpeed's real partition code for ``num_stages`` stages without a process group of that size.

    PipelineModule.__init__ needs world_size divisible by num_stages; _partition_layers itself only reads the
    attributes set here, so we call it on a bare instance.
    """
    module = PipelineModule.__new__(PipelineModule)
    torch.nn.Module.__init__(module)
    module.num_stages = num_stages
    module._topo = PipeDataParallelTopology(num_pp=num_stages, num_dp=1)
    module.global_rank = 0
    module.loss_fn = None
    module._layer_specs = [LayerSpec(cls, *args, **kwargs) for cls, args, kwargs in layer_constructors(cfg)]
    module._partition_layers(method=method)
    return [int(p) for p in module.parts]


@pytest.mark.parametrize("method", PARTITION_METHODS)
@pytest.mark.parametrize("num_stages", [1, 2, 4])
def test_ranges_cover_every_layer_once_and_agree_with_deepspeed(num_stages, method):
    ranges = stage_layer_ranges(CFG, num_stages, method)
    covered = [i for start, stop in ranges for i in range(start, stop)]
    assert covered == list(range(CFG.num_pipeline_layers))
    assert all(stop > start for start, stop in ranges)
    parts = deepspeed_parts(CFG, num_stages, method)
    assert [(parts[s], parts[s + 1]) for s in range(num_stages)] == ranges


def test_type_partition_gives_each_stage_the_same_number_of_decoder_layers():
    cfg = MistralConfig.preset("mistral-7b")
    ranges = stage_layer_ranges(cfg, 4)
    decoder_counts = [len([i for i in range(a, b) if 1 <= i <= cfg.num_hidden_layers]) for a, b in ranges]
    assert decoder_counts == [8, 8, 8, 8]
    assert ranges[0][0] == 0 and ranges[-1][1] == cfg.num_pipeline_layers


def test_bad_stage_counts_and_methods_are_refused():
    with pytest.raises(ConfigError, match="num_stages \\(5\\) is larger than num_hidden_layers \\(4\\)"):
        stage_layer_ranges(CFG, 5)
    with pytest.raises(ConfigError, match="unknown partition_method"):
        stage_layer_ranges(CFG, 2, "profile")
    with pytest.raises(ConfigError, match="matches no layer"):
        stage_layer_ranges(CFG, 2, "type:TransformerLayer")


def test_flops_per_token_against_hand_count_for_mistral_7b():
    cfg = MistralConfig.preset("mistral-7b")
    # Hand count: 32 layers x (4096*(4096+1024+1024+4096) + 3*4096*14336 + 2*4096) + final norm + LM head.
    per_layer = 4096 * (4096 + 1024 + 1024 + 4096) + 3 * 4096 * 14336 + 2 * 4096
    n_matmul = 32 * per_layer + 4096 + 32000 * 4096
    assert matmul_parameters(cfg) == n_matmul
    assert flops_per_token(cfg, 2048) == 6 * n_matmul + 12 * 32 * 32 * 128 * 2048
    # The sliding window (4096) caps the attention context.
    assert flops_per_token(cfg, 8192) == 6 * n_matmul + 12 * 32 * 32 * 128 * 4096
    tokens_per_s = 3000.0
    assert mfu(tokens_per_s, cfg, 2048, 989e12) == pytest.approx(tokens_per_s * flops_per_token(cfg, 2048) / 989e12)


def test_pipeline_bubble_fraction():
    assert pipeline_bubble_fraction(num_micro_batches=8, num_stages=4) == pytest.approx(3 / 11)
    assert pipeline_bubble_fraction(num_micro_batches=5, num_stages=1) == 0.0
    with pytest.raises(Exception, match="num_micro_batches"):
        pipeline_bubble_fraction(0, 2)
