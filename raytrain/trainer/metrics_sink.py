"""Where a training step's metrics go, behind one interface: the console line, ``reports/metrics.jsonl``,
TensorBoard, MLflow / W&B (train.tracking), the Prometheus gauges, each data-reading rank's data trace, and Ray
Train's report. The loop hands every step's metrics to one ``MetricsSink`` and never formats output itself.

Rank 0 (a data-reading first stage) owns the human-facing channels; every rank records its gauges and reports to
Ray Train; data-reading ranks write their own data trace.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from typing import Any

from raytrain.config import JobConfig
from raytrain.pipeline.dpo import METRICS as PAIR_METRICS
from raytrain.pipeline.lora import model_parameter_counts
from raytrain.telemetry import record_train_step
from raytrain.trainer.schedule import Topology
from raytrain.trainer.tracking import Trackers

TENSORBOARD_SCALARS = ("loss", "lr", "grad_norm", "real_tokens_per_s", "tokens_seen", "step_time_s", "mfu")
"""Step metrics written as TensorBoard scalars ``train/<name>``."""

EVAL_LABELS = {"validation_loss": ("validation loss", "held-out sequences", "validation/loss"),
               "benchmark_loss": ("benchmark loss", "eval-set sequences", "benchmark/loss")}
"""Evaluation metric -> (console label, what its sequences are, TensorBoard tag)."""


class MetricsSink:
    """One step's metrics dict in, every output channel written. ``report`` is Ray Train's ``ray.train.report``
    in a worker (a plain callable in tests)."""

    def __init__(self, job: JobConfig, topo: Topology, reports_dir: str | None, start_step: int,
                 eval_sizes: Mapping[str, int], report: Callable[[dict[str, Any]], None]) -> None:
        self.job, self.topo, self.report_fn = job, topo, report
        self.eval_sizes = dict(eval_sizes)  # metric -> number of sequences it is computed on
        lead = topo.world_rank == 0
        self.metrics_path = os.path.join(reports_dir, "metrics.jsonl") if reports_dir and lead else None
        self.trace_path = (os.path.join(reports_dir, f"data_trace_rank{topo.world_rank}.jsonl")
                           if reports_dir and topo.needs_data else None)
        # `tensorboard --logdir <run>/reports/tensorboard`
        self.board = _tensorboard(os.path.join(reports_dir, "tensorboard"), start_step) if reports_dir and lead \
            else None
        # only rank 0 records them: the other ranks skip building the model on the meta device
        counts = model_parameter_counts(job) if lead else None
        self.trackers = Trackers(job, reports_dir, topo.world_rank, counts)  # MLflow / W&B on request, rank 0
        if self.board is not None and counts is not None:
            lora = job.model.lora
            kind = f"LoRA rank {lora.rank} on {', '.join(lora.targets)}" if lora.rank else "full fine-tune"
            self.board.add_text("run/parameters", f"{kind}: {counts['trainable']:,} trainable of "
                                                  f"{counts['total']:,} parameters", start_step)

    def step(self, metrics: dict[str, Any], consumed: list[tuple[int, str]]) -> None:
        """Record one optimizer step: ``metrics`` (``eval_time_s`` and the eval metrics present on eval steps) and
        the global micro-batches this rank consumed in it."""
        step = metrics["step"]
        record_train_step(self.job.storage.run_name, self.topo.stage, self.topo.dp_rank, metrics)
        if self.topo.world_rank == 0:
            self._console(metrics)
            if self.metrics_path:
                _append_json(self.metrics_path, metrics)
            if self.board is not None:
                self._tensorboard(metrics)
            self.trackers.log(metrics, step)
        if self.trace_path:
            _append_json(self.trace_path, {"step": step, "stage": self.topo.stage, "dp_rank": self.topo.dp_rank,
                                           "consumed": consumed})

    def checkpoint(self, step: int, uri: str) -> None:
        if self.topo.world_rank == 0:
            print(f"[raytrain] checkpoint step {step} -> {uri}", flush=True)

    def report(self, metrics: dict[str, Any]) -> None:
        """Ray Train's report (the dashboard and the driver's result), after the step's checkpoint."""
        self.report_fn({k: v for k, v in metrics.items() if v is not None})

    def close(self) -> None:
        if self.board is not None:
            self.board.close()
        self.trackers.close()

    def _console(self, m: dict[str, Any]) -> None:
        max_steps = self.job.train.max_steps
        grad_norm = f" grad norm {m['grad_norm']:.3f}" if m["grad_norm"] is not None else ""
        print(f"[raytrain] step {m['step']}/{max_steps} loss {m['loss']:.4f}{_rewards(m)} lr {m['lr']:.2e}"
              f"{grad_norm} {m['real_tokens_per_s'] or m['tokens_per_s']:,.0f} tok/s {m['step_time_s']:.2f}s "
              f"eta {m['eta_s']:.0f}s", flush=True)
        if "eval_time_s" in m:
            parts = [f"{label} {m[metric]:.4f}{_rewards(m, metric.removesuffix('_loss') + '/')} on "
                     f"{self.eval_sizes[metric]} {what}"
                     for metric, (label, what, _tag) in EVAL_LABELS.items() if metric in m]
            print(f"[raytrain] step {m['step']}/{max_steps} {', '.join(parts)} ({m['eval_time_s']:.1f}s)",
                  flush=True)

    def _tensorboard(self, m: dict[str, Any]) -> None:
        assert self.board is not None
        for name in TENSORBOARD_SCALARS:
            if m.get(name) is not None:
                self.board.add_scalar(f"train/{name}", m[name], m["step"])
        for metric, (_label, _what, tag) in EVAL_LABELS.items():
            if metric in m:
                self.board.add_scalar(tag, m[metric], m["step"])
        for prefix in ("", "validation/"):  # DPO: TRL's metric names
            for name in PAIR_METRICS:
                if m.get(prefix + name) is not None:
                    self.board.add_scalar(f"{prefix or 'train/'}{name}", m[prefix + name], m["step"])
        self.board.flush()


def _rewards(m: dict[str, Any], prefix: str = "") -> str:
    """The DPO part of a console line (reward accuracy and margin), "" for a fine-tune."""
    if m.get(prefix + "rewards/accuracies") is None:
        return ""
    return f" reward acc {m[prefix + 'rewards/accuracies']:.2f} margin {m[prefix + 'rewards/margins']:.4f}"


def _append_json(path: str, record: dict[str, Any]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def _tensorboard(logdir: str, step: int) -> Any:
    """A tensorboardX writer; a resumed run purges events after its checkpoint's step, so curves do not fold back."""
    from tensorboardX import SummaryWriter

    return SummaryWriter(logdir=logdir, purge_step=step + 1 if step else None)
