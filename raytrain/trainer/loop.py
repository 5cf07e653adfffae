"""The per-worker training loop: one TorchTrainer worker hosts one stage of one pipeline replica.

setup (process group, stage engine, resume) -> train (steps, metrics, checkpoints) -> done. Reads top to bottom.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from typing import Any

import ray.train
import torch
import torch.distributed as dist

from raytrain.checkpoint.layout import step_dir_name
from raytrain.checkpoint.store import CheckpointStore, CommittedCheckpoint
from raytrain.config import JobConfig
from raytrain.dataset.labels import IGNORE_INDEX
from raytrain.dataset.packs import PackReader
from raytrain.dataset.stream import stream_micro_batches
from raytrain.pipeline.flops import mfu, pipeline_bubble_fraction
from raytrain.pipeline.model import model_config
from raytrain.storage import resolve
from raytrain.telemetry import record_train_step
from raytrain.trainer.feed import FeedTrace, micro_batches, validation_micro_batches
from raytrain.trainer.schedule import Topology, check_resume_position, data_position, validation_micro_batches_of
from raytrain.trainer.tracking import Trackers

log = logging.getLogger(__name__)


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    """Entry point run by every TorchTrainer worker. `loop_config` (pickled to the workers): job (the JobConfig),
    run_uri, ds_config, packed / validation / benchmark (folder URI, file names, number of packs), versions."""
    from raytrain.pipeline.engine import build_stage_engine, init_distributed

    job: JobConfig = loop_config["job"]
    tc = job.train
    torch.manual_seed(tc.seed)

    # ---- setup -------------------------------------------------------------------------------------------------
    init_distributed("nccl" if tc.use_gpu else "gloo")
    model_cfg = model_config(job.model.preset, job.model.init_from)
    stage = build_stage_engine(model_cfg, loop_config["ds_config"], pp=tc.pp, dp=tc.dp,
                               partition_method=tc.partition_method,
                               activation_checkpoint_interval=tc.activation_checkpoint_interval,
                               activation_checkpoint_reentrant=tc.activation_checkpoint_reentrant,
                               seed=tc.seed, init_from=job.model.init_from, attn_impl=job.model.attn_impl)
    # where this worker sits, as DeepSpeed's grid placed it
    topo = Topology(pp=stage.num_stages, dp=stage.num_replicas, stage=stage.stage, dp_rank=stage.dp_rank,
                    world_rank=stage.world_rank)

    run_root = resolve(loop_config["run_uri"], s3_endpoint=job.storage.s3_endpoint or None)
    store = CheckpointStore(run_root, keep_last=tc.keep_last, keep_best=tc.keep_best or None,
                            on_corrupt=tc.on_corrupt_checkpoint)
    step, resumed_metrics = _resume(stage, store, topo, tc)

    # ---- data: first and last stages read their replica's packs in the epoch's order (raytrain.trainer.feed) ----
    trace = FeedTrace()
    data_iter = None
    read_stats: dict[str, int] = {}
    endpoint = job.storage.s3_endpoint or None
    packed = loop_config["packed"]
    if topo.needs_data:
        counts = PackReader(packed["uri"], packed["files"], endpoint).counts()

        def read(own: list) -> Any:
            return stream_micro_batches(packed["uri"], tuple(packed["files"]), endpoint, own, tc.micro_batch_size,
                                        read_stats)

        data_iter = micro_batches(counts, read, micro_batch_size=tc.micro_batch_size,
                                  start_position=data_position(step, tc.dp, tc.grad_accum_steps),
                                  dp_rank=topo.dp_rank, dp=tc.dp, grad_accum_steps=tc.grad_accum_steps,
                                  seed=tc.seed, shuffle=tc.shuffle, trace=trace)

    # ---- evaluation sets: the held-out validation packs (eval_loss) and the benchmark items (benchmark_loss); each
    # evaluated whole, dp replicas sharing its micro-batches; read once, then kept in memory ---------------------
    eval_sets = {metric: loop_config[name] for name, metric in (("validation", "eval_loss"),
                                                                ("benchmark", "benchmark_loss"))
                 if loop_config.get(name)}
    own_eval: dict[str, list[Any]] = {}

    def evaluate(metric: str) -> float:
        held = eval_sets[metric]
        count = validation_micro_batches_of(topo.dp_rank, tc.dp, held["num_packs"], tc.micro_batch_size)
        eval_iter = None
        if topo.needs_data:
            if metric not in own_eval:
                reader = PackReader(held["uri"], held["files"], endpoint)
                mbs, total = tc.micro_batch_size, held["num_packs"]
                batches = (reader.read(range(i, min(i + mbs, total))) for i in range(0, total, mbs))
                own, _targets = validation_micro_batches(batches, micro_batch_size=mbs, dp_rank=topo.dp_rank,
                                                         dp=tc.dp)
                assert len(own) == count, f"{metric}: read {len(own)} micro-batches, expected {count}"
                own_eval[metric] = own
            eval_iter = iter(own_eval[metric])
        return stage.eval_loss(eval_iter, count)

    # ---- train -------------------------------------------------------------------------------------------------
    seq_len = job.dataset.seq_len
    tokens_per_step = tc.global_batch_size * seq_len
    bubble = pipeline_bubble_fraction(tc.grad_accum_steps, tc.pp)
    reports_dir = loop_config.get("local_reports_dir")
    metrics_path = os.path.join(reports_dir, "metrics.jsonl") if reports_dir else None
    # rank 0 (a data-reading first stage) writes TensorBoard events: `tensorboard --logdir <run>/reports/tensorboard`
    board = _tensorboard(os.path.join(reports_dir, "tensorboard"), step) if reports_dir and topo.world_rank == 0 \
        else None
    samples = _Samples(stage, job, topo, eval_sets.get("eval_loss"), endpoint, reports_dir) \
        if tc.sample_new_tokens and "eval_loss" in eval_sets else None
    trackers = Trackers(job, reports_dir, topo.world_rank)  # MLflow / W&B on request (train.tracking), rank 0
    end_step = tc.stop_at_step or tc.max_steps
    tokens_seen = int(resumed_metrics.get("tokens_seen") or 0)
    launch_t0, launch_step = time.perf_counter(), step
    while step < end_step:
        t0 = time.perf_counter()
        consumed_before = len(trace.consumed)
        loss = stage.train_batch(data_iter)
        step_time_s = time.perf_counter() - t0
        step += 1
        tokens_per_s = tokens_per_step / step_time_s
        # real (non-padding) tokens of the global batch, counted by this rank's feed (ranks without one: None)
        real_tokens = trace.step_tokens[-1] if trace.step_tokens else None
        tokens_seen += real_tokens or 0
        seconds_per_step = (time.perf_counter() - launch_t0) / (step - launch_step)
        metrics = {
            "step": step, "loss": loss, "lr": stage.lr(), "grad_norm": stage.grad_norm(),
            "step_time_s": step_time_s, "tokens_per_s": tokens_per_s,
            "real_tokens": real_tokens, "real_tokens_per_s": real_tokens / step_time_s if real_tokens else None,
            "target_tokens": trace.step_targets[-1] if trace.step_targets else None,
            "tokens_seen": tokens_seen if topo.needs_data else None,
            "eta_s": seconds_per_step * (end_step - step),
            "samples_per_s": tc.global_batch_size / step_time_s,
            "pipeline_bubble": bubble, "stage": topo.stage, "dp_rank": topo.dp_rank,
            "mfu": mfu(tokens_per_s, model_cfg, seq_len, tc.peak_tflops * 1e12 * tc.num_workers) if tc.peak_tflops else None,
            "data_position": data_position(step, tc.dp, tc.grad_accum_steps),
        }
        if eval_sets and (step == end_step or (tc.eval_every and step % tc.eval_every == 0)):
            t_eval = time.perf_counter()
            for metric in eval_sets:
                metrics[metric] = evaluate(metric)
            metrics["eval_time_s"] = time.perf_counter() - t_eval
        record_train_step(job.storage.run_name, topo.stage, topo.dp_rank, metrics)
        if topo.world_rank == 0:
            grad_norm = f" grad norm {metrics['grad_norm']:.3f}" if metrics["grad_norm"] is not None else ""
            print(f"[raytrain] step {step}/{tc.max_steps} loss {loss:.4f} lr {metrics['lr']:.2e}{grad_norm} "
                  f"{metrics['real_tokens_per_s'] or tokens_per_s:,.0f} tok/s {step_time_s:.2f}s "
                  f"eta {metrics['eta_s']:.0f}s", flush=True)
            if "eval_time_s" in metrics:
                parts = [f"{label} {metrics[metric]:.4f} on {eval_sets[metric]['num_packs']} {what}"
                         for metric, label, what in (("eval_loss", "eval loss", "held-out sequences"),
                                                     ("benchmark_loss", "benchmark loss", "eval-set sequences"))
                         if metric in metrics]
                print(f"[raytrain] step {step}/{tc.max_steps} {', '.join(parts)} ({metrics['eval_time_s']:.1f}s)",
                      flush=True)
            if metrics_path:
                with open(metrics_path, "a", encoding="utf-8") as f:
                    f.write(json.dumps(metrics) + "\n")
            if board is not None:
                for name in TENSORBOARD_SCALARS:
                    if metrics.get(name) is not None:
                        board.add_scalar(f"train/{name}", metrics[name], step)
                if "eval_loss" in metrics:
                    board.add_scalar("eval/loss", metrics["eval_loss"], step)
                if "benchmark_loss" in metrics:
                    board.add_scalar("eval/benchmark_loss", metrics["benchmark_loss"], step)
                board.flush()
            trackers.log(metrics, step)
        if topo.needs_data and loop_config.get("local_reports_dir"):
            with open(os.path.join(loop_config["local_reports_dir"], f"data_trace_rank{topo.world_rank}.jsonl"),
                      "a", encoding="utf-8") as f:
                f.write(json.dumps({"step": step, "stage": topo.stage, "dp_rank": topo.dp_rank,
                                    "consumed": trace.consumed[consumed_before:]}) + "\n")

        if step % tc.checkpoint_every == 0 or step == end_step:
            _save_checkpoint(store, stage, step, job, loop_config, metrics)
            if topo.world_rank == 0:
                print(f"[raytrain] checkpoint step {step} -> {run_root.join('checkpoints').uri}", flush=True)
            if samples is not None:
                samples.generate(step)
        ray.train.report({k: v for k, v in metrics.items() if v is not None})

    if board is not None:
        board.close()
    trackers.close()
    if topo.needs_data:
        print(f"[raytrain] rank {topo.world_rank} (stage {topo.stage}, replica {topo.dp_rank}) read "
              f"{read_stats.get('packs_read', 0)} of {counts.num_packs} packs, "
              f"{read_stats.get('bytes_read', 0) / 2**10:,.0f} KiB of Parquet this launch", flush=True)
    stage_parameters = sum(p.numel() for p in stage.engine.module.parameters())
    if loop_config.get("local_reports_dir") and stage_parameters <= PARAM_DIGEST_MAX_PARAMETERS:
        # Parameter digests per rank: data-parallel replicas of one stage must hold identical weights.
        digests = {name: hashlib.sha256(p.detach().float().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]
                   for name, p in stage.engine.module.named_parameters()}
        with open(os.path.join(loop_config["local_reports_dir"], f"param_digest_rank{topo.world_rank}.json"), "w",
                  encoding="utf-8") as f:
            json.dump({"step": step, "stage": topo.stage, "dp_rank": topo.dp_rank, "digests": digests}, f)


PARAM_DIGEST_MAX_PARAMETERS = 50_000_000
"""Stages above this many parameters write no end-of-run parameter digests (an fp32 CPU copy of each parameter:
the tests' tiny models check dp replicas with them; a 7B stage would copy gigabytes for an audit no one reads)."""


class _Samples:
    """Greedy generations at each checkpoint on the first micro_batch_size validation prompts (the first document
    of each of the first validation packs, up to its first target token); rank 0 writes them with the reference
    answers to reports/samples.jsonl."""

    def __init__(self, stage: Any, job: JobConfig, topo: Topology, held: dict[str, Any], endpoint: str | None,
                 reports_dir: str | None) -> None:
        from raytrain.dataset.tokenize import load_tokenizer

        self.stage, self.job = stage, job
        self.path = os.path.join(reports_dir, "samples.jsonl") if reports_dir and topo.world_rank == 0 else None
        self.tokenizer = load_tokenizer(job.dataset.tokenizer)
        self.count = min(job.train.micro_batch_size, held["num_packs"])
        self.prompts: list[list[int]] | None = None
        self.references: list[list[int]] = []
        if topo.needs_data:
            batch = PackReader(held["uri"], held["files"], endpoint).read(range(self.count))
            self.prompts = []
            for ids, labels, segments in zip(batch["input_ids"], batch["labels"], batch["segment_ids"], strict=True):
                first = segments == segments[0]  # the pack's first document
                start = int((labels[first] != IGNORE_INDEX).argmax())  # labels[t] is token t + 1: answer at t + 1
                self.prompts.append(ids[first][:start + 1].tolist())
                self.references.append(ids[first][start + 1:].tolist())

    def generate(self, step: int) -> None:
        tc = self.job.train
        inner = self.tokenizer.instruct_tokenizer.tokenizer
        new = self.stage.greedy_generate(self.prompts, num_prompts=self.count, micro_batch_size=tc.micro_batch_size,
                                         seq_len=self.job.dataset.seq_len, max_new_tokens=tc.sample_new_tokens,
                                         eos_id=inner.eos_id)
        if self.path is None:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            for prompt, reference, tokens in zip(self.prompts or [], self.references, new, strict=True):
                f.write(json.dumps({"step": step, "prompt": inner.decode(prompt), "reference": inner.decode(reference),
                                    "generated": inner.decode(tokens), "prompt_ids": prompt,
                                    "generated_ids": tokens}) + "\n")
        print(f"[raytrain] step {step}: {len(new)} sample generations -> {self.path}", flush=True)


TENSORBOARD_SCALARS = ("loss", "lr", "grad_norm", "real_tokens_per_s", "tokens_seen", "step_time_s", "mfu")
"""Step metrics written as TensorBoard scalars ``train/<name>``."""


def _tensorboard(logdir: str, step: int) -> Any:
    """A tensorboardX writer; a resumed run purges events after its checkpoint's step, so curves do not fold back."""
    from tensorboardX import SummaryWriter

    return SummaryWriter(logdir=logdir, purge_step=step + 1 if step else None)


def _resume(stage: Any, store: CheckpointStore, topo: Topology, tc: Any) -> tuple[int, dict[str, Any]]:
    """Load the newest good checkpoint into this stage; returns its step (0 when starting fresh) and the step
    metrics its manifest recorded ({} when starting fresh).

    Rank 0 cleans partial saves; every rank checks the sizes and hashes its share of the files against the manifest;
    rank 0 decides (falling back to an older checkpoint when configured) and tells every rank which step to load,
    so all stages load the same one.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        removed = store.cleanup_partials()  # leftovers of a save that crashed before its commit
        if removed:
            print(f"[raytrain] removed {len(removed)} partial checkpoint(s): {removed}", flush=True)
    dist.barrier()
    latest = store.latest()
    # every rank hashes its share of the files in parallel; rank 0 decides (and falls back, when configured)
    problems: list[str | None] = [None] * world
    dist.all_gather_object(problems, store.find_problem(latest, rank, world) if latest is not None else None)
    chosen: list[int | None] = [None]
    if rank == 0 and latest is not None:
        chosen[0] = store.verify(latest, problem=next((p for p in problems if p), None)).step
    dist.broadcast_object_list(chosen, src=0)
    if chosen[0] is None:
        return 0, {}
    ckpt = store.get(chosen[0])
    if ckpt is None:
        raise RuntimeError(f"checkpoint step {chosen[0]} vanished between verify and load")
    client_state = _load_own_files(stage, store, ckpt, rank)
    step = int(client_state["step"])
    check_resume_position(client_state["data_position"], step, tc.dp, tc.grad_accum_steps, ckpt.uri,
                          saved_with=(ckpt.manifest.get("metadata", {}).get("config") or {}).get("train"))
    store.protect(step)  # retention never deletes the checkpoint a run resumed from
    if topo.world_rank == 0:
        print(f"[raytrain] resumed from checkpoint step {step} ({ckpt.uri})", flush=True)
    return step, dict(ckpt.manifest.get("metadata", {}).get("metrics") or {})


def _load_own_files(stage: Any, store: CheckpointStore, ckpt: CommittedCheckpoint, rank: int) -> dict[str, Any]:
    """Load ``ckpt`` into this rank's stage and return DeepSpeed's client state. On POSIX in place; on s3/hdfs only
    the files this rank's load opens (stage.checkpoint_files) are downloaded, into a node-local temp dir removed
    right after the load, and what was fetched is recorded in ``reports/resume/<step>-rank<R>.json``."""
    names = sorted(ckpt.manifest["files"])
    opened, listed = stage.checkpoint_files(names) if ckpt.local_path is None else ([], [])
    t0 = time.perf_counter()
    with store.local_copy(ckpt, opened, label=f"resume-rank{rank}") as local:
        for rel in listed:  # other ranks' files DeepSpeed only counts: empty stand-ins (stage.checkpoint_files)
            open(os.path.join(local, *rel.split("/")), "wb").close()
        fetched_bytes = _tree_bytes(local) if ckpt.local_path is None else 0
        client_state = stage.load(local)
    if opened:
        record = {"step": ckpt.step, "rank": rank, "files": opened, "stand_ins": listed,
                  "fetched_bytes": fetched_bytes,
                  "checkpoint_bytes": sum(e["size"] for e in ckpt.manifest["files"].values()),
                  "local_dir": local, "local_dir_removed": not os.path.exists(local),
                  "seconds": round(time.perf_counter() - t0, 3)}
        store.run_root.join("reports", "resume", f"{step_dir_name(ckpt.step)}-rank{rank}.json") \
            .write_atomic(json.dumps(record, indent=1))
        print(f"[raytrain] rank {rank}: fetched {len(opened)} of {len(names)} checkpoint files "
              f"({fetched_bytes / 2**20:,.1f} of {record['checkpoint_bytes'] / 2**20:,.1f} MiB) for its stage; "
              "temp copy removed after the load", flush=True)
    return client_state


def _tree_bytes(directory: str) -> int:
    """Bytes of the files below ``directory`` (what a local copy occupies on disk, give or take block rounding)."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(directory) for f in files)


def _save_checkpoint(store: CheckpointStore, stage: Any, step: int, job: JobConfig,
                     loop_config: dict[str, Any], metrics: dict[str, Any]) -> None:
    """Every rank writes its shard into the step's staging dir and hashes its share of the files; rank 0 commits
    (the manifest from the ranks' recorded sizes and hashes) after all have finished."""
    tc = job.train
    client_state = {"step": step, "data_position": data_position(step, tc.dp, tc.grad_accum_steps)}
    staging = store.staging_dir(step)
    stage.save(staging, client_state)
    store.upload(step, staging)
    dist.barrier()  # every stage's files are in place before they are hashed
    store.hash_share(step, dist.get_rank(), dist.get_world_size())  # POSIX: each rank hashes + fsyncs a share
    dist.barrier()  # every share is recorded before the manifest makes the checkpoint visible
    if dist.get_rank() == 0:
        store.commit(step, {
            "step": step, "data_position": client_state["data_position"], "metrics": metrics,
            "config": job.to_dict(), "config_hash": job.config_hash(), "versions": loop_config.get("versions", {}),
            "world": {"pp": tc.pp, "dp": tc.dp}, "model": job.model.preset,
        })
    dist.barrier()  # nobody races ahead to the next save while the commit renames the directory
