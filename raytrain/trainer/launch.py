"""Launch the TorchTrainer: pp x dp workers, each one DeepSpeed pipeline stage, fed by the packed Ray Dataset."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import ray
import ray.train
from ray.data import ExecutionOptions
from ray.train import DataConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

from raytrain.checkpoint.store import CheckpointStore
from raytrain.config import JobConfig
from raytrain.errors import RaytrainError
from raytrain.pipeline.ds_config import derive_ds_config, load_ds_config
from raytrain.storage import StorageLocation
from raytrain.trainer.loop import train_loop_per_worker

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainResult:
    final_metrics: dict[str, Any]
    checkpoint_dir: str


def job_as_overrides(job: JobConfig) -> list[str]:
    """The resolved job config as dotted overrides: plain strings travel to workers and rebuild the same config."""
    import json

    out: list[str] = []

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            out.append(f"{prefix}={json.dumps(list(node) if isinstance(node, tuple) else node)}")

    walk("", job.to_dict())
    return out


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


def user_error(error: BaseException) -> RaytrainError | None:
    """The first RaytrainError a failed worker group raised (rank order), looking through Ray's task-error
    wrappers; None when the failure was something else (a crash, a lost node)."""
    failures = getattr(error, "worker_failures", None) or {}
    for _, failure in sorted(failures.items()):
        seen: set[int] = set()
        while failure is not None and id(failure) not in seen:
            seen.add(id(failure))
            if isinstance(failure, RaytrainError):
                return failure
            failure = getattr(failure, "cause", None) or failure.__cause__
    return None


def train(job: JobConfig, run_root: StorageLocation, packed: ray.data.Dataset, num_packs: int,
          max_failures: int = 0, validation: ray.data.Dataset | None = None, validation_packs: int = 0
          ) -> TrainResult:
    """Fit the TorchTrainer on ``packed`` (``num_packs`` sequences); ``validation`` (``validation_packs``
    sequences) gives the eval loss every train.eval_every steps and at the end."""
    tc = job.train
    ds_config = derive_ds_config(load_ds_config(tc.ds_config), tc, ds_path=tc.ds_config)
    micro_batches_per_epoch = num_packs // tc.micro_batch_size
    if micro_batches_per_epoch < tc.dp * tc.grad_accum_steps:
        raise ValueError(
            f"the packed dataset holds {num_packs} sequences = {micro_batches_per_epoch} micro-batches of "
            f"{tc.micro_batch_size}, fewer than one optimizer step needs ({tc.dp} x {tc.grad_accum_steps}); "
            "use more data, a smaller dataset.seq_len or smaller batches")
    if validation is not None and -(-validation_packs // tc.micro_batch_size) < tc.dp:
        log.warning("validation: %d held-out sequences make fewer micro-batches than train.dp=%d replicas; no eval "
                    "loss (raise dataset.validation_fraction)", validation_packs, tc.dp)
        validation, validation_packs = None, 0
    if validation is None and tc.eval_every:
        log.warning("train.eval_every=%d but the run has no validation set: no eval loss (set "
                    "dataset.validation_fraction > 0)", tc.eval_every)
    if run_root.is_posix:
        run_root.join("reports").mkdirs()  # workers append metrics and data traces here
    loop_config = {
        "overrides": job_as_overrides(job),
        "run_uri": run_root.uri,
        "ds_config": ds_config,
        "micro_batches_per_epoch": micro_batches_per_epoch,
        "validation_packs": validation_packs if validation is not None else 0,
        "local_reports_dir": run_root.join("reports").path if run_root.scheme == "file" else None,
        "versions": software_versions(),
    }
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=loop_config,
        torch_config=TorchConfig(backend="nccl" if tc.use_gpu else "gloo"),
        scaling_config=ScalingConfig(num_workers=tc.num_workers, use_gpu=tc.use_gpu,
                                     resources_per_worker=tc.worker_resources() or None,
                                     placement_strategy=tc.placement_strategy),
        run_config=RunConfig(
            name="ray_train", storage_path=run_root.join("ray").ray_storage_path,
            storage_filesystem=run_root.join("ray").ray_storage_filesystem,
            failure_config=FailureConfig(max_failures=max_failures)),
        datasets={"train": packed, **({"validation": validation} if validation is not None else {})},
        # Not split by Ray (that would shard by world rank): every reader sees the whole dataset in a fixed order
        # and takes its data-parallel share itself (raytrain.trainer.schedule).
        dataset_config=DataConfig(datasets_to_split=[], execution_options=ExecutionOptions(preserve_order=True)),
    )
    try:
        trainer.fit()
    except ray.train.WorkerGroupError as e:
        # A worker refused bad input (a corrupt checkpoint, a changed batch layout): surface that error, with its
        # file/field and fix, rather than Ray's wrapper around it and the worker's traceback.
        refused = user_error(e)
        if refused is not None:
            raise RaytrainError(str(refused)) from e
        raise
    # Ray attaches metrics to reported checkpoints only; ours are committed by the store, whose manifest records
    # the metrics of the step it saved (the last step is always saved).
    latest = CheckpointStore(run_root).latest()
    return TrainResult(final_metrics=dict(latest.metadata.get("metrics", {})) if latest else {},
                       checkpoint_dir=run_root.join("checkpoints").uri)
