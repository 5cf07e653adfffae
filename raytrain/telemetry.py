"""Metrics exported through `ray.util.metrics`, so they reach the Ray dashboard's Prometheus endpoint and the
Grafana dashboard in cluster/grafana/raytrain.json (Ray prefixes every name with `ray_`)."""

from __future__ import annotations

from functools import cache
from typing import Any

TRAIN_GAUGES = {
    "raytrain_train_loss": "training loss of the last optimizer step",
    "raytrain_train_tokens_per_s": "tokens per second across the whole job (global batch x seq_len / step time)",
    "raytrain_train_step_time_s": "wall time of the last optimizer step in seconds",
    "raytrain_train_mfu": "estimated model FLOPs utilisation (needs train.peak_tflops)",
    "raytrain_train_lr": "learning rate of the last step",
}
TRAIN_TAGS = ("run", "stage", "dp_rank")
ENRICH_GAUGES = {
    "raytrain_enrich_rows_per_s": "rows per second through one enrichment step",
    "raytrain_enrich_quarantined_rows": "rows quarantined by the enrichment, per reason",
}


@cache
def _gauge(name: str, description: str, tag_keys: tuple[str, ...]) -> Any:
    from ray.util.metrics import Gauge

    return Gauge(name, description=description, tag_keys=tag_keys)


def record_train_step(run: str, stage: int, dp_rank: int, metrics: dict[str, Any]) -> None:
    """Set the training gauges from one step's metrics dict (keys loss, tokens_per_s, step_time_s, mfu, lr)."""
    tags = {"run": run, "stage": str(stage), "dp_rank": str(dp_rank)}
    for name, description in TRAIN_GAUGES.items():
        value = metrics.get(name.removeprefix("raytrain_train_"))
        if value is not None:
            _gauge(name, description, TRAIN_TAGS).set(float(value), tags=tags)


def record_enrich_step(run: str, step: str, rows: int, seconds: float) -> None:
    _gauge("raytrain_enrich_rows_per_s", ENRICH_GAUGES["raytrain_enrich_rows_per_s"], ("run", "stage")).set(
        rows / seconds if seconds > 0 else 0.0, tags={"run": run, "stage": step})


def record_quarantine(run: str, per_reason: dict[str, int]) -> None:
    gauge = _gauge("raytrain_enrich_quarantined_rows", ENRICH_GAUGES["raytrain_enrich_quarantined_rows"],
                   ("run", "reason"))
    for reason, count in per_reason.items():
        gauge.set(float(count), tags={"run": run, "reason": reason})
