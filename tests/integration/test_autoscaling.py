"""Autoscaling on one machine with Ray's fake_multinode provider (cluster/local-fake-multinode.yaml).

The head advertises 1 CPU; the submitted training job needs 2 trainer workers (1 CPU each) plus a CPU for Ray Data's
reads, so it can only run once the autoscaler has started fake worker nodes (extra raylets on this machine). After
the job the idle nodes are removed again (idle_timeout_minutes: 0.5).

The head is `RAY_FAKE_CLUSTER=1 ray start --head --block --autoscaling-config=<copy of the YAML>`, the copy pointing
the provider at this head's GCS port (the provider dials port 6379 otherwise). Teardown kills the processes of this
cluster only (never `ray stop`: other Ray clusters share this machine).
"""

from __future__ import annotations

import os
import shutil
import time

import pytest
import yaml
from local_cluster import (
    MAX_STEPS,
    REPO,
    LocalCluster,
    cluster_env,
    free_port,
    job_overrides,
    new_temp_dir,
    prepack_run,
    submit_job,
)

FAKE_YAML = os.path.join(REPO, "cluster", "local-fake-multinode.yaml")
JOB_TIMEOUT_S = 300
SCALE_DOWN_TIMEOUT_S = 120


def node_kind(node) -> str:
    """'head', or the custom resource that names a worker node type of the YAML (raytrain_enrich/raytrain_train)."""
    if node.is_head_node:
        return "head"
    kinds = [k for k in node.resources_total if k.startswith("raytrain_")]
    return kinds[0] if kinds else "unknown"


@pytest.fixture(scope="module")
def fake_cluster():
    temp_dir = new_temp_dir()
    c = LocalCluster(temp_dir=temp_dir, env=cluster_env(RAY_FAKE_CLUSTER="1"))
    with open(FAKE_YAML) as f:
        config = yaml.safe_load(f)
    head_cpus = int(config["available_node_types"]["ray.head.default"]["resources"]["CPU"])
    try:
        gcs_port = free_port()  # the YAML copy must name it before the head (and its autoscaler) starts
        config["provider"]["gcs_address"] = f"127.0.0.1:{gcs_port}"
        autoscaling_yaml = os.path.join(temp_dir, "fake-multinode.yaml")
        with open(autoscaling_yaml, "w") as f:
            yaml.safe_dump(config, f)
        c.start_head(num_cpus=head_cpus, gcs_port=gcs_port,
                     extra=(f"--autoscaling-config={autoscaling_yaml}",))
        yield c, config
    finally:
        c.stop()
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_job_needing_more_cpus_than_the_head_scales_up_and_completes(fake_cluster, tmp_path_factory):
    from ray.job_submission import JobSubmissionClient

    cluster, config = fake_cluster
    assert [node_kind(n) for n in cluster.alive_nodes()] == ["head"]
    storage_root = str(tmp_path_factory.mktemp("autoscale-runs"))
    overrides = [*job_overrides(storage_root, run_name="autoscale"),
                 f"train.ds_config={os.path.join(REPO, 'configs', 'ds_config.json')}"]
    prepack_run(cluster.gcs_address, storage_root, overrides)

    # No --working-dir here: fake nodes share the head's session folder (the provider gives them the head's temp
    # dir), so each node would unpack the job's working_dir into the same path under the running driver. The
    # repository reaches the nodes through PYTHONPATH instead (test_ops_cluster covers `--working-dir .`).
    t0 = time.monotonic()
    submission_id = submit_job(
        cluster, ["python", os.path.join(REPO, "jobs", "train.py"), "--config",
                  os.path.join(REPO, "configs", "demo.yaml"), *overrides],
        {"PYTHONUNBUFFERED": "1", "PYTHONPATH": REPO}, working_dir=False)
    client = JobSubmissionClient(cluster.dashboard_url)
    kinds_seen: set[str] = set()
    max_nodes = 0
    status = client.get_job_status(submission_id)
    while not status.is_terminal():
        assert time.monotonic() - t0 < JOB_TIMEOUT_S, f"job still {status} after {JOB_TIMEOUT_S}s"
        nodes = cluster.alive_nodes()
        max_nodes = max(max_nodes, len(nodes))
        kinds_seen.update(node_kind(n) for n in nodes)
        time.sleep(1)
        status = client.get_job_status(submission_id)
    logs = client.get_job_logs(submission_id)
    print(f"job {submission_id}: {status.value} in {time.monotonic() - t0:.0f}s; nodes seen {kinds_seen}")
    assert status.value == "SUCCEEDED", logs[-4000:]
    assert f"[raytrain] checkpoint step {MAX_STEPS}" in logs

    # the autoscaler added fake worker nodes of the YAML's types, never more than its max_workers
    worker_kinds = kinds_seen - {"head"}
    assert worker_kinds and worker_kinds <= {"raytrain_enrich", "raytrain_train"}, kinds_seen
    assert 2 <= max_nodes <= 1 + config["max_workers"]

    # ...and removes them once idle (idle_timeout_minutes: 0.5)
    deadline = time.monotonic() + SCALE_DOWN_TIMEOUT_S
    while len(cluster.alive_nodes()) > 1:
        assert time.monotonic() < deadline, f"idle fake nodes still up after {SCALE_DOWN_TIMEOUT_S}s"
        time.sleep(2)
    assert [node_kind(n) for n in cluster.alive_nodes()] == ["head"]
