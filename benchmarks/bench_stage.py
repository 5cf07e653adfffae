"""One decoder layer on CPU, dense against segment attention: time and activation memory of forward + backward.
Prints figures; never asserts.

    python benchmarks/bench_stage.py [--seq-len 2048 8192] [--docs 4] [--iters 3] [--warmup 1] [--threads N]

The layer is one DecoderLayerPipe of the ``small`` preset (hidden 512, 8 heads, 4 kv heads), fp32, batch 1,
a pack of ``--docs`` equal documents (positions restart per document). Both contenders share the weights and the
input; "new" is ``attn_impl="segment"`` (raytrain.pipeline.attention).

Memory is what the layer keeps for backward, measured with ``torch.autograd.graph.saved_tensors_hooks``: the bytes
of the distinct storages saved during the forward pass (views of one storage counted once), plus the dense
(B, 1, T, T) boolean mask when autograd did not save it (it is built per layer either way). Transient buffers that
die inside the forward (score tiles, the GQA K/V repeat) are not counted: it is the memory a pipeline stage holds
per in-flight micro-batch, not the allocator's peak. Time is the median wall time of forward + backward.

Printed exactly as: ``layer T=2048: dense X s Y MiB, new X s Y MiB, memory ratio R`` (ratio = new / dense: under
1 means the new path holds less), then the max abs difference of the outputs and of the gradients (input and
weights); once per ``--seq-len`` (2,048, the issue's shape, and 8,192 by default).

What the ratio can show: on CPU (torch 2.13) SDPA runs its flash kernel with the boolean mask too, so the dense path
never holds (B, heads, T, T) scores. What it holds beyond the new path is the boolean mask and the float copy SDPA
makes of it, 5 bytes per (query, key) pair: a T^2 term, while the rest of the layer (projections, MLP, norms: the
same for both paths) grows with T. At T = 2,048 the small preset's linear activations dominate (about 100 MiB against 20 MiB of mask), so the
ratio stays near 0.8; at 8,192 the mask terms are as large as the rest and the ratio falls to about half.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from raytrain.pipeline.model import DecoderLayerPipe, MistralConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-len", type=int, nargs="+", default=[2048, 8192], help="one line per length")
    parser.add_argument("--docs", type=int, default=4, help="equal documents packed into the sequence")
    parser.add_argument("--iters", type=int, default=3, help="timed forward+backward passes per contender")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    return parser.parse_args(argv)


def packed_inputs(seq_len: int, num_docs: int, hidden_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden (1, T, H) fp32 requiring grad, position_ids (1, T) restarting per document, segment_ids (1, T)."""
    doc_len = seq_len // num_docs
    segment_ids = (torch.arange(seq_len) // doc_len).clamp(max=num_docs - 1)[None]  # (1, T); last doc takes the rest
    starts = segment_ids * doc_len  # (1, T) start of each token's document
    position_ids = torch.arange(seq_len)[None] - starts
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, seq_len, hidden_size, generator=generator).requires_grad_(True)
    return hidden, position_ids, segment_ids


def saved_bytes_of_forward(layer: DecoderLayerPipe, inputs) -> tuple[torch.Tensor, int]:
    """Run the forward pass; return its output and the bytes of distinct storages autograd saved for backward."""
    storages: dict[int, int] = {}
    saw_mask = False
    seq_len = inputs[0].shape[1]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal saw_mask
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        saw_mask |= tensor.dtype == torch.bool and tensor.numel() >= seq_len * seq_len
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = layer(inputs)[0]
    mask_bytes = inputs[2].shape[0] * seq_len * seq_len  # (B, 1, T, T) bool, dense only
    extra = mask_bytes if layer.attn_impl == "dense" and not saw_mask else 0
    return out, sum(storages.values()) + extra


def run(layer: DecoderLayerPipe, inputs, grad_out: torch.Tensor, warmup: int, iters: int):
    """Median seconds of forward+backward, saved bytes, and the last output and gradients."""
    times = []
    for i in range(warmup + iters):
        layer.zero_grad(set_to_none=True)
        inputs[0].grad = None
        start = time.perf_counter()
        out, saved = saved_bytes_of_forward(layer, inputs)
        out.backward(grad_out)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    grads = [inputs[0].grad] + [p.grad for p in layer.parameters()]
    return statistics.median(times), saved, out.detach(), grads


def compare(layer: DecoderLayerPipe, cfg: MistralConfig, seq_len: int, args: argparse.Namespace) -> None:
    """Dense against segment attention on one pack of ``args.docs`` documents of total length ``seq_len``."""
    inputs = packed_inputs(seq_len, args.docs, cfg.hidden_size)
    grad_out = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(1))
    results = {}
    for impl in ("dense", "segment"):
        layer.attn_impl = impl
        results[impl] = run(layer, inputs, grad_out, args.warmup, args.iters)
    (t_dense, m_dense, out_dense, g_dense), (t_new, m_new, out_new, g_new) = results["dense"], results["segment"]
    mib = 2**20
    print(f"layer T={seq_len}: dense {t_dense:.3f} s {m_dense / mib:.1f} MiB, "
          f"new {t_new:.3f} s {m_new / mib:.1f} MiB, memory ratio {m_new / m_dense:.2f}")
    grad_diff = max((a - b).abs().max().item() for a, b in zip(g_dense, g_new, strict=True))
    print(f"max abs diff: output {(out_dense - out_new).abs().max().item():.2e}, "
          f"grads (input and weights) {grad_diff:.2e}")
    print(f"({args.docs} documents of {seq_len // args.docs} tokens, small preset, fp32, "
          f"{torch.get_num_threads()} threads, median of {args.iters}; time ratio {t_dense / t_new:.2f})", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = MistralConfig.preset("small")
    layer = DecoderLayerPipe(cfg, 0, seed=0)
    for seq_len in args.seq_len:
        compare(layer, cfg, seq_len, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
