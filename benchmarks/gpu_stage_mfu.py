"""MFU of one Mistral-7B-shaped pipeline stage on one GPU: forward + backward of raytrain's own DecoderLayerPipe x N.

What a middle pipeline stage does: it receives hidden states (B, T, H) with position and segment ids, runs its
decoder layers, and back-propagates a gradient of the same shape. Packs of documents are timed for each attention
implementation of raytrain.pipeline.attention:

* ``dense``: the (B, 1, T, T) mask per layer and repeated K/V (the default, the reference; no flash kernel);
* ``segment``: SDPA per document with ``is_causal`` + ``enable_gqa`` (flash kernel, no mask);
* ``flex``: FlexAttention, compiled, with one BlockMask per micro-batch built outside the layers (its build time is
  inside the timed step) and passed to every layer.

Two packs: ``docs`` (``--docs`` equal documents filling the sequence) and ``single`` (one document: SDPA's causal
path for segment). FLOPs per token follow PaLM appendix B (as raytrain.pipeline.flops, what the training log
reports): 6 * N_layers + 12 * L * heads * head_dim * min(T, window), the same for both packs -- a pack of short
documents needs fewer attention FLOPs than it is credited, so compare ms first and read MFU as the log would.

Then, on a small shape in fp32 (``--check-*``: uneven documents, one longer than the window, padding): max abs
difference of the stage output and the input gradient, segment and flex against dense; and bf16 against fp32 of one
stage (same weights, same input): relative difference of the scalar loss mean(out^2).

    PYTHONPATH=. python3 benchmarks/gpu_stage_mfu.py --layers 8 --seq-len 4096 --peak-tflops 989
    PYTHONPATH=. python3 benchmarks/gpu_stage_mfu.py --device cpu --layers 1 --seq-len 256 --iters 1 --warmup 0

The second line is a dry run on CPU (proves the script end to end; flex is forward only there, so its timing and
gradient check are skipped). Prints figures and never asserts. Exits with a message when CUDA is asked for and
absent. About 2-3 minutes on an H200 (flex compiles once per dtype and shape); imports only torch and raytrain's
pipeline model and attention modules.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
import time

IMPLS = ("dense", "segment", "flex")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8, help="decoder layers in the stage (7B/4 stages = 8)")
    parser.add_argument("--preset", default="mistral-7b", help="raytrain MistralConfig preset for the layer shape")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--docs", type=int, default=4, help="equal documents in the 'docs' pack")
    parser.add_argument("--packs", default="docs,single", help="comma list of: docs, single")
    parser.add_argument("--impl", default=",".join(IMPLS), help=f"comma list of: {', '.join(IMPLS)}")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--peak-tflops", type=float, default=989.0,
                        help="dense bf16 peak of one device in TFLOP/s (H100/H200 SXM: 989)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu = dry run of the script")
    parser.add_argument("--check-seq-len", type=int, default=None, help="fp32 check length (default min(T, 1024))")
    parser.add_argument("--check-window", type=int, default=None, help="fp32 check window (default check T / 4)")
    parser.add_argument("--check-layers", type=int, default=1)
    args = parser.parse_args(argv)
    args.impls = [name for name in args.impl.split(",") if name]
    args.pack_names = [name for name in args.packs.split(",") if name]
    bad = sorted(set(args.impls) - set(IMPLS)) + sorted(set(args.pack_names) - {"docs", "single"})
    if bad:
        parser.error(f"unknown --impl/--packs value(s) {bad}")
    return args


def stage_flops_per_token(cfg, num_layers: int, seq_len: int, params_per_layer: int) -> float:
    """PaLM training FLOPs per token for ``num_layers`` decoder layers (no embedding, no head)."""
    context = seq_len if cfg.sliding_window is None else min(seq_len, cfg.sliding_window)
    attention = 12.0 * num_layers * cfg.num_attention_heads * cfg.head_dim * context
    return 6.0 * num_layers * params_per_layer + attention


def pack_ids(batch_size: int, doc_lengths: list[int], seq_len: int, device, torch):
    """position_ids, segment_ids (B, T): documents in order, positions restarting per document, padding (-1) after."""
    segment_ids = torch.full((seq_len,), -1, dtype=torch.long)
    position_ids = torch.zeros(seq_len, dtype=torch.long)
    start = 0
    for doc, length in enumerate(doc_lengths):
        segment_ids[start:start + length] = doc
        position_ids[start:start + length] = torch.arange(length)
        start += length
    position_ids[start:] = torch.arange(seq_len - start)  # padding: its own segment, any positions
    expand = (batch_size, seq_len)
    return position_ids.expand(expand).to(device), segment_ids.expand(expand).contiguous().to(device)


def build_stage(cfg, num_layers: int, device, dtype, torch):
    """``num_layers`` DecoderLayerPipe, built on meta and initialised on ``device`` (fast: no CPU draw for 7B)."""
    from raytrain.pipeline.model import DecoderLayerPipe

    with torch.device("meta"):
        layers = torch.nn.ModuleList([DecoderLayerPipe(cfg, i) for i in range(num_layers)])
    layers = layers.to_empty(device=device)
    torch.manual_seed(0)
    with torch.no_grad():
        for param in layers.parameters():
            if param.ndim == 1:  # RMSNorm weights
                param.fill_(1.0)
            else:
                param.normal_(0.0, cfg.initializer_range)
    return layers.to(dtype)


def stage_forward(layers, impl: str, hidden, position_ids, segment_ids, torch):
    """The stage: for flex, one BlockMask for this micro-batch, shared by all layers. Returns hidden (B, T, H)."""
    from raytrain.pipeline.attention import flex_block_mask

    block_mask = flex_block_mask(segment_ids, layers[0].cfg.sliding_window) if impl == "flex" else None
    for layer in layers:
        layer.attn_impl = impl
        hidden = layer((hidden, position_ids, segment_ids), block_mask=block_mask)[0]
    return hidden


def time_stage(layers, impl, position_ids, segment_ids, args, device, dtype, torch) -> float:
    """Mean seconds per forward+backward over ``args.iters`` timed iterations."""
    shape = (*segment_ids.shape, layers[0].cfg.hidden_size)
    grad_out = torch.randn(shape, device=device, dtype=dtype)

    def step() -> None:
        hidden = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)  # (B, T, H) from prev stage
        out = stage_forward(layers, impl, hidden, position_ids, segment_ids, torch)
        out.backward(grad_out)  # the gradient the next stage would send back
        for p in layers.parameters():
            p.grad = None

    for _ in range(args.warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.iters):
            step()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1000.0 / args.iters
    start_s = time.perf_counter()
    for _ in range(args.iters):
        step()
    return (time.perf_counter() - start_s) / max(args.iters, 1)


def run_timings(cfg, args, device, torch) -> None:
    from raytrain.pipeline.model import layer_parameter_counts

    dtype = torch.bfloat16
    layers = build_stage(cfg, args.layers, device, dtype, torch)
    params_per_layer = layer_parameter_counts(cfg)[1]
    flops_per_token = stage_flops_per_token(cfg, args.layers, args.seq_len, params_per_layer)
    tokens = args.batch_size * args.seq_len
    weights_gib = sum(p.numel() * p.element_size() for p in layers.parameters()) / 2**30
    print(f"stage: {args.layers} {args.preset} decoder layers ({params_per_layer * args.layers / 1e9:.2f} B params, "
          f"{weights_gib:.1f} GiB), bf16, batch {args.batch_size} x seq {args.seq_len}, "
          f"{flops_per_token / 1e9:.1f} GFLOP/token")
    doc_len = args.seq_len // args.docs
    packs = {"docs": [doc_len] * (args.docs - 1) + [args.seq_len - doc_len * (args.docs - 1)],
             "single": [args.seq_len]}
    for pack in args.pack_names:
        position_ids, segment_ids = pack_ids(args.batch_size, packs[pack], args.seq_len, device, torch)
        label = f"{args.docs}x{doc_len}" if pack == "docs" else f"1x{args.seq_len}"
        for impl in args.impls:
            if impl == "flex" and device.type != "cuda":
                print(f"pack={label:9s} impl={impl:7s}  skipped: FlexAttention has no backward on CPU")
                continue
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            seconds = time_stage(layers, impl, position_ids, segment_ids, args, device, dtype, torch)
            tflops = tokens * flops_per_token / seconds / 1e12
            peak = f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if device.type == "cuda" else "n/a (CPU)"
            print(f"pack={label:9s} impl={impl:7s}  {seconds * 1000:8.1f} ms/iter  {tokens / seconds:9.0f} tokens/s  "
                  f"{tflops:6.1f} TFLOP/s  MFU {tflops / args.peak_tflops:6.1%} of {args.peak_tflops:.0f}  "
                  f"peak mem {peak}")
    del layers


def stage_output_and_input_grad(layers, impl, hidden, position_ids, segment_ids, torch, with_grad: bool):
    """Output (B, T, H) and d(mean(out^2))/d(hidden) (None without grad); the loss as a float."""
    if not with_grad:
        with torch.no_grad():
            out = stage_forward(layers, impl, hidden, position_ids, segment_ids, torch)
        return out, None, out.float().pow(2).mean().item()
    hidden = hidden.detach().requires_grad_(True)
    out = stage_forward(layers, impl, hidden, position_ids, segment_ids, torch)
    loss = out.float().pow(2).mean()
    (grad,) = torch.autograd.grad(loss, hidden)
    return out.detach(), grad, loss.item()


def run_checks(cfg, args, device, torch) -> None:
    """Segment/flex against dense in fp32, and bf16 against fp32, on a small shape with every kind of segment."""
    seq_len = args.check_seq_len or min(args.seq_len, 1024)
    window = args.check_window or max(seq_len // 4, 1)
    check_cfg = dataclasses.replace(cfg, sliding_window=window)
    # A document longer than the window (banded path), a short one, a tiny one, then padding.
    doc_lengths = [window + window // 2, seq_len // 8, 3]
    doc_lengths = [n for n in doc_lengths if n > 0]
    while sum(doc_lengths) > seq_len:
        doc_lengths.pop()
    position_ids, segment_ids = pack_ids(1, doc_lengths, seq_len, device, torch)
    layers32 = build_stage(check_cfg, args.check_layers, device, torch.float32, torch)
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(1, seq_len, check_cfg.hidden_size, generator=generator).to(device)
    print(f"check: {args.check_layers} layer(s), fp32, seq {seq_len}, window {window}, documents {doc_lengths} "
          f"+ {seq_len - sum(doc_lengths)} padding")
    results = {}
    for impl in args.impls:
        with_grad = impl != "flex" or device.type == "cuda"
        results[impl] = stage_output_and_input_grad(layers32, impl, hidden, position_ids, segment_ids, torch,
                                                    with_grad)
    if "dense" in results:
        out_ref, grad_ref, _ = results["dense"]
        for impl in (name for name in results if name != "dense"):
            out, grad, _ = results[impl]
            grad_text = "skipped (no CPU backward)" if grad is None else f"{(grad - grad_ref).abs().max().item():.2e}"
            print(f"check {impl} vs dense (fp32): max abs diff output {(out - out_ref).abs().max().item():.2e}, "
                  f"input grad {grad_text}  (output scale {out_ref.abs().max().item():.2e})")
    layers16 = copy.deepcopy(layers32).to(torch.bfloat16)  # same weights, rounded
    for impl in args.impls:
        _, _, loss32 = results[impl]
        _, _, loss16 = stage_output_and_input_grad(layers16, impl, hidden.to(torch.bfloat16), position_ids,
                                                   segment_ids, torch, with_grad=False)
        print(f"check {impl} bf16 vs fp32: loss mean(out^2) {loss16:.6f} vs {loss32:.6f}, "
              f"relative diff {abs(loss16 - loss32) / abs(loss32):.2e}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_stage_mfu: no CUDA device visible (torch.cuda.is_available() is False); run it on a GPU machine, "
              "or pass --device cpu for a dry run.")
        return 2
    from raytrain.pipeline.model import MistralConfig

    wall_start = time.perf_counter()
    device = torch.device(args.device)
    cfg = MistralConfig.preset(args.preset)
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu (dry run)"
    print(f"device: {name}  torch {torch.__version__}")
    run_checks(cfg, args, device, torch)
    run_timings(cfg, args, device, torch)
    print(f"wall {time.perf_counter() - wall_start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
