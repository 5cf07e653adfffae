"""Two real pipeline stages in two processes (gloo, CPU): activations (hidden, position_ids, segment_ids) cross a
stage boundary, and the merged per-layer checkpoint exports to the model transformers + AdamW would have trained;
with LoRA adapters on a frozen base, one step equals peft's on transformers' model."""

import copy
import json
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
import transformers

from raytrain.config import LoraConfig
from raytrain.pipeline.hf_io import export_to_hf
from raytrain.pipeline.model import MistralConfig

# Integration: starts two processes (~15 s); tests/integration/conftest.py marks it.

CFG = MistralConfig.preset("tiny")
MICRO_BATCH_SIZE, GRAD_ACCUM, SEQ_LEN = 2, 2, 16
ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
LORA = LoraConfig(rank=4, alpha=8.0)


def _adapter_values(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The adapters both sides start from, a function of the PEFT name alone (peft starts lora_B at zero, which would
    leave lora_A without a gradient on the first step)."""
    import zlib

    return torch.randn(shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode()))) * 0.05


def _batches():
    """Packed micro-batches (two documents per row) with next-token labels, and the per-document pieces."""
    generator = torch.Generator().manual_seed(21)
    out = []
    for _ in range(GRAD_ACCUM):
        input_ids = torch.randint(0, CFG.vocab_size, (MICRO_BATCH_SIZE, SEQ_LEN), generator=generator)
        split = 6  # document A = tokens [0, 6), document B = [6, 16)
        position_ids = torch.cat([torch.arange(split), torch.arange(SEQ_LEN - split)]).expand(MICRO_BATCH_SIZE, -1)
        segment_ids = torch.cat([torch.zeros(split), torch.ones(SEQ_LEN - split)]).long().expand(MICRO_BATCH_SIZE, -1)
        labels = torch.full_like(input_ids, -100)
        labels[:, : split - 1] = input_ids[:, 1:split]  # next token inside document A
        labels[:, split:-1] = input_ids[:, split + 1:]  # next token inside document B
        out.append(((input_ids, position_ids.contiguous(), segment_ids.contiguous()), labels))
    return out


def _worker(rank: int, port: int, hf_dir: str, save_dir: str, result_dir: str, lora: str = "") -> None:
    """One stage's process; ``lora``: the partition method of a LoRA step (empty: the full fine-tune's step)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    import deepspeed

    from raytrain.pipeline.engine import init_distributed
    from raytrain.pipeline.hf_io import load_hf_into_stage
    from raytrain.pipeline.model import hf_prefix
    from raytrain.pipeline.module import build_pipeline_module, stage_range

    init_distributed("gloo")
    module = build_pipeline_module(CFG, num_stages=2, seed=1, **({"partition_method": lora} if lora else {}))
    load_hf_into_stage(module, hf_dir)
    if lora:
        _lora_worker(rank, module, result_dir)
        return
    engine, _, _, _ = deepspeed.initialize(model=module, config=_ds_config(), model_parameters=module.parameters())
    start, _stop = stage_range(module)
    names = {id(p): hf_prefix(start + i, CFG) + n
             for i, layer in enumerate(module.forward_funcs) for n, p in layer.named_parameters()}
    grads: dict[str, torch.Tensor] = {}

    def snapshot(optimizer, _args, _kwargs):  # gradients as the optimizer sees them
        grads.update({names[id(p)]: p.grad.detach().clone() for g in optimizer.param_groups for p in g["params"]})

    engine.optimizer.register_step_pre_hook(snapshot)
    loss = engine.train_batch(data_iter=iter(_batches()))
    engine.save_checkpoint(save_dir, tag="step1")
    torch.save(grads, os.path.join(result_dir, f"grads{rank}.pt"))
    with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"loss": float(loss), "range": list(stage_range(module))}, f)
    torch.distributed.barrier()


def _ds_config() -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO_BATCH_SIZE,
        "gradient_accumulation_steps": GRAD_ACCUM,
        "optimizer": {"type": "AdamW", "params": {**ADAMW, "betas": list(ADAMW["betas"]), "torch_adam": True}},
        "gradient_clipping": 0.0,  # DeepSpeed clips to 1.0 unless told otherwise
        "steps_per_print": 10_000,
    }


def _lora_worker(rank: int, module, result_dir: str) -> None:
    """One step of this stage with adapters: its loss, adapter gradients (as the optimizer sees them) and updated
    adapters under PEFT names, and whether its frozen weights came through bit-identical."""
    import deepspeed

    from raytrain.pipeline.engine import optimizer_parameters
    from raytrain.pipeline.lora import adapter_state_dict, add_adapters, load_adapter_state_dict
    from raytrain.pipeline.module import stage_range

    add_adapters(module, LORA, seed=1)
    load_adapter_state_dict(module, {n: _adapter_values(n, tuple(t.shape)) for n, t in adapter_state_dict(module).items()})
    frozen = {n: p.detach().clone() for n, p in module.named_parameters() if not p.requires_grad}
    params = optimizer_parameters(module)  # a stage without adapters: one placeholder
    engine, _, _, _ = deepspeed.initialize(model=module, config=_ds_config(), model_parameters=params)
    trainable = [p for n, p in module.named_parameters() if ".lora_" in n]
    names = {id(p): n for n, p in zip(adapter_state_dict(module), trainable, strict=True)}
    names.update({id(p): "placeholder" for p in params if not trainable})
    grads: dict[str, torch.Tensor] = {}

    def snapshot(optimizer, _args, _kwargs):
        grads.update({names[id(p)]: p.grad.detach().clone() for g in optimizer.param_groups for p in g["params"]
                      if p.grad is not None})

    engine.optimizer.register_step_pre_hook(snapshot)
    loss = engine.train_batch(data_iter=iter(_batches()))
    torch.save({"grads": grads, "adapters": {n: t.clone() for n, t in adapter_state_dict(module).items()}},
               os.path.join(result_dir, f"lora{rank}.pt"))
    unchanged = all(torch.equal(p, frozen[n]) for n, p in module.named_parameters() if not p.requires_grad)
    with open(os.path.join(result_dir, f"lora{rank}.json"), "w") as f:
        json.dump({"loss": float(loss), "frozen_unchanged": unchanged, "frozen": len(frozen),
                   "layers": list(stage_range(module)), "placeholder_unchanged": all(
                       torch.equal(p, torch.zeros(1)) for p in params if not trainable)}, f)
    torch.distributed.barrier()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reference_backward(reference) -> float:
    """The reference's gradients for the step: each packed document run alone through transformers (or peft on it),
    the packed loss = mean over all targets per micro-batch, accumulated over the micro-batches; returns the loss."""
    losses = []
    for (input_ids, _position_ids, _segment_ids), labels in _batches():
        logits = torch.cat([reference(input_ids=input_ids[:, :6]).logits,
                            reference(input_ids=input_ids[:, 6:]).logits], dim=1)  # (B, T, V)
        keep = labels != -100
        loss = torch.nn.functional.cross_entropy(logits[keep], labels[keep])
        (loss / GRAD_ACCUM).backward()
        losses.append(loss.detach())
    return torch.stack(losses).mean().item()


def test_two_stage_training_step_matches_transformers(tmp_path):
    hf_dir, save_dir, result_dir = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "results"
    result_dir.mkdir()
    torch.manual_seed(0)
    reference = transformers.MistralForCausalLM._from_config(CFG.to_hf(), attn_implementation="eager")
    reference.save_pretrained(hf_dir)

    mp.start_processes(_worker, args=(_free_port(), str(hf_dir), str(save_dir), str(result_dir)), nprocs=2,
                       join=True, start_method="spawn")
    results = [json.loads((result_dir / f"rank{r}.json").read_text()) for r in range(2)]
    assert results[0]["range"][0] == 0 and results[0]["range"][1] == results[1]["range"][0]
    assert results[1]["range"][1] == CFG.num_pipeline_layers

    before = copy.deepcopy(reference.state_dict())
    optimizer = torch.optim.AdamW(reference.parameters(), **ADAMW)
    expected_loss = _reference_backward(reference)
    expected_grads = {name: p.grad.detach().clone() for name, p in reference.named_parameters()}
    optimizer.step()
    assert results[1]["loss"] == pytest.approx(expected_loss, rel=1e-5)
    grads = {**torch.load(result_dir / "grads0.pt"), **torch.load(result_dir / "grads1.pt")}
    assert sorted(grads) == sorted(expected_grads)
    for name, grad in grads.items():  # stage 0's gradients arrived through the pipeline's backward sends
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-4, atol=1e-8, msg=name)

    out = export_to_hf(save_dir / "step1", CFG, tmp_path / "export")
    exported = transformers.MistralForCausalLM.from_pretrained(out).state_dict()
    updated = reference.state_dict()
    for name, tensor in exported.items():
        # Adam divides by |grad| + eps: where |grad| is near eps (1e-8) fp32 noise in the gradient moves the update
        # by up to lr, so exact agreement is only expected where the gradient is well above eps.
        clear = expected_grads[name].abs() > 1e-6
        torch.testing.assert_close(tensor[clear], updated[name][clear], rtol=0.0, atol=1e-5, msg=name)
        assert (tensor - updated[name]).abs().max() <= 2 * ADAMW["lr"], name
        assert not torch.equal(tensor, before[name]), name  # every tensor was updated


@pytest.mark.parametrize("partition", ["type:DecoderLayerPipe", "uniform"])
def test_two_stage_lora_step_matches_peft_on_transformers(tmp_path, partition):
    """One optimizer step of two LoRA stages (adapters on a frozen base, fp32) against peft's LoRA on transformers'
    MistralForCausalLM from the same base, adapters and packed batch: loss, every adapter's gradient (stage 0's
    reached it through the frozen embedding's activations and the backward send), the updated adapters. With the
    uniform partition the last stage holds only the final norm and the LM head: no adapter, nothing to train, and it
    still steps (DeepSpeed #5071) and sends its gradient back."""
    import peft

    from raytrain.pipeline.lora import peft_config

    hf_dir, result_dir = tmp_path / "hf", tmp_path / "results"
    result_dir.mkdir()
    torch.manual_seed(1)
    base = transformers.MistralForCausalLM._from_config(CFG.to_hf(), attn_implementation="eager")
    base.save_pretrained(hf_dir)
    mp.start_processes(_worker, args=(_free_port(), str(hf_dir), "", str(result_dir), partition), nprocs=2,
                       join=True, start_method="spawn")
    results = [json.loads((result_dir / f"lora{r}.json").read_text()) for r in range(2)]
    assert all(r["frozen_unchanged"] and r["frozen"] > 0 and r["placeholder_unchanged"] for r in results)
    ours = [torch.load(result_dir / f"lora{r}.pt") for r in range(2)]
    grads = {**ours[0]["grads"], **ours[1]["grads"]}
    updated = {**ours[0]["adapters"], **ours[1]["adapters"]}
    if partition == "uniform":  # stage 1: the final norm and the LM head (pipeline layers 3 and 4), no adapter
        assert results[1]["layers"] == [3, CFG.num_pipeline_layers] and not ours[1]["adapters"]
        assert list(ours[1]["grads"]) == ["placeholder"] and not ours[1]["grads"]["placeholder"].any()
        del grads["placeholder"]  # its gradient is zero: it never changes
    else:
        assert ours[0]["grads"] and ours[1]["grads"]  # both stages hold adapters

    reference = peft.get_peft_model(base, peft_config(LORA))
    start = {n: _adapter_values(n, tuple(t.shape)) for n, t in updated.items()}
    assert not peft.set_peft_model_state_dict(reference, start).unexpected_keys
    optimizer = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], **ADAMW)
    expected_loss = _reference_backward(reference)
    peft_name = {n: n.replace(".default.", ".") for n, p in reference.named_parameters() if p.requires_grad}
    expected = {peft_name[n]: p.grad.detach().clone() for n, p in reference.named_parameters() if p.requires_grad}
    optimizer.step()
    after = {peft_name[n]: p.detach() for n, p in reference.named_parameters() if p.requires_grad}
    assert results[1]["loss"] == pytest.approx(expected_loss, rel=1e-5)
    assert sorted(grads) == sorted(expected) == sorted(updated) and len(grads) == 2 * 7 * CFG.num_hidden_layers
    for name, grad in grads.items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-8, msg=name)
    for name, tensor in updated.items():
        clear = expected[name].abs() > 1e-6  # Adam's step near |grad| ~ eps is fp32 noise (see the test above)
        torch.testing.assert_close(tensor[clear], after[name][clear], rtol=0.0, atol=1e-5, msg=name)
        assert not torch.equal(tensor, start[name]), name
