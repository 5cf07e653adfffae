"""The whole job (enrich -> pack -> train) on card-length rows, streamed in waves against one wave, side by side in
one run: when the first and the last optimizer step happen after the job starts. Prints figures; never asserts.

    python benchmarks/bench_stream.py [--rows 2000] [--waves 10] [--steps 12] [--seq-len 4096] [--out DIR]

Rows: the sample dataset at the dataset card's row lengths (``size_scale=1.0``), each split rewritten into
``--waves / 5`` shards so that ``enrich.wave_rows`` cuts the input into ``--waves`` waves of whole files; the demo
config otherwise (tiny Mistral, pp 2, the embedded local Ray), no context corpus, ``dataset.seq_len`` 4,096 as in the
7B configs. One wave runs first, then the streamed run, each a `raytrain run` process of its own (its embedded Ray
and Spark; the frameworks' output in the run's log file). The times are from submit (the process's start) to each
step's ``finished_unix_s`` in the run's metrics.jsonl.

The lines a script reads, exactly in this form:
    time to first step: streamed S1 s, one wave S2 s, ratio R1
    time to last step: streamed T1 s, one wave T2 s, ratio R2
    kept rows equal: True

Then the extrapolation to the full dataset on a cluster, from the streamed run's measured rates: the enrichment's
rows/s per Spark core (the waves' rows over their enrichment seconds, over the executors' cores; a wave's fixed
cost is inside it, and on this machine the trainer shares the cores), the packing seconds per wave, and the time
from the job's start to the first wave's commit less that wave's enrichment (Spark's start, planning). On a 64-core head node with 8 GPUs,
56 cores enriching (8 left to the trainer's data reads), waves of ``--cluster-wave-rows`` rows: the first step
comes after the start, one wave's enrichment and packing, and the trainer's start (measured here).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SPLITS = 5
FULL_ROWS = 25_700_000
CLUSTER_CORES, CLUSTER_ENRICH_CORES, CLUSTER_GPUS = 64, 56, 8


def reshard(sample_dir: str, shards: int) -> None:
    """Rewrite every split of the sample into ``shards`` files of consecutive rows, named as the hub names them."""
    import pyarrow.parquet as pq

    from raytrain.sample_data.spec import FILE_PREFIX, shard_names

    data = os.path.join(sample_dir, "data")
    for split, prefix in FILE_PREFIX.items():
        table = pq.read_table([os.path.join(sample_dir, n) for n in shard_names(split)])
        for name in shard_names(split):
            os.remove(os.path.join(sample_dir, name))
        per = -(-table.num_rows // shards)
        for i in range(shards):
            pq.write_table(table.slice(i * per, per), os.path.join(data, f"{prefix}-{i:05d}-of-{shards:05d}.parquet"))


def timed_run(job, overrides: list[str]) -> dict:
    """`raytrain run` of ``job`` (the demo config and ``overrides``) in a process of its own, timed from its start
    (submit): the steps' finish times, the waves' records and the kept rows, from the run folder."""
    import pyarrow.parquet as pq

    from raytrain.runner import open_run

    t0 = time.time()
    done = subprocess.run([sys.executable, "-m", "raytrain.cli", "run", "configs/demo.yaml", *overrides], cwd=REPO,
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"raytrain run failed ({done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
    run = open_run(job)
    with open(run.root.join("reports", "metrics.jsonl").path) as f:
        steps = [json.loads(line) for line in f]

    def records(folder) -> list[dict]:
        return [json.loads(folder.join(n).read_text()) for n in sorted(folder.listdir()) if n.endswith(".json")] \
            if folder.exists() else []

    kept = set(pq.read_table(run.paths.enriched.path, columns=["uuid"]).column("uuid").to_pylist())
    return {"start": t0, "first": steps[0]["finished_unix_s"] - t0, "last": steps[-1]["finished_unix_s"] - t0,
            "enriched": records(run.paths.waves), "packed": records(run.paths.packed.join("waves")), "kept": kept}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--waves", type=int, default=10, help="a multiple of 5 (each split in waves / 5 files)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--cluster-wave-rows", type=int, default=50_000)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.waves % SPLITS:
        parser.error(f"--waves must be a multiple of {SPLITS} (each split is cut into waves / {SPLITS} files)")
    from raytrain.config import load_job_config
    from raytrain.sample_data import write_sample_dataset

    out = args.out or tempfile.mkdtemp(prefix="bench_stream-")
    shutil.rmtree(os.path.join(out, "runs"), ignore_errors=True)
    sample = os.path.join(out, "sample")
    write_sample_dataset(sample, rows_per_split=args.rows // SPLITS, size_scale=1.0)
    reshard(sample, args.waves // SPLITS)
    wave_rows = args.rows // args.waves

    def overrides(name: str, waves: int) -> list[str]:
        return [f"storage.root={out}/runs", f"storage.run_name={name}", f"input.path={sample}",
                f"enrich.wave_rows={waves}", "enrich.context_corpus=[]", "enrich.eval_sets=[]",
                f"dataset.seq_len={args.seq_len}", f"train.max_steps={args.steps}",
                f"train.checkpoint_every={args.steps}", f"train.eval_every={args.steps}", "train.generation_tokens=0"]

    def timed(name: str, waves: int):
        job = load_job_config(os.path.join(REPO, "configs", "demo.yaml"), overrides(name, waves))
        return job, timed_run(job, overrides(name, waves))

    _, one = timed("one-wave", 0)
    streamed_job, streamed = timed("streamed", wave_rows)
    print(f"time to first step: streamed {streamed['first']:.1f} s, one wave {one['first']:.1f} s, ratio "
          f"{streamed['first'] / one['first']:.2f}")
    print(f"time to last step: streamed {streamed['last']:.1f} s, one wave {one['last']:.1f} s, ratio "
          f"{streamed['last'] / one['last']:.2f}")
    print(f"kept rows equal: {streamed['kept'] == one['kept']}")

    waves, packs = streamed["enriched"], streamed["packed"]
    cores = streamed_job.enrich.num_executors * streamed_job.enrich.executor_cores
    rows, seconds = sum(w["rows_in"] for w in waves), sum(w["seconds"] for w in waves)
    # the waves' whole time over their rows: any fixed cost of a wave is inside this rate (the waves are the same
    # size here, so it cannot be told apart; each wave's seconds are printed)
    per_core = rows / seconds / cores
    pack_s = sum(p["seconds"] for p in packs) / len(packs)
    start_s = waves[0]["committed_unix_s"] - streamed["start"] - waves[0]["seconds"]
    trainer_start_s = streamed["first"] - (packs[0]["committed_unix_s"] - streamed["start"])
    took = ", ".join(f"{w['seconds']:.0f}" for w in waves)
    print(f"measured: {len(waves)} waves of ~{wave_rows} rows in {took} s "
          f"= {per_core:.1f} rows/s per Spark core; packing {pack_s:.1f} s per wave; start to the first wave "
          f"{start_s:.1f} s; first wave packed to the first step {trainer_start_s:.1f} s")
    if all("around_s" in w for w in waves):  # each wave's seconds: the rows' work and the rest around it
        split = ", ".join(f"{w['rows_work_s']:.0f}+{w['around_s']:.0f}" for w in waves)
        around = sum(w["around_s"] for w in waves) / len(waves)
        print(f"per wave, the rows' work + around it: {split} s; around it {around:.1f} s a wave on average "
              "(Spark's planning and scheduling, reads, shuffles, writes: the fixed cost of a wave, mostly)")
    wave_s = args.cluster_wave_rows / (per_core * CLUSTER_ENRICH_CORES)
    first = start_s + wave_s + pack_s + trainer_start_s
    total_h = (FULL_ROWS / args.cluster_wave_rows) * wave_s / 3600
    print(f"extrapolated to {FULL_ROWS:,} rows on a {CLUSTER_CORES}-core head node with {CLUSTER_GPUS} GPUs "
          f"({CLUSTER_ENRICH_CORES} cores enriching, waves of {args.cluster_wave_rows:,} rows): first step "
          f"{first / 60:.1f} min after submit (goal <= 10 min), enrichment of every row {total_h:.1f} h while training "
          "runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
