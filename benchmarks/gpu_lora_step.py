"""LoRA training steps of Mistral-7B on one GPU: raytrain's own stage (build_stage_engine with model.lora), bf16 base,
rank-16 adapters on all seven projections, packed documents of seq 4,096. Prints tokens/s, MFU, peak memory and the
loss of each step (one batch repeated, so a working adapter path makes it fall); never asserts.

    PYTHONPATH=. python3 benchmarks/gpu_lora_step.py                     # one GPU, ~3-4 minutes with the load
    PYTHONPATH=. python3 benchmarks/gpu_lora_step.py --device cpu --preset tiny --seq-len 256 --steps 3

The second line is a dry run on CPU (fp32, the `dense` attention): it proves the script end to end.

One stage holds the whole model, as configs/mistral7b-lora-1gpu.yaml trains it: two pipeline stages cannot share one
GPU under NCCL, which refuses two ranks on one device (NCCL >= 2.5, "Duplicate GPU detected"). The base is seeded,
not loaded: the FLOPs and the memory are the same.

MFU counts the FLOPs a LoRA step does: raytrain.pipeline.flops' 6N + attention per token, less the 2N of weight
gradients the frozen base does not compute (forward 2N and input gradients 2N remain), plus 6 per adapter parameter.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="mistral-7b")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--docs", type=int, default=4, help="equal documents packed into the sequence")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-3, help="high for a repeated batch: the loss should fall")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak (H100 SXM 989)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu = dry run of the script")
    return parser.parse_args(argv)


def packed_batch(vocab_size: int, seq_len: int, docs: int, torch):
    """One micro-batch of ``docs`` equal documents: (input_ids, position_ids, segment_ids) and next-token labels."""
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, vocab_size, (1, seq_len), generator=generator)
    length = seq_len // docs
    position_ids = (torch.arange(seq_len) % length).unsqueeze(0)
    segment_ids = torch.clamp(torch.arange(seq_len) // length, max=docs - 1).unsqueeze(0)
    labels = torch.cat([input_ids[:, 1:], torch.full((1, 1), -100)], dim=1)
    labels[:, length - 1::length] = -100  # no target across a document boundary
    return (input_ids, position_ids, segment_ids), labels


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_lora_step: no CUDA device here; use --device cpu for a dry run", file=sys.stderr)
        return 2
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from raytrain.config import LoraConfig, TrainConfig
    from raytrain.pipeline.ds_config import derive_ds_config, load_ds_config
    from raytrain.pipeline.engine import build_stage_engine, init_distributed
    from raytrain.pipeline.flops import flops_per_token
    from raytrain.pipeline.lora import adapter_parameter_count
    from raytrain.pipeline.model import MistralConfig, layer_parameter_counts

    gpu = args.device == "cuda"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29571"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    torch.distributed.init_process_group("nccl" if gpu else "gloo", rank=0, world_size=1)
    init_distributed("nccl" if gpu else "gloo")
    cfg = MistralConfig.preset(args.preset)
    lora = LoraConfig(rank=args.rank, alpha=2.0 * args.rank)
    tc = TrainConfig(pp=1, dp=1, micro_batch_size=1, grad_accum_steps=1, max_steps=args.steps, lr=args.lr,
                     warmup_steps=1, use_gpu=gpu)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ds_path = os.path.join(repo, "configs", "ds_config_gpu.json" if gpu else "ds_config.json")
    ds_config = derive_ds_config(load_ds_config(ds_path), tc, ds_path=ds_path)
    t0 = time.perf_counter()
    stage = build_stage_engine(cfg, ds_config, pp=1, dp=1, partition_method="type:DecoderLayerPipe",
                               activation_checkpoint_interval=0, seed=0, attn_impl="segment" if gpu else "dense",
                               lora=lora)
    build_s = time.perf_counter() - t0
    device = torch.device("cuda" if gpu else "cpu")
    inputs, labels = packed_batch(cfg.vocab_size, args.seq_len, args.docs, torch)
    batch = (tuple(t.to(device) for t in inputs), labels.to(device))
    base, adapters = sum(layer_parameter_counts(cfg)), adapter_parameter_count(cfg, lora)
    embedding = layer_parameter_counts(cfg)[0]
    lora_flops = flops_per_token(cfg, args.seq_len) - 2 * (base - embedding) + 6 * adapters
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    for _ in range(args.steps):
        if gpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        losses.append(stage.train_batch(iter([batch])))
        if gpu:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    step_s = sorted(times[1:] or times)[len(times[1:] or times) // 2]  # median after the first (warm-up) step
    tokens_per_s = args.seq_len / step_s
    print(f"{args.preset}, LoRA rank {args.rank} on all seven projections: {adapters:,} trainable of "
          f"{base + adapters:,}; seq {args.seq_len} in {args.docs} documents, {args.device}, stage built in "
          f"{build_s:.1f} s")
    print(f"  step {step_s:.3f} s (median of {len(times) - 1 or 1}), {tokens_per_s:,.0f} tokens/s, "
          f"{lora_flops / 1e9:.3g} GFLOP per token counted")
    if gpu:
        mfu = tokens_per_s * lora_flops / (args.peak_tflops * 1e12)
        print(f"  MFU {100 * mfu:.1f}% of {args.peak_tflops:.0f} TFLOP/s; peak memory "
              f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB allocated, "
              f"{torch.cuda.max_memory_reserved() / 2**30:.1f} GiB reserved")
    print(f"  losses {', '.join(f'{x:.4f}' for x in losses)} (falling: {losses[-1] < losses[0]})")
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
