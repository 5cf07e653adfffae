"""The runtime_env a job gives Ray: on a cluster, workers do not inherit the driver's environment, so the S3 endpoint
and region travel in it; the keys never do (Ray logs runtime_env on every node and serves it from the dashboard;
workers take keys from their own node's AWS chain). The real cluster's logs, dashboard and `ps` are searched for the
keys in tests/integration/test_s3_run.py."""

import json
import secrets

from raytrain.runner import TRAIN_POLL_ENV, WORKER_ENV, WORKER_SETUP_HOOK, job_runtime_env

CANARY = {"AWS_ACCESS_KEY_ID": f"AKIACANARY{secrets.token_hex(5).upper()}",
          "AWS_SECRET_ACCESS_KEY": f"canary-secret-{secrets.token_hex(12)}",
          "AWS_SESSION_TOKEN": f"canary-session-{secrets.token_hex(12)}"}


def test_s3_settings_travel_but_no_credentials(monkeypatch):
    for k, v in CANARY.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9")
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    runtime_env = job_runtime_env()
    env_vars = runtime_env["env_vars"]
    assert {k: env_vars.get(k) for k in ("AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL_S3")} == {
        "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL_S3": "http://127.0.0.1:9"}
    assert not set(CANARY) & set(env_vars)
    assert not [v for v in CANARY.values() if v in json.dumps(runtime_env)]
    assert runtime_env["worker_process_setup_hook"] == WORKER_SETUP_HOOK


def test_inside_ray_job_submit_the_jobs_own_settings_win(monkeypatch):
    """Ray refuses to merge two runtime_envs that set the same variable: what `ray job submit` set is left out."""
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9")
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"runtime_env": {
        "env_vars": {"AWS_ENDPOINT_URL_S3": "http://s3.internal"}, "worker_process_setup_hook": "mine.hook"}}))
    runtime_env = job_runtime_env()
    assert "AWS_ENDPOINT_URL_S3" not in runtime_env["env_vars"]
    assert "worker_process_setup_hook" not in runtime_env


def test_the_embedded_ray_leaves_cpus_beside_the_trainers_workers(monkeypatch):
    """pp 2 x dp 2 takes 4 logical CPUs: the embedded Ray gets 2 more for the workers' Ray Data reads (with 4 in
    all they waited forever); ray.num_cpus, when set, is taken as it is."""
    import os

    from raytrain.config import load_job_config
    from raytrain.runner import embedded_cpus

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert embedded_cpus(load_job_config("configs/demo.yaml", [])) == 4
    assert embedded_cpus(load_job_config("configs/demo.yaml", ["train.pp=2", "train.dp=2"])) == 6
    assert embedded_cpus(load_job_config("configs/demo.yaml", ["train.pp=2", "train.worker_cpus=1.5"])) == 5
    assert embedded_cpus(load_job_config("configs/demo.yaml", ["train.pp=2", "train.dp=2", "ray.num_cpus=3"])) == 3


def test_ray_train_polls_every_half_second_unless_the_submitter_says_otherwise(monkeypatch):
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    monkeypatch.delenv(TRAIN_POLL_ENV, raising=False)
    assert job_runtime_env()["env_vars"][TRAIN_POLL_ENV] == WORKER_ENV[TRAIN_POLL_ENV] == "0.5"
    monkeypatch.setenv(TRAIN_POLL_ENV, "5")
    assert job_runtime_env()["env_vars"][TRAIN_POLL_ENV] == "5"


def _embedded_runtime_env(monkeypatch) -> dict:
    """The runtime_env connect_ray starts an embedded Ray with (Ray itself not started)."""
    import types

    from raytrain import runner
    from raytrain.config import load_job_config

    seen = {}

    def init(num_cpus, runtime_env, dashboard):
        seen.update(runtime_env)
        return types.SimpleNamespace(dashboard_url="")

    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(runner, "_init_embedded", init)
    monkeypatch.setattr(runner, "_embedded_auth", lambda: "")
    monkeypatch.setattr(runner, "hook_worker_output", lambda: None)
    for k in WORKER_ENV:  # connect_ray sets them in this process: restored afterwards
        monkeypatch.setenv(k, WORKER_ENV[k])
    monkeypatch.setenv("RAY_DATA_DISABLE_PROGRESS_BARS", "1")
    assert runner.connect_ray(load_job_config("configs/demo.yaml", [])) is True
    return seen


def test_no_preemption_watcher_on_the_embedded_ray_unless_the_environment_says_so(monkeypatch):
    from raytrain.runner import PREEMPTION_WATCHER_ENV

    monkeypatch.setenv(PREEMPTION_WATCHER_ENV, "0")
    monkeypatch.delenv(PREEMPTION_WATCHER_ENV)
    assert _embedded_runtime_env(monkeypatch)["env_vars"][PREEMPTION_WATCHER_ENV] == "0"
    assert PREEMPTION_WATCHER_ENV not in job_runtime_env()["env_vars"]  # a cluster's job keeps Ray's default
    monkeypatch.setenv(PREEMPTION_WATCHER_ENV, "1")
    assert _embedded_runtime_env(monkeypatch)["env_vars"][PREEMPTION_WATCHER_ENV] == "1"
