"""A DPO step against a fine-tune step on the same packed tokens, and the reference pass against one epoch.
Prints figures; never asserts.

    python benchmarks/bench_dpo.py [--steps 8] [--preset tiny] [--seq-len 1024]

The HelpSteer3-shaped sample's pairs (raytrain.sample_data.preference) are derived, tokenized and packed as the
runner packs them (pair_pack_batch). Two single-stage DeepSpeed engines with the same seeded weights train on the
same packs, one with the fine-tune's token loss, one with DpoLoss (reference log-probabilities from a reference pass
of the DPO engine itself), their steps interleaved (SFT, DPO, DPO, SFT, ...) so the machine's drift enters both
alike. Tokens/s counts real (non-padding) tokens. The reference pass is timed over every pack, against the training
time of one epoch of the same packs (steps per epoch x the median DPO step).
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


def _engine(cfg, loss_fn, micro_batch_size: int, grad_accum: int):
    import deepspeed

    from raytrain.pipeline.module import build_pipeline_module

    module = build_pipeline_module(cfg, num_stages=1, seed=0, **({"loss_fn": loss_fn} if loss_fn else {}))
    config = {"train_micro_batch_size_per_gpu": micro_batch_size, "gradient_accumulation_steps": grad_accum,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}, "steps_per_print": 10**6}
    engine, _, _, _ = deepspeed.initialize(model=module, config=config, model_parameters=module.parameters())
    return engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--seq-len", type=int, default=1024)
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
    packs = pair_pack_batch(_pairs_frame(args.seq_len), args.seq_len)
    num_packs, mbs, accum = len(packs["num_tokens"]), 2, 2
    per_step = mbs * accum
    print(f"{num_packs} packs of {args.seq_len} tokens from the sample's pairs, {packs['num_pairs'].sum()} pairs, "
          f"{packs['num_tokens'].sum() / (num_packs * args.seq_len):.1%} fill; model {args.preset}")

    def batch(start: int, rows: int) -> dict[str, np.ndarray]:
        index = np.arange(start, start + rows) % num_packs
        return {**{k: v[index] for k, v in packs.items()}, "pack_index": index}

    dpo_loss = DpoLoss(DpoConfig())
    sft, dpo = _engine(cfg, None, mbs, accum), _engine(cfg, dpo_loss, mbs, accum)
    zeros = np.zeros_like(packs["pair_segments"], dtype=np.float32)
    t0 = time.perf_counter()
    with dpo_loss.recording() as recorded:
        micro = [to_pair_micro_batch({**batch(i, mbs), "ref_logps": zeros[:mbs]}, 0.0, 0.0)
                 for i in range(0, num_packs - num_packs % mbs, mbs)]
        dpo.eval_batch(iter(micro), num_micro_batches=len(micro))
    reference_s = time.perf_counter() - t0
    ref = np.concatenate([r.reshape(r.shape[0], -1).numpy() for r in recorded])

    times: dict[str, list[float]] = {"sft": [], "dpo": []}
    tokens: list[int] = []
    for step in range(args.steps):
        start = (step * per_step) % (num_packs - num_packs % mbs)
        rows = batch(start, per_step)
        tokens.append(int(rows["num_tokens"].sum()))
        targets = int((rows["labels"] != -100).sum())
        pairs, chosen = (int(n.sum()) for n in pair_counts(rows["pair_segments"], rows["segment_ids"], rows["labels"]))
        for name in (("sft", "dpo") if step % 2 == 0 else ("dpo", "sft")):
            if name == "sft":
                feed = [to_micro_batch(batch(start + k * mbs, mbs), accum / targets) for k in range(accum)]
                engine = sft
            else:
                feed = [to_pair_micro_batch({**batch(start + k * mbs, mbs), "ref_logps": ref[(np.arange(
                    start + k * mbs, start + (k + 1) * mbs) % len(ref))]}, accum / pairs, accum / chosen)
                    for k in range(accum)]
                engine = dpo
            t = time.perf_counter()
            engine.train_batch(data_iter=iter(feed))
            times[name].append(time.perf_counter() - t)
        dpo_loss.take_sums()
    skip = 1 if args.steps > 2 else 0  # the first step of each engine warms its allocator
    tok = statistics.median(tokens)
    rate = {name: tok / statistics.median(values[skip:]) for name, values in times.items()}
    print(f"step tokens/s on the same packs: DPO {rate['dpo']:,.0f}, SFT {rate['sft']:,.0f}, "
          f"ratio {rate['dpo'] / rate['sft']:.2f} (median of {args.steps - skip} interleaved steps each)")
    epoch_s = (num_packs // per_step) * statistics.median(times["dpo"][skip:])
    print(f"reference pass: {reference_s:.1f}s over {len(ref)} packs; one training epoch of them: {epoch_s:.1f}s "
          f"(ratio {reference_s / epoch_s:.2f})")


if __name__ == "__main__":
    main()
