"""Every shipped configs/*.yaml loads through the real config loader, derives a DeepSpeed config DeepSpeed itself
accepts, and holds the figures its comments argue from, each checked against a reference that does not come from the
preset: DeepSpeed's own topology and 1F1B schedule (workers, pipeline bubble, micro-batches in flight), transformers'
Mistral-7B-v0.1 (model dims, parameters per stage), mistral-common's tokenizer (vocabulary), the ds_config the preset
names (bytes per parameter) and the cloud cluster YAMLs under cluster/ (GPUs per node, nodes, placement)."""

from __future__ import annotations

import functools
import glob
import os
import re

import pytest
import torch
import transformers
import yaml
from deepspeed.runtime.pipe.schedule import BackwardPass, ForwardPass, TrainSchedule
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

from raytrain.config import load_job_config
from raytrain.dataset.tokenize import load_tokenizer
from raytrain.pipeline.ds_config import derive_ds_config, load_ds_config
from raytrain.pipeline.flops import pipeline_bubble_fraction
from raytrain.pipeline.model import DecoderLayerPipe, MistralConfig, layer_parameter_counts
from raytrain.pipeline.module import stage_layer_ranges

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRESETS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))
NODES_GPUS = re.compile(r"(\d+)node-(\d+)gpu")  # mistral7b-<nodes>node-<gpus>gpu[-variant].yaml
LORA_PRESETS = [p for p in PRESETS if "lora" in os.path.basename(p)]  # mistral7b-*-lora*.yaml: model.lora on
GPU_PRESETS = [p for p in PRESETS if NODES_GPUS.search(os.path.basename(p)) and p not in LORA_PRESETS]
CLOUD_CLUSTERS = ["aws-gpu.yaml", "gcp-gpu.yaml"]
GIB = 2**30
H100_GIB = 80
RUNTIME_SLACK_GIB = 5  # CUDA context, NCCL buffers, allocator fragmentation (the comments' "~5 GiB")


def _name(path: str) -> str:
    return os.path.basename(path)


def _load(path: str):
    # ds_config paths in the presets are relative to the repo root (where `ray job submit --working-dir .` runs)
    job = load_job_config(path)
    ds_path = os.path.join(ROOT, job.train.ds_config)
    return job, derive_ds_config(load_ds_config(ds_path), job.train, ds_path=ds_path)


def _nodes_and_gpus(path: str) -> tuple[int, int]:
    nodes, gpus = NODES_GPUS.search(_name(path)).groups()
    return int(nodes), int(gpus)


def _stage_params(cfg: MistralConfig, pp: int, partition_method: str) -> list[int]:
    counts = layer_parameter_counts(cfg)
    return [sum(counts[a:b]) for a, b in stage_layer_ranges(cfg, pp, partition_method)]


@functools.cache
def _hf_mistral_7b_v01_parameters() -> dict[str, int]:
    """Parameter name -> element count of transformers' MistralForCausalLM with transformers' default config (its
    defaults are Mistral-7B-v0.1), built on the meta device: no memory, no raytrain code involved."""
    with torch.device("meta"):
        model = transformers.MistralForCausalLM(transformers.MistralConfig())
    return {name: p.numel() for name, p in model.named_parameters()}


def _hf_pipeline_index(name: str, num_layers: int) -> int:
    """Which pipeline layer (0 embedding, 1..L decoder layers, L+1 final norm, L+2 LM head) holds an HF parameter."""
    if name.startswith("model.embed_tokens."):
        return 0
    if match := re.match(r"model\.layers\.(\d+)\.", name):
        return int(match.group(1)) + 1
    if name.startswith("model.norm."):
        return num_layers + 1
    assert name.startswith("lm_head."), name
    return num_layers + 2


def _deepspeed_schedule(micro_batches: int, stages: int, stage_id: int) -> tuple[int, int, int]:
    """DeepSpeed's own 1F1B TrainSchedule for one stage: (schedule steps, steps with a forward or backward pass, most
    micro-batches forwarded and not yet backwarded at once, i.e. the activations the stage keeps)."""
    steps = busy = in_flight = most = 0
    for commands in TrainSchedule(micro_batches=micro_batches, stages=stages, stage_id=stage_id).steps():
        steps += 1
        busy += any(isinstance(c, ForwardPass | BackwardPass) for c in commands)
        in_flight += sum(isinstance(c, ForwardPass) for c in commands) - sum(isinstance(c, BackwardPass)
                                                                             for c in commands)
        most = max(most, in_flight)
    return steps, busy, most


def _bytes_per_param(ds: dict, dp: int) -> float:
    """Bytes per parameter of weights, gradients and optimizer states, read off a bf16 DeepSpeed config: bf16 weights
    and their transient bf16 .grad, the gradient-accumulation buffer in data_types.grad_accum_dtype, and the fp32
    master copy plus Adam's m and v (fp32), partitioned over the dp group from ZeRO stage 1 on."""
    assert ds["bf16"]["enabled"] is True
    assert ds["optimizer"]["type"].lower() in ("adam", "adamw")  # two fp32 states per parameter
    accumulation = {"fp32": 4, "bf16": 2}[ds["data_types"]["grad_accum_dtype"]]
    sharded_over = dp if ds["zero_optimization"]["stage"] >= 1 else 1
    return 2 + 2 + accumulation + (4 + 4 + 4) / sharded_over


def test_presets_found():
    names = {_name(p) for p in PRESETS}
    assert {"demo.yaml", "cpu-tiny.yaml", "mistral7b-1node-8gpu.yaml", "mistral7b-2node-16gpu.yaml"} <= names
    assert {"mistral7b-1node-8gpu.yaml", "mistral7b-1node-8gpu-corpus.yaml",
            "mistral7b-2node-16gpu.yaml"} <= {_name(p) for p in GPU_PRESETS}


@pytest.mark.parametrize("path", PRESETS, ids=_name)
def test_preset_loads_and_deepspeed_accepts_the_derived_config(path, monkeypatch):
    job, ds = _load(path)
    tc = job.train
    assert ds["train_batch_size"] == tc.micro_batch_size * tc.grad_accum_steps * tc.dp == tc.global_batch_size
    assert "auto" not in repr(ds)

    # DeepSpeed's own parser is the reference for train_batch = micro x accum x data-parallel world (dp, not pp*dp).
    import deepspeed.runtime.config as ds_runtime_config
    from deepspeed.runtime.config import DeepSpeedConfig

    monkeypatch.setattr(ds_runtime_config.dist, "get_rank", lambda *a, **k: 0)

    class _Mpu:
        def get_data_parallel_world_size(self):
            return tc.dp

        def get_model_parallel_world_size(self):
            return 1

    parsed = DeepSpeedConfig(ds, mpu=_Mpu())
    assert parsed.train_batch_size == tc.global_batch_size
    assert parsed.train_micro_batch_size_per_gpu == tc.micro_batch_size
    assert parsed.gradient_accumulation_steps == tc.grad_accum_steps
    assert parsed.zero_optimization_stage in (0, 1)  # the pipeline engine refuses ZeRO-2/3
    assert parsed.bfloat16_config.enabled is tc.use_gpu  # bf16 on GPUs, fp32 on CPU


@pytest.mark.parametrize("path", PRESETS, ids=_name)
def test_preset_workers_and_bubble_are_deepspeeds(path):
    """The workers Ray Train starts (train.num_workers) are the world DeepSpeed's pipe x data topology needs, and the
    bubble the training log reports (pipeline_bubble_fraction) is the idle share of DeepSpeed's own 1F1B schedule,
    on every stage."""
    job, _ = _load(path)
    tc = job.train
    assert tc.num_workers == PipeDataParallelTopology(num_pp=tc.pp, num_dp=tc.dp).world_size()
    bubble = pipeline_bubble_fraction(tc.grad_accum_steps, tc.pp)
    for stage in range(tc.pp):
        steps, busy, _ = _deepspeed_schedule(tc.grad_accum_steps, tc.pp, stage)
        assert bubble == pytest.approx(1 - busy / steps, abs=1e-12), stage


@pytest.mark.parametrize("path", PRESETS, ids=_name)
def test_preset_topology_fits_the_model(path):
    job, _ = _load(path)
    tc = job.train
    cfg = MistralConfig.preset(job.model.preset)
    assert tc.pp <= cfg.num_hidden_layers
    ranges = stage_layer_ranges(cfg, tc.pp, tc.partition_method)
    covered = [i for a, b in ranges for i in range(a, b)]
    assert covered == list(range(cfg.num_pipeline_layers))  # every pipeline layer on exactly one stage
    # the tokenizer's ids (mistral-common's own vocabulary size) must all have an embedding row; the presets pair
    # each model with the tokenizer its vocabulary was sized for, so no row is unused either
    assert load_tokenizer(job.dataset.tokenizer).instruct_tokenizer.tokenizer.n_words == cfg.vocab_size
    assert job.dataset.seq_len <= cfg.max_position_embeddings


@pytest.mark.parametrize("path", GPU_PRESETS + LORA_PRESETS, ids=_name)
def test_7b_preset_is_mistral_7b_v01(path):
    """The dims of the model the 7B presets train are the published Mistral-7B-v0.1's (transformers' MistralConfig
    defaults), the checkpoint they start from and the tokenizer they name are v0.1's (v1: 32,000 ids; v0.3 has
    32,768), and the parameter count of the comments is transformers' own count of that model."""
    job, _ = _load(path)
    cfg = MistralConfig.preset(job.model.preset)
    reference = transformers.MistralConfig()
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "sliding_window", "tie_word_embeddings"):
        assert getattr(cfg, field) == getattr(reference, field), field
    assert cfg.rope_theta == reference.rope_parameters["rope_theta"]
    # Two fields where transformers' defaults (1e-6, 131072) are not the release: Mistral-7B-v0.1's config.json says
    # rms_norm_eps 1e-5 and max_position_embeddings 32768 (and init_from refuses a checkpoint whose eps differs).
    assert (cfg.rms_norm_eps, cfg.max_position_embeddings) == (1e-5, 32768)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.intermediate_size, cfg.vocab_size) == (4096, 32, 32, 8, 14336, 32000)
    assert os.path.basename(job.model.init_from) == "Mistral-7B-v0.1"
    assert load_tokenizer(job.dataset.tokenizer).instruct_tokenizer.tokenizer.n_words == reference.vocab_size
    hf = _hf_mistral_7b_v01_parameters()
    assert sum(layer_parameter_counts(cfg)) == sum(hf.values()) == 7_241_732_096


@pytest.mark.parametrize("path", GPU_PRESETS, ids=_name)
def test_7b_preset_stage_parameters_match_transformers(path):
    """Parameters per pipeline stage (what the memory arithmetic multiplies) from raytrain's layer counts and
    partition, against transformers' MistralForCausalLM parameters assigned to the same pipeline layers by name."""
    job, _ = _load(path)
    tc = job.train
    cfg = MistralConfig.preset(job.model.preset)
    ranges = stage_layer_ranges(cfg, tc.pp, tc.partition_method)
    stage_of = {i: stage for stage, (a, b) in enumerate(ranges) for i in range(a, b)}
    reference = [0] * tc.pp
    for name, count in _hf_mistral_7b_v01_parameters().items():
        reference[stage_of[_hf_pipeline_index(name, cfg.num_hidden_layers)]] += count
    assert _stage_params(cfg, tc.pp, tc.partition_method) == reference
    # type:DecoderLayerPipe: the same number of decoder layers on every stage (the comments' "8 decoder layers each")
    decoder_layers = [sum(1 for i in range(a, b) if 1 <= i <= cfg.num_hidden_layers) for a, b in ranges]
    assert decoder_layers == [cfg.num_hidden_layers // tc.pp] * tc.pp
    # the comments' largest stage (embedding or LM head + 8 decoder layers = 1.876B)
    assert max(reference) == pytest.approx(1.876e9, rel=5e-4)


@pytest.mark.parametrize("path", GPU_PRESETS, ids=_name)
def test_gpu_preset_uses_one_gpu_per_worker_bf16_and_zero1(path):
    job, ds = _load(path)
    tc = job.train
    _nodes, num_gpus = _nodes_and_gpus(path)
    assert tc.use_gpu and tc.num_workers == num_gpus
    assert ds["bf16"]["enabled"] is True and ds["zero_optimization"]["stage"] == 1
    assert ds["data_types"]["grad_accum_dtype"] == "fp32"  # what makes DeepSpeed pick its BF16_Optimizer with pipe
    assert tc.peak_tflops == 989.0
    assert job.storage.root.startswith("/mnt/shared/")
    # bytes per parameter of the comments: bf16 weight 2 + bf16 grad 2 + fp32 accumulation 4, fp32 master + Adam
    # m + v = 12 sharded over dp by ZeRO-1, read off the ds_config the preset names
    assert _bytes_per_param(ds, tc.dp) == 8 + 12 / tc.dp


@pytest.mark.parametrize("cluster", CLOUD_CLUSTERS)
@pytest.mark.parametrize("path", GPU_PRESETS + [p for p in LORA_PRESETS if NODES_GPUS.search(_name(p))], ids=_name)
def test_gpu_preset_fits_the_cloud_cluster(path, cluster):
    """The nodes and GPUs a preset's name promises are what the cluster YAML's GPU node type gives: whole nodes, one
    GPU per worker (Ray Train's own request for the preset's ScalingConfig), within the autoscaler's limits, with the
    node's CPUs for the Spark executors beside the trainers; and, Ray Train numbering workers node by node and
    DeepSpeed ranking them pipe-major, every data-parallel group inside one node (the all-reduce stays on NVLink)."""
    from ray.train import ScalingConfig

    job, _ = _load(path)
    tc = job.train
    nodes, gpus = _nodes_and_gpus(path)
    with open(os.path.join(ROOT, "cluster", cluster), encoding="utf-8") as f:
        config = yaml.safe_load(f)
    [gpu_type] = [t for t in config["available_node_types"].values() if t["resources"].get("GPU")]
    node = gpu_type["resources"]
    assert gpus == nodes * node["GPU"] == tc.num_workers
    assert nodes <= gpu_type["max_workers"] <= config["max_workers"]
    asked = ScalingConfig(num_workers=tc.num_workers, use_gpu=tc.use_gpu,
                          resources_per_worker=tc.worker_resources() or None).total_resources
    assert asked.get("GPU") == tc.num_workers
    assert all(amount <= nodes * node.get(resource, 0) for resource, amount in asked.items()), asked
    executors = job.enrich.num_executors * job.enrich.executor_ray_cpus
    assert executors + asked.get("CPU", 0) <= nodes * node["CPU"]
    workers_per_node = tc.num_workers // nodes
    for group in PipeDataParallelTopology(num_pp=tc.pp, num_dp=tc.dp).get_axis_comm_lists("data"):
        assert len({rank // workers_per_node for rank in group}) == 1, group


@functools.cache
def _saved_bytes_per_token_units(preset: str, attn_impl: str, seq_lens: tuple[int, ...] = (64, 128)
                                 ) -> tuple[float, ...]:
    """Bytes one decoder layer saves for backward (bf16, micro-batch 1) at each of ``seq_lens``, in units of
    seq_len x hidden x 2 bytes. One 7B-wide layer (seconds to build) measured once per preset and kernel, then freed.

    Counted with torch's saved-tensor hooks (unique storages, parameters excluded), every tensor the layer keeps,
    with the preset's attention kernel: nothing is left out of the count.
    """
    cfg = MistralConfig.preset(preset)
    torch.manual_seed(0)
    layer = DecoderLayerPipe(cfg, 0, attn_impl=attn_impl).to(torch.bfloat16)
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    units = []
    for seq_len in seq_lens:
        saved: dict[int, tuple[tuple[int, ...], int]] = {}

        def pack(t: torch.Tensor, saved=saved) -> torch.Tensor:
            saved[t.untyped_storage().data_ptr()] = (tuple(t.shape), t.untyped_storage().nbytes())
            return t

        hidden = torch.randn(1, seq_len, cfg.hidden_size, dtype=torch.bfloat16, requires_grad=True)  # (1, T, H)
        position_ids = torch.arange(seq_len)[None]  # (1, T)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            layer((hidden, position_ids, torch.zeros_like(position_ids)))
        per_token = sum(n for ptr, (_shape, n) in saved.items() if ptr not in params)
        units.append(per_token / (seq_len * cfg.hidden_size * 2))
    return tuple(units)


@pytest.mark.parametrize("path", GPU_PRESETS, ids=_name)
def test_gpu_preset_fits_an_80gib_gpu_without_recomputation(path):
    """The memory arithmetic of the comments: static (weights, grads, optimizer) + 1F1B activations + slack."""
    job, ds = _load(path)
    tc = job.train
    cfg = MistralConfig.preset(job.model.preset)
    # The arithmetic extrapolates a 7B-wide layer measured at short sequences to seq_len, which holds when the layer
    # keeps nothing quadratic in T: "segment" runs SDPA per document with no mask (its kernels keep the output and
    # the log-sum-exp; the dense path would add a (B, 1, T, T) mask per layer).
    assert job.model.attn_impl == "segment"
    units, at_128 = _saved_bytes_per_token_units(job.model.preset, job.model.attn_impl)  # T = 64 and 128
    assert at_128 == pytest.approx(units, rel=1e-9)  # linear in T
    assert 20 <= units <= 30  # the comments' "~26 x (T x H x 2 B)"
    per_layer_mb = units * job.dataset.seq_len * cfg.hidden_size * 2 * tc.micro_batch_size
    # 1F1B: stage s keeps min(pp - s, m) micro-batches in flight; stage 0 holds the most (DeepSpeed's schedule agrees)
    in_flight = min(tc.pp, tc.grad_accum_steps)
    assert [_deepspeed_schedule(tc.grad_accum_steps, tc.pp, s)[2] for s in range(tc.pp)] == [
        min(tc.pp - s, tc.grad_accum_steps) for s in range(tc.pp)]
    ranges = stage_layer_ranges(cfg, tc.pp, tc.partition_method)
    layers_on_stage0 = sum(1 for i in range(*ranges[0]) if 1 <= i <= cfg.num_hidden_layers)
    activations = in_flight * layers_on_stage0 * per_layer_mb
    static = max(_stage_params(cfg, tc.pp, tc.partition_method)) * _bytes_per_param(ds, tc.dp)
    assert tc.activation_checkpoint_interval == 0
    assert (static + activations) / GIB + RUNTIME_SLACK_GIB < H100_GIB


def test_lora_presets_found():
    assert {_name(p) for p in LORA_PRESETS} == {"mistral7b-1node-8gpu-lora.yaml", "mistral7b-lora-1gpu.yaml"}


@pytest.mark.parametrize("path", LORA_PRESETS, ids=_name)
def test_lora_preset_fits_an_80gib_gpu_as_its_comments_say(path):
    """The comments' arithmetic for a LoRA preset: the frozen base in bf16 (2 B/param, no gradient, master copy or
    Adam state), the adapters (peft's count of them on transformers' model) at a full fine-tune's bytes per
    parameter, one stage holding the whole model with one micro-batch of activations in flight."""
    import peft

    from raytrain.pipeline.lora import adapter_parameter_count, peft_config

    job, ds = _load(path)
    tc, lora = job.train, job.model.lora
    cfg = MistralConfig.preset(job.model.preset)
    assert (lora.rank, lora.alpha, set(lora.targets)) == (16, 32.0, {"q_proj", "k_proj", "v_proj", "o_proj",
                                                                    "gate_proj", "up_proj", "down_proj"})
    with torch.device("meta"):
        reference = peft.get_peft_model(transformers.MistralForCausalLM(transformers.MistralConfig()),
                                        peft_config(lora))
    trainable = sum(p.numel() for p in reference.parameters() if p.requires_grad)
    assert adapter_parameter_count(cfg, lora) == trainable == 41_943_040  # the comments' count (0.58%)
    assert ds["bf16"]["enabled"] is True and ds["zero_optimization"]["stage"] == 1 and tc.use_gpu
    assert (tc.pp, tc.micro_batch_size, tc.activation_checkpoint_interval) == (1, 1, 0)
    base = sum(layer_parameter_counts(cfg))
    static = base * 2 + trainable * _bytes_per_param(ds, tc.dp)
    units = _saved_bytes_per_token_units(job.model.preset, job.model.attn_impl)[0]  # T = 64
    activations = cfg.num_hidden_layers * units * job.dataset.seq_len * cfg.hidden_size * 2 * tc.micro_batch_size
    assert [_deepspeed_schedule(tc.grad_accum_steps, 1, 0)[2]] == [1]  # one stage: one micro-batch in flight
    assert static / GIB == pytest.approx(13.9 if tc.dp == 8 else 14.3, abs=0.05)  # the comments' figures
    assert (static + activations) / GIB + RUNTIME_SLACK_GIB < 46 < H100_GIB
    assert tc.global_batch_size == (64 if tc.dp == 8 else 16)
