"""The chunked cross-entropy (raytrain.pipeline.model.causal_lm_loss): chunks as slices under activation
checkpointing (as it was), as split views under checkpointing (an accelerator's default) and as split views without
(the CPU's default), in one training micro-batch of the tiny Mistral on CPU (one thread), side by side, interleaved.

    python benchmarks/bench_loss.py [--tokens 1024] [--batch 2] [--repeats 5]

Prints the median seconds of a forward + backward of each, their ratios to the first, and whether the losses and
every gradient are equal to the first's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils.checkpoint import checkpoint

from raytrain.dataset.labels import IGNORE_INDEX
from raytrain.pipeline.model import LOSS_CHUNK_TOKENS, MistralConfig, _chunk_loss_sum, build_sequential, causal_lm_loss


def sliced_loss(logits: torch.Tensor, labels: torch.Tensor, chunk_tokens: int = LOSS_CHUNK_TOKENS) -> torch.Tensor:
    """causal_lm_loss as it was with slices of the logits (mean over the target tokens)."""
    flat_logits, flat_labels = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
    loss_sum = sum(checkpoint(_chunk_loss_sum, flat_logits[i:i + chunk_tokens], flat_labels[i:i + chunk_tokens],
                              use_reentrant=False) for i in range(0, flat_labels.shape[0], chunk_tokens))
    return loss_sum / (flat_labels != IGNORE_INDEX).sum().clamp(min=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = MistralConfig.preset("tiny")
    model = build_sequential(cfg)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.tokens), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(args.tokens).repeat(args.batch, 1)
    segments = torch.ones_like(ids)

    def step(loss_fn):
        model.zero_grad(set_to_none=True)
        x = (ids, positions, segments)
        for layer in model:
            x = layer(x)
        loss = loss_fn(x, ids)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    contenders = {"slices, recomputed": sliced_loss,
                  "split, recomputed": lambda logits, labels: causal_lm_loss(logits, labels, recompute=True),
                  "split": lambda logits, labels: causal_lm_loss(logits, labels, recompute=False)}
    seconds: dict[str, list[float]] = {name: [] for name in contenders}
    for fn in contenders.values():
        step(fn)  # warm-up
    for _ in range(args.repeats):
        for name, fn in contenders.items():
            t0 = time.perf_counter()
            step(fn)
            seconds[name].append(time.perf_counter() - t0)
    (loss_a, grads_a), *others = (step(fn) for fn in contenders.values())
    medians = {name: statistics.median(v) for name, v in seconds.items()}
    first = next(iter(medians.values()))
    print(f"micro-batch {args.batch} x {args.tokens} tokens, vocabulary {cfg.vocab_size}, one thread, "
          f"median of {args.repeats}:")
    for name, s in medians.items():
        print(f"  {name:18s} {s:.3f} s  {s / first:.2f}")
    print("losses and gradients equal to the first's: " + ", ".join(
        str(torch.equal(loss_a, loss) and all(torch.equal(a, b) for a, b in zip(grads_a, grads, strict=True)))
        for loss, grads in others))

if __name__ == "__main__":
    main()
