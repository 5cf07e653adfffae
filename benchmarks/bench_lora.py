"""LoRA against the full fine-tune, side by side: the `small` preset (~59M parameters) with pp = 2 on CPU, the same
data, steps and save for both, in one run (rounds alternate full / LoRA so the machine's drift hits both). Prints
figures; never asserts.

    python benchmarks/bench_lora.py [--steps 4] [--rounds 2] [--seq-len 128] [--rank 16]

Per variant: trainable parameters, optimizer-state bytes per stage (fp32 master copies and Adam moments the
optimizer holds), checkpoint bytes (what StageEngine.save wrote) and save time, median step time. Then the same
arithmetic for Mistral-7B: bytes of weights + optimizer per GPU and checkpoint size, full fine-tune (the
mistral7b-1node-8gpu preset) against LoRA (mistral7b-1node-8gpu-lora).

Two processes (one per stage, a gloo group, no Ray) run raytrain's own pieces: build_stage_engine (with or without
model.lora), the training feed and StageEngine.save.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _optimizer_bytes(engine) -> int:
    """Bytes of every tensor the optimizer holds: Adam's moments and, where DeepSpeed keeps one, the fp32 master."""
    import torch

    total = 0
    for state in engine.optimizer.state.values():
        total += sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t))
    return total


def worker(rank: int, port: int, args: argparse.Namespace, lora_rank: int, root: str, result_path: str) -> None:
    import torch.distributed as dist
    from bench_pipeline import random_feed, small_pp2_stage

    from raytrain.config import LoraConfig
    from raytrain.pipeline.lora import parameter_counts

    lora = LoraConfig(rank=lora_rank, alpha=2.0 * lora_rank) if lora_rank else None
    cfg, stage = small_pp2_stage(rank, port, lora)
    feed = random_feed(cfg.vocab_size, args.seq_len, grad_accum_steps=2)
    step_s = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        stage.train_batch(feed)
        step_s.append(time.perf_counter() - t0)
    dist.barrier()
    t0 = time.perf_counter()
    stage.save(root, {"step": args.steps, "data_position": args.steps * 2})
    dist.barrier()
    save_s = time.perf_counter() - t0
    trainable, total = parameter_counts(stage.engine.module)
    own = [os.path.join(dp, f) for dp, _, fs in os.walk(root) for f in fs]
    with open(f"{result_path}.rank{rank}", "w", encoding="utf-8") as f:
        json.dump({"step_s": step_s, "save_s": save_s, "trainable": trainable, "total": total,
                   "optimizer_bytes": _optimizer_bytes(stage.engine),
                   "checkpoint_bytes": sum(os.path.getsize(p) for p in own) if rank == 0 else 0}, f)
    dist.destroy_process_group()


def run_variant(args: argparse.Namespace, lora_rank: int) -> list[dict]:
    import torch.multiprocessing as mp
    from bench_pipeline import free_port

    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        root, result = os.path.join(tmp, "ckpt"), os.path.join(tmp, "result")
        mp.start_processes(worker, args=(free_port(), args, lora_rank, root, result), nprocs=2, join=True,
                           start_method="spawn")
        out = []
        for rank in range(2):
            with open(f"{result}.rank{rank}", encoding="utf-8") as f:
                out.append(json.load(f))
    return out


def seven_b(rank: int) -> None:
    """The 7B presets' arithmetic (the configs' comments): bytes of weights + optimizer per GPU and checkpoint size."""
    from raytrain.config import LoraConfig
    from raytrain.pipeline.lora import adapter_parameter_count
    from raytrain.pipeline.model import MistralConfig, layer_parameter_counts

    cfg = MistralConfig.preset("mistral-7b")
    params = sum(layer_parameter_counts(cfg))
    adapters = adapter_parameter_count(cfg, LoraConfig(rank=rank))
    largest_stage = 1.876e9  # mistral7b-1node-8gpu: pp=4 (embedding or head + 8 decoder layers)
    full_gpu = largest_stage * (8 + 12 / 2)  # bf16 weight + grad + fp32 accumulation, master + Adam over dp=2
    lora_gpu = params * 2 + adapters * (8 + 12 / 8)  # pp=1 x dp=8: frozen bf16 base + adapters as a full FT's weights
    print(f"7B, rank {rank} on all seven projections: {adapters:,} trainable of {params:,} "
          f"({100 * adapters / params:.2f}%)")
    print(f"  weights + optimizer per GPU: full fine-tune (pp=4 x dp=2) {full_gpu / 2**30:.1f} GiB, "
          f"LoRA (pp=1 x dp=8) {lora_gpu / 2**30:.1f} GiB")
    print(f"  checkpoint: full fine-tune {params * 14 / 1e9:.0f} GB (bf16 weights + fp32 master and Adam), "
          f"LoRA {adapters * 14 / 1e9:.2f} GB (the adapters and their optimizer state)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2, help="full / LoRA pairs, alternating")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    results: dict[str, list[list[dict]]] = {"full": [], "lora": []}
    for _ in range(args.rounds):
        results["full"].append(run_variant(args, 0))
        results["lora"].append(run_variant(args, args.rank))
    print(f"small preset, pp=2, CPU, seq {args.seq_len}, {args.steps} steps x {args.rounds} rounds; LoRA rank "
          f"{args.rank} (alpha {2 * args.rank}) on all seven projections")
    summary = {}
    for name, rounds in results.items():
        step = statistics.median(s for ranks in rounds for s in ranks[0]["step_s"][1:] or ranks[0]["step_s"])
        save = statistics.median(max(r["save_s"] for r in ranks) for ranks in rounds)
        first = rounds[0]
        trainable, total = sum(r["trainable"] for r in first), sum(r["total"] for r in first)
        optim = [r["optimizer_bytes"] for r in first]
        ckpt = first[0]["checkpoint_bytes"]
        summary[name] = (step, save, ckpt, sum(optim))
        print(f"  {name:4s}: {trainable:,} trainable of {total:,}; optimizer state per stage "
              f"{', '.join(f'{b / 2**20:.1f}' for b in optim)} MiB; checkpoint {ckpt / 2**20:.1f} MiB saved in "
              f"{save:.2f} s; step {step:.3f} s (median)")
    (fs, fv, fc, fo), (ls, lv, lc, lo) = summary["full"], summary["lora"]
    print(f"  LoRA / full: step time {ls / fs:.2f}, optimizer state {lo / fo:.4f}, checkpoint {lc / fc:.4f}, "
          f"save time {lv / fv:.2f}")
    seven_b(args.rank)


if __name__ == "__main__":
    main()
