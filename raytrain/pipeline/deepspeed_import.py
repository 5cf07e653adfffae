"""DeepSpeed, imported without its autotuner's MLflow hook, for the modules of this package that use it.

``import deepspeed`` imports its autotuner (through ``deepspeed.runtime.config``), which imports MLflow whenever it is
installed, as it is with the ``tracking`` extra: 1.4 s of every worker's start on the CPU machines here (1.76 s
against 0.36 s after torch). raytrain never runs DeepSpeed's autotuner, so MLflow is hidden while DeepSpeed is
first imported; raytrain's own MLflow tracking (raytrain.trainer.tracking) imports it normally afterwards.
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
