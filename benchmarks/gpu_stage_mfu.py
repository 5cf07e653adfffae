"""MFU of one Mistral-7B-shaped pipeline stage on one GPU: forward + backward of N decoder layers.

Plain torch + transformers (no DeepSpeed, no raytrain), so the figure isolates the compute a middle pipeline
stage does: it receives hidden states (B, T, H), runs its decoder layers, and back-propagates a gradient of the
same shape. Two attention masks are timed:

* ``causal``: no mask tensor, SDPA's ``is_causal`` path (flash kernel) -- the best case;
* ``explicit``: a boolean (1, 1, T, T) causal mask, which is what a packed-sequence model must pass (documents in
  a pack may not see each other), and which moves SDPA off the flash kernel.

FLOPs per token follow PaLM appendix B (as raytrain.pipeline.flops): 6 * N_layers + 12 * L * heads * head_dim * T.

    python benchmarks/gpu_stage_mfu.py --layers 8 --seq-len 4096 --peak-tflops 989

Prints figures and never asserts. Exits with a message when no CUDA device is present. Takes well under 5 minutes
on an H100/H200 (8 layers, 3 warmup + 10 timed iterations per mask).
"""

from __future__ import annotations

import argparse
import sys
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8, help="decoder layers in the stage (7B/4 stages = 8)")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--peak-tflops", type=float, default=989.0,
                        help="dense bf16 peak of one device in TFLOP/s (H100/H200 SXM: 989)")
    parser.add_argument("--mask", choices=["causal", "explicit", "both"], default="both")
    return parser.parse_args(argv)


def stage_flops_per_token(cfg, num_layers: int, seq_len: int, params_per_layer: int) -> float:
    """PaLM training FLOPs per token for ``num_layers`` decoder layers (no embedding, no head)."""
    context = seq_len if cfg.sliding_window is None else min(seq_len, cfg.sliding_window)
    attention = 12.0 * num_layers * cfg.num_attention_heads * cfg.head_dim * context
    return 6.0 * num_layers * params_per_layer + attention


def time_stage(layers, rotary, hidden_size: int, args, explicit_mask: bool, torch) -> float:
    """Mean seconds per forward+backward over ``args.iters`` timed iterations (CUDA events)."""
    device, dtype = torch.device("cuda"), torch.bfloat16
    shape = (args.batch_size, args.seq_len, hidden_size)
    position_ids = torch.arange(args.seq_len, device=device).expand(args.batch_size, -1)
    mask = None
    if explicit_mask:
        idx = torch.arange(args.seq_len, device=device)
        mask = (idx[None, :] <= idx[:, None])[None, None]  # (1, 1, T, T) bool, True = attend
    grad_out = torch.randn(shape, device=device, dtype=dtype)

    def step() -> None:
        hidden = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)  # (B, T, H) from prev stage
        position_embeddings = rotary(hidden, position_ids)  # (cos, sin), each (B, T, D)
        out = hidden
        for layer in layers:
            out = layer(out, attention_mask=mask, position_ids=position_ids,
                        position_embeddings=position_embeddings)
        out.backward(grad_out)  # the gradient the next stage would send back
        for layer in layers:
            for p in layer.parameters():
                p.grad = None

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.iters):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000.0 / args.iters


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_stage_mfu: no CUDA device visible (torch.cuda.is_available() is False); run it on a GPU machine.")
        return 2
    from transformers import MistralConfig
    from transformers.models.mistral.modeling_mistral import MistralDecoderLayer, MistralRotaryEmbedding

    wall_start = time.perf_counter()
    cfg = MistralConfig(num_hidden_layers=args.layers)  # transformers' defaults are the Mistral-7B-v0.1 shape
    cfg._attn_implementation = "sdpa"
    device = torch.device("cuda")
    with torch.device(device):
        layers = torch.nn.ModuleList([MistralDecoderLayer(cfg, i) for i in range(args.layers)]).to(torch.bfloat16)
        rotary = MistralRotaryEmbedding(cfg)
    for p in layers.parameters():
        torch.nn.init.normal_(p, std=0.02)
    params_per_layer = sum(p.numel() for p in layers[0].parameters())
    flops_per_token = stage_flops_per_token(cfg, args.layers, args.seq_len, params_per_layer)
    tokens = args.batch_size * args.seq_len
    print(f"device: {torch.cuda.get_device_name(0)}  torch {torch.__version__}")
    print(f"stage: {args.layers} Mistral-7B decoder layers ({params_per_layer * args.layers / 1e9:.2f} B params), "
          f"bf16, batch {args.batch_size} x seq {args.seq_len}, {flops_per_token / 1e9:.1f} GFLOP/token")
    modes = ["causal", "explicit"] if args.mask == "both" else [args.mask]
    for mode in modes:
        torch.cuda.reset_peak_memory_stats()
        seconds = time_stage(layers, rotary, cfg.hidden_size, args, mode == "explicit", torch)
        tflops = tokens * flops_per_token / seconds / 1e12
        print(f"mask={mode:8s}  {seconds * 1000:8.1f} ms/iter  {tokens / seconds:9.0f} tokens/s  "
              f"{tflops:6.1f} TFLOP/s  MFU {tflops / args.peak_tflops:6.1%} of {args.peak_tflops:.0f}  "
              f"peak mem {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    print(f"wall {time.perf_counter() - wall_start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
