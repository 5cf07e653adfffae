"""raytrain: raw post-training data to a trained Mistral model on one Ray cluster.

What a script needs, the same calls as the `raytrain` command line::

    import raytrain

    job = raytrain.load_job_config("configs/demo.yaml", ["train.max_steps=20"])
    summary = raytrain.run_sft(job)        # `raytrain run`: enrich + pack + train, resuming a run of the same name
    packed = raytrain.run_enrich_only(job) # `raytrain enrich`: enrichment (Spark on Ray) + tokenize/pack
    summary = raytrain.run_train(job)      # `raytrain train`: train on what an earlier enrich packed
    out_dir = raytrain.export_latest(job)  # `raytrain export`: the latest checkpoint as a Hugging Face folder

Everything else is the stages' own API (raytrain.enrich, .dataset, .trainer, .pipeline, .checkpoint).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_PUBLIC = {
    "load_job_config": "raytrain.config",
    "JobConfig": "raytrain.config",
    "run_sft": "raytrain.runner",
    "run_enrich_only": "raytrain.runner",
    "run_train": "raytrain.runner",
    "export_latest": "raytrain.runner",
    "RaytrainError": "raytrain.errors",
    "ConfigError": "raytrain.errors",
}
__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str) -> Any:
    # Imported on first use: `import raytrain.pipeline.model` on a bare GPU box (benchmarks/gpu_stage_mfu.py) must not
    # pull in the runner's dependencies (pyarrow, Ray).
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'raytrain' has no attribute {name!r}")
