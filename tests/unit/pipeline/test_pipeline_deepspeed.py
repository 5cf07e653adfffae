"""The PipelineModule inside a real DeepSpeed engine (one process, gloo, CPU accelerator), checked against
transformers + torch.optim.AdamW, and the Hugging Face import/export round trips."""

import copy
import os
import shutil

import mistral_common
import numpy as np
import pytest
import torch
import transformers
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

from raytrain.config import LoraConfig
from raytrain.errors import RaytrainError
from raytrain.pipeline.hf_io import export_to_hf, load_hf_into_stage
from raytrain.pipeline.lora import adapter_state_dict, add_adapters, parameter_counts, peft_config
from raytrain.pipeline.model import MistralConfig, hf_prefix, layer_parameter_counts
from raytrain.pipeline.module import build_pipeline_module, stage_layer_ranges, stage_range

deepspeed = pytest.importorskip("deepspeed")

CFG = MistralConfig.preset("tiny")
MICRO_BATCH_SIZE, GRAD_ACCUM, SEQ_LEN = 2, 2, 16
ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
V3_TOKENIZER = os.path.join(os.path.dirname(mistral_common.__file__), "data",
                            "mistral_instruct_tokenizer_240323.model.v3")


def hf_reference(seed: int = 0) -> transformers.MistralForCausalLM:
    torch.manual_seed(seed)
    return transformers.MistralForCausalLM._from_config(CFG.to_hf(), attn_implementation="eager")


def micro_batches(num: int, seed: int = 5):
    """(inputs, labels) micro-batches for the engine, plus the HF-style (unshifted) labels for the reference."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(num):
        input_ids = torch.randint(0, CFG.vocab_size, (MICRO_BATCH_SIZE, SEQ_LEN), generator=generator)
        hf_labels = input_ids.clone()
        hf_labels[:, :3] = -100  # a masked prompt
        shifted = torch.cat([hf_labels[:, 1:], torch.full_like(hf_labels[:, :1], -100)], dim=1)
        position_ids = torch.arange(SEQ_LEN).expand(MICRO_BATCH_SIZE, SEQ_LEN).contiguous()
        inputs = (input_ids, position_ids, torch.zeros_like(input_ids))
        batches.append(((inputs, shifted), hf_labels))
    return batches


def ds_config() -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO_BATCH_SIZE,
        "gradient_accumulation_steps": GRAD_ACCUM,
        "optimizer": {"type": "AdamW", "params": {**ADAMW, "betas": list(ADAMW["betas"]), "torch_adam": True}},
        "gradient_clipping": 0.0,
        "steps_per_print": 10_000,
    }


def stage_named_parameters(module) -> dict[str, torch.nn.Parameter]:
    """The stage's parameters under their Hugging Face names."""
    start, _stop = stage_range(module)
    return {hf_prefix(start + i, CFG) + name: p
            for i, layer in enumerate(module.forward_funcs) for name, p in layer.named_parameters()}


def stage_state(module) -> dict[str, torch.Tensor]:
    """HF-named copy of the stage's parameters."""
    return {name: p.detach().clone() for name, p in stage_named_parameters(module).items()}


def capture_gradients(engine, module, names: dict[int, str] | None = None) -> dict[str, torch.Tensor]:
    """Fill the returned dict with the gradients the optimizer sees at its next step, under ``names`` (parameter
    id -> name; default: the stage's parameters' HF names).

    Adam's first step is nearly invariant to the gradient's scale, so comparing updated weights alone would miss a
    wrong loss scaling (e.g. gradient accumulation); the gradients themselves are compared too.
    """
    names = names or {id(p): name for name, p in stage_named_parameters(module).items()}
    captured: dict[str, torch.Tensor] = {}

    def snapshot(optimizer, _args, _kwargs):
        for group in optimizer.param_groups:
            for param in group["params"]:
                captured[names[id(param)]] = param.grad.detach().clone()

    engine.optimizer.register_step_pre_hook(snapshot)
    return captured


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf")
    hf_reference().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def trained(gloo_group, hf_dir, tmp_path_factory):
    """One DeepSpeed train_batch from HF weights, and the same step done by transformers + torch AdamW."""
    module = build_pipeline_module(CFG, num_stages=1, seed=99)
    load_hf_into_stage(module, hf_dir)
    engine, _, _, _ = deepspeed.initialize(model=module, config=ds_config(), model_parameters=module.parameters())
    batches = micro_batches(GRAD_ACCUM)
    ds_grads = capture_gradients(engine, module)
    ds_loss = engine.train_batch(data_iter=iter([b for b, _ in batches]))

    reference = transformers.MistralForCausalLM.from_pretrained(hf_dir, attn_implementation="eager")
    before = copy.deepcopy(reference.state_dict())
    optimizer = torch.optim.AdamW(reference.parameters(), **ADAMW)
    ref_losses = []
    for ((input_ids, _pos, _seg), _shifted), hf_labels in batches:
        loss = reference(input_ids=input_ids, labels=hf_labels).loss
        (loss / GRAD_ACCUM).backward()
        ref_losses.append(loss.detach())
    ref_grads = {name: p.grad.detach().clone() for name, p in reference.named_parameters()}
    optimizer.step()
    save_dir = tmp_path_factory.mktemp("ds_ckpt")
    engine.save_checkpoint(str(save_dir), tag="step1")
    return dict(engine=engine, module=module, ds_loss=ds_loss, ref_loss=torch.stack(ref_losses).mean(),
                ds_grads=ds_grads, ref_grads=ref_grads,
                reference=reference.eval(), before=before, ckpt_tag_dir=save_dir / "step1")


def test_real_pipeline_module_partition_matches_stage_layer_ranges(trained):
    module = trained["module"]
    assert [tuple(int(x) for x in module.parts[s:s + 2]) for s in range(1)] == stage_layer_ranges(CFG, 1)
    assert stage_range(module) == (0, CFG.num_pipeline_layers)


def test_load_hf_into_stage_copies_every_tensor(gloo_group, hf_dir, tmp_path):
    module = build_pipeline_module(CFG, num_stages=1, seed=3)
    loaded = load_hf_into_stage(module, hf_dir)
    reference = hf_reference().state_dict()
    assert sorted(loaded) == sorted(reference)
    for name, tensor in stage_state(module).items():
        assert torch.equal(tensor, reference[name]), name
    # Sharded checkpoints (model.safetensors.index.json) load the same tensors.
    sharded = tmp_path / "sharded"
    hf_reference().save_pretrained(sharded, max_shard_size="1MB")
    assert (sharded / "model.safetensors.index.json").is_file()
    module = build_pipeline_module(CFG, num_stages=1, seed=4)
    load_hf_into_stage(module, sharded)
    for name, tensor in stage_state(module).items():
        assert torch.equal(tensor, reference[name]), name


def test_train_batch_loss_gradients_and_update_match_torch_adamw(trained):
    torch.testing.assert_close(trained["ds_loss"].float(), trained["ref_loss"], rtol=1e-5, atol=0.0)
    assert sorted(trained["ds_grads"]) == sorted(trained["ref_grads"])
    for name, grad in trained["ds_grads"].items():
        torch.testing.assert_close(grad, trained["ref_grads"][name], rtol=1e-4, atol=1e-8, msg=name)
    updated = trained["reference"].state_dict()
    before = trained["before"]
    for name, ours in stage_state(trained["module"]).items():
        torch.testing.assert_close(ours, updated[name], rtol=0.0, atol=1e-5, msg=name)
        # The step moved the weights: a no-op optimizer would fail the comparison of the deltas.
        delta_ours, delta_ref = ours - before[name], updated[name] - before[name]
        if delta_ref.abs().max() > 0:
            assert (delta_ours - delta_ref).norm() <= 1e-3 * delta_ref.norm(), name


def test_grad_norm_is_the_global_norm_before_clipping(gloo_group, hf_dir, trained):
    """fp32 with gradient clipping: the engine reports the norm of the unclipped gradients (transformers' on the
    same batch), and the optimizer sees them scaled down to the clip value."""
    from raytrain.pipeline.engine import keep_fp32_grad_norm

    module = build_pipeline_module(CFG, num_stages=1)
    load_hf_into_stage(module, hf_dir)
    engine, _, _, _ = deepspeed.initialize(model=module, config={**ds_config(), "gradient_clipping": 1.0},
                                           model_parameters=module.parameters())
    keep_fp32_grad_norm(engine)
    clipped = capture_gradients(engine, module)
    engine.train_batch(data_iter=iter([b for b, _ in micro_batches(GRAD_ACCUM)]))
    reference_norm = float(torch.linalg.vector_norm(torch.stack(
        [torch.linalg.vector_norm(g) for g in trained["ref_grads"].values()])))
    assert reference_norm > 1.0, "the batch must need clipping for the test to see it"
    assert engine.get_global_grad_norm() == pytest.approx(reference_norm, rel=1e-4)
    clipped_norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in clipped.values()])))
    assert clipped_norm == pytest.approx(1.0, rel=1e-4)


def test_export_round_trip_loads_in_transformers_and_generates(trained, tmp_path):
    out = export_to_hf(trained["ckpt_tag_dir"], CFG, tmp_path / "export")
    exported = transformers.MistralForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    ((inputs, _labels), _hf_labels) = micro_batches(1, seed=11)[0]
    module = trained["module"].eval()
    with torch.no_grad():
        ours = module(inputs)
        theirs = exported(input_ids=inputs[0]).logits
    module.train()
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)

    prompt = inputs[0][:1, :4]
    generated = exported.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=2)
    new_tokens = generated[0, 4:].tolist()
    assert len(new_tokens) >= 1 and all(0 <= t < CFG.vocab_size for t in new_tokens)
    text = MistralTokenizer.from_file(V3_TOKENIZER).decode(new_tokens)
    assert isinstance(text, str)

    # Sharded export (index + shards) loads to the same logits.
    sharded = export_to_hf(trained["ckpt_tag_dir"], CFG, tmp_path / "sharded", max_shard_bytes=2**20)
    assert (sharded / "model.safetensors.index.json").is_file()
    reloaded = transformers.MistralForCausalLM.from_pretrained(sharded, attn_implementation="eager").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=inputs[0]).logits, theirs, rtol=0.0, atol=0.0)


def test_export_names_the_missing_layer_file(trained, tmp_path):
    partial = tmp_path / "partial"
    shutil.copytree(trained["ckpt_tag_dir"], partial)
    (partial / "layer_02-model_states.pt").unlink()
    with pytest.raises(RaytrainError, match=r"layer_02-model_states\.pt is missing: pipeline layer 2 "
                                            r"\(model\.layers\.1\.\*\)"):
        export_to_hf(partial, CFG, tmp_path / "out")
    with pytest.raises(RaytrainError, match="already holds"):
        out = export_to_hf(trained["ckpt_tag_dir"], CFG, tmp_path / "twice")
        export_to_hf(trained["ckpt_tag_dir"], CFG, out)


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_gives_the_same_gradients(gloo_group, hf_dir, reentrant):
    """Checkpointing every decoder layer (DeepSpeed's non-reentrant or reentrant checkpoint) must not change the
    loss or cut any parameter off from its gradient."""
    results = []
    for interval in (0, 1):
        module = build_pipeline_module(CFG, num_stages=1, activation_checkpoint_interval=interval,
                                       activation_checkpoint_reentrant=reentrant)
        load_hf_into_stage(module, hf_dir)
        engine, _, _, _ = deepspeed.initialize(model=module, config=ds_config(),
                                               model_parameters=module.parameters())
        engine.train_batch(data_iter=iter([b for b, _ in micro_batches(GRAD_ACCUM)]))
        results.append(stage_state(module))
    for name in results[0]:
        torch.testing.assert_close(results[1][name], results[0][name], rtol=0.0, atol=1e-6, msg=name)


def test_loss_is_token_weighted_over_the_global_batch(gloo_group, hf_dir):
    """Micro-batches with very uneven target counts, fed through the training feed (loss_scale): the engine's loss
    and gradients equal transformers' with num_items_in_batch = all targets of the step (sum / N, not a mean of
    per-micro-batch means)."""
    from raytrain.trainer.feed import in_memory_packs
    from raytrain.trainer.feed import micro_batches as feed_micro_batches

    generator = torch.Generator().manual_seed(21)
    numpy_batches, hf_batches = [], []
    for keep in (2, SEQ_LEN):  # micro-batch 0: 1 target per row; micro-batch 1: all but the last position
        input_ids = torch.randint(0, CFG.vocab_size, (MICRO_BATCH_SIZE, SEQ_LEN), generator=generator)
        hf_labels = input_ids.clone()
        hf_labels[:, keep:] = -100
        hf_labels[:, 0] = -100
        shifted = torch.cat([hf_labels[:, 1:], torch.full_like(hf_labels[:, :1], -100)], dim=1)
        position_ids = torch.arange(SEQ_LEN).expand(MICRO_BATCH_SIZE, SEQ_LEN)
        numpy_batches.append({"input_ids": input_ids.numpy(), "position_ids": position_ids.numpy(),
                              "segment_ids": torch.zeros_like(input_ids).numpy(), "labels": shifted.numpy(),
                              "doc_ids": [f"d{len(numpy_batches)}-{r}" for r in range(MICRO_BATCH_SIZE)]})
        hf_batches.append((input_ids, hf_labels))
    num_targets = sum(int((labels[:, 1:] != -100).sum()) for _, labels in hf_batches)
    assert num_targets == MICRO_BATCH_SIZE * (1 + SEQ_LEN - 1)

    module = build_pipeline_module(CFG, num_stages=1)
    load_hf_into_stage(module, hf_dir)
    engine, _, _, _ = deepspeed.initialize(model=module, config=ds_config(), model_parameters=module.parameters())
    grads = capture_gradients(engine, module)
    counts, read = in_memory_packs({name: np.concatenate([b[name] for b in numpy_batches])
                                    for name in numpy_batches[0]})  # written order: micro-batch 0, then 1
    feed = feed_micro_batches(counts, read, micro_batch_size=MICRO_BATCH_SIZE, start_position=0, dp_rank=0, dp=1,
                              grad_accum_steps=GRAD_ACCUM)
    loss = float(engine.train_batch(data_iter=feed))

    reference = transformers.MistralForCausalLM.from_pretrained(hf_dir, attn_implementation="eager")
    ref_loss = sum(reference(input_ids=ids, labels=labels, num_items_in_batch=num_targets).loss
                   for ids, labels in hf_batches)
    ref_loss.backward()
    assert loss == pytest.approx(float(ref_loss), rel=1e-5)
    mean_of_means = sum(float(reference(input_ids=ids, labels=labels).loss) for ids, labels in hf_batches) / 2
    assert abs(loss - mean_of_means) > 1e-3, "the micro-batches must be uneven enough to tell the two apart"
    for name, param in reference.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-4, atol=1e-8, msg=name)


def test_eval_loss_is_the_token_mean_over_the_whole_validation_set(gloo_group, hf_dir):
    """Three validation micro-batches of uneven targets, the last one short (padded by the feed), through DeepSpeed's
    pipeline eval schedule: the loss equals transformers' summed token loss over the set / its target count, and
    evaluating changes no weight."""
    from raytrain.pipeline.engine import StageEngine
    from raytrain.trainer.feed import validation_micro_batches

    generator = torch.Generator().manual_seed(33)
    numpy_batches, hf_batches = [], []
    for rows, keep in ((MICRO_BATCH_SIZE, 3), (MICRO_BATCH_SIZE, SEQ_LEN), (1, 9)):
        input_ids = torch.randint(0, CFG.vocab_size, (rows, SEQ_LEN), generator=generator)
        hf_labels = input_ids.clone()
        hf_labels[:, keep:] = -100
        shifted = torch.cat([hf_labels[:, 1:], torch.full_like(hf_labels[:, :1], -100)], dim=1)
        numpy_batches.append({"input_ids": input_ids.numpy(),
                              "position_ids": torch.arange(SEQ_LEN).expand(rows, SEQ_LEN).numpy(),
                              "segment_ids": torch.zeros_like(input_ids).numpy(), "labels": shifted.numpy(),
                              "doc_ids": [f"v{len(numpy_batches)}-{r}" for r in range(rows)]})
        hf_batches.append((input_ids, hf_labels))
    own, num_targets = validation_micro_batches(iter(numpy_batches), micro_batch_size=MICRO_BATCH_SIZE, dp_rank=0,
                                                dp=1)

    module = build_pipeline_module(CFG, num_stages=1)
    load_hf_into_stage(module, hf_dir)
    engine, _, _, _ = deepspeed.initialize(model=module, config=ds_config(), model_parameters=module.parameters())
    before = stage_state(module)
    loss = StageEngine.of(engine).eval_loss(iter(own), len(own))

    reference = transformers.MistralForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        ref_loss = sum(float(reference(input_ids=ids, labels=labels, num_items_in_batch=num_targets).loss)
                       for ids, labels in hf_batches)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert all(torch.equal(before[name], tensor) for name, tensor in stage_state(module).items())


def test_deepspeed_backend_has_no_shared_memory_op(gloo_group):
    """raytrain's init_distributed leaves DeepSpeed's shared-memory all-reduce op unbuilt (DeepSpeed would compile it
    at a CPU machine's first launch); the engines of this module train and evaluate through the gloo group."""
    from deepspeed.comm import comm as ds_comm

    assert ds_comm.cdb is not None and ds_comm.cdb.shm_comm_op is None
    assert not hasattr(torch.ops.deepspeed, "inference_all_reduce_")


def test_greedy_generation_through_the_pipeline_equals_transformers_generate(gloo_group, hf_dir):
    """StageEngine.greedy_generate (one eval forward per token, 13 wide where seq_len is 16, prompts of different
    lengths padded in one micro-batch) gives transformers' greedy ``generate`` tokens for each prompt."""
    from raytrain.pipeline.engine import StageEngine

    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, CFG.vocab_size, (n,), generator=generator).tolist() for n in (3, 7)]
    module = build_pipeline_module(CFG, num_stages=1)
    load_hf_into_stage(module, hf_dir)
    engine, _, _, _ = deepspeed.initialize(model=module, config=ds_config(), model_parameters=module.parameters())
    new = StageEngine.of(engine).greedy_generate(
        prompts, num_prompts=2, micro_batch_size=MICRO_BATCH_SIZE, seq_len=SEQ_LEN, max_new_tokens=6, eos_id=-1)
    reference = transformers.MistralForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval()
    for prompt, tokens in zip(prompts, new, strict=True):
        with torch.no_grad():
            out = reference.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                                     pad_token_id=0)
        assert tokens == out[0, len(prompt):].tolist() and len(tokens) == 6


def packed_micro_batches(num: int, seed: int = 7):
    """Engine micro-batches of packed rows: three documents per row (segment ids 0, 1, 2, positions restarting)."""
    generator = torch.Generator().manual_seed(seed)
    bounds = [0, 5, 11, SEQ_LEN]
    spans = list(zip(bounds[:-1], bounds[1:], strict=True))
    segment_ids = torch.cat([torch.full((b - a,), k) for k, (a, b) in enumerate(spans)])
    position_ids = torch.cat([torch.arange(b - a) for a, b in spans])
    batches = []
    for _ in range(num):
        input_ids = torch.randint(0, CFG.vocab_size, (MICRO_BATCH_SIZE, SEQ_LEN), generator=generator)
        labels = torch.cat([input_ids[:, 1:], torch.full_like(input_ids[:, :1], -100)], dim=1)
        labels[:, [b - 1 for b in bounds[1:]]] = -100  # no target across a document boundary
        inputs = (input_ids, position_ids.expand(MICRO_BATCH_SIZE, SEQ_LEN).contiguous(),
                  segment_ids.expand(MICRO_BATCH_SIZE, SEQ_LEN).contiguous())
        batches.append((inputs, labels))
    return batches


def test_model_attn_impl_segment_trains_like_dense_in_the_engine(gloo_group, hf_dir):
    """model.attn_impl reaches every decoder layer of the PipelineModule; on packed rows the segment kernel's
    loss and gradients equal the dense-mask reference's. (Updated weights are not compared: Adam's first step
    divides by |g| + eps, so where a gradient is ~eps, float noise of 1e-12 moves a weight by ~1% of lr.)"""
    results = []
    for impl in ("dense", "segment"):
        module = build_pipeline_module(CFG, num_stages=1, attn_impl=impl)
        assert {layer.attn_impl for layer in module.forward_funcs if hasattr(layer, "attn_impl")} == {impl}
        load_hf_into_stage(module, hf_dir)
        engine, _, _, _ = deepspeed.initialize(model=module, config=ds_config(),
                                               model_parameters=module.parameters())
        grads = capture_gradients(engine, module)
        loss = engine.train_batch(data_iter=iter(packed_micro_batches(GRAD_ACCUM)))
        results.append((float(loss), grads))
    (dense_loss, dense_grads), (loss, grads) = results
    assert set(grads) == set(dense_grads) and len(grads) == len(stage_named_parameters(module))
    assert loss == pytest.approx(dense_loss, rel=1e-6)
    for name in dense_grads:
        torch.testing.assert_close(grads[name], dense_grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_export_casts_to_bf16_and_transformers_loads_it(tmp_path):
    """Layer files as DeepSpeed names them, written by hand (no engine needed): export with dtype=bfloat16."""
    from raytrain.pipeline.model import build_sequential

    layers = build_sequential(CFG, seed=1)
    tag_dir = tmp_path / "tag"
    tag_dir.mkdir()
    for i, layer in enumerate(layers):
        torch.save(layer.state_dict(), tag_dir / f"layer_{i:02d}-model_states.pt")
    out = export_to_hf(tag_dir, CFG, tmp_path / "out", dtype=torch.bfloat16)
    loaded = transformers.MistralForCausalLM.from_pretrained(out)
    assert loaded.dtype == torch.bfloat16
    state = loaded.state_dict()
    for i, layer in enumerate(layers):
        for name, param in layer.named_parameters():
            assert torch.equal(state[hf_prefix(i, CFG) + name], param.detach().to(torch.bfloat16)), name
    assert loaded.generation_config.eos_token_id == 2


# ---- LoRA on the pipeline's layers (raytrain.pipeline.lora) against peft on transformers' MistralForCausalLM --------
LORA = LoraConfig(rank=4, alpha=8.0)


def _random_adapters(module, seed: int) -> None:
    """peft starts lora_B at zero, which leaves lora_A without a gradient on the first step: give both factors
    values, so the step checks every adapter gradient."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if ".lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)


def _lora_stage(hf_dir, **module_kwargs):
    module = build_pipeline_module(CFG, num_stages=1, seed=99, **module_kwargs)
    load_hf_into_stage(module, hf_dir)
    add_adapters(module, LORA, seed=99)
    _random_adapters(module, seed=7)
    return module


def _adapter_gradients(engine, module) -> dict[str, torch.Tensor]:
    """The adapter gradients the optimizer sees at its next step, under PEFT adapter-file names."""
    return capture_gradients(engine, module, {id(p): name for name, p in zip(
        adapter_state_dict(module), (p for n, p in module.named_parameters() if ".lora_" in n), strict=True)})


@pytest.fixture(scope="module")
def lora_trained(gloo_group, hf_dir):
    """One DeepSpeed train_batch of the LoRA stage, and the same step by peft + transformers + torch AdamW from the
    same adapter weights (loaded with peft's own set_peft_model_state_dict, which reads PEFT file names)."""
    import peft

    module = _lora_stage(hf_dir)
    frozen_before = {n: p.detach().clone() for n, p in module.named_parameters() if not p.requires_grad}
    adapters_before = {k: v.clone() for k, v in adapter_state_dict(module).items()}
    engine, _, _, _ = deepspeed.initialize(model=module, config=ds_config(),
                                           model_parameters=[p for p in module.parameters() if p.requires_grad])
    batches = micro_batches(GRAD_ACCUM)
    ds_grads = _adapter_gradients(engine, module)
    ds_loss = engine.train_batch(data_iter=iter([b for b, _ in batches]))

    base = transformers.MistralForCausalLM.from_pretrained(hf_dir, attn_implementation="eager")
    reference = peft.get_peft_model(base, peft_config(LORA))
    result = peft.set_peft_model_state_dict(reference, {k: v.clone() for k, v in adapters_before.items()})
    assert not result.unexpected_keys
    base_before = {n: p.detach().clone() for n, p in reference.named_parameters() if not p.requires_grad}
    optimizer = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], **ADAMW)
    ref_losses = []
    for ((input_ids, _pos, _seg), _shifted), hf_labels in batches:
        loss = reference(input_ids=input_ids, labels=hf_labels).loss
        (loss / GRAD_ACCUM).backward()
        ref_losses.append(loss.detach())
    peft_names = {n: n.replace(".default.", ".") for n, p in reference.named_parameters() if p.requires_grad}
    ref_grads = {peft_names[n]: p.grad.detach().clone() for n, p in reference.named_parameters() if p.requires_grad}
    optimizer.step()
    return dict(engine=engine, module=module, ds_loss=ds_loss, ref_loss=torch.stack(ref_losses).mean(),
                ds_grads=ds_grads, ref_grads=ref_grads, reference=reference, peft_names=peft_names,
                frozen_before=frozen_before, adapters_before=adapters_before, base_before=base_before)


def test_lora_step_matches_peft_on_transformers(lora_trained):
    t = lora_trained
    torch.testing.assert_close(t["ds_loss"].float(), t["ref_loss"], rtol=1e-5, atol=0.0)
    # every adapter, and nothing else, got a gradient; the same as peft's
    assert sorted(t["ds_grads"]) == sorted(t["ref_grads"]) == sorted(t["adapters_before"])
    assert len(t["ds_grads"]) == 2 * len(LORA.targets) * CFG.num_hidden_layers
    for name, grad in t["ds_grads"].items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(grad, t["ref_grads"][name], rtol=1e-4, atol=1e-8, msg=name)
    # the updated adapters equal peft's after torch AdamW (tolerances of the full fine-tune's test above: Adam's
    # first step is about lr * sign(gradient), so near-zero gradients may differ in sign), and moved as peft's did
    updated = {t["peft_names"][n]: p.detach() for n, p in t["reference"].named_parameters() if p.requires_grad}
    for name, ours in adapter_state_dict(t["module"]).items():
        torch.testing.assert_close(ours, updated[name], rtol=0.0, atol=1e-5, msg=name)
        delta_ours, delta_ref = ours - t["adapters_before"][name], updated[name] - t["adapters_before"][name]
        assert delta_ref.abs().max() > 0 and (delta_ours - delta_ref).norm() <= 1e-3 * delta_ref.norm(), name
    # the base is frozen: bit-identical after the step, in ours and in peft's
    for name, param in t["module"].named_parameters():
        if not param.requires_grad:
            assert torch.equal(param, t["frozen_before"][name]), name
    for name, param in t["reference"].named_parameters():
        if not param.requires_grad:
            assert torch.equal(param, t["base_before"][name]), name


def test_lora_optimizer_holds_only_the_adapters(lora_trained):
    """No optimizer state or fp32 master copy for the frozen base: the optimizer's parameters are the adapters."""
    module, engine = lora_trained["module"], lora_trained["engine"]
    trainable, total = parameter_counts(module)
    in_optimizer = [p for group in engine.optimizer.param_groups for p in group["params"]]
    assert sum(p.numel() for p in in_optimizer) == trainable
    expected = {"q_proj": (CFG.hidden_size, CFG.num_attention_heads * CFG.head_dim),
                "k_proj": (CFG.hidden_size, CFG.num_key_value_heads * CFG.head_dim),
                "v_proj": (CFG.hidden_size, CFG.num_key_value_heads * CFG.head_dim),
                "o_proj": (CFG.num_attention_heads * CFG.head_dim, CFG.hidden_size),
                "gate_proj": (CFG.hidden_size, CFG.intermediate_size), "up_proj": (CFG.hidden_size, CFG.intermediate_size),
                "down_proj": (CFG.intermediate_size, CFG.hidden_size)}
    assert trainable == CFG.num_hidden_layers * sum(LORA.rank * (i + o) for i, o in expected.values())
    assert total == trainable + sum(layer_parameter_counts(CFG))
    # AdamW's moments exist for the adapters only
    assert {id(p) for p in engine.optimizer.state} == {id(p) for p in in_optimizer}


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_lora_gradients_reach_the_adapters_through_activation_checkpointing(gloo_group, hf_dir, lora_trained,
                                                                             reentrant):
    """Every decoder layer in an activation checkpoint, behind the frozen embedding: the adapters get the same
    gradients as without checkpointing (a reentrant checkpoint whose input needs no gradient would give none)."""
    module = _lora_stage(hf_dir, activation_checkpoint_interval=1, activation_checkpoint_reentrant=reentrant)
    engine, _, _, _ = deepspeed.initialize(model=module, config=ds_config(),
                                           model_parameters=[p for p in module.parameters() if p.requires_grad])
    grads = _adapter_gradients(engine, module)
    loss = engine.train_batch(data_iter=iter([b for b, _ in micro_batches(GRAD_ACCUM)]))
    torch.testing.assert_close(loss, lora_trained["ds_loss"], rtol=1e-6, atol=0.0)
    assert sorted(grads) == sorted(lora_trained["ds_grads"])
    for name, grad in grads.items():
        torch.testing.assert_close(grad, lora_trained["ds_grads"][name], rtol=1e-5, atol=1e-9, msg=name)


def test_lora_adapters_do_not_depend_on_the_stage_split(gloo_group):
    """Each decoder layer's adapter is drawn from (seed, layer index): the whole model in one Sequential and the
    module of one stage hold the same adapters, and the global RNG is untouched."""
    from raytrain.pipeline.model import build_sequential

    whole = build_sequential(CFG, seed=5)
    state = torch.random.get_rng_state()
    add_adapters(whole, LORA, seed=5)
    assert torch.equal(torch.random.get_rng_state(), state)
    stage = build_pipeline_module(CFG, num_stages=1, seed=5)
    add_adapters(stage, LORA, seed=5)
    ours, theirs = adapter_state_dict(whole), adapter_state_dict(stage)
    assert sorted(ours) == sorted(theirs) and ours
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    # and a layer's adapter differs from the next layer's
    a = ours["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    b = ours["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"]
    assert not torch.equal(a, b)


def test_lora_with_bf16_and_zero1_holds_the_base_in_bf16_and_only_the_adapters_in_fp32(gloo_group, hf_dir):
    """DeepSpeed's bf16 ZeRO-1 optimizer with a frozen base (CPU accelerator): the module, base and adapters, runs
    in bf16; the optimizer's fp32 master partition has exactly the adapters' size; only adapters change."""
    module = _lora_stage(hf_dir)
    config = {**ds_config(), "bf16": {"enabled": True}, "zero_optimization": {"stage": 1}, "gradient_clipping": 1.0}
    engine, _, _, _ = deepspeed.initialize(model=module, config=config,
                                           model_parameters=[p for p in module.parameters() if p.requires_grad])
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    loss = engine.train_batch(data_iter=iter([b for b, _ in micro_batches(GRAD_ACCUM)]))
    assert torch.isfinite(loss)
    assert {p.dtype for p in module.parameters()} == {torch.bfloat16}
    trainable, _total = parameter_counts(module)
    assert sum(t.numel() for t in engine.optimizer.single_partition_of_fp32_groups) == trainable
    changed = {n for n, p in module.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(".lora_" in n for n in changed)


@pytest.mark.parametrize("accumulation", [None, "fp32"], ids=["zero1", "zero1-fp32-accumulation"])
def test_a_stage_without_adapters_steps_with_the_bf16_optimizers(gloo_group, hf_dir, lora_trained, accumulation):
    """A LoRA stage whose layers hold no adapter (here: every adapter frozen) gets the placeholder of
    raytrain.pipeline.engine.optimizer_parameters; DeepSpeed's ZeRO-1 and BF16 optimizers (the GPU presets') step
    it, and it stays zero. Without it DeepSpeed cannot build (empty parameter list) or step (no gradient to norm)."""
    from raytrain.pipeline.engine import optimizer_parameters

    module = _lora_stage(hf_dir)
    module.requires_grad_(False)
    params = optimizer_parameters(module)
    assert [p.numel() for p in params] == [1] and params[0] is module.lora_placeholder
    config = {**ds_config(), "bf16": {"enabled": True}, "zero_optimization": {"stage": 1}, "gradient_clipping": 1.0}
    if accumulation:
        config["data_types"] = {"grad_accum_dtype": accumulation}
    engine, _, _, _ = deepspeed.initialize(model=module, config=config, model_parameters=params)
    kind = {None: "DeepSpeedZeroOptimizer", "fp32": "BF16_Optimizer"}[accumulation]
    assert type(engine.optimizer).__name__ == kind
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    loss = engine.train_batch(data_iter=iter([b for b, _ in micro_batches(GRAD_ACCUM)]))
    torch.testing.assert_close(loss.float(), lora_trained["ds_loss"].float(), rtol=2e-2, atol=0.0)  # bf16 forward
    assert all(torch.equal(p, before[n]) for n, p in module.named_parameters())
