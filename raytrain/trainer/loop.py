"""The per-worker training loop: one TorchTrainer worker hosts one stage of one pipeline replica.

``train_loop_per_worker`` builds the stage (process group, DeepSpeed engine) and calls ``train``: resume, then per
step train_batch -> metrics -> evaluation when due -> one MetricsSink -> checkpoint when due. ``train`` takes the
stage engine, the pack reader and Ray's report as arguments, so its control flow is unit-tested with fakes
(tests/unit/trainer/test_loop_control.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import ray.train
import torch
import torch.distributed as dist

from raytrain.checkpoint.layout import step_dir_name
from raytrain.checkpoint.store import CheckpointStore, CommittedCheckpoint
from raytrain.config import JobConfig
from raytrain.pipeline.flops import mfu, pipeline_bubble_fraction
from raytrain.pipeline.model import model_config
from raytrain.redact import redact_tree
from raytrain.runlock import Fence
from raytrain.storage import RunPaths, StorageLocation, apply_run_umask, resolve
from raytrain.trainer.evaluation import Evaluator, Generations, OpenPacks, PackedFiles, PackSource
from raytrain.trainer.feed import FeedTrace, micro_batches
from raytrain.trainer.metrics_sink import MetricsSink
from raytrain.trainer.pack_order import WaveOrder
from raytrain.trainer.preference import pair_metrics
from raytrain.trainer.schedule import Topology, check_resume_position, data_position

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoopConfig:
    """What every TorchTrainer worker is handed (pickled), built by raytrain.trainer.launch."""

    job: JobConfig
    run_uri: str
    """The run's root (checkpoints/ and reports/ below it)."""
    ds_config: dict[str, Any]
    """DeepSpeed's config, derived from train.ds_config and the batch sizes."""
    packed: PackedFiles
    """The training packs."""
    validation: PackedFiles | None = None
    """The held-out packs (validation_loss), None when none or too few for dp."""
    benchmark: PackedFiles | None = None
    """The eval sets' items (benchmark_loss), None when none."""
    local_reports_dir: str | None = None
    """<run>/reports on a POSIX run root (metrics.jsonl, TensorBoard, traces); None on object stores."""
    versions: dict[str, str] = field(default_factory=dict)
    """Software versions recorded in each checkpoint's manifest."""
    fence: Fence | None = None
    """The driver's run lock (token, generation): commits and cleanups check the lock still holds it."""
    base: dict[str, Any] = field(default_factory=dict)
    """What the weights start from, recorded in every checkpoint: a LoRA run's base (raytrain.pipeline.lora.
    base_identity), a preference run's source checkpoint (launch.source_weights: ``init_from_run``, ``step``), or
    {}."""
    reference_key: str = ""
    """train.objective=dpo: the folder name of the stored reference log-probabilities (trainer.preference's key,
    computed once on the driver: it hashes the starting weights)."""


def train_loop_per_worker(config: dict[str, LoopConfig]) -> None:
    """Entry point run by every TorchTrainer worker (``train_loop_config={"loop": LoopConfig}``): build this
    worker's pipeline stage as DeepSpeed's grid places it, then train."""
    from raytrain.pipeline.engine import build_stage_engine, init_distributed

    cfg = config["loop"]
    job, tc = cfg.job, cfg.job.train
    torch.manual_seed(tc.seed)
    init_distributed("nccl" if tc.use_gpu else "gloo")
    model_cfg = model_config(job.model.preset, job.model.init_from)
    loss_fn = None
    if tc.objective == "dpo":
        from raytrain.pipeline.dpo import DpoLoss

        loss_fn = DpoLoss(tc.dpo)
    stage = build_stage_engine(model_cfg, cfg.ds_config, pp=tc.pp, dp=tc.dp, partition_method=tc.partition_method,
                               activation_checkpoint_interval=tc.activation_checkpoint_interval,
                               activation_checkpoint_reentrant=tc.activation_checkpoint_reentrant,
                               seed=tc.seed, init_from=job.model.init_from, attn_impl=job.model.attn_impl,
                               lora=job.model.lora, loss_fn=loss_fn,
                               start_weights=_source_weights(cfg) if cfg.base.get("init_from_run") else None)
    endpoint = job.storage.s3_endpoint or None
    if cfg.packed.streamed:  # started with the enrichment: the first window's packs, once they are packed
        from raytrain.trainer.wave_source import first_window

        cfg = replace(cfg, **first_window(cfg.packed, tc, endpoint, announce=dist.get_rank() == 0))
    apply_run_umask()  # DeepSpeed's and torch.save's files: 0640 (a worker on another node has the node's umask)
    store = CheckpointStore(resolve(cfg.run_uri, s3_endpoint=endpoint), keep_last=tc.keep_last,
                            keep_best=tc.keep_best or None, on_corrupt=tc.on_corrupt_checkpoint, fence=cfg.fence)
    train(cfg, stage, store, lambda packed: open_packed(packed, endpoint, announce=dist.get_rank() == 0),
          report=ray.train.report,
          mfu_of=lambda tokens_per_s: mfu(tokens_per_s, model_cfg, job.dataset.seq_len,
                                                   tc.peak_tflops * 1e12 * tc.num_workers))


def train(cfg: LoopConfig, stage: Any, store: CheckpointStore, open_packs: OpenPacks, *,
          report: Callable[[dict[str, Any]], None], mfu_of: Callable[[float], float]) -> int:
    """setup (resume, data, evaluation, outputs) -> steps -> close; returns the last step.

    ``stage`` is a raytrain.pipeline.engine.StageEngine (a fake in tests), ``open_packs`` reads packed sets,
    ``report`` is ``ray.train.report``, ``mfu_of`` turns tokens/s into MFU (used when train.peak_tflops)."""
    job, tc = cfg.job, cfg.job.train
    topo = Topology(pp=stage.num_stages, dp=stage.num_replicas, stage=stage.stage, dp_rank=stage.dp_rank,
                    world_rank=stage.world_rank)
    train_packs = open_packs(cfg.packed)
    held = {metric: open_packs(packed) for metric, packed in (("validation_loss", cfg.validation),
                                                              ("benchmark_loss", cfg.benchmark)) if packed}
    refs = _reference_logps(cfg, stage, topo, store, train_packs, held) if tc.objective == "dpo" else None
    step, resumed_metrics = _resume(stage, _resume_source(store, job), topo, tc, RunPaths(store.run_root).reports)
    feed = _Feed(train_packs, topo, tc, step, refs["train"] if refs else None) if topo.needs_data else None
    evaluator = Evaluator(stage, topo, job, held, {"validation_loss": refs["validation"]}
                          if refs and "validation" in refs else None)
    generations = Generations(stage, job, topo, held["validation_loss"], cfg.local_reports_dir) \
        if tc.generation_tokens and "validation_loss" in held else None
    sink = MetricsSink(job, topo, cfg.local_reports_dir, step, {m: s.num_packs for m, s in held.items()}, report)
    clock = _StepClock(job, topo, step, int(resumed_metrics.get("tokens_seen") or 0), mfu_of)
    end_step = tc.stop_at_step or tc.max_steps
    try:
        while step < end_step:
            consumed_before = feed.consumed_count() if feed else 0
            t0 = time.perf_counter()
            loss = stage.train_batch(feed.iterator if feed else None)
            step += 1
            metrics = clock.metrics(step, end_step, loss, time.perf_counter() - t0, stage, feed)
            if refs is not None:
                metrics.update(pair_metrics(stage))
            if evaluator.due(step, end_step):
                metrics.update(evaluator.run())
            sink.step(metrics, feed.consumed_since(consumed_before) if feed else [])
            if step % tc.checkpoint_every == 0 or step == end_step:
                _save_checkpoint(store, stage, step, cfg, metrics)
                sink.checkpoint(step, store.root.uri)
                if generations is not None:
                    generations.generate(step)
            sink.report(metrics)
    finally:
        sink.close()
    if feed is not None:
        feed.print_summary(topo)
    if cfg.local_reports_dir:
        _write_param_digests(stage, topo, step, cfg.local_reports_dir)
    return step


def _reference_logps(cfg: LoopConfig, stage: Any, topo: Topology, store: CheckpointStore, train_packs: PackSource,
                     held: dict[str, PackSource]) -> dict[str, Any]:
    """train.objective=dpo: every training and validation pack's reference log-probabilities, scored with the
    starting weights (this runs before any checkpoint is loaded) or read from the run (raytrain.trainer.preference)."""
    from raytrain.trainer.preference import reference_logps

    sets = {"train": train_packs, **({"validation": held["validation_loss"]} if "validation_loss" in held else {})}
    folder = RunPaths(store.run_root).data.join("reference", cfg.reference_key)
    return reference_logps(stage, topo, cfg.job, sets, folder, store.check_fence)


def open_packed(packed: PackedFiles, s3_endpoint: str | None, announce: bool = False) -> PackSource:
    """A worker's reader of a packed set: a streamed run's training packs grow as waves are committed."""
    if packed.streamed:
        from raytrain.trainer.wave_source import WavePackSource

        return WavePackSource(packed, s3_endpoint, announce)
    return PackSource(packed, s3_endpoint)


class _Feed:
    """This replica's training micro-batches from ``step`` on (raytrain.trainer.feed), with what it consumed."""

    def __init__(self, packs: PackSource, topo: Topology, tc: Any, step: int, ref_logps: Any = None) -> None:
        self.packs, self.trace = packs, FeedTrace()
        order = None
        if hasattr(packs, "wait"):  # a streamed run's packs (raytrain.trainer.wave_source)
            order = WaveOrder(packs.wait, tc.micro_batch_size, tc.shuffle_window_waves, tc.seed, tc.shuffle)
        self.order = order
        self.counts = order.counts if order is not None else packs.counts()
        self.iterator = micro_batches(self.counts, lambda own: packs.stream(own, tc.micro_batch_size),
                                      micro_batch_size=tc.micro_batch_size,
                                      start_position=data_position(step, tc.dp, tc.grad_accum_steps),
                                      dp_rank=topo.dp_rank, dp=tc.dp, grad_accum_steps=tc.grad_accum_steps,
                                      seed=tc.seed, shuffle=tc.shuffle, trace=self.trace, ref_logps=ref_logps,
                                      order=order)

    def consumed_count(self) -> int:
        return len(self.trace.consumed)

    def consumed_since(self, count: int) -> list[tuple[int, str]]:
        return self.trace.consumed[count:]

    def print_summary(self, topo: Topology) -> None:
        stats = self.packs.read_stats
        counts = self.order.counts if self.order is not None else self.counts
        waited = f", waited {self.packs.waited_s:.1f}s for waves" if self.order is not None else ""
        print(f"[raytrain] rank {topo.world_rank} (stage {topo.stage}, replica {topo.dp_rank}) read "
              f"{stats.get('packs_read', 0)} of {counts.num_packs} packs, "
              f"{stats.get('bytes_read', 0) / 2**10:,.0f} KiB of Parquet this launch{waited}", flush=True)


class _StepClock:
    """A step's metrics from its loss and duration: throughput, real tokens (this rank's feed counts them; ranks
    without one report None), tokens seen (carried over a resume), ETA over this launch's steps, MFU."""

    def __init__(self, job: JobConfig, topo: Topology, step: int, tokens_seen: int,
                 mfu_of: Callable[[float], float]) -> None:
        self.job, self.topo, self.tokens_seen, self.mfu_of = job, topo, tokens_seen, mfu_of
        self.tokens_per_step = job.train.global_batch_size * job.dataset.seq_len
        self.bubble = pipeline_bubble_fraction(job.train.grad_accum_steps, job.train.pp)
        self.launch_t0, self.launch_step = time.perf_counter(), step

    def metrics(self, step: int, end_step: int, loss: float, step_time_s: float, stage: Any,
                feed: _Feed | None) -> dict[str, Any]:
        tc, topo = self.job.train, self.topo
        trace = feed.trace if feed else None
        tokens_per_s = self.tokens_per_step / step_time_s
        real_tokens = trace.step_tokens[-1] if trace and trace.step_tokens else None
        self.tokens_seen += real_tokens or 0
        seconds_per_step = (time.perf_counter() - self.launch_t0) / (step - self.launch_step)
        return {
            "step": step, "loss": loss, "lr": stage.lr(), "grad_norm": stage.grad_norm(),
            "step_time_s": step_time_s, "tokens_per_s": tokens_per_s,
            "real_tokens": real_tokens, "real_tokens_per_s": real_tokens / step_time_s if real_tokens else None,
            "target_tokens": trace.step_targets[-1] if trace and trace.step_targets else None,
            "tokens_seen": self.tokens_seen if topo.needs_data else None,
            "eta_s": seconds_per_step * (end_step - step),
            "samples_per_s": tc.global_batch_size / step_time_s,
            "pipeline_bubble": self.bubble, "stage": topo.stage, "dp_rank": topo.dp_rank,
            "mfu": self.mfu_of(tokens_per_s) if tc.peak_tflops else None,
            "data_position": data_position(step, tc.dp, tc.grad_accum_steps),
            "finished_unix_s": round(time.time(), 3),  # compared with a streamed run's wave records
            # a streamed run: seconds this launch's feed waited for the enrichment's waves so far
            "waited_for_waves_s": round(feed.packs.waited_s, 3) if feed and feed.order is not None else None,
        }


def _write_param_digests(stage: Any, topo: Topology, step: int, reports_dir: str) -> None:
    """Parameter digests per rank: data-parallel replicas of one stage must hold identical weights."""
    if sum(p.numel() for p in stage.engine.module.parameters()) > PARAM_DIGEST_MAX_PARAMETERS:
        return
    digests = {name: hashlib.sha256(p.detach().float().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]
               for name, p in stage.engine.module.named_parameters()}
    with open(os.path.join(reports_dir, f"param_digest_rank{topo.world_rank}.json"), "w", encoding="utf-8") as f:
        json.dump({"step": step, "stage": topo.stage, "dp_rank": topo.dp_rank, "digests": digests}, f)


PARAM_DIGEST_MAX_PARAMETERS = 50_000_000
"""Stages above this many parameters write no end-of-run parameter digests (an fp32 CPU copy of each parameter:
the tests' tiny models check dp replicas with them; a 7B stage would copy gigabytes for an audit no one reads)."""


def _resume(stage: Any, store: CheckpointStore, topo: Topology, tc: Any, reports: StorageLocation
            ) -> tuple[int, dict[str, Any]]:
    """Load the newest good checkpoint of ``store`` into this stage; returns its step (0 when starting fresh) and
    the step metrics its manifest recorded ({} when starting fresh). ``reports``: this run's reports folder (the
    store may be another run's, read-only: storage.init_from_run).

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
    client_state = _load_own_files(stage, store, ckpt, rank, reports)
    step = int(client_state["step"])
    check_resume_position(client_state["data_position"], step, tc.dp, tc.grad_accum_steps, ckpt.uri,
                          saved_with=(ckpt.manifest.get("metadata", {}).get("config") or {}).get("train"))
    store.protect(step)  # retention never deletes the checkpoint a run resumed from
    if topo.world_rank == 0:
        print(f"[raytrain] resumed from checkpoint step {step} ({ckpt.uri})", flush=True)
    return step, dict(ckpt.manifest.get("metadata", {}).get("metrics") or {})


def _resume_source(store: CheckpointStore, job: JobConfig) -> CheckpointStore:
    """Where to resume from: this run's store, or, while the run has no checkpoint of its own and
    storage.init_from_run names another run, that run's store opened read-only (never written or cleaned). Not for
    preference training, which takes only the other run's weights (``_source_weights``)."""
    if not job.storage.init_from_run or job.train.objective == "dpo" or store.latest() is not None:
        return store
    if dist.get_rank() == 0:
        store.cleanup_partials()  # this run's own leftovers (the source's are never touched); _resume's barrier follows
    source = resolve(job.storage.init_from_run, s3_endpoint=job.storage.s3_endpoint or None)
    return CheckpointStore(source, on_corrupt=job.train.on_corrupt_checkpoint, read_only=True)


def _source_weights(cfg: LoopConfig) -> Callable[[Any], None]:
    """Loads a stage's layers from the checkpoint a preference run starts from (``cfg.base``: another run's,
    storage.init_from_run), read-only; on s3/hdfs only this stage's layer files are fetched."""
    from raytrain.pipeline.engine import load_layer_files
    from raytrain.trainer.preference import started_from_layers

    def load(module: Any) -> None:
        layers = range(module._local_start, module._local_stop)
        with started_from_layers(cfg.base, cfg.job.storage.s3_endpoint or None, layers) as local:
            load_layer_files(module, local)
    return load


def _load_own_files(stage: Any, store: CheckpointStore, ckpt: CommittedCheckpoint, rank: int,
                    reports: StorageLocation) -> dict[str, Any]:
    """Load ``ckpt`` into this rank's stage and return DeepSpeed's client state. On POSIX in place; on s3/hdfs only
    the files this rank's load opens (stage.checkpoint_files) are downloaded, into a node-local temp dir removed
    right after the load, and what was fetched is recorded in ``reports/resume/<step>-rank<R>.json``."""
    names = sorted(ckpt.manifest["files"])
    opened, listed = stage.checkpoint_files(names) if ckpt.local_path is None else ([], [])
    t0 = time.perf_counter()
    with store.local_copy(ckpt, opened, label=f"resume-rank{rank}") as local:
        fetched_bytes = _tree_bytes(local) if ckpt.local_path is None else 0
        if listed:  # other ranks' files DeepSpeed only counts
            stage.write_stand_ins(local, listed, names)
        client_state = stage.load(local)
    if opened:
        record = {"step": ckpt.step, "rank": rank, "files": opened, "stand_ins": listed,
                  "fetched_bytes": fetched_bytes,
                  "checkpoint_bytes": sum(e["size"] for e in ckpt.manifest["files"].values()),
                  "local_dir": local, "local_dir_removed": not os.path.exists(local),
                  "seconds": round(time.perf_counter() - t0, 3)}
        reports.join("resume", f"{step_dir_name(ckpt.step)}-rank{rank}.json").write_atomic(json.dumps(record, indent=1))
        print(f"[raytrain] rank {rank}: fetched {len(opened)} of {len(names)} checkpoint files "
              f"({fetched_bytes / 2**20:,.1f} of {record['checkpoint_bytes'] / 2**20:,.1f} MiB) for its stage; "
              "temp copy removed after the load", flush=True)
    return client_state


def _tree_bytes(directory: str) -> int:
    """Bytes of the files below ``directory`` (what a local copy occupies on disk, give or take block rounding)."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(directory) for f in files)


def _save_checkpoint(store: CheckpointStore, stage: Any, step: int, cfg: LoopConfig, metrics: dict[str, Any]) -> None:
    """Every rank writes its shard into the step's staging dir and hashes its share of the files; rank 0 commits
    (the manifest from the ranks' recorded sizes and hashes) after all have finished. A job whose run lock was
    taken over stops here (LockLostError) before writing anything, and rank 0's commit re-checks the lock right
    before each visible change."""
    job, tc = cfg.job, cfg.job.train
    store.check_fence(f"save checkpoint step {step}")
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
            "config": redact_tree(job.to_dict()), "config_hash": job.config_hash(), "versions": cfg.versions,
            "world": {"pp": tc.pp, "dp": tc.dp}, "model": job.model.preset,
            **({"base": cfg.base} if cfg.base else {}),
        })
    dist.barrier()  # nobody races ahead to the next save while the commit renames the directory
