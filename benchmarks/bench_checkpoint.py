"""Checkpoint cost: training time lost per save for the `small` preset (~59M parameters) with pp = 2 on CPU, beside
the time between saves at checkpoint_every = 200, and the same estimate for the Mistral-7B presets from the write
and hash bandwidth measured here. Prints figures; never asserts.

    python benchmarks/bench_checkpoint.py [--steps 4] [--saves 2] [--seq-len 128] [--every 200]

Two processes (one per stage, a gloo group, no Ray) run raytrain's own pieces: build_stage_engine, the training
feed, StageEngine.save, CheckpointStore.hash_share (each rank hashes and fsyncs its share of the files) and
commit (rank 0, the manifest from the ranks' sidecars). A save stops training for its whole duration (DeepSpeed's
save, the two barriers, the hashing, the commit), so the time lost per save is that duration; it is printed with
the median step time, as a fraction of the time between saves.

It also prints the local disk an s3/hdfs resume takes per rank: each rank downloads only the files its stage loads
(StageEngine.checkpoint_files), where it used to download the whole checkpoint.
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

# Mistral-7B presets (raytrain/pipeline/model.py): 7.24e9 parameters; bf16 weights (2 bytes) per stage, fp32
# master weights + Adam moments (12 bytes) partitioned over dp by ZeRO-1.
PARAMS_7B = 7.24e9
LAYOUTS_7B = {"mistral7b-1node-8gpu (pp 4 x dp 2)": (4, 2), "mistral7b-2node-16gpu (pp 4 x dp 4)": (4, 4)}


def worker(rank: int, port: int, args: argparse.Namespace, root: str, result_path: str) -> None:
    import torch.distributed as dist
    from bench_pipeline import random_feed, small_pp2_stage

    from raytrain.checkpoint.store import CheckpointStore
    from raytrain.storage import resolve

    cfg, stage = small_pp2_stage(rank, port)
    feed = random_feed(cfg.vocab_size, args.seq_len, grad_accum_steps=2)
    store = CheckpointStore(resolve(root), keep_last=1)
    step_s, saves = [], []
    step = 0
    for _ in range(args.saves):
        for _ in range(args.steps):
            t0 = time.perf_counter()
            stage.train_batch(feed)
            step_s.append(time.perf_counter() - t0)
            step += 1
        dist.barrier()
        t0 = time.perf_counter()
        staging = store.staging_dir(step)
        stage.save(staging, {"step": step, "data_position": step * 2})
        store.upload(step, staging)
        t_written = time.perf_counter()
        dist.barrier()
        hashed = store.hash_share(step, rank, 2)
        t_hashed = time.perf_counter()
        dist.barrier()
        if rank == 0:
            store.commit(step, {"step": step, "metrics": {}})
        dist.barrier()
        t_done = time.perf_counter()
        size = sum(e["size"] for e in store.latest().manifest["files"].values())
        saves.append({"total_s": t_done - t0, "write_s": t_written - t0, "hash_s": t_hashed - t_written,
                      "bytes_hashed": hashed, "checkpoint_bytes": size})
    files = store.latest().manifest["files"]
    own_bytes = sum(files[rel]["size"] for rel in stage.checkpoint_files(sorted(files))[0])
    with open(f"{result_path}.rank{rank}", "w", encoding="utf-8") as f:
        json.dump({"step_s": step_s, "saves": saves, "resume_own_bytes": own_bytes}, f)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4, help="training steps between saves")
    parser.add_argument("--saves", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--every", type=int, default=200, help="checkpoint_every to compare against")
    args = parser.parse_args()
    import torch.multiprocessing as mp
    from bench_pipeline import free_port

    with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as tmp:
        root, result = os.path.join(tmp, "run"), os.path.join(tmp, "result")
        mp.start_processes(worker, args=(free_port(), args, root, result), nprocs=2, join=True,
                           start_method="spawn")
        ranks = []
        for rank in range(2):
            with open(f"{result}.rank{rank}", encoding="utf-8") as f:
                ranks.append(json.load(f))
    step_s = statistics.median(ranks[0]["step_s"][1:] or ranks[0]["step_s"])  # the first step warms up
    lost = [max(r["saves"][i]["total_s"] for r in ranks) for i in range(args.saves)]
    lost_s = statistics.median(lost)
    written = ranks[0]["saves"][0]["checkpoint_bytes"]  # both stages' files (the committed manifest)
    write_bw = written / max(r["saves"][0]["write_s"] for r in ranks) / 2  # per rank: the two write side by side
    hash_bw = sum(r["saves"][0]["bytes_hashed"] for r in ranks) / max(r["saves"][0]["hash_s"] for r in ranks) / 2
    interval_s = args.every * step_s
    print(f"small preset, pp=2, CPU: step {step_s:.2f} s (median), save {lost_s:.2f} s lost per save "
          f"(saves: {[round(x, 2) for x in lost]} s; checkpoint {written / 2**20:.0f} MiB, written at "
          f"{write_bw / 2**20:.0f} MiB/s and hashed at {hash_bw / 2**20:.0f} MiB/s per rank)")
    print(f"  lost per save / time between saves at checkpoint_every={args.every}: {lost_s:.2f} / {interval_s:.0f} s "
          f"= {100 * lost_s / interval_s:.2f}% (target <= 2%)")
    own = [r["resume_own_bytes"] for r in ranks]
    print(f"  s3/hdfs resume, local disk per rank: {', '.join(f'{b / 2**20:.0f}' for b in own)} MiB (the files its load opens) "
          f"of the {written / 2**20:.0f} MiB checkpoint every rank used to download")
    for name, (pp, dp) in LAYOUTS_7B.items():
        per_rank = PARAMS_7B * 2 / pp + PARAMS_7B * 12 / (pp * dp)
        estimate = per_rank / write_bw + per_rank / hash_bw  # every rank writes and hashes about its own share
        print(f"  7B estimate, {name}: {per_rank / 2**30:.1f} GiB per rank -> {estimate:.0f} s per save at this "
              "machine's per-rank write and hash bandwidth (a parallel filesystem's differ; measure there); "
              f"an s3 resume takes {per_rank / 2**30:.1f} GiB of local disk per rank, not the whole "
              f"{PARAMS_7B * 14 / 2**30:.0f} GiB checkpoint")


if __name__ == "__main__":
    main()
