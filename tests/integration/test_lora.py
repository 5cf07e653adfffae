"""LoRA runs through Ray Train (pp=2 DeepSpeed stages on CPU, gloo), without Spark: synthetic conversations are
packed by Ray Data into the run's data folder, then `raytrain.runner.run_train` trains adapters on the tiny Mistral.

Checks: checkpoints hold only the adapters; the frozen base ends bit-identical to the seeded base; a run stopped
and resumed ends bit-equal to an uninterrupted one; a resume with other LoRA settings or onto another base is
refused naming both; the run summary and `raytrain status` say it is a LoRA run with its parameter counts.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest
import torch
from cli_runs import cli
from synthetic_data import synthetic_conversations, write_packed

from raytrain.checkpoint.store import CheckpointStore
from raytrain.config import load_job_config
from raytrain.errors import RaytrainError
from raytrain.pipeline.lora import add_adapters
from raytrain.pipeline.model import build_sequential, model_config
from raytrain.runner import open_run, run_train

STEPS = 4
LORA = ["model.lora.rank=4", "model.lora.alpha=8"]


def make_job(root, run_name: str, *overrides: str):
    return load_job_config("configs/cpu-tiny.yaml", [
        f"storage.root={root}", f"storage.run_name={run_name}", "storage.user=ci", f"train.max_steps={STEPS}",
        "train.checkpoint_every=2", "train.warmup_steps=1", "train.lr=1e-2", "dataset.length_policy=split",
        "dataset.validation_fraction=0.1", *LORA, *overrides])


def _metrics(job) -> list[dict]:
    with open(open_run(job).root.join("reports", "metrics.jsonl").path) as f:
        return [json.loads(line) for line in f]


def _digests(job) -> dict[str, str]:
    """Every parameter's digest at the end of the run, both stages (raytrain.trainer.loop's param_digest files)."""
    reports = open_run(job).root.join("reports").path
    out: dict[str, str] = {}
    for rank in (0, 1):
        with open(os.path.join(reports, f"param_digest_rank{rank}.json")) as f:
            out.update(json.load(f)["digests"])
    return out


@pytest.fixture(scope="module")
def straight(ray_local, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    job = make_job(root, "straight")
    packed = write_packed(job, synthetic_conversations(60, uuid_prefix="lora"))
    assert packed.num_packs // job.train.micro_batch_size >= STEPS * job.train.grad_accum_steps
    return job, run_train(job)


@pytest.fixture(scope="module")
def resumed(straight):
    """The same run stopped after step 2, then launched again to step 4."""
    src, _ = straight
    job = make_job(src.storage.root, "resumed", "train.stop_at_step=2")
    shutil.copytree(open_run(src).paths.packed.path, open_run(job).paths.packed.path)
    run_train(job)
    again = make_job(src.storage.root, "resumed")
    return again, run_train(again)


def test_checkpoints_hold_only_the_adapters(straight):
    job, _ = straight
    ckpt = CheckpointStore(open_run(job).root).latest()
    layer_files = sorted(f for f in ckpt.manifest["files"] if "/layer_" in f)
    assert len(layer_files) == 5  # embedding, 2 decoder layers, final norm, head: one file each
    saved = {rel: torch.load(os.path.join(ckpt.local_path, rel), map_location="cpu", weights_only=True)
             for rel in layer_files}
    decoder = {rel: state for rel, state in saved.items() if "layer_01" in rel or "layer_02" in rel}
    assert all(not state for rel, state in saved.items() if rel not in decoder)  # frozen layers: nothing saved
    for state in decoder.values():
        assert state and all(".lora_A." in k or ".lora_B." in k for k in state), sorted(state)
        assert len(state) == 2 * len(job.model.lora.targets)
    adapters = sum(t.numel() for state in decoder.values() for t in state.values())
    assert adapters == json.loads(open_run(job).root.join("reports", "run_summary.json").read_text()
                                  )["parameters"]["trainable"] == 8192
    # the checkpoint's size is the adapters', not the 4.3M-parameter base's
    size = sum(os.path.getsize(os.path.join(ckpt.local_path, rel)) for rel in layer_files)
    assert size < 200_000, size


def test_the_base_stays_as_seeded_and_the_adapters_train(straight):
    job, _ = straight
    losses = [m["loss"] for m in _metrics(job)]
    assert len(losses) == STEPS and all(x == x for x in losses)
    fresh = build_sequential(model_config(job.model.preset), seed=job.train.seed)
    add_adapters(fresh, job.model.lora, job.train.seed)
    digests = _digests(job)
    for name, param in fresh.named_parameters():
        ours = hashlib.sha256(param.detach().float().contiguous().numpy().tobytes()).hexdigest()[:16]
        if ".lora_" in name:
            assert digests[name] != ours, f"{name} did not train"
        else:
            assert digests[name] == ours, f"{name} of the frozen base changed"
    assert set(digests) == {n for n, _ in fresh.named_parameters()}


def test_resumed_run_matches_the_uninterrupted_one(straight, resumed):
    (job, _), (again, summary) = straight, resumed
    assert summary["final"]["step"] == STEPS
    assert [m["loss"] for m in _metrics(again)] == [m["loss"] for m in _metrics(job)]  # bit-equal on CPU
    assert _digests(again) == _digests(job)


@pytest.mark.parametrize("change,message", [
    (("model.lora.rank=8",), r"was trained with model\.lora \{[^}]*'rank': 4, [^}]*\}, this config has "
                             r"\{[^}]*'rank': 8, "),
    (("model.lora.rank=0",), r"was trained with model\.lora \{[^}]*'rank': 4, [^}]*\}, this config has "
                             r"\{[^}]*'rank': 0, "),
    (("train.seed=1",), r"holds LoRA adapters trained on the base \{'preset': 'tiny', 'seed': \d+\}; this "
                        r"config's base is \{'preset': 'tiny', 'seed': 1\}"),
])
def test_resuming_with_other_settings_or_onto_another_base_is_refused(straight, change, message):
    job, _ = straight
    with pytest.raises(RaytrainError, match=message):
        run_train(make_job(job.storage.root, "straight", *change))
    assert [c.step for c in CheckpointStore(open_run(job).root).committed()] == [2, 4]  # nothing trained on top


def test_summary_status_and_tensorboard_say_lora(straight):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    job, summary = straight
    board = EventAccumulator(open_run(job).root.join("reports", "tensorboard").path, size_guidance={"tensors": 0})
    board.Reload()
    (text,) = board.Tensors("run/parameters/text_summary")
    assert text.tensor_proto.string_val[0].decode() == \
        "LoRA rank 4 on q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj: 8,192 trainable of " \
        f"{summary['parameters']['total']:,} parameters"
    assert summary["lora"]["rank"] == 4 and summary["parameters"]["trainable"] == 8192
    assert summary["parameters"]["total"] > 4_000_000
    out = cli("status", open_run(job).root.path)
    assert out.returncode == 0, out.stderr
    assert "parameters   LoRA rank 4 on q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj: 8,192 " \
           "trainable of " in out.stdout


# ---- export: the merged model, the PEFT adapter folder, the seeded base ------------------------------------------
@pytest.fixture(scope="module")
def exported(straight, tmp_path_factory):
    from raytrain.runner import export_latest

    job, _ = straight
    return job, export_latest(job, str(tmp_path_factory.mktemp("lora-export") / "out"))


def _pipeline_with_trained_adapters(job) -> torch.nn.Sequential:
    """Our layers in one process: the seeded base plus the adapters of the run's latest checkpoint."""
    from raytrain.pipeline.lora import decoder_layers

    ours = build_sequential(model_config(job.model.preset), seed=job.train.seed)
    add_adapters(ours, job.model.lora, job.train.seed)
    ckpt = CheckpointStore(open_run(job).root).latest()
    for layer in decoder_layers(ours):
        trained = torch.load(os.path.join(ckpt.local_path, "ds", f"layer_{layer.layer_idx + 1:02d}-model_states.pt"),
                             map_location="cpu", weights_only=True)
        layer.load_state_dict(trained, strict=False)
        assert all(torch.equal(p, trained[n]) for n, p in layer.named_parameters() if p.requires_grad)
    return ours.eval()


def test_merged_export_and_peft_adapter_give_the_pipelines_logits(exported):
    import peft
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    job, out = exported
    input_ids = torch.randint(0, 32768, (2, 24), generator=torch.Generator().manual_seed(3))
    position_ids = torch.arange(24).expand(2, 24)
    with torch.no_grad():
        ours = _pipeline_with_trained_adapters(job)((input_ids, position_ids, torch.zeros_like(input_ids)))
        merged = AutoModelForCausalLM.from_pretrained(out).eval()(input_ids=input_ids).logits
        base = AutoModelForCausalLM.from_pretrained(os.path.join(out, "base"))
        adapted = peft.PeftModel.from_pretrained(base, os.path.join(out, "adapter")).eval()
        with_adapter = adapted(input_ids=input_ids).logits
    torch.testing.assert_close(merged, ours, rtol=0, atol=2e-5)
    torch.testing.assert_close(with_adapter, ours, rtol=0, atol=2e-5)
    # the adapter folder is peft's format: its config as peft reads it, its tensor names as peft itself saves them
    config = peft.PeftConfig.from_pretrained(os.path.join(out, "adapter"))
    assert (config.peft_type, config.r, config.lora_alpha) == (peft.PeftType.LORA, 4, 8)
    assert set(config.target_modules) == set(job.model.lora.targets)
    assert config.base_model_name_or_path == os.path.join(out, "base")
    with safe_open(os.path.join(out, "adapter", "adapter_model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert names == set(peft.get_peft_model_state_dict(adapted)) and len(names) == 2 * 7 * 2


def test_generate_answers_the_same_from_the_merged_model_and_the_adapter(exported):
    from raytrain.generate import generate

    _, out = exported
    merged = generate(out, "Why is the sky blue?", max_new_tokens=6)
    adapter = generate(os.path.join(out, "adapter"), "Why is the sky blue?", max_new_tokens=6)
    assert merged.prompt_ids == adapter.prompt_ids and merged.new_ids == adapter.new_ids and merged.new_ids


# ---- the first step through Ray Train against peft on transformers ------------------------------------------------
@pytest.fixture(scope="module")
def three_steps(straight):
    """Three optimizer steps, checkpointed after the third. DeepSpeed's WarmupCosineLR runs the first two at
    learning rate 0 (before its first step, and at warmup ratio 0 / 1); the third moves the adapters."""
    src, _ = straight
    job = make_job(src.storage.root, "three-steps", "train.max_steps=3", "train.warmup_steps=1",
                   "train.checkpoint_every=3")
    shutil.copytree(open_run(src).paths.packed.path, open_run(job).paths.packed.path)
    run_train(job)
    return job


def _hf_reference(job):
    """transformers' MistralForCausalLM holding the run's seeded base, with peft's adapters set to the ones the run
    started from (drawn again from the seed): the same model, made by code no one here wrote."""
    import peft
    import transformers

    from raytrain.pipeline.lora import adapter_state_dict, peft_config
    from raytrain.pipeline.model import hf_prefix

    cfg, seed = model_config(job.model.preset), job.train.seed
    hf = transformers.MistralForCausalLM._from_config(cfg.to_hf(), attn_implementation="eager")
    hf.load_state_dict({hf_prefix(i, cfg) + name: tensor for i, layer in enumerate(build_sequential(cfg, seed=seed))
                        for name, tensor in layer.state_dict().items()})
    ours = build_sequential(cfg, seed=seed)
    add_adapters(ours, job.model.lora, seed)
    reference = peft.get_peft_model(hf, peft_config(job.model.lora))
    assert not peft.set_peft_model_state_dict(reference, adapter_state_dict(ours)).unexpected_keys
    return reference


def _global_batch_loss(reference, job, step: int) -> tuple[torch.Tensor, int]:
    """The global batch of ``step`` (its packs of epoch 0's order, read by pyarrow), each packed document run alone
    through the reference: cross-entropy summed over every target token, divided by their count."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raytrain.dataset.labels import IGNORE_INDEX
    from raytrain.trainer.pack_order import epoch_order

    tc, packed = job.train, open_run(job).paths.packed.path
    with open(os.path.join(packed, "_manifest.json")) as f:
        manifest = json.load(f)
    table = pa.concat_tables([pq.read_table(os.path.join(packed, n), columns=["input_ids", "segment_ids", "labels"])
                              for n in manifest["files"]])
    per_step = tc.dp * tc.grad_accum_steps * tc.micro_batch_size
    rows = epoch_order(manifest["num_packs"], 0, tc.seed, tc.shuffle)[(step - 1) * per_step:step * per_step]
    loss_sum, targets = torch.zeros(()), 0
    for row in rows:
        ids, seg, labels = (torch.tensor(np.array(table.column(c)[int(row)].as_py())) for c in
                            ("input_ids", "segment_ids", "labels"))
        for doc in sorted(set(seg.tolist()) - {-1}):
            where = (seg == doc).nonzero().flatten()
            a, b = int(where[0]), int(where[-1]) + 1
            logits = reference(input_ids=ids[a:b][None]).logits[0]  # (T_doc, V)
            loss_sum = loss_sum + torch.nn.functional.cross_entropy(logits, labels[a:b], ignore_index=IGNORE_INDEX,
                                                                    reduction="sum")
            targets += int((labels[a:b] != IGNORE_INDEX).sum())
    return loss_sum / targets, targets


def test_steps_through_ray_train_equal_peft_on_transformers(three_steps):
    """pp=2 through Ray Train, fp32, CPU, from the run's own initial adapters: each step's loss and gradient norm
    (over both stages' adapters, before clipping), and the adapters after the third step, equal peft's on
    transformers' model stepped by torch AdamW with the steps' learning rates and the ds_config's betas and eps.
    The frozen base is checked bit-identical to the seed's in test_the_base_stays_as_seeded_and_the_adapters_train.

    The learning rate a metrics row reports is the scheduler's after that step, the one the next step uses; the
    first step runs at the scheduler's initial 0."""
    job = three_steps
    tc, metrics = job.train, _metrics(job)
    used_lr = [0.0] + [row["lr"] for row in metrics[:-1]]
    assert used_lr[:2] == [0.0, 0.0] and used_lr[2] > 0
    reference = _hf_reference(job)
    trainable = {n.replace(".default.", "."): p for n, p in reference.named_parameters() if p.requires_grad}
    optimizer = torch.optim.AdamW(list(trainable.values()), lr=0.0, betas=(0.9, 0.95), eps=1e-8,
                                  weight_decay=tc.weight_decay)
    for step, row in enumerate(metrics, start=1):
        optimizer.zero_grad()
        loss, targets = _global_batch_loss(reference, job, step)
        assert row["step"] == step and row["target_tokens"] == targets
        assert row["loss"] == pytest.approx(loss.item(), rel=1e-5)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(list(trainable.values()), tc.grad_clip)
        assert row["grad_norm"] == pytest.approx(float(norm), rel=1e-4) and float(norm) > 0
        grads = {n: p.grad.clone() for n, p in trainable.items()}
        for group in optimizer.param_groups:
            group["lr"] = used_lr[step - 1]
        optimizer.step()
    ckpt = CheckpointStore(open_run(job).root).latest()
    assert ckpt.step == len(metrics) == 3
    moved = 0
    for layer in (1, 2):
        saved = torch.load(os.path.join(ckpt.local_path, "ds", f"layer_{layer:02d}-model_states.pt"),
                           weights_only=True)
        for local, tensor in saved.items():
            name = f"base_model.model.model.layers.{layer - 1}.{local.replace('.default.', '.')}"
            clear = grads[name].abs() > 1e-6  # Adam's step near |grad| ~ eps is fp32 noise
            torch.testing.assert_close(tensor[clear], trainable[name].detach()[clear], rtol=0.0, atol=1e-5,
                                       msg=name)
            moved += int(clear.any())
    assert moved >= len(job.model.lora.targets) * 2  # every lora_B of both layers moved on the third step
