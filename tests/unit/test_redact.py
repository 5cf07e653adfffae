"""raytrain.redact: credentials inside URIs never reach what is printed or stored (console, log file, reports,
checkpoint manifests, tracker params)."""

from __future__ import annotations

import io
import json
import logging
from urllib.parse import urlsplit

import pytest

from raytrain.config import load_job_config
from raytrain.console import RedactFilter
from raytrain.redact import MASK, redact, redact_tree

PASSWORD = "pa55-canary-9d1e"


@pytest.mark.parametrize(("given", "expected"), [
    (f"https://alice:{PASSWORD}@mlflow.internal:5000/", "https://***@mlflow.internal:5000/"),
    (f"http://ci:{PASSWORD}@127.0.0.1:9000", "http://***@127.0.0.1:9000"),
    ("https://ghp_tokenonly123@git.example/x.git", "https://***@git.example/x.git"),  # a bare token as user
    (f"tracking at databricks://bob:{PASSWORD}@ws and s3://b/k", "tracking at databricks://***@ws and s3://b/k"),
    (f"'https://a:{PASSWORD}@h/p'", "'https://***@h/p'"),  # quoted, as in a repr or JSON
    (f"https://h/o?X-Amz-Signature={PASSWORD}&X-Amz-Date=1", "https://h/o?X-Amz-Signature=***&X-Amz-Date=1"),
    (f"https://h/api?access_token={PASSWORD}", "https://h/api?access_token=***"),
    (f"https://h/api?user=a&password={PASSWORD}#frag", "https://h/api?user=a&password=***#frag"),
])
def test_redact_hides_userinfo_and_credential_parameters(given, expected):
    assert redact(given) == expected
    assert PASSWORD not in redact(given) and "tokenonly" not in redact(given)


@pytest.mark.parametrize("kept", [
    "s3://bucket/runs/ci/demo/run1", "http://127.0.0.1:8265", "hdfs://nn:8020/user/a/b@c", "/mnt/shared/x@y",
    "alice@example.com wrote a=b", "step 4/6 loss 2.31", "https://h/p?page=2&size=10", "",
])
def test_redact_leaves_uris_without_credentials_unchanged(kept):
    assert redact(kept) == kept


def test_redacted_uri_still_parses_to_the_same_host():
    """The masked form stays a URI (what a reader of a report needs: where, not who)."""
    parts = urlsplit(redact(f"https://alice:{PASSWORD}@mlflow.internal:5000/x"))
    assert (parts.hostname, parts.port, parts.path, parts.username, parts.password) == (
        "mlflow.internal", 5000, "/x", MASK, None)


def test_config_dump_is_redacted_everywhere_it_holds_a_uri():
    """The resolved config as the checkpoint manifest and the tracker params store it."""
    job = load_job_config("configs/demo.yaml", [f"train.mlflow_uri=https://alice:{PASSWORD}@mlflow.internal/",
                                                f"storage.s3_endpoint=http://ci:{PASSWORD}@127.0.0.1:9000"])
    assert PASSWORD in json.dumps(job.to_dict())  # the job itself keeps what it needs to connect
    tree = redact_tree(job.to_dict())
    assert PASSWORD not in json.dumps(tree)
    assert tree["train"]["mlflow_uri"] == "https://***@mlflow.internal/"
    assert tree["storage"]["s3_endpoint"] == "http://***@127.0.0.1:9000"
    flat = redact_tree(job.flat_dict())
    assert flat["storage.s3_endpoint"] == "http://***@127.0.0.1:9000"
    # everything else is untouched, types included (tuples stay tuples, numbers numbers)
    assert {k: v for k, v in flat.items() if k not in ("train.mlflow_uri", "storage.s3_endpoint")} == {
        k: v for k, v in job.flat_dict().items() if k not in ("train.mlflow_uri", "storage.s3_endpoint")}
    assert redact_tree({"a": (1, f"https://u:{PASSWORD}@h"), "b": [2.5, None, True]}) == {
        "a": (1, "https://***@h"), "b": [2.5, None, True]}


def test_log_records_are_redacted_by_the_handlers_filter():
    """Any library's record (here one with %-args, as urllib3 or mlflow log a URL) leaves the handler redacted."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(RedactFilter())
    logger = logging.getLogger("test_redact.some_library")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        logger.info("connecting to %s (attempt %d)", f"https://alice:{PASSWORD}@mlflow.internal/", 2)
        logger.info("plain %s line", "s3://b/k")
    finally:
        logger.removeHandler(handler)
    assert out.getvalue().splitlines() == ["connecting to https://***@mlflow.internal/ (attempt 2)",
                                           "plain s3://b/k line"]


def test_mlflow_params_are_redacted(tmp_path, monkeypatch):
    """A real MLflow file store: the params Trackers logs hold the endpoint without its password."""
    mlflow = pytest.importorskip("mlflow")
    pytest.importorskip("ray.air.integrations.mlflow")
    from raytrain.trainer.tracking import Trackers

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    job = load_job_config("configs/demo.yaml", ["train.tracking=[mlflow]", "storage.run_name=redact",
                                                f"storage.s3_endpoint=http://ci:{PASSWORD}@127.0.0.1:9000"])
    trackers = Trackers(job, str(tmp_path), world_rank=0)
    trackers.log({"loss": 1.5}, step=1)
    trackers.close()
    client = mlflow.tracking.MlflowClient(tracking_uri=f"file://{tmp_path / 'mlruns'}")
    [run] = client.search_runs([client.get_experiment_by_name(job.storage.project).experiment_id])
    assert run.data.params["storage.s3_endpoint"] == "http://***@127.0.0.1:9000"
    assert run.data.metrics["loss"] == 1.5
    stored = "".join(p.read_text(errors="replace") for p in (tmp_path / "mlruns").rglob("*") if p.is_file())
    assert PASSWORD not in stored
