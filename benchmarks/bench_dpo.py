"""A DPO step against a fine-tune step on the same packed tokens, the pair layouts against each other, and the
reference pass against one epoch. Prints figures; never asserts.

    python benchmarks/bench_dpo.py [--steps 8] [--preset tiny] [--seq-len 1024] [--attn-impl segment]

The HelpSteer3-shaped sample's pairs (raytrain.sample_data.preference) are derived, tokenized and packed as the
runner packs them (pair_pack_batch). Two single-stage DeepSpeed engines with the same seeded weights train on the
same packs, one with the fine-tune's token loss, one with DpoLoss (reference log-probabilities from a reference pass
of the DPO engine itself), their steps interleaved (SFT, DPO, DPO, SFT, ...) so the machine's drift enters both
alike. Tokens/s counts real (non-padding) tokens. The reference pass is timed over every pack, against the training
time of one epoch of the same packs (steps per epoch x the median DPO step).

Layouts: the packed one (a pair is two adjacent segments, short pairs share a sequence) against one pair per row
padded to the longest pair of its micro-batch, a third engine interleaved with the others. With segment attention a
row holding one pair costs what the two rows ``prompt + chosen`` and ``prompt + rejected`` of TRL's layout cost,
less their padding; that layout's fill (real tokens over rows x the longest row of each micro-batch) is printed.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import socket
import statistics
import tempfile
import time

import numpy as np
import pandas as pd
import torch


def _pairs_frame(seq_len: int) -> pd.DataFrame:
    from raytrain.dataset.tokenize import load_tokenizer, tokenize_pair
    from raytrain.enrich.preference import PreferenceExample, derive_pair
    from raytrain.sample_data.preference import write_preference_sample

    tokenizer = load_tokenizer("v3")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        sample = write_preference_sample(tmp)
        with gzip.open(sample.train_path, "rt", encoding="utf-8") as f:
            for line in f:
                pair = derive_pair(json.loads(line))
                if isinstance(pair, PreferenceExample):
                    t = tokenize_pair(pair.pair_id, pair.prompt, pair.chosen, pair.rejected, tokenizer)
                    if t.num_tokens <= seq_len:
                        rows.append({"uuid": pair.pair_id, "prompt_ids": list(t.prompt), "chosen_ids": list(t.chosen),
                                     "rejected_ids": list(t.rejected)})
    return pd.DataFrame(rows)


def _engine(cfg, loss_fn, micro_batch_size: int, grad_accum: int, attn_impl: str):
    import deepspeed

    from raytrain.pipeline.module import build_pipeline_module

    module = build_pipeline_module(cfg, num_stages=1, seed=0, attn_impl=attn_impl,
                                   **({"loss_fn": loss_fn} if loss_fn else {}))
    config = {"train_micro_batch_size_per_gpu": micro_batch_size, "gradient_accumulation_steps": grad_accum,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}, "steps_per_print": 10**6}
    engine, _, _, _ = deepspeed.initialize(model=module, config=config, model_parameters=module.parameters())
    return engine


def _pair_rows(frame: pd.DataFrame, rows: int) -> tuple[list[dict[str, np.ndarray]], int, int]:
    """The pairs of ``frame`` in order, one per row, ``rows`` per micro-batch, each micro-batch padded to its longest
    pair (pair_pack_batch with one pair per pack). Returns the micro-batches' columns, the tokens they compute
    (rows x width) and the tokens TRL's two-row layout would compute (2 rows per pair x its longest row)."""
    from raytrain.dataset.pair_pack import pair_pack_batch

    out, computed, two_rows = [], 0, 0
    for start in range(0, len(frame) - len(frame) % rows, rows):
        part = frame.iloc[start:start + rows]
        lengths = [2 * len(p) + len(c) + len(r) for p, c, r in
                   zip(part["prompt_ids"], part["chosen_ids"], part["rejected_ids"], strict=True)]
        width = max(lengths)
        out.append(pair_pack_batch(part, width, max_pairs=1))
        computed += rows * width
        two_rows += 2 * rows * max(len(p) + max(len(c), len(r)) for p, c, r in
                                   zip(part["prompt_ids"], part["chosen_ids"], part["rejected_ids"], strict=True))
    return out, computed, two_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--attn-impl", default="segment", choices=("segment", "dense"),
                        help="segment: each document attends only within itself, as two rows would")
    args = parser.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    from raytrain.config import DpoConfig
    from raytrain.dataset.pair_pack import pair_counts, pair_pack_batch
    from raytrain.pipeline.dpo import DpoLoss
    from raytrain.pipeline.engine import init_distributed
    from raytrain.pipeline.model import MistralConfig
    from raytrain.trainer.feed import to_micro_batch, to_pair_micro_batch

    init_distributed("gloo")
    torch.manual_seed(0)
    cfg = MistralConfig.preset(args.preset)
    frame = _pairs_frame(args.seq_len)
    packs = pair_pack_batch(frame, args.seq_len)
    num_packs, mbs, accum = len(packs["num_tokens"]), 2, 2
    per_step = mbs * accum
    print(f"{num_packs} packs of {args.seq_len} tokens from the sample's pairs, {packs['num_pairs'].sum()} pairs, "
          f"{packs['num_tokens'].sum() / (num_packs * args.seq_len):.1%} fill; model {args.preset}, "
          f"{args.attn_impl} attention")
    rows_accum = max(1, round(per_step * packs["num_pairs"].mean() / mbs))  # about the pairs of a packed step
    row_batches, computed, two_rows = _pair_rows(frame, mbs)
    real = sum(int(b["num_tokens"].sum()) for b in row_batches)
    print(f"one pair per row, {mbs} rows per micro-batch padded to its longest pair: {real / computed:.1%} fill; "
          f"TRL's two rows per pair padded to the longest row: {real / two_rows:.1%} fill")

    def batch(start: int, rows: int) -> dict[str, np.ndarray]:
        index = np.arange(start, start + rows) % num_packs
        return {**{k: v[index] for k, v in packs.items()}, "pack_index": index}

    dpo_loss = DpoLoss(DpoConfig())
    sft, dpo = _engine(cfg, None, mbs, accum, args.attn_impl), _engine(cfg, dpo_loss, mbs, accum, args.attn_impl)
    rows_loss = DpoLoss(DpoConfig())
    per_row = _engine(cfg, rows_loss, mbs, rows_accum, args.attn_impl)
    zeros = np.zeros_like(packs["pair_segments"], dtype=np.float32)
    t0 = time.perf_counter()
    with dpo_loss.recording() as recorded:
        micro = [to_pair_micro_batch({**batch(i, mbs), "ref_logps": zeros[:mbs]}, 0.0, 0.0)
                 for i in range(0, num_packs - num_packs % mbs, mbs)]
        dpo.eval_batch(iter(micro), num_micro_batches=len(micro))
    reference_s = time.perf_counter() - t0
    ref = np.concatenate([r.reshape(r.shape[0], -1).numpy() for r in recorded])

    times: dict[str, list[float]] = {"sft": [], "dpo": [], "rows": []}
    tokens: list[int] = []
    row_tokens: list[int] = []
    for step in range(args.steps):
        first = (step * rows_accum) % (len(row_batches) - rows_accum + 1)
        step_rows = row_batches[first:first + rows_accum]
        row_tokens.append(sum(int(b["num_tokens"].sum()) for b in step_rows))
        row_pairs = sum(int(b["num_pairs"].sum()) for b in step_rows)
        start = (step * per_step) % (num_packs - num_packs % mbs)
        rows = batch(start, per_step)
        tokens.append(int(rows["num_tokens"].sum()))
        targets = int((rows["labels"] != -100).sum())
        pairs, chosen = (int(n.sum()) for n in pair_counts(rows["pair_segments"], rows["segment_ids"], rows["labels"]))
        order = ("sft", "dpo", "rows")[step % 3:] + ("sft", "dpo", "rows")[:step % 3]  # each goes first in turn
        for name in order if step % 2 == 0 else tuple(reversed(order)):
            if name == "sft":
                feed = [to_micro_batch(batch(start + k * mbs, mbs), accum / targets) for k in range(accum)]
                engine = sft
            elif name == "dpo":
                feed = [to_pair_micro_batch({**batch(start + k * mbs, mbs), "ref_logps": ref[(np.arange(
                    start + k * mbs, start + (k + 1) * mbs) % len(ref))]}, accum / pairs, accum / chosen)
                    for k in range(accum)]
                engine = dpo
            else:  # the reference's values do not change the step's cost
                feed = [to_pair_micro_batch({**b, "ref_logps": np.zeros(b["pair_segments"].shape, np.float32)},
                                            rows_accum / row_pairs, 0.0) for b in step_rows]
                engine = per_row
            t = time.perf_counter()
            engine.train_batch(data_iter=iter(feed))
            times[name].append(time.perf_counter() - t)
        dpo_loss.take_sums()
        rows_loss.take_sums()
    skip = 1 if args.steps > 2 else 0  # the first step of each engine warms its allocator
    tok = statistics.median(tokens)
    rate = {name: tok / statistics.median(times[name][skip:]) for name in ("sft", "dpo")}
    print(f"step tokens/s on the same packs: DPO {rate['dpo']:,.0f}, SFT {rate['sft']:,.0f}, "
          f"ratio {rate['dpo'] / rate['sft']:.2f} (median of {args.steps - skip} interleaved steps each)")
    rows_rate = statistics.median(row_tokens) / statistics.median(times["rows"][skip:])
    print(f"DPO layouts, real tokens/s: packed {rate['dpo']:,.0f}, one pair per row {rows_rate:,.0f} "
          f"({rows_accum} micro-batches of {mbs} pairs a step), ratio packed / per row {rate['dpo'] / rows_rate:.2f}")
    epoch_s = (num_packs // per_step) * statistics.median(times["dpo"][skip:])
    print(f"reference pass: {reference_s:.1f}s over {len(ref)} packs; one training epoch of them: {epoch_s:.1f}s "
          f"(ratio {reference_s / epoch_s:.2f})")


if __name__ == "__main__":
    main()
