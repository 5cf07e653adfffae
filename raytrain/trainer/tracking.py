"""Experiment trackers beside TensorBoard: MLflow and Weights & Biases through Ray's own integrations
(``ray.air.integrations.mlflow.setup_mlflow`` / ``.wandb.setup_wandb``), opened by rank 0 of the TorchTrainer.

Each logs the resolved config once (dotted keys) and every step's numeric metrics (loss, lr, grad norm, tokens/s,
validation loss, ...) at the optimizer step. Offline by default: MLflow writes a file store under the run's
``reports/mlruns`` (``train.mlflow_uri`` names a server instead), W&B an offline run under ``reports/wandb``
(``wandb sync`` uploads it later; ``train.wandb_mode: online`` needs WANDB_API_KEY).
"""

from __future__ import annotations

import os
from typing import Any

from raytrain.config import JobConfig
from raytrain.redact import redact_tree


class Trackers:
    """The trackers ``train.tracking`` names, for one rank; empty on every rank but 0."""

    def __init__(self, job: JobConfig, reports_dir: str | None, world_rank: int,
                 parameters: dict[str, int] | None = None) -> None:
        """``parameters``: the model's trainable and total parameter counts, recorded with the config's params."""
        self._mlflow: Any = None
        self._wandb: Any = None
        if world_rank != 0 or not job.train.tracking:
            return
        # the params are stored by the tracker and shown in its UI: no password of a URI in them (the tracker itself
        # still connects with the URI as given)
        tc, params = job.train, redact_tree(job.flat_dict())
        params.update({f"parameters.{k}": v for k, v in (parameters or {}).items()})
        if "mlflow" in tc.tracking:
            from ray.air.integrations.mlflow import setup_mlflow

            uri = tc.mlflow_uri or f"file://{os.path.join(reports_dir or '', 'mlruns')}"
            if uri.startswith("file:"):
                # MLflow 3 refuses its file store unless asked for it; a run-local store is what we want offline
                os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            self._mlflow = setup_mlflow({k: str(v) for k, v in params.items()}, tracking_uri=uri,
                                        experiment_name=job.storage.project, run_name=job.storage.run_name,
                                        create_experiment_if_not_exists=True, rank_zero_only=True)
        if "wandb" in tc.tracking:
            from ray.air.integrations.wandb import setup_wandb

            os.environ["WANDB_MODE"] = tc.wandb_mode  # Ray's setup asks for an API key unless offline
            self._wandb = setup_wandb(params, project=tc.wandb_project, name=job.storage.run_name,
                                      group=job.storage.project, mode=tc.wandb_mode, dir=reports_dir,
                                      rank_zero_only=True)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        numeric = {k: float(v) for k, v in metrics.items()
                   if isinstance(v, int | float) and not isinstance(v, bool) and k != "step"}
        if self._mlflow is not None:
            self._mlflow.log_metrics(numeric, step=step)
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)

    def close(self) -> None:
        if self._mlflow is not None:
            self._mlflow.end_run()
        if self._wandb is not None:
            import wandb

            self._wandb.finish()
            # finish() returns before W&B's service process has flushed the offline run's file; Ray kills a worker's
            # child processes when the worker exits, so wait for the service to end here
            wandb.teardown()
