"""Operations on a real multi-node Ray cluster on loopback: `ray job submit` of jobs/train.py, pipeline stages placed
on different nodes, and raytrain's gauges read back from the nodes' Prometheus endpoints while the job runs.

One cluster and one training job serve the whole module (2 cores: a training job costs about a minute). The cluster
is three `ray start --block` processes with 1 CPU each: Ray Train's placement group (2 bundles of 1 CPU, PACK) cannot
fit on one node, so the two pipeline stages land on two nodes and the third CPU is left for Ray Data's read tasks
(a trainer holding every CPU starves them: docs/decisions.md). Every process this module starts runs under its own
`--temp-dir` and session; teardown kills exactly those (never `ray stop`: other Ray clusters share this machine).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field

import pandas as pd
import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raytrain.config import DatasetConfig
from raytrain.dataset.pack import tokenize_frame

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RAY_BIN = os.path.join(os.path.dirname(sys.executable), "ray")
RUN_NAME = "ops"
MAX_STEPS = 3
JOB_TIMEOUT_S = 300


# ---------------------------------------------------------------------------------------------------------------------
# A Ray cluster of `ray start --block` processes on loopback, owned by this test process


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_port_args() -> list[str]:
    """Explicit free ports for everything a node listens on: the defaults (10001 client server, 52365 agent, ...)
    collide with other Ray clusters on this machine. Worker ports 0 = any free port."""
    return [f"--node-manager-port={free_port()}", f"--object-manager-port={free_port()}",
            "--min-worker-port=0", "--max-worker-port=0",
            f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}"]


def cluster_env(**extra: str) -> dict[str, str]:
    """Environment of every node: the venv's python first on PATH (the job entrypoint runs `python`), offline hubs,
    no token auth, metrics pushed to the Prometheus endpoint every second instead of every 10."""
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env.update({"PATH": os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""),
                "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "RAY_USAGE_STATS_ENABLED": "0", "RAY_metrics_report_interval_ms": "1000"})
    env.pop("PYTHONPATH", None)  # raytrain reaches the cluster through `--working-dir .`, as on a real cluster
    env.update(extra)
    return env


@dataclass
class LocalCluster:
    """Head + worker nodes started by this process; `stop()` ends exactly them."""

    temp_dir: str
    env: dict[str, str]
    gcs_port: int = 0
    dashboard_port: int = 0
    metrics_ports: list[int] = field(default_factory=list)
    procs: list[subprocess.Popen] = field(default_factory=list)
    log_names: list[str] = field(default_factory=list)
    session_name: str = ""

    @property
    def gcs_address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def _start(self, args: list[str], log_name: str) -> subprocess.Popen:
        metrics_port = free_port()
        log = open(os.path.join(self.temp_dir, log_name), "w")
        # A new session: the node's raylet, GCS, agents and workers are one process group we can end alone.
        proc = subprocess.Popen(
            [RAY_BIN, "start", "--block", "--node-ip-address=127.0.0.1", f"--metrics-export-port={metrics_port}",
             *node_port_args(), *args],
            env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=self.temp_dir)
        self.procs.append(proc)
        self.metrics_ports.append(metrics_port)
        self.log_names.append(log_name)
        return proc

    def _forget(self, proc: subprocess.Popen) -> None:
        i = self.procs.index(proc)
        for items in (self.procs, self.metrics_ports, self.log_names):
            del items[i]
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def start_head(self, num_cpus: int, extra: tuple[str, ...] = (), gcs_port: int = 0) -> None:
        self.gcs_port, self.dashboard_port = gcs_port or free_port(), free_port()
        self._start(["--head", f"--port={self.gcs_port}", f"--num-cpus={num_cpus}", f"--temp-dir={self.temp_dir}",
                     "--dashboard-host=127.0.0.1", f"--dashboard-port={self.dashboard_port}",
                     f"--ray-client-server-port={free_port()}", "--include-dashboard=true", *extra], "head.log")
        self.wait_for_dashboard()
        self.wait_for_nodes(1)
        # Nodes that the autoscaler starts use Ray's default temp dir, in a folder named after this session.
        self.session_name = os.path.basename(os.path.realpath(os.path.join(self.temp_dir, "session_latest")))

    def add_node(self, num_cpus: int, resources: dict[str, float], attempts: int = 3) -> None:
        """Start a worker node and wait until the cluster lists it. Ray gives a raylet 30 s (hard-coded) to
        register; on a loaded 2-core machine that can pass, so a node that gave up is started again."""
        expected = len(self.alive_nodes()) + 1
        for attempt in range(1, attempts + 1):
            # Its own temp dir, as a separate host would have: nodes sharing one session folder unpack the job's
            # working_dir into the same path, replacing the directory under the running driver's feet.
            node_temp_dir = os.path.join(self.temp_dir, f"n{len(self.procs)}")
            proc = self._start([f"--address={self.gcs_address}", f"--num-cpus={num_cpus}",
                                f"--resources={json.dumps(resources)}", f"--temp-dir={node_temp_dir}"],
                               f"node{len(self.procs)}-{attempt}.log")
            try:
                self.wait_for_nodes(expected)
                return
            except RuntimeError:
                if attempt == attempts:
                    raise
                self._forget(proc)

    def wait_for_dashboard(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                with urllib.request.urlopen(f"{self.dashboard_url}/api/version", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        raise TimeoutError(f"Ray dashboard at {self.dashboard_url} not up after {timeout_s}s; see {self.temp_dir}")

    def alive_nodes(self) -> list:
        from ray.util.state import list_nodes

        return [n for n in list_nodes(address=self.dashboard_url, raise_on_missing_output=False)
                if n.state == "ALIVE"]

    def wait_for_nodes(self, count: int, timeout_s: float = 120) -> list:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_alive()
            nodes = self.alive_nodes()
            if len(nodes) >= count:
                return nodes
            time.sleep(1)
        raise TimeoutError(f"{count} Ray nodes not alive after {timeout_s}s; see logs in {self.temp_dir}")

    def check_alive(self) -> None:
        for p, log_name in zip(self.procs, self.log_names, strict=True):
            if p.poll() is not None:
                with open(os.path.join(self.temp_dir, log_name)) as f:
                    tail = f.read()[-3000:]
                raise RuntimeError(f"`ray start {' '.join(p.args[2:])}` exited with {p.returncode}:\n{tail}")

    def owned_pids(self) -> set[int]:
        """Our `ray start` processes, their descendants, and any process naming our temp dir or session (raylets
        started by the autoscaler live under the monitor, workers may have been re-parented)."""
        pids: set[int] = set()
        for p in self.procs:
            try:
                parent = psutil.Process(p.pid)
                pids.add(p.pid)
                pids.update(c.pid for c in parent.children(recursive=True))
            except psutil.NoSuchProcess:
                pass
        markers = [m for m in (self.temp_dir, self.session_name) if m]
        for proc in psutil.process_iter(["pid", "cmdline"]):
            try:
                if any(m in arg for arg in proc.info["cmdline"] or () for m in markers):
                    pids.add(proc.info["pid"])
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        pids.discard(os.getpid())
        return pids

    def stop(self) -> None:
        pids = self.owned_pids()
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGTERM)  # the session leader's pid is its process group id
            except ProcessLookupError:
                pass
        procs = []
        for pid in pids:
            try:
                proc = psutil.Process(pid)
                proc.terminate()
                procs.append(proc)
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(procs, timeout=15)
        for proc in alive:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=5)
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass


def new_temp_dir() -> str:
    # Short: Ray's unix socket paths live under it and must stay below ~107 characters.
    return tempfile.mkdtemp(prefix="rt-ops-", dir="/tmp")


# ---------------------------------------------------------------------------------------------------------------------
# Data: enriched-like Parquet packed into the run, so the submitted job skips enrichment (no Spark)


def job_overrides(storage_root: str, run_name: str = RUN_NAME, max_steps: int = MAX_STEPS) -> list[str]:
    # dataset.seq_len=128: the synthetic conversations are short; the demo's 1,024-token packs would hold all 64 of
    # them in a handful of sequences, fewer than the steps need
    return [f"storage.root={storage_root}", "storage.user=ci", f"storage.run_name={run_name}",
            f"train.max_steps={max_steps}", f"train.checkpoint_every={max_steps}", "train.warmup_steps=1",
            "dataset.seq_len=128"]


def write_enriched(folder: str, num_rows: int = 64) -> None:
    """Synthetic conversations in the enrich stage's output schema (uuid, token ids, loss mask)."""
    rows = []
    for i in range(num_rows):
        messages = [{"role": "user", "content": f"What is {i} plus {i + 1}? Explain the steps."},
                    {"role": "assistant", "content": f"Adding {i} and {i + 1} gives {2 * i + 1}, because the "
                                                     f"second number is one more than the first."}]
        rows.append({"uuid": f"conv-{i:04d}", "messages_json": json.dumps(messages)})
    os.makedirs(folder, exist_ok=True)
    pq.write_table(pa.Table.from_pandas(tokenize_frame(pd.DataFrame(rows), DatasetConfig().tokenizer),
                                        preserve_index=False), os.path.join(folder, "part-0.parquet"))


def prepack_run(cluster_address: str, storage_root: str, overrides: list[str]):
    """Tokenize + pack on the given cluster into <run>/data/packed with the run's data hash; returns PackedData."""
    import ray

    from raytrain.config import load_job_config
    from raytrain.dataset.stream import pack_enriched
    from raytrain.runner import open_run
    from raytrain.storage import resolve

    job = load_job_config(os.path.join(REPO, "configs", "demo.yaml"), overrides)
    run = open_run(job)
    enriched = os.path.join(storage_root, "enriched-input")
    write_enriched(enriched)
    # the packing tasks import raytrain: this driver is not a submitted job, so point its workers at the repo
    ray.init(address=cluster_address, runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "PYTHONPATH": REPO}})
    try:
        packed = pack_enriched(resolve(enriched), run.root.join("data", "packed"), job.dataset, run.data_hash)
    finally:
        ray.shutdown()
    return packed


def submit_job(cluster: LocalCluster, entrypoint: list[str], env_vars: dict[str, str],
               working_dir: bool = True) -> str:
    """`ray job submit --no-wait --working-dir .` from the repository root with env vars only in the runtime env
    (the cluster already holds the dependencies: cluster/README.md); returns the submission id."""
    out = subprocess.run(
        [RAY_BIN, "job", "submit", "--address", cluster.dashboard_url, "--no-wait",
         *(["--working-dir", "."] if working_dir else []),
         "--runtime-env-json", json.dumps({"env_vars": env_vars}), "--", *entrypoint],
        cwd=REPO, env=cluster.env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    match = re.search(r"raysubmit_\w+", out.stdout + out.stderr)
    assert match, out.stdout + out.stderr
    return match.group(0)


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
    overrides = job_overrides(storage_root)
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

    job = load_job_config(os.path.join(REPO, "configs", "demo.yaml"), job_overrides(trained.storage_root))
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
