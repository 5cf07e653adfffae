"""Pipeline-parallel throughput on CPU workers: pp=2 against pp=1, and the Ray Data feed against an in-memory one.
Prints figures; never asserts.

    python benchmarks/bench_pipeline.py [--steps 6] [--warmup 2] [--rounds 2] [--grad-accum 8] [--seq-len 256]
                                        [--busy-baseline] [--same-cores] [--only pp1-1thread,pp2-memory]
    python benchmarks/bench_pipeline.py --interleaved [--steps 30]

Contenders (same model, same global batch, same seeded random-token data, TorchTrainer + DeepSpeed pipeline engine
through raytrain's own `build_stage_engine`, `micro_batches` feed and `Topology`):

1. pp=1, 1 worker x 1 thread          baseline for the pipeline speed-up (one core)
2. pp=2, 2 workers x 1 thread, fed from memory     tokens/s against 1.: ideal 2 * m / (m + p - 1) (target >= 0.9)
3. pp=2, 2 workers x 1 thread, fed by Ray Data      tokens/s against 2. (target >= 0.97), the production read path:
   packed Parquet -> raytrain.dataset.stream.stream_micro_batches (Ray Data tasks read the replica's packs)
(--same-cores) pp=1, 1 worker x 2 threads: the two cores pp=2 uses, spent on intra-op parallelism instead
(--busy-baseline) two pp=1 runs side by side, one core each: pp=1 with the machine as busy as pp=2 makes it, so
   pp=2 against it separates the cost of the schedule and its sends from the cost of filling both cores

--interleaved measures the same contenders differently: all of them are up at once as plain Ray actors (each rank in
its own gloo group, the Ray Data one streaming through the same `stream_micro_batches`), and the driver steps them in turn, one
optimizer step each, order alternating. Ratios come from adjacent steps, so the machine's drift between launches (on
this 2-vCPU VM pp=1's step time moved from 1.0 to 1.5 s within an hour) does not enter them; idle actors use no CPU.

The model is a Mistral of 8 decoder layers, hidden 256, with a 1,024-token vocabulary, so the LM head (which sits on
the last stage) costs about a third of a decoder layer and the two stages are nearly balanced: the presets' 32,768-token
vocabulary would make the head ~10 decoder layers on a model this narrow, and the pipeline would then measure
the partition, not the schedule. The balance is printed (FLOPs of the busier stage over half the total).

On a 2-core machine pp=2 takes both cores (one per stage) against one for pp=1, and has no spare core to overlap
communication onto. Other processes compete for the same cores, so each launch first waits until the CPUs are quiet
(what the previous launch left behind has finished), prints its step times and the load average, contenders run in
ABC CBA order, and ratios are given from the best step (least disturbed) and from the median step of each contender.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

TARGET_PP_RATIO = 0.9  # achieved pp=2 speed-up over the ideal 2m/(m+p-1)
TARGET_FEED_RATIO = 0.97  # tokens/s fed by Ray Data over fed from memory

BENCH_MODEL = dict(vocab_size=1024, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="timed optimizer steps per contender")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (engine warm-up, stream start)")
    parser.add_argument("--grad-accum", type=int, default=8, help="micro-batches per step (the pipeline's m)")
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2, help="launches per contender, in ABC CBA order")
    parser.add_argument("--same-cores", action="store_true",
                        help="also time pp=1 with 2 threads (the two cores pp=2 uses); slow on a loaded machine")
    parser.add_argument("--quiet-busy", type=float, default=0.15,
                        help="before each launch, wait until the CPUs are at most this busy (fraction, /proc/stat)")
    parser.add_argument("--quiet-timeout", type=float, default=60.0, help="give up waiting for quiet after this many s")
    parser.add_argument("--busy-baseline", action="store_true",
                        help="also time two pp=1 runs side by side (pp=1 with both cores busy, as under pp=2)")
    parser.add_argument("--interleaved", action="store_true",
                        help="instead: pp=1, pp=2 and two pp=1 side by side as Ray actors, stepped in turn")
    parser.add_argument("--only", default="", help="comma-separated contender names to run (default: all)")
    parser.add_argument("--out", default="", help="working folder (default: a new temp dir)")
    return parser.parse_args(argv)


def write_random_packs(folder: str, num_packs: int, seq_len: int, vocab_size: int, seed: int = 0) -> list[str]:
    """Packed-sequence Parquet in the schema raytrain.dataset writes: one document per pack, next-token labels."""
    rng = np.random.default_rng(seed)
    input_ids = rng.integers(0, vocab_size, size=(num_packs, seq_len), dtype=np.int64)  # (N, T)
    labels = np.concatenate([input_ids[:, 1:], np.full((num_packs, 1), -100, dtype=np.int64)], axis=1)  # (N, T)
    position_ids = np.broadcast_to(np.arange(seq_len, dtype=np.int64), (num_packs, seq_len))
    table = pa.table({
        "input_ids": list(input_ids), "position_ids": list(position_ids),
        "segment_ids": list(np.zeros((num_packs, seq_len), dtype=np.int64)), "labels": list(labels),
        "doc_ids": [f"bench-{i:05d}" for i in range(num_packs)],
        "num_tokens": np.full(num_packs, seq_len, dtype=np.int64),
        "num_targets": np.full(num_packs, seq_len - 1, dtype=np.int64),
    })
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "part-00000.parquet")
    pq.write_table(table, path, row_group_size=1)  # one pack per row group, as raytrain.dataset.stream writes
    return [path]


def _cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs from /proc/stat; None where there is none (not Linux)."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def wait_for_quiet(max_busy: float, timeout_s: float, window_s: float = 1.0, windows: int = 2) -> tuple[float, float]:
    """Wait until `windows` consecutive windows of `window_s` have the CPUs at most `max_busy` busy, or `timeout_s`.

    A launch leaves work behind (Ray Data's stats actor and split coordinator, worker processes exiting, gloo
    teardown) that would otherwise run on the next contender's cores. Returns (seconds waited, last busy fraction).
    """
    t0, quiet, busy = time.perf_counter(), 0, 0.0
    prev = _cpu_times()
    if prev is None:
        return 0.0, float("nan")
    while time.perf_counter() - t0 < timeout_s:
        time.sleep(window_s)
        cur = _cpu_times()
        busy = (cur[0] - prev[0]) / max(1, cur[1] - prev[1])
        prev = cur
        quiet = quiet + 1 if busy <= max_busy else 0
        if quiet >= windows:
            break
    return time.perf_counter() - t0, busy


def bench_worker_loop(config: dict) -> None:
    """One TorchTrainer worker: build its pipeline stage, run warmup + timed steps, report step times."""
    import ray.train

    world_rank = ray.train.get_context().get_world_rank()
    measured = time_steps(config, world_rank)
    # Ray Train 2.60 keeps metrics only with checkpoints, so each rank writes its timings to a file. Rank 0's step
    # times are the pipeline's: stage 0 finishes a 1F1B step last (its backward of the last micro-batch comes after
    # every other stage's).
    path = config["result_path"] if world_rank == 0 else f"{config['result_path']}.rank{world_rank}"
    with open(path, "w", encoding="utf-8") as f:
        json.dump(measured, f)


def random_feed(vocab_size: int, seq_len: int, grad_accum_steps: int, num_packs: int = 64, seed: int = 0):
    """Micro-batches (micro-batch 1, one replica) of random single-document packs held in memory, through
    raytrain's own training feed: what the two-process benchmarks train on."""
    import numpy as np

    from raytrain.trainer.feed import in_memory_packs, micro_batches

    ids = np.random.default_rng(seed).integers(0, vocab_size, size=(num_packs, seq_len))  # (N, T)
    counts, read = in_memory_packs({"input_ids": ids, "position_ids": np.tile(np.arange(seq_len), (num_packs, 1)),
                                    "segment_ids": np.zeros((num_packs, seq_len), dtype=np.int64),
                                    "labels": np.concatenate([ids[:, 1:], np.full((num_packs, 1), -100)], axis=1),
                                    "doc_ids": [f"d{i}" for i in range(num_packs)]})
    return micro_batches(counts, read, micro_batch_size=1, start_position=0, dp_rank=0, dp=1,
                         grad_accum_steps=grad_accum_steps)


def small_pp2_stage(rank: int, port: int, lora=None):
    """This process's stage of the `small` preset cut into 2 (one process per stage, a gloo group, no Ray), built
    by raytrain's build_stage_engine with configs/ds_config.json (micro-batch 1, 2 micro-batches per step) and,
    given ``lora`` (a raytrain.config.LoraConfig), adapters on a frozen base. Returns (model config, stage)."""
    import torch

    from raytrain.config import TrainConfig
    from raytrain.pipeline.ds_config import derive_ds_config, load_ds_config
    from raytrain.pipeline.engine import build_stage_engine, init_distributed
    from raytrain.pipeline.model import MistralConfig

    torch.set_num_threads(1)
    join_gloo(rank, 2, port)
    init_distributed("gloo")
    cfg = MistralConfig.preset("small")
    tc = TrainConfig(pp=2, dp=1, micro_batch_size=1, grad_accum_steps=2, max_steps=1000, lr=1e-4, warmup_steps=1)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ds_config = derive_ds_config(load_ds_config(os.path.join(repo, "configs", "ds_config.json")), tc)
    return cfg, build_stage_engine(cfg, ds_config, pp=2, dp=1, partition_method="type:DecoderLayerPipe",
                                   activation_checkpoint_interval=0, seed=0, lora=lora)


def join_gloo(rank: int, world_size: int, port: int) -> None:
    """Join a gloo group of `world_size` processes on this host outside Ray Train (waits for the other ranks); the
    env vars are what DeepSpeed's init_distributed reads when it wraps the group."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK="0",
                      WORLD_SIZE=str(world_size))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def pair_member(config: dict, port: int) -> dict:
    """A pp=1 run in a plain Ray task with its own one-process gloo group; two side by side fill both cores."""
    import torch.distributed as dist

    join_gloo(0, 1, port)
    try:
        return time_steps(config, 0)
    finally:
        dist.destroy_process_group()


def time_steps(config: dict, world_rank: int) -> dict:
    """Build this rank's pipeline stage and time warmup + timed optimizer steps on it."""
    runner = StageRunner(config, world_rank)
    step_times, losses, feed_times = [], [], []
    for _ in range(config["warmup"] + config["steps"]):
        seconds, loss, feed_s = runner.step()
        step_times.append(seconds)
        losses.append(loss)
        feed_times.append(feed_s)
    return {"step_times": step_times, "losses": losses, "feed_times": feed_times}


class StageRunner:
    """One rank's pipeline stage (raytrain's build_stage_engine) and its feed, in a process group already joined."""

    def __init__(self, config: dict, world_rank: int):
        import torch

        from raytrain.pipeline.engine import build_stage_engine, init_distributed
        from raytrain.pipeline.model import MistralConfig
        from raytrain.trainer.feed import micro_batches
        from raytrain.trainer.schedule import Topology

        torch.set_num_threads(config["threads"])
        torch.manual_seed(0)
        init_distributed("gloo")
        self.stage = build_stage_engine(MistralConfig.from_dict(config["model"]), config["ds_config"],
                                        pp=config["pp"], dp=1, partition_method="type:DecoderLayerPipe",
                                        activation_checkpoint_interval=0, seed=0)
        topo = Topology(pp=self.stage.num_stages, dp=self.stage.num_replicas, stage=self.stage.stage,
                        dp_rank=self.stage.dp_rank, world_rank=self.stage.world_rank)
        mbs, m = config["micro_batch_size"], config["grad_accum_steps"]
        self.data_iter = None
        if topo.needs_data:
            from raytrain.dataset.pack_reader import PackReader

            folder = os.path.dirname(config["files"][0])
            names = tuple(os.path.basename(f) for f in config["files"])
            reader = PackReader(folder, names)
            counts = reader.counts()
            if config["feed"] == "ray_data":  # the production read path: Ray Data tasks read this replica's packs
                from raytrain.dataset.stream import stream_micro_batches

                def read(own):
                    return stream_micro_batches(folder, names, None, own, mbs)
            else:  # the same packs, read into memory before the clock starts
                from raytrain.trainer.feed import in_memory_packs

                counts, read = in_memory_packs(reader.read(range(counts.num_packs)))
            self.data_iter = TimedIterator(micro_batches(counts, read, micro_batch_size=mbs, start_position=0,
                                                         dp_rank=0, dp=1, grad_accum_steps=m))

    def step(self) -> tuple[float, float, float]:
        """One optimizer step: (seconds, loss, seconds waited in next() of the feed)."""
        t0 = time.perf_counter()
        loss = self.stage.train_batch(self.data_iter)
        seconds = time.perf_counter() - t0
        return seconds, loss, self.data_iter.take_seconds() if self.data_iter is not None else 0.0


class InterleavedStage:
    """A Ray actor hosting one rank of a pp=1 or pp=2 run in its own gloo group, stepped by the driver."""

    def __init__(self, config: dict, rank: int, port: int):
        join_gloo(rank, config["pp"], port)
        self.runner = StageRunner(config, rank)

    def step(self) -> tuple[float, float, float]:
        return self.runner.step()


class TimedIterator:
    """Counts the seconds spent waiting in next(): the feed's own share of a step."""

    def __init__(self, it):
        self._it, self._seconds = it, 0.0

    def __iter__(self):
        return self

    def __next__(self):
        t0 = time.perf_counter()
        try:
            return next(self._it)
        finally:
            self._seconds += time.perf_counter() - t0

    def take_seconds(self) -> float:
        seconds, self._seconds = self._seconds, 0.0
        return seconds


CONTENDERS = (  # name, pp, threads per worker, feed
    ("pp1-1thread", 1, 1, "memory"),
    ("pp2-memory", 2, 1, "memory"),
    ("pp2-raydata", 2, 1, "ray_data"),
)
# Opt-in (--same-cores): one worker with 2 intra-op threads. On a loaded 2-core machine its OpenMP regions wait for
# both threads to be scheduled at once, and steps of 15-70 s were seen (against ~1.4 s with one thread).
SAME_CORES = ("pp1-2threads", 1, 2, "memory")
# Opt-in (--busy-baseline): two pp=1 runs side by side, one core each, as plain Ray tasks. Their step time is pp=1's
# with the machine as busy as pp=2 makes it (both cores computing: shared cache and memory bandwidth, no spare core
# for Ray's own actors, hypervisor steal), so pp=2 against it isolates what the schedule and its sends cost.
BUSY_BASELINE = ("pp1-pair", 1, 1, "memory")


def worker_config(pp: int, threads: int, feed: str, args, files: list[str], num_packs: int,
                  result_path: str = "") -> dict:
    from raytrain.config import TrainConfig
    from raytrain.pipeline.ds_config import derive_ds_config, load_ds_config

    tc = TrainConfig(pp=pp, dp=1, micro_batch_size=args.micro_batch_size, grad_accum_steps=args.grad_accum,
                     max_steps=args.warmup + args.steps, lr=1e-3, warmup_steps=1)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ds_config = derive_ds_config(load_ds_config(os.path.join(root, "configs", "ds_config.json")), tc)
    return {"pp": pp, "threads": threads, "feed": feed, "model": BENCH_MODEL, "ds_config": ds_config,
            "micro_batch_size": args.micro_batch_size, "grad_accum_steps": args.grad_accum,
            "warmup": args.warmup,
            "steps": args.steps, "files": files, "result_path": result_path}


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_interleaved(args, files: list[str], num_packs: int) -> None:
    """pp=1, pp=2 fed from memory, pp=2 fed by Ray Data and two pp=1 side by side, alive at once as Ray actors and
    stepped in turn, one optimizer step each (order alternating), so the machine's drift between launches does not
    enter the ratios."""
    import ray

    actor = ray.remote(num_cpus=1)(InterleavedStage)
    one, two = (worker_config(pp, 1, "memory", args, files, num_packs) for pp in (1, 2))
    streamed = worker_config(2, 1, "ray_data", args, files, num_packs)
    port_memory, port_streamed = free_port(), free_port()
    groups = {
        "pp1-1thread": [actor.remote(one, 0, free_port())],
        "pp2-memory": [actor.remote(two, rank, port_memory) for rank in range(2)],
        "pp2-raydata": [actor.remote(streamed, rank, port_streamed) for rank in range(2)],
        "pp1-pair": [actor.remote(one, 0, free_port()) for _ in range(2)],
    }
    ray.get([a.__ray_ready__.remote() for group in groups.values() for a in group])
    waited_s, busy = wait_for_quiet(args.quiet_busy, args.quiet_timeout)
    print(f"interleaved: {sum(map(len, groups.values()))} actors up; waited {waited_s:.0f}s for CPUs {busy:.0%} busy",
          flush=True)
    times: dict[str, list[float]] = {name: [] for name in groups}
    losses: dict[str, list[float]] = {name: [] for name in groups}
    for i in range(args.warmup + args.steps):
        for name in list(groups) if i % 2 == 0 else list(reversed(groups)):
            results = ray.get([a.step.remote() for a in groups[name]])  # the others wait idle meanwhile
            # pp=2: stage 0's time (it finishes last); the pair: the mean of its two runs
            seconds = statistics.mean(r[0] for r in results) if name == "pp1-pair" else results[0][0]
            losses[name].append(results[0][1])
            if i >= args.warmup:
                times[name].append(seconds)
        print(f"  step {i}{' (untimed)' if i < args.warmup else ''}: "
              + ", ".join(f"{n} {times[n][-1] if i >= args.warmup else float('nan'):.2f}s" for n in groups),
              flush=True)
    for group in groups.values():
        for a in group:
            ray.kill(a)
    m, p = args.grad_accum, 2
    ideal = 2 * m / (m + p - 1)
    print(f"\ninterleaved, {args.steps} timed steps each (median step s: "
          + ", ".join(f"{n} {statistics.median(t):.3f}" for n, t in times.items()) + ")")
    for base in ("pp1-1thread", "pp1-pair"):
        per_step = [b / a for a, b in zip(times["pp2-memory"], times[base], strict=True)]
        speedup = statistics.median(per_step)
        print(f"  pp=2 over {base}: median of per-step ratios {speedup:.2f}x, achieved/ideal {speedup / ideal:.2f} "
              f"(ideal {ideal:.2f}x, target >= {TARGET_PP_RATIO}); ratio of medians "
              f"{statistics.median(times[base]) / statistics.median(times['pp2-memory']):.2f}x")
    per_step = [m_ / r_ for m_, r_ in zip(times["pp2-memory"], times["pp2-raydata"], strict=True)]
    print(f"  Ray Data feed over in-memory feed (pp=2): median of per-step ratios {statistics.median(per_step):.3f} "
          f"(target >= {TARGET_FEED_RATIO}); ratio of medians "
          f"{statistics.median(times['pp2-memory']) / statistics.median(times['pp2-raydata']):.3f}; same losses: "
          f"{losses['pp2-raydata'] == losses['pp2-memory']}")
    diffs = [abs(a - b) for a, b in zip(losses["pp1-1thread"], losses["pp2-memory"], strict=True)]
    print(f"  losses pp=1 vs pp=2 (same seed, weights and batches; fp32 sums in another order): abs difference "
          f"{diffs[0]:.1e} at step 0, at most {max(diffs):.1e} over {len(diffs)} steps")


def run_contender(name: str, round_index: int, *, pp: int, threads: int, feed: str, args, files: list[str],
                  num_packs: int, workdir: str) -> dict:
    """One TorchTrainer launch; returns its step times (warmup dropped), losses and the load average around it."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    result_path = os.path.join(workdir, f"{name}-round{round_index}.json")
    config = worker_config(pp, threads, feed, args, files, num_packs, result_path)
    waited_s, busy = wait_for_quiet(args.quiet_busy, args.quiet_timeout)
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    if name == BUSY_BASELINE[0]:
        import ray

        task = ray.remote(num_cpus=threads)(pair_member)
        pair = ray.get([task.remote(config, free_port()) for _ in range(2)])
        print(f"  {name:<13} round {round_index}: steps {[round(t, 2) for t in pair[0]['step_times']]} and "
              f"{[round(t, 2) for t in pair[1]['step_times']]} s (first {args.warmup} untimed), launch "
              f"{time.perf_counter() - t0:.0f}s, load {load_before:.1f}->{os.getloadavg()[0]:.1f}, waited "
              f"{waited_s:.0f}s for CPUs {busy:.0%} busy", flush=True)
        times = [t for r in pair for t in r["step_times"][args.warmup:]]
        return {"step_times": times, "first_step_s": max(r["step_times"][0] for r in pair), "losses": pair[0]["losses"],
                "load_avg": (load_before, os.getloadavg()[0])}
    TorchTrainer(
        bench_worker_loop, train_loop_config=config, torch_config=TorchConfig(backend="gloo"),
        scaling_config=ScalingConfig(num_workers=pp, use_gpu=False, resources_per_worker={"CPU": threads}),
        run_config=RunConfig(name=f"{name}-round{round_index}", storage_path=os.path.join(workdir, "ray")),
    ).fit()
    wall_s = time.perf_counter() - t0
    with open(result_path, encoding="utf-8") as f:
        measured = json.load(f)
    feed_times = [measured["feed_times"]]  # every stage that loads data (the first: inputs, the last: labels)
    for rank in range(1, pp):
        with open(f"{result_path}.rank{rank}", encoding="utf-8") as f:
            feed_times.append(json.load(f)["feed_times"])
    feed_ms = 1000 * max(statistics.median(t[args.warmup:]) for t in feed_times)
    print(f"  {name:<13} round {round_index}: steps {[round(t, 2) for t in measured['step_times']]} s "
          f"(first {args.warmup} untimed; the slowest-fed stage waits {feed_ms:.1f} ms/step for its data), launch {wall_s:.0f}s, "
          f"load {load_before:.1f}->{os.getloadavg()[0]:.1f}, waited {waited_s:.0f}s for CPUs {busy:.0%} busy",
          flush=True)
    return {"step_times": measured["step_times"][args.warmup:], "first_step_s": measured["step_times"][0],
            "losses": measured["losses"], "load_avg": (load_before, os.getloadavg()[0]), "feed_s": feed_ms / 1000}


def stage_balance(pp: int, seq_len: int) -> float:
    """Training FLOPs of the busiest stage over the mean stage: 1.0 = perfectly balanced (PaLM counting)."""
    from raytrain.pipeline.model import MistralConfig, layer_parameter_counts
    from raytrain.pipeline.module import stage_layer_ranges

    cfg = MistralConfig.from_dict(BENCH_MODEL)
    counts = layer_parameter_counts(cfg)
    attention = 12.0 * cfg.num_attention_heads * cfg.head_dim * seq_len
    flops = [0.0] + [6.0 * c + attention for c in counts[1:-2]] + [6.0 * counts[-2], 6.0 * counts[-1]]
    per_stage = [sum(flops[a:b]) for a, b in stage_layer_ranges(cfg, pp, "type:DecoderLayerPipe")]
    return max(per_stage) / (sum(per_stage) / pp)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    contenders = CONTENDERS + ((SAME_CORES,) if args.same_cores else ()) + ((BUSY_BASELINE,) if args.busy_baseline
                                                                            else ())
    if args.only:
        wanted = args.only.split(",")
        unknown = sorted(set(wanted) - {c[0] for c in contenders})
        if unknown:
            raise SystemExit(f"--only: unknown contender(s) {unknown}; choose from {[c[0] for c in contenders]} "
                             "(pp1-2threads needs --same-cores, pp1-pair --busy-baseline)")
        contenders = tuple(c for c in contenders if c[0] in wanted)
    import ray
    import ray.data

    from raytrain.runner import WORKER_ENV

    workdir = args.out or tempfile.mkdtemp(prefix="bench_pipeline-")
    num_packs = (args.warmup + args.steps) * args.grad_accum * args.micro_batch_size  # one epoch, no pack reused
    files = write_random_packs(os.path.join(workdir, "packed"), num_packs, args.seq_len, BENCH_MODEL["vocab_size"])
    m, p = args.grad_accum, 2
    print(f"bench_pipeline: model {BENCH_MODEL}, seq {args.seq_len}, micro-batch {args.micro_batch_size} x m={m} "
          f"= {args.micro_batch_size * m * args.seq_len} tokens/step; {args.warmup} warmup + {args.steps} timed "
          f"steps; {os.cpu_count()} CPUs; work dir {workdir}", flush=True)
    # log_to_driver off: the figures below are the output (workers' DeepSpeed/Ray Data chatter stays in Ray's logs)
    # logical CPUs: 7 for the interleaved actors (idle but for the one group stepping), 4 for the launches
    ray.init(num_cpus=8 if args.interleaved else 4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": dict(WORKER_ENV)})
    ray.data.DataContext.get_current().enable_progress_bars = False
    t_all = time.perf_counter()
    if args.interleaved:
        try:
            run_interleaved(args, files, num_packs)
        finally:
            ray.shutdown()
        print(f"\nbench_pipeline: {time.perf_counter() - t_all:.0f}s")
        return 0
    runs: dict[str, list[dict]] = {name: [] for name, *_ in contenders}
    try:
        common = dict(args=args, files=files, num_packs=num_packs, workdir=workdir)
        for round_index in range(args.rounds):
            # ABC then CBA: a load that drifts during the run weighs on every contender alike
            order = contenders if round_index % 2 == 0 else tuple(reversed(contenders))
            for name, pp, threads, feed in order:
                runs[name].append(run_contender(name, round_index, pp=pp, threads=threads, feed=feed, **common))
    finally:
        ray.shutdown()

    tokens_per_step = args.micro_batch_size * m * args.seq_len
    stats = {}
    for name, *_ in contenders:
        times = [t for r in runs[name] for t in r["step_times"]]
        stats[name] = {"best": min(times), "median": statistics.median(times),
                       "first": statistics.median(r["first_step_s"] for r in runs[name])}
    print(f"\n{'contender':<14} {'workers x thr':>13} {'feed':>9} {'best step s':>12} {'median step s':>14} "
          f"{'tok/s (best)':>13} {'tok/s (median)':>15} {'first step s':>13}")
    for name, pp, threads, feed in contenders:
        st = stats[name]
        print(f"{name:<14} {pp:>9} x {threads:<1} {feed:>9} {st['best']:>12.3f} {st['median']:>14.3f} "
              f"{tokens_per_step / st['best']:>13.0f} {tokens_per_step / st['median']:>15.0f} {st['first']:>13.2f}")

    ideal = 2 * m / (m + p - 1)
    balance = stage_balance(p, args.seq_len)

    def ratio(a: str, b: str, key: str) -> float:  # tokens/s of a over b = step time of b over a
        return stats[b][key] / stats[a][key]

    have = set(stats)
    print()
    if {"pp1-1thread", "pp2-memory"} <= have:
        print(f"pp=2 vs pp=1 (one core per worker), ideal 2m/(m+p-1) = {ideal:.2f}x "
              f"(stage balance busiest/mean FLOPs {balance:.3f} -> balance-adjusted ideal {ideal / balance:.2f}x):")
        for key in ("best", "median"):
            speedup = ratio("pp2-memory", "pp1-1thread", key)
            print(f"  {key:>6} steps: speed-up {speedup:.2f}x, achieved/ideal {speedup / ideal:.2f} "
                  f"(target >= {TARGET_PP_RATIO})")
    if {"pp1-2threads", "pp2-memory"} <= have:
        for key in ("best", "median"):
            print(f"  {key:>6} steps: pp=2 over pp=1 with 2 threads (the same two cores): "
                  f"{ratio('pp2-memory', 'pp1-2threads', key):.2f}x")
    if {"pp1-pair", "pp2-memory"} <= have:
        for key in ("best", "median"):
            speedup = ratio("pp2-memory", "pp1-pair", key)
            print(f"  {key:>6} steps: pp=2 over pp=1 with both cores busy (two pp=1 side by side): {speedup:.2f}x, "
                  f"over ideal {speedup / ideal:.2f}")
    if {"pp2-raydata", "pp2-memory"} <= have:
        print(f"Ray Data feed vs in-memory feed (pp=2), target >= {TARGET_FEED_RATIO}:")
        for key in ("best", "median"):
            print(f"  {key:>6} steps: {ratio('pp2-raydata', 'pp2-memory', key):.3f}")
        for name in ("pp2-memory", "pp2-raydata"):
            feed_s = statistics.median(r["feed_s"] for r in runs[name])
            print(f"  {name}: the slowest-fed stage waits {1000 * feed_s:.1f} ms per step in next() of its feed, "
                  f"{feed_s / stats[name]['median']:.2%} of the median step")
        print(f"  first step (stream start, engine warm-up): Ray Data {stats['pp2-raydata']['first']:.2f}s, "
              f"memory {stats['pp2-memory']['first']:.2f}s")
        same_losses = all(r["losses"] == runs["pp2-memory"][0]["losses"] for r in runs["pp2-raydata"])
        print(f"  same losses step by step with both feeds (same micro-batches, same order): {same_losses}")
    print(f"\nbench_pipeline: {time.perf_counter() - t_all:.0f}s for {args.rounds * len(contenders)} launches; "
          f"load average now {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
