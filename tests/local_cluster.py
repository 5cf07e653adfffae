"""A Ray cluster of `ray start --block` processes on loopback owned by the test process, and a training job for it
that skips enrichment (shared test helpers of tests/integration/test_ops_cluster.py and test_autoscaling.py).
Every process a LocalCluster starts runs under its own `--temp-dir` and session; stop() ends exactly those (never
`ray stop`: other Ray clusters share the machine)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field

import psutil
from synthetic_data import SHORT, synthetic_conversations, write_packed

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RAY_BIN = os.path.join(os.path.dirname(sys.executable), "ray")
MAX_STEPS = 3  # steps of the jobs job_overrides describes


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


def job_overrides(storage_root: str, run_name: str, max_steps: int = MAX_STEPS) -> list[str]:
    # dataset.seq_len=128: the synthetic conversations are short; the demo's 1,024-token packs would hold all 64 of
    # them in a handful of sequences, fewer than the steps need
    return [f"storage.root={storage_root}", "storage.user=ci", f"storage.run_name={run_name}",
            f"train.max_steps={max_steps}", f"train.checkpoint_every={max_steps}", "train.warmup_steps=1",
            "dataset.seq_len=128"]


def prepack_run(cluster_address: str, storage_root: str, overrides: list[str]):
    """Synthetic conversations (short enough for the demo's drop policy at 128 tokens) tokenized and packed on the
    given cluster into <run>/data/packed with the run's data hash; returns PackedData."""
    import ray

    from raytrain.config import load_job_config

    job = load_job_config(os.path.join(REPO, "configs", "demo.yaml"), overrides)
    # the packing tasks import raytrain: this driver is not a submitted job, so point its workers at the repo
    ray.init(address=cluster_address, runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "PYTHONPATH": REPO}})
    try:
        return write_packed(job, synthetic_conversations(64, uuid_prefix="ops", **SHORT),
                            enriched=os.path.join(storage_root, "enriched-input"))
    finally:
        ray.shutdown()


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
