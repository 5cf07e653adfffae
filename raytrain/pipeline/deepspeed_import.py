"""DeepSpeed, imported without its autotuner's MLflow hook, for the modules of this package that use it.

``import deepspeed`` imports its autotuner, which imports MLflow whenever it is installed (the ``tracking`` extra):
over a second of every worker's start. raytrain never runs DeepSpeed's autotuner, so MLflow is hidden while DeepSpeed
is first imported; raytrain's own MLflow tracking imports it normally afterwards (docs/decisions.md).
"""

from __future__ import annotations

import sys

_HIDE_MLFLOW = "deepspeed" not in sys.modules and "mlflow" not in sys.modules
if _HIDE_MLFLOW:
    sys.modules["mlflow"] = None  # type: ignore[assignment]  # `import mlflow` raises ImportError meanwhile
try:
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule
    from deepspeed.runtime import utils as ds_utils
    from deepspeed.runtime.activation_checkpointing import checkpointing
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology
finally:
    if _HIDE_MLFLOW:
        del sys.modules["mlflow"]

__all__ = ["LayerSpec", "PipeDataParallelTopology", "PipelineModule", "checkpointing", "deepspeed", "ds_utils"]
