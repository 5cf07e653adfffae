"""The enrichment on RayDP against a single process doing the same steps, at two sizes of realistic rows: Spark
jobs per enrichment, the fixed overhead, the marginal rows/s of both, peak memory. Prints figures; never asserts.

    python benchmarks/bench_enrich.py [--sizes 2000 20000] [--executors 2] [--out /tmp/bench_enrich]

Rows: the sample dataset at the dataset card's row lengths (``size_scale=1.0``: code ~48 KB, math ~37 KB, with
``<think>`` traces), the same rows for both contenders; no context corpus (the corpus table is built once per
corpus and reused, a separate cost: benchmarks/bench_corpus.py). Same cores: Spark gets ``--executors``
executors of one core each; the single process gets as many torch threads. The contenders run one after the
other, so both see the machine's load; read the load averages it prints.

From the two sizes n1 < n2 with times t1, t2: marginal rows/s = (n2 - n1) / (t2 - t1), and the per-run constant
t1 - n1 / marginal; "fixed overhead" adds Spark's start (once per job) to that constant. Spark jobs are counted
by Spark's status tracker (the enrichment runs in a job group). Peak memory: resident set sizes sampled every
0.5 s and summed per side: the driver (this Python process and the Spark driver JVM it starts) and the executors
(RayDP's executor JVMs and the Python workers they start).

The lines a script reads, exactly in this form:
    spark jobs per enrichment: N
    fixed overhead: S s
    marginal rows/s: spark X, single process Y, ratio R
    peak memory: driver A GiB, executors B GiB
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
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SPLITS = 5  # the sample writes rows_per_split rows in each of the dataset's five splits


def baseline_enrich(rows: list[dict], job, eval_texts: list[str]) -> dict:
    """The same steps in one process, plain Python + sentence-transformers: returns the time and rows kept."""
    from raytrain.dataset.length import decide_length
    from raytrain.dataset.tokenize import fit_tool_call_turns, load_tokenizer, tokenize_conversation
    from raytrain.enrich.context import answer_for_scoring, candidate_sentences, with_context_block
    from raytrain.enrich.conversation import Example, derive_example
    from raytrain.enrich.decontam import build_eval_index, ngram_hashes
    from raytrain.enrich.dedup import exact_key, minhash_signatures, near_duplicate_clusters
    from raytrain.enrich.relevance import load_embedder, score_batch
    from raytrain.errors import RaytrainError

    cfg = job.enrich
    embedder, tokenizer = load_embedder(cfg.embedding_model or None), load_tokenizer(job.dataset.tokenizer)
    t0 = time.perf_counter()
    examples = [e for e in (derive_example(r, max_chars=cfg.max_chars) for r in rows) if isinstance(e, Example)]
    allowed = {lic.lower() for lic in cfg.licenses}
    examples = [e for e in examples if e.license.strip().lower() in allowed]
    best: dict[str, Example] = {}
    for e in examples:
        k = exact_key(e.full_text())
        if k not in best or e.uuid < best[k].uuid:
            best[k] = e
    examples = list(best.values())
    drop = set(near_duplicate_clusters([e.uuid for e in examples], minhash_signatures([e.full_text() for e in examples]),
                                       cfg.near_dup_threshold))
    examples = [e for e in examples if e.uuid not in drop]
    index = build_eval_index(eval_texts, cfg.decontam_ngram)
    examples = [e for e in examples if not any(int(h) in index for h in ngram_hashes(e.full_text(), cfg.decontam_ngram))]
    kept = 0
    for start in range(0, len(examples), 256):  # the same 256-row batches Spark's Arrow batches have
        batch = examples[start : start + 256]
        contexts = [candidate_sentences(e.messages).all for e in batch]  # enrich.system_prompt=keep
        sels = score_batch(contexts, [e.question for e in batch],
                           [answer_for_scoring(e.answer, cfg.answer_text) for e in batch], embedder,
                           batch_size=cfg.embed_batch_size, top_k=cfg.top_k, threshold=cfg.min_score,
                           question_weight=cfg.question_weight)
        for e, sents, sel in zip(batch, contexts, sels, strict=True):
            messages = with_context_block(list(e.messages), sel.kept(sents))
            try:
                fitted = fit_tool_call_turns(messages, job.dataset.tokenizer, job.dataset.text_with_tool_calls)
                tokenized = tokenize_conversation(fitted.messages, tokenizer, verify=False)
            except (RaytrainError, ValueError):
                continue
            kept += decide_length(tokenized.loss_mask, job.dataset.seq_len, job.dataset.length_policy).action != "drop"
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
    parser.add_argument("--executors", type=int, default=2)
    parser.add_argument("--out", default="/tmp/bench_enrich")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("raytrain").setLevel(logging.INFO)

    import pyarrow as pa
    import pyarrow.parquet as pq
    import ray
    import torch

    from raytrain.config import load_job_config
    from raytrain.enrich.decontam import load_eval_sets
    from raytrain.enrich.job import enrich_in_session
    from raytrain.enrich.spark import spark_session
    from raytrain.runner import WORKER_ENV
    from raytrain.sample_data import write_sample_dataset
    from raytrain.storage import resolve

    sizes = sorted(args.sizes)
    samples = {n: write_sample_dataset(os.path.join(args.out, f"sample-{n}"), rows_per_split=n // SPLITS,
                                       size_scale=1.0) for n in sizes}
    job = load_job_config(os.path.join(os.path.dirname(__file__), "..", "configs", "demo.yaml"), [
        f"storage.root={args.out}/runs", f"enrich.num_executors={args.executors}", "enrich.executor_cores=1",
        f"enrich.num_partitions={4 * args.executors}", "enrich.context_corpus=[]"])
    figures: dict = {"cpu_count": os.cpu_count(), "load_avg_start": os.getloadavg(), "spark": {}, "single": {}}

    ray.init(num_cpus=4, include_dashboard=False, runtime_env={"env_vars": dict(WORKER_ENV)})
    try:
        with MemorySampler() as memory:
            t0 = time.perf_counter()
            with spark_session(job.enrich, app_name="bench-enrich") as spark:
                figures["spark_start_s"] = time.perf_counter() - t0
                sc = spark.sparkContext
                for n in sizes:
                    group = f"enrich-{n}"
                    sc.setJobGroup(group, group)
                    t0 = time.perf_counter()
                    report = enrich_in_session(spark, job, resolve(samples[n].out_dir),
                                               resolve(f"{args.out}/runs/bench-{n}"),
                                               eval_sets=(samples[n].eval_path,)).report
                    seconds = time.perf_counter() - t0
                    figures["spark"][n] = {"seconds": seconds, "rows_in": report["rows_in"],
                                           "rows_out": report["rows_out"], "passes": report["passes"],
                                           "jobs": len(sc.statusTracker().getJobIdsForGroup(group))}
                    print(f"spark {n} rows: {seconds:.1f} s, passes {report['passes']}, "
                          f"{figures['spark'][n]['jobs']} jobs", flush=True)
        figures["peak_memory_bytes"] = dict(memory.peak)
    finally:
        ray.shutdown()
    figures["load_avg_after_spark"] = os.getloadavg()

    torch.set_num_threads(args.executors)  # the cores Spark's executors had
    for n in sizes:
        sample = samples[n]
        rows = pa.concat_tables([pq.read_table(p) for p in sample.all_files()]).to_pylist()
        base = baseline_enrich(rows, job, load_eval_sets([sample.eval_path]))
        figures["single"][n] = {"seconds": base["seconds"], "rows_in": len(rows), "rows_out": base["rows_out"]}
        print(f"single process {n} rows: {base['seconds']:.1f} s", flush=True)
        del rows
    figures["load_avg_end"] = os.getloadavg()
    print(json.dumps(figures, indent=1, default=str))

    (n1, n2), sp, one = sizes, figures["spark"], figures["single"]
    spark_rate = (sp[n2]["rows_in"] - sp[n1]["rows_in"]) / (sp[n2]["seconds"] - sp[n1]["seconds"])
    single_rate = (one[n2]["rows_in"] - one[n1]["rows_in"]) / (one[n2]["seconds"] - one[n1]["seconds"])
    constant = sp[n1]["seconds"] - sp[n1]["rows_in"] / spark_rate
    gib = 2**30
    print(f"\n{os.cpu_count()} cores, 1-min load average {figures['load_avg_start'][0]:.1f} (start) / "
          f"{figures['load_avg_after_spark'][0]:.1f} (after Spark) / {figures['load_avg_end'][0]:.1f} (end); "
          f"rows {n1} and {n2}; Spark start {figures['spark_start_s']:.1f} s, per-run constant {constant:.1f} s; "
          f"rows kept: spark {sp[n1]['rows_out']}/{sp[n2]['rows_out']}, single {one[n1]['rows_out']}/"
          f"{one[n2]['rows_out']}")
    print(f"passes at {n2} rows: " + ", ".join(f"{k} {v:.1f} s" for k, v in sp[n2]["passes"].items()))
    print(f"spark jobs per enrichment: {sp[n2]['jobs']}")
    print(f"fixed overhead: {figures['spark_start_s'] + constant:.1f} s")
    print(f"marginal rows/s: spark {spark_rate:.1f}, single process {single_rate:.1f}, "
          f"ratio {spark_rate / single_rate:.2f}")
    print(f"peak memory: driver {figures['peak_memory_bytes']['driver'] / gib:.2f} GiB, "
          f"executors {figures['peak_memory_bytes']['executors'] / gib:.2f} GiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
