"""Launch the TorchTrainer: pp x dp workers, each one DeepSpeed pipeline stage, fed by the packed Ray Dataset."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from typing import Any

import pyarrow.fs as pafs
import ray
import ray.train
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

from raytrain.checkpoint.store import CheckpointStore, CommittedCheckpoint
from raytrain.config import JobConfig
from raytrain.dataset.stream import PackedData
from raytrain.errors import CorruptCheckpointError, RaytrainError
from raytrain.pipeline.ds_config import derive_ds_config, load_ds_config
from raytrain.runlock import Fence
from raytrain.storage import RunPaths, StorageLocation, resolve
from raytrain.trainer.evaluation import evaluable, packed_files
from raytrain.trainer.failures import StopOnUnretryableError, user_error
from raytrain.trainer.loop import LoopConfig, train_loop_per_worker
from raytrain.trainer.preference import reference_key
from raytrain.trainer.schedule import check_data_order, check_enough_packs

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainResult:
    final_metrics: dict[str, Any]
    checkpoint_dir: str


def ray_storage(location: StorageLocation) -> tuple[str, pafs.FileSystem | None]:
    """``(storage_path, storage_filesystem)`` for ray.train.RunConfig: a POSIX path goes as it is (Ray opens it),
    an object-store path with the resolver's pyarrow filesystem (which carries the endpoint and credentials)."""
    return location.path, None if location.is_posix else location.filesystem


def software_versions() -> dict[str, str]:
    import importlib.metadata as md

    names = ("raytrain", "ray", "torch", "deepspeed", "transformers", "mistral-common", "raydp", "pyspark")
    out = {}
    for n in names:
        try:
            out[n] = md.version(n)
        except md.PackageNotFoundError:
            out[n] = "not installed"
    return out


def _starting_weights(job: JobConfig, latest: CommittedCheckpoint | None) -> dict[str, Any]:
    """What the run's weights start from, recorded in its checkpoints: a preference run's source checkpoint
    (``source_weights``; with LoRA, the adapters' base), a LoRA run's base (raytrain.pipeline.lora.base_identity),
    {} otherwise; after checking that the run's newest checkpoint was trained with the same model.lora settings on
    the same base (``latest``: the run's newest checkpoint)."""
    from raytrain.pipeline.lora import base_identity, check_resume_settings, model_parameter_counts

    if job.train.objective == "dpo" and (job.storage.init_from_run or (latest and (latest.metadata.get("base") or {})
                                                                       .get("init_from_run"))):
        base = source_weights(job, latest)
        log.info("train: the weights start from %s (storage.init_from_run, step %d): only the weights, this run "
                 "counts its own steps", base["checkpoint"], base["step"])
    else:
        base = base_identity(job) if job.model.lora.rank else {}
    if latest is not None:
        check_resume_settings(latest.metadata.get("config") or {}, latest.metadata.get("base"), job, base,
                              f"checkpoint {latest.uri}")
    if job.model.lora.rank:
        counts, lora = model_parameter_counts(job), job.model.lora
        log.info("train: LoRA rank %d (alpha %g) on %s: %s trainable of %s parameters (%.2f%%)", lora.rank, lora.alpha,
                 ", ".join(lora.targets), f"{counts['trainable']:,}", f"{counts['total']:,}",
                 100 * counts["trainable"] / counts["total"])
    return base


def source_weights(job: JobConfig, latest: CommittedCheckpoint | None) -> dict[str, Any]:
    """Preference training from storage.init_from_run takes that run's weights (not its step, data or optimizer):
    its latest checkpoint when this run has none of its own, afterwards the one this run started from (recorded in
    its checkpoints), so a resumed run and its stored reference keep the weights they began with although the
    other run goes on. RaytrainError naming the fix when that checkpoint is gone, the source changed, or it holds
    no full model."""
    started = (latest.metadata.get("base") or {}) if latest is not None else {}
    wanted = job.storage.init_from_run
    if started.get("init_from_run") and not wanted:
        raise RaytrainError(f"this run started from {started['checkpoint']} (storage.init_from_run); set "
                            f"storage.init_from_run={started['init_from_run']} again, or start a new storage.run_name")
    source = CheckpointStore(resolve(wanted, s3_endpoint=job.storage.s3_endpoint or None), read_only=True)
    if latest is not None and started.get("init_from_run") != source.run_root.uri:
        raise RaytrainError(f"storage.init_from_run={wanted}: this run's checkpoint {latest.uri} did not start from "
                            f"it ({started.get('checkpoint') or 'it started from model.init_from / the seed'}); "
                            "set it as that run had it, or start a new storage.run_name")
    ckpt = source.get(started["step"]) if started else source.latest()
    if ckpt is None:
        where = started.get("checkpoint") or source.root.uri
        raise RaytrainError(f"storage.init_from_run={wanted}: no checkpoint {where} to take the starting weights "
                            "from (it was deleted?); start a new storage.run_name from that run's current checkpoint")
    saved_model = (ckpt.metadata.get("config") or {}).get("model") or {}
    if (saved_model.get("lora") or {}).get("rank"):
        raise RaytrainError(f"storage.init_from_run={wanted}: {ckpt.uri} holds LoRA adapters, not a whole model; "
                            "export that run (`raytrain export`) and set model.init_from to the folder")
    if saved_model.get("preset", job.model.preset) != job.model.preset:
        raise RaytrainError(f"storage.init_from_run={wanted}: {ckpt.uri} is a model.preset={saved_model['preset']} "
                            f"model, this config trains model.preset={job.model.preset}; set it as that run had it")
    manifest = json.dumps(ckpt.manifest, sort_keys=True).encode()
    return {"init_from_run": source.run_root.uri, "step": ckpt.step, "checkpoint": ckpt.uri,
            "manifest_sha256": hashlib.sha256(manifest).hexdigest()}


def train(job: JobConfig, run_root: StorageLocation, packed: PackedData, max_failures: int = 0,
          fence: Fence | None = None) -> TrainResult:
    """Fit the TorchTrainer on the ``packed`` sequences; their validation packs (``packed.validation``) give the
    validation loss every train.eval_every steps and at the end. ``fence``: the driver's run-lock token and generation;
    the workers' checkpoint store refuses to commit or clean up once the run's lock holds another."""
    tc = job.train
    num_packs = packed.num_packs
    streamed = packed.waves is not None
    # A streamed run's workers take its validation and benchmark sets from the wave records once the first window
    # is packed (raytrain.trainer.wave_source.first_window): they start before it is.
    validation = None if streamed else evaluable(packed.validation, "validation", tc.micro_batch_size, tc.dp,
                                                 log.warning)
    benchmark = None if streamed else evaluable(packed.benchmark, "benchmark", tc.micro_batch_size, tc.dp,
                                                log.warning)
    ds_config = derive_ds_config(load_ds_config(tc.ds_config), tc, ds_path=tc.ds_config)
    if packed.complete:  # a streamed run's trainer waits for the waves its steps need
        check_enough_packs(num_packs, tc.micro_batch_size, tc.dp, tc.grad_accum_steps)
    if validation is None and tc.eval_every and not streamed:
        log.warning("train.eval_every=%d but the run has no validation set: no validation loss (set "
                    "dataset.validation_fraction > 0)", tc.eval_every)
    if tc.tracking and not run_root.is_posix and (("mlflow" in tc.tracking and not tc.mlflow_uri)
                                                  or "wandb" in tc.tracking and tc.wandb_mode == "offline"):
        raise RaytrainError(f"train.tracking={list(tc.tracking)} writes under the run's reports/, which is on "
                            f"{run_root.uri} (not a POSIX mount): set train.mlflow_uri to a tracking server and "
                            "train.wandb_mode=online, or use a run root on a shared filesystem")
    if run_root.is_posix:
        RunPaths(run_root).reports.mkdirs()  # workers append metrics and data traces here
    latest = CheckpointStore(run_root).latest()
    base = _starting_weights(job, latest)
    if latest is not None:
        check_data_order((latest.metadata.get("config") or {}).get("train") or {}, job.to_dict()["train"],
                         streamed, latest.uri)
    loop_config = LoopConfig(
        job=job, run_uri=run_root.uri, ds_config=ds_config, packed=packed_files(packed, job.data_hash()),
        validation=packed_files(validation) if validation is not None else None,
        benchmark=packed_files(benchmark) if benchmark is not None else None,
        local_reports_dir=RunPaths(run_root).reports.path if run_root.scheme == "file" else None,
        versions=software_versions(), fence=fence, base=base,
        reference_key=reference_key(job, packed.location.uri, base) if tc.objective == "dpo" else "")
    storage_path, storage_filesystem = ray_storage(run_root.join("ray"))
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"loop": loop_config},
        torch_config=TorchConfig(backend="nccl" if tc.use_gpu else "gloo"),
        scaling_config=ScalingConfig(num_workers=tc.num_workers, use_gpu=tc.use_gpu,
                                     resources_per_worker=tc.worker_resources() or None,
                                     placement_strategy=tc.placement_strategy),
        run_config=RunConfig(
            name="ray_train", storage_path=storage_path, storage_filesystem=storage_filesystem,
            failure_config=FailureConfig(max_failures=max_failures), callbacks=[StopOnUnretryableError()]),
        # No `datasets=`: Ray Train would shard them by world rank, and the two data-reading stages of a pipeline
        # must see the same micro-batches (ray#60439). Each reading worker streams exactly its replica's packs with
        # Ray Data itself (raytrain.trainer.feed, raytrain.dataset.stream.stream_micro_batches).
    )
    data = f"{num_packs} packed sequences"
    if not packed.complete:
        data = (f"the waves as the enrichment packs them ({len(packed.waves or ())} packed so far, {num_packs} "
                "sequences)")
    log.info("train: starting %d Ray Train workers (pp %d x dp %d) for %d steps on %s%s", tc.num_workers, tc.pp,
             tc.dp, tc.stop_at_step or tc.max_steps, data,
             f", eval on {validation.num_packs} held out" if validation is not None else "")
    try:
        trainer.fit()
    except (ray.train.WorkerGroupError, ray.train.ControllerError) as e:
        # A worker refused bad input (a corrupt checkpoint, a changed batch layout): surface that error, with its
        # file/field and fix, rather than Ray's wrapper around it and the worker's traceback.
        refused = user_error(e)
        if refused is not None:
            kind = CorruptCheckpointError if isinstance(refused, CorruptCheckpointError) else RaytrainError
            raise kind(str(refused)) from e
        raise
    # Ray attaches metrics to reported checkpoints only; ours are committed by the store, whose manifest records
    # the metrics of the step it saved (the last step is always saved).
    latest = CheckpointStore(run_root).latest()
    return TrainResult(final_metrics=dict(latest.metadata.get("metrics", {})) if latest else {},
                       checkpoint_dir=RunPaths(run_root).checkpoints.uri)
