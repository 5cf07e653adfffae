"""raytrain.pipeline.deepspeed_import: DeepSpeed without its autotuner's MLflow import, MLflow usable afterwards.
A subprocess: the import state of a fresh worker is the point."""

import importlib.util
import subprocess
import sys

import pytest

PROBE = """
import sys
import raytrain.pipeline.engine
assert "deepspeed" in sys.modules
print("mlflow after deepspeed:", "mlflow" in sys.modules)
import deepspeed.autotuning.autotuner as autotuner
print("autotuner sees mlflow:", autotuner.has_mlflow)
import mlflow
print("mlflow imports afterwards:", bool(mlflow.__version__))
"""


@pytest.mark.skipif(importlib.util.find_spec("mlflow") is None, reason="mlflow (the tracking extra) not installed")
def test_deepspeed_imports_without_mlflow_which_stays_importable():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [line for line in out.stdout.splitlines() if not line.startswith("[")]  # DeepSpeed's own log lines
    assert lines == ["mlflow after deepspeed: False", "autotuner sees mlflow: False",
                                       "mlflow imports afterwards: True"]
