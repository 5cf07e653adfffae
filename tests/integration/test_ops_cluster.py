"""Operations on a real multi-node Ray cluster on loopback: `ray job submit` of jobs/train.py, pipeline stages placed
on different nodes, and raytrain's gauges read back from the nodes' Prometheus endpoints while the job runs.

One cluster and one training job serve the whole module (2 cores: a training job costs about a minute). The cluster
is three `ray start --block` processes with 1 CPU each: Ray Train's placement group (2 bundles of 1 CPU, PACK) cannot
fit on one node, so the two pipeline stages land on two nodes and the third CPU is left for Ray Data's read tasks
(a trainer holding every CPU starves them: docs/decisions.md). Every process this module starts runs under its own
`--temp-dir` and session; teardown kills exactly those (never `ray stop`: other Ray clusters share this machine).
"""

from __future__ import annotations

import os
import re
import shutil
import time
import urllib.request
from dataclasses import dataclass

import pytest
from local_cluster import (
    MAX_STEPS,
    REPO,
    LocalCluster,
    cluster_env,
    job_overrides,
    new_temp_dir,
    prepack_run,
    submit_job,
)

RUN_NAME = "ops"
JOB_TIMEOUT_S = 300


# ---------------------------------------------------------------------------------------------------------------------
# Prometheus endpoints of the nodes


def scrape(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=3) as r:
            return r.read().decode()
    except OSError:
        return ""


def parse_samples(text: str, metric: str) -> list[tuple[dict[str, str], float]]:
    """Prometheus text exposition -> [(labels, value)] for one metric name."""
    out = []
    for line in text.splitlines():
        if not line.startswith(metric + "{"):
            continue
        labels_text, value = line[len(metric) + 1:].rsplit("}", 1)
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', labels_text))
        out.append((labels, float(value.split()[0])))
    return out


# ---------------------------------------------------------------------------------------------------------------------
# The module's cluster and its one training job


@dataclass
class JobOutcome:
    submission_id: str
    status: str
    logs: str
    wall_s: float
    storage_root: str
    metrics_seen: dict[str, list[tuple[dict[str, str], float]]]
    worker_nodes: list[str]  # node id of each RayTrainWorker actor
    node_ids: dict[str, str]  # node id -> "head" / the node's fake_host resource


@pytest.fixture(scope="module")
def cluster():
    temp_dir = new_temp_dir()
    c = LocalCluster(temp_dir=temp_dir, env=cluster_env())
    try:
        c.start_head(num_cpus=1)
        c.add_node(num_cpus=1, resources={"fake_host_b": 1})
        c.add_node(num_cpus=1, resources={"fake_host_c": 1})
        c.wait_for_nodes(3)
        yield c
    finally:
        c.stop()
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def trained(cluster, tmp_path_factory):
    from ray.job_submission import JobSubmissionClient
    from ray.util.state import list_actors

    storage_root = str(tmp_path_factory.mktemp("ops-runs"))
    overrides = job_overrides(storage_root, RUN_NAME)
    packed = prepack_run(cluster.gcs_address, storage_root, overrides)
    assert packed.num_packs >= 4

    t0 = time.monotonic()
    # PYTHONUNBUFFERED: per-step lines reach the job log as they happen. The README's HF_HUB_OFFLINE runtime env
    # has its own test below (test_documented_runtime_env_joins_cluster).
    submission_id = submit_job(cluster, ["python", "jobs/train.py", "--config", "configs/demo.yaml", *overrides],
                               {"PYTHONUNBUFFERED": "1"})
    client = JobSubmissionClient(cluster.dashboard_url)
    metrics_seen: dict[str, list] = {}
    status = client.get_job_status(submission_id)
    while not status.is_terminal():
        assert time.monotonic() - t0 < JOB_TIMEOUT_S, f"job {submission_id} still {status} after {JOB_TIMEOUT_S}s"
        # Scrape every node while the job runs: the gauges live in the node that hosts each stage.
        for port in cluster.metrics_ports:
            text = scrape(port)
            for name in ("ray_raytrain_train_loss", "ray_raytrain_train_tokens_per_s"):
                samples = [s for s in parse_samples(text, name) if s[0].get("run") == RUN_NAME]
                if samples:
                    metrics_seen.setdefault(name, []).extend(samples)
        time.sleep(0.5)
        status = client.get_job_status(submission_id)
    wall_s = time.monotonic() - t0
    logs = client.get_job_logs(submission_id)
    with open(os.path.join(storage_root, "job.log"), "w") as f:  # kept with pytest's tmp dirs for a post-mortem
        f.write(logs)

    workers = list_actors(address=cluster.dashboard_url, filters=[("class_name", "=", "RayTrainWorker")],
                          detail=True, raise_on_missing_output=False)
    nodes = {n.node_id: ("head" if n.is_head_node else ",".join(k for k in n.resources_total
                                                                if k.startswith("fake_host")))
             for n in cluster.alive_nodes()}
    return JobOutcome(submission_id, status.value, logs, wall_s, storage_root, metrics_seen,
                      [w.node_id for w in workers], nodes)


# ---------------------------------------------------------------------------------------------------------------------


def test_job_submit_succeeds_and_logs_training(trained):
    outcome = trained
    print(f"job {outcome.submission_id}: {outcome.status} in {outcome.wall_s:.0f}s")
    assert outcome.status == "SUCCEEDED", outcome.logs[-4000:]
    # the per-step lines world rank 0 prints, in step order (Ray's log forwarding may repeat a line)
    steps = [int(m) for m in re.findall(rf"\[raytrain\] step (\d+)/{MAX_STEPS} loss [0-9.]+", outcome.logs)]
    assert sorted(set(steps)) == list(range(1, MAX_STEPS + 1)) and steps == sorted(steps), outcome.logs[-4000:]
    assert f"[raytrain] checkpoint step {MAX_STEPS}" in outcome.logs


def test_job_wrote_committed_checkpoint(trained):
    # the job ran in Ray's unpacked copy of the repository, yet wrote into the storage root the test gave it
    from raytrain.checkpoint.store import CheckpointStore
    from raytrain.config import load_job_config
    from raytrain.runner import open_run

    job = load_job_config(os.path.join(REPO, "configs", "demo.yaml"), job_overrides(trained.storage_root, RUN_NAME))
    store = CheckpointStore(open_run(job).root)
    latest = store.latest()
    assert latest is not None and latest.step == MAX_STEPS
    store.verify(latest)  # sizes + sha256 of every file in the manifest


def test_pipeline_stages_on_different_nodes(trained):
    outcome = trained
    assert len(outcome.worker_nodes) == 2, outcome.worker_nodes
    node_a, node_b = outcome.worker_nodes
    assert node_a != node_b, f"both stages on node {node_a}"
    assert {node_a, node_b} <= set(outcome.node_ids), "a worker ran on a node that is not part of this cluster"


def test_train_gauges_exported_with_run_and_stage_tags(trained):
    outcome = trained
    for name in ("ray_raytrain_train_loss", "ray_raytrain_train_tokens_per_s"):
        samples = outcome.metrics_seen.get(name, [])
        assert samples, f"{name} never appeared on any node's /metrics while the job ran"
        assert {labels["stage"] for labels, _ in samples} == {"0", "1"}, samples
        assert all(labels["dp_rank"] == "0" for labels, _ in samples)
        assert all(value > 0 for _, value in samples)


def test_documented_runtime_env_joins_cluster(cluster):
    """The README's `--runtime-env-json '{"env_vars": {"HF_HUB_OFFLINE": "1"}}'`: the job's driver joins the cluster
    through raytrain.runner.connect_ray, and its tasks see both the job's env vars and raytrain's WORKER_ENV."""
    from ray.job_submission import JobSubmissionClient

    script = ("from raytrain.config import load_job_config; from raytrain.runner import connect_ray; import os, ray; "
              "connect_ray(load_job_config(None, [])); "
              "env = ray.get(ray.remote(lambda: {k: os.environ.get(k) for k in "
              "('HF_HUB_OFFLINE', 'TOKENIZERS_PARALLELISM')}).remote()); print('TASK_ENV', sorted(env.items()))")
    submission_id = submit_job(cluster, ["python", "-c", script], {"HF_HUB_OFFLINE": "1"})
    client = JobSubmissionClient(cluster.dashboard_url)
    deadline = time.monotonic() + 120
    while not client.get_job_status(submission_id).is_terminal():
        assert time.monotonic() < deadline, f"job {submission_id} did not finish in 120s"
        time.sleep(1)
    logs = client.get_job_logs(submission_id)
    assert client.get_job_status(submission_id).value == "SUCCEEDED", logs[-3000:]
    assert "TASK_ENV [('HF_HUB_OFFLINE', '1'), ('TOKENIZERS_PARALLELISM', 'false')]" in logs, logs[-3000:]
