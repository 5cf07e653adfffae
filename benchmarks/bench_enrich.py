"""The enrichment on RayDP against a single process doing the same steps, at two sizes of realistic rows: Spark
jobs per enrichment, the fixed overhead, the marginal rows/s of both, peak memory. Prints figures; never asserts.

    python benchmarks/bench_enrich.py [--sizes 2000 20000] [--single-sizes N1 N2] [--executors 2] [--seq-len 4096]
                                      [--warmup-rows 100] [--out /tmp/bench_enrich]

Rows: the sample dataset at the dataset card's row lengths (``size_scale=1.0``: code ~48 KB, math ~37 KB, with
``<think>`` traces), the same rows for both contenders; the demo config with the 7B configs' ``dataset.seq_len``
(4,096, length policy drop: most code and math rows are quarantined as too long, before they are embedded); no
context corpus (the corpus table is built once per corpus and reused, a separate cost: benchmarks/bench_corpus.py).
Same cores: Spark gets ``--executors`` executors of one core each; the single process gets as many torch threads.
The contenders run one after the other, so both see the machine's load; read the load averages it prints.

Each contender first enriches ``--warmup-rows`` rows, then the two sizes n1 < n2 with times t1, t2: marginal
rows/s = (n2 - n1) / (t2 - t1), the per-run constant t1 - n1 / marginal, and the first run's warm-up (Python
workers, imports, the model in each worker: what the first enrichment of a Spark session pays once) the warm-up
run's time less its rows at the marginal rate and the constant. Without the warm-up run that cost would sit in t1
alone and flatter the slope. "fixed overhead" is what one enrichment job pays besides its rows: Spark's start, the
warm-up and the per-run constant. ``--single-sizes`` (default: ``--sizes``) lets the single process, whose cost is
per row, take its slope from smaller samples of the same generator when the large size would take too long twice
(the scale run: ``--sizes 2000 20000 --single-sizes 400 2000``). Spark jobs are counted
by Spark's status tracker: those of the enrichment's job group, plus the jobs without a group that appeared during
it (a broadcast join's job runs in a thread of its own and carries no group; nothing else runs meanwhile). The
count is printed for n2. Peak memory: resident set sizes sampled every
0.5 s and summed per side: the driver (this Python process and the Spark driver JVM it starts) and the executors
(RayDP's executor JVMs and the Python workers they start).

The lines a script reads, exactly in this form:
    spark jobs per enrichment: N
    fixed overhead: S s
    marginal rows/s: spark X, single process Y, ratio R
    peak memory: driver A GiB, executors B GiB

On a 64-core node (not measured here; what the design predicts): Spark would get e.g. 16 executors x 4 cores with
``enrich.num_partitions`` 64 or more and torch's threads per Python worker set to the executor's cores (``batches``
sets them; concurrent workers x threads never exceed the cores). The per-row work (MinHash, sentence embedding,
tokenization) is independent per row, so the marginal rate should grow about with the cores, while one process's
torch threads scale sublinearly on MiniLM's small matrices, so the ratio R should rise above this machine's. The
fixed overhead would not shrink: the JVMs, the Python workers and their imports start per executor in parallel,
and the per-run constant is stages and jobs, not rows. At the real dataset's 25 million rows it is noise; the
rows are the schedule, and the near-duplicate clustering runs in one task on the verified pairs only.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the near-duplicate rule in one process lives with the tests, which check the Spark job against it
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SPLITS = 5  # the sample writes rows_per_split rows in each of the dataset's five splits


def baseline_enrich(rows: list[dict], job, eval_texts: list[str]) -> dict:
    """The same steps in one process, plain Python + sentence-transformers: returns the time and rows kept."""
    from near_dedup_reference import near_duplicates_in_order

    from raytrain.dataset.length import decide_length
    from raytrain.dataset.tokenize import fit_tool_call_turns, load_tokenizer, tokenize_conversation
    from raytrain.enrich.context import answer_for_scoring, candidate_sentences, with_context_block
    from raytrain.enrich.conversation import Example, derive_example
    from raytrain.enrich.decontam import build_eval_index, ngram_hashes
    from raytrain.enrich.dedup import exact_key, minhash_signatures
    from raytrain.enrich.relevance import load_embedder, score_batch
    from raytrain.errors import RaytrainError

    cfg = job.enrich
    embedder, tokenizer = load_embedder(cfg.embedding_model or None), load_tokenizer(job.dataset.tokenizer)
    t0 = time.perf_counter()
    examples = [e for e in (derive_example(r, max_chars=cfg.max_chars) for r in rows) if isinstance(e, Example)]
    allowed = {lic.lower() for lic in cfg.licenses}
    examples = [e for e in examples if e.license.strip().lower() in allowed]
    first: dict[str, Example] = {}
    for e in examples:  # `rows` in input order: the first row of each key stays
        first.setdefault(exact_key(e.full_text()), e)
    examples = list(first.values())
    drop = set(near_duplicates_in_order([e.uuid for e in examples],
                                        minhash_signatures([e.full_text() for e in examples]), cfg.near_dup_threshold))
    examples = [e for e in examples if e.uuid not in drop]
    index = build_eval_index(eval_texts, cfg.decontam_ngram)
    examples = [e for e in examples if not any(int(h) in index for h in ngram_hashes(e.full_text(), cfg.decontam_ngram))]
    kept = 0
    ds = job.dataset

    def tokenized_or_none(messages: list[dict]):
        try:
            fitted = fit_tool_call_turns(messages, ds.tokenizer, ds.text_with_tool_calls)
            return tokenize_conversation(fitted.messages, tokenizer, verify=False)
        except (RaytrainError, ValueError):
            return None

    def refused(tokenized) -> bool:
        return tokenized is None or decide_length(tokenized.loss_mask, ds.seq_len, ds.length_policy).action == "drop"

    # as batches.refused_before_context: a row refused as it stands (context only adds tokens) is never embedded
    examples = [e for e in examples if len(json.dumps(list(e.messages), ensure_ascii=False)) <= ds.seq_len
                or not refused(tokenized_or_none(list(e.messages)))]
    for start in range(0, len(examples), 256):  # the same 256-row batches Spark's Arrow batches have
        batch = examples[start : start + 256]
        contexts = [candidate_sentences(e.messages).all for e in batch]  # enrich.system_prompt=keep
        sels = score_batch(contexts, [e.question for e in batch],
                           [answer_for_scoring(e.answer, cfg.answer_text) for e in batch], embedder,
                           batch_size=cfg.embed_batch_size, top_k=cfg.top_k, threshold=cfg.min_score,
                           question_weight=cfg.question_weight)
        for e, sents, sel in zip(batch, contexts, sels, strict=True):
            kept += not refused(tokenized_or_none(with_context_block(list(e.messages), sel.kept(sents))))
    return {"seconds": time.perf_counter() - t0, "rows_out": kept}


class MemorySampler:
    """Peak summed RSS of the driver side and the executor side, sampled every ``interval_s`` in a thread."""

    def __init__(self, interval_s: float = 0.5):
        import psutil

        self._psutil, self._me = psutil, psutil.Process()
        self.peak = {"driver": 0, "executors": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _side(self, p) -> str | None:
        if p.pid == self._me.pid:
            return "driver"
        cmd = " ".join(p.cmdline())
        if "java" in cmd and "RayDPExecutor" not in cmd and ("SparkSubmit" in cmd or "pyspark-shell" in cmd):
            return "driver"  # the Spark driver JVM behind py4j
        if "java" in cmd and ("RayDPExecutor" in cmd or "raydp" in cmd.lower()):
            return "executors"
        if "pyspark.daemon" in cmd or "pyspark/daemon" in cmd or "pyspark.worker" in cmd:
            return "executors"
        return None

    def _run(self) -> None:
        while not self._stop.is_set():
            total = {"driver": 0, "executors": 0}
            for p in self._psutil.process_iter():
                try:
                    side = self._side(p)
                    if side:
                        total[side] += p.memory_info().rss
                except (self._psutil.NoSuchProcess, self._psutil.AccessDenied, self._psutil.ZombieProcess):
                    continue
            for k, v in total.items():
                self.peak[k] = max(self.peak[k], v)
            self._stop.wait(0.5)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs=2, default=[2000, 20000], help="rows of the two enrichments")
    parser.add_argument("--single-sizes", type=int, nargs=2, default=None,
                        help="rows of the single process's two runs (default: --sizes)")
    parser.add_argument("--executors", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=4096, help="dataset.seq_len (the 7B configs' value)")
    parser.add_argument("--warmup-rows", type=int, default=100, help="rows of the first run (at least 100: 20 per split)")
    parser.add_argument("--out", default="/tmp/bench_enrich")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("raytrain").setLevel(logging.INFO)

    import pyarrow as pa
    import pyarrow.parquet as pq
    import ray
    import torch

    from raytrain.config import load_job_config
    from raytrain.enrich.job import enrich_in_session
    from raytrain.enrich.plan import load_eval_texts
    from raytrain.enrich.spark import spark_session
    from raytrain.runner import WORKER_ENV
    from raytrain.sample_data import write_sample_dataset
    from raytrain.storage import resolve

    sizes = sorted(args.sizes)
    single_sizes = sorted(args.single_sizes or sizes)
    runs, single_runs = [args.warmup_rows, *sizes], [args.warmup_rows, *single_sizes]
    samples = {n: write_sample_dataset(os.path.join(args.out, f"sample-{n}"), rows_per_split=n // SPLITS,
                                       size_scale=1.0) for n in sorted({*runs, *single_runs})}
    job = load_job_config(os.path.join(os.path.dirname(__file__), "..", "configs", "demo.yaml"), [
        f"storage.root={args.out}/runs", f"enrich.num_executors={args.executors}", "enrich.executor_cores=1",
        f"enrich.num_partitions={4 * args.executors}", "enrich.context_corpus=[]", f"dataset.seq_len={args.seq_len}"])
    figures: dict = {"cpu_count": os.cpu_count(), "load_avg_start": os.getloadavg(), "spark": {}, "single": {}}

    ray.init(num_cpus=4, include_dashboard=False, runtime_env={"env_vars": dict(WORKER_ENV)})
    try:
        with MemorySampler() as memory:
            t0 = time.perf_counter()
            with spark_session(job.enrich, app_name="bench-enrich") as spark:
                figures["spark_start_s"] = time.perf_counter() - t0
                sc = spark.sparkContext
                for n in runs:
                    group = f"enrich-{n}"
                    sc.setJobGroup(group, group)
                    ungrouped = set(sc.statusTracker().getJobIdsForGroup(None))
                    t0 = time.perf_counter()
                    report = enrich_in_session(spark, job, resolve(samples[n].out_dir),
                                               resolve(f"{args.out}/runs/bench-{n}"),
                                               eval_sets=(samples[n].eval_path,)).report
                    seconds = time.perf_counter() - t0
                    figures["spark"][n] = {"seconds": seconds, "rows_in": report["rows_in"],
                                           "rows_out": report["rows_out"], "passes": report["passes"],
                                           "steps": report.get("steps"),
                                           "jobs": len(sc.statusTracker().getJobIdsForGroup(group)) + len(
                                               set(sc.statusTracker().getJobIdsForGroup(None)) - ungrouped)}
                    print(f"spark {n} rows: {seconds:.1f} s, passes {report['passes']}, "
                          f"{figures['spark'][n]['jobs']} jobs", flush=True)
        figures["peak_memory_bytes"] = dict(memory.peak)
    finally:
        ray.shutdown()
    figures["load_avg_after_spark"] = os.getloadavg()

    torch.set_num_threads(args.executors)  # the cores Spark's executors had
    for n in single_runs:
        sample = samples[n]
        rows = pa.concat_tables([pq.read_table(p).sort_by("uuid") for p in sample.all_files()]).to_pylist()
        base = baseline_enrich(rows, job, load_eval_texts((sample.eval_path,), resolve("/"), None).texts)
        figures["single"][n] = {"seconds": base["seconds"], "rows_in": len(rows), "rows_out": base["rows_out"]}
        print(f"single process {n} rows: {base['seconds']:.1f} s", flush=True)
        del rows
    figures["load_avg_end"] = os.getloadavg()
    print(json.dumps(figures, indent=1, default=str))

    (n1, n2), (s1, s2), sp, one = sizes, single_sizes, figures["spark"], figures["single"]
    spark_rate = (sp[n2]["rows_in"] - sp[n1]["rows_in"]) / (sp[n2]["seconds"] - sp[n1]["seconds"])
    single_rate = (one[s2]["rows_in"] - one[s1]["rows_in"]) / (one[s2]["seconds"] - one[s1]["seconds"])
    constant = sp[n1]["seconds"] - sp[n1]["rows_in"] / spark_rate
    warm = sp[args.warmup_rows]
    warmup = warm["seconds"] - warm["rows_in"] / spark_rate - constant
    gib = 2**30
    print(f"\n{os.cpu_count()} cores, 1-min load average {figures['load_avg_start'][0]:.1f} (start) / "
          f"{figures['load_avg_after_spark'][0]:.1f} (after Spark) / {figures['load_avg_end'][0]:.1f} (end); "
          f"rows {n1} and {n2}, seq_len {args.seq_len}; Spark start {figures['spark_start_s']:.1f} s, first-run "
          f"warm-up {warmup:.1f} s ({warm['rows_in']} rows in {warm['seconds']:.1f} s), per-run constant "
          f"{constant:.1f} s; "
          f"rows kept: spark {sp[n1]['rows_out']}/{sp[n2]['rows_out']}, single {one[s1]['rows_out']}/"
          f"{one[s2]['rows_out']} (at {s1} and {s2} rows)")
    print(f"passes at {n2} rows: " + ", ".join(f"{k} {v:.1f} s" for k, v in sp[n2]["passes"].items()))
    print(f"spark jobs per enrichment: {sp[n2]['jobs']}")
    print(f"fixed overhead: {figures['spark_start_s'] + warmup + constant:.1f} s")
    print(f"marginal rows/s: spark {spark_rate:.1f}, single process {single_rate:.1f}, "
          f"ratio {spark_rate / single_rate:.2f}")
    print(f"peak memory: driver {figures['peak_memory_bytes']['driver'] / gib:.2f} GiB, "
          f"executors {figures['peak_memory_bytes']['executors'] / gib:.2f} GiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
