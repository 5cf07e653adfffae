"""DeepSpeed, imported without its autotuner's MLflow hook, for the modules of this package that use it.

``import deepspeed`` imports its autotuner, which imports MLflow whenever it is installed (the ``tracking`` extra):
over a second of every worker's start. raytrain never runs DeepSpeed's autotuner, so MLflow is hidden while DeepSpeed
is first imported; raytrain's own MLflow tracking imports it normally afterwards (docs/decisions.md).
"""

from __future__ import annotations

import sys

if "deepspeed" not in sys.modules and "mlflow" not in sys.modules:
    sys.modules["mlflow"] = None  # type: ignore[assignment]  # `import mlflow` raises ImportError meanwhile
    try:
        import deepspeed
    finally:
        del sys.modules["mlflow"]

import deepspeed  # noqa: E402,F811 - the module, imported above or before this one
from deepspeed.pipe import LayerSpec, PipelineModule  # noqa: E402
from deepspeed.runtime import utils as ds_utils  # noqa: E402
from deepspeed.runtime.activation_checkpointing import checkpointing  # noqa: E402
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology  # noqa: E402

__all__ = ["LayerSpec", "PipeDataParallelTopology", "PipelineModule", "checkpointing", "deepspeed", "ds_utils"]
