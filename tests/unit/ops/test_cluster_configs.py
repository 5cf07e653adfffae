"""Cluster launcher YAMLs against Ray's own schema and config preparation (offline), plus raytrain's rules."""

import copy
import json
import os
import re
import socket
import tomllib
from pathlib import Path

import jsonschema
import pytest
import ray.autoscaler
import yaml
from packaging.utils import canonicalize_name
from ray.autoscaler._private.docker import validate_docker_config
from ray.autoscaler._private.fake_multi_node.node_provider import FAKE_HEAD_NODE_TYPE
from ray.autoscaler._private.util import (
    fill_node_type_min_max_workers,
    merge_setup_commands,
    prepare_config,
    validate_config,
)

CLUSTER_DIR = Path(__file__).resolve().parents[3] / "cluster"
CLOUD_CONFIGS = ["aws-gpu.yaml", "gcp-gpu.yaml"]
FAKE_CONFIG = "local-fake-multinode.yaml"
ALL_CONFIGS = CLOUD_CONFIGS + [FAKE_CONFIG]
PLACEHOLDER = re.compile(r"REPLACE_ME_[A-Z0-9_]*[A-Z0-9]")


def _load(name: str) -> dict:
    """Parse cluster/<name> the way Ray's CLI does (yaml.safe_load)."""
    return yaml.safe_load((CLUSTER_DIR / name).read_text())


def _worker_types(config: dict) -> dict[str, dict]:
    return {k: v for k, v in config["available_node_types"].items() if k != config["head_node_type"]}


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """No cloud credentials and no network: any connect() fails the test instead of reaching a cloud API."""
    for var in list(os.environ):
        if var.startswith(("AWS_", "GOOGLE_", "CLOUDSDK_", "GCLOUD_")):
            monkeypatch.delenv(var)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "no-gcloud"))

    def refuse(self, address):
        raise AssertionError(f"network access attempted: {address}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)


@pytest.mark.parametrize("name", ALL_CONFIGS)
def test_config_matches_rays_json_schema(name):
    schema_path = Path(ray.autoscaler.__file__).parent / "ray-schema.json"
    schema = json.loads(schema_path.read_text())
    jsonschema.validate(_load(name), schema)


@pytest.mark.parametrize("name", CLOUD_CONFIGS)
def test_cloud_config_survives_rays_prepare_config_offline(name, offline):
    raw = _load(name)
    prepared = prepare_config(copy.deepcopy(raw))
    validate_config(prepared)  # what `ray up` runs after filling defaults
    # Ray's provider defaults were merged in without replacing our choices.
    for key in ("provider", "docker", "head_node_type", "initialization_commands", "max_workers"):
        assert prepared[key] == raw[key], key
    for node_type, node in raw["available_node_types"].items():
        assert prepared["available_node_types"][node_type]["node_config"] == node["node_config"], node_type
        assert prepared["available_node_types"][node_type]["resources"] == node["resources"], node_type
    assert prepared["available_node_types"][raw["head_node_type"]]["max_workers"] == 0
    assert prepared["worker_setup_commands"] == raw["setup_commands"] + raw["worker_setup_commands"]


def test_fake_config_is_complete_without_provider_defaults():
    """The 2.60.0 wheel lacks fake_multi_node/example.yaml, so prepare_config cannot fill defaults for this provider
    (the autoscaler started by `ray start --autoscaling-config` reads the file as is). Run the rest of prepare_config's
    steps, then check every top-level key of Ray's own AWS defaults is present."""
    raw = _load(FAKE_CONFIG)
    assert raw["provider"]["type"] == "fake_multinode"
    config = copy.deepcopy(raw)
    merge_setup_commands(config)
    validate_docker_config(config)
    fill_node_type_min_max_workers(config)
    validate_config(config)
    aws_defaults = yaml.safe_load((Path(ray.autoscaler.__file__).parent / "aws" / "defaults.yaml").read_text())
    assert set(aws_defaults) <= set(raw), set(aws_defaults) - set(raw)


def test_fake_config_head_type_is_the_one_the_fake_provider_hardcodes():
    assert _load(FAKE_CONFIG)["head_node_type"] == FAKE_HEAD_NODE_TYPE


def test_fake_config_is_cpu_only_small_and_uses_custom_resources():
    config = _load(FAKE_CONFIG)
    for name, node in config["available_node_types"].items():
        assert node["resources"].get("GPU", 0) == 0, name
    workers = _worker_types(config)
    assert workers and config["max_workers"] <= 4
    for name, node in workers.items():
        custom = set(node["resources"]) - {"CPU", "GPU", "memory", "object_store_memory"}
        assert custom, f"{name} has no custom resource to demand"
        assert node["min_workers"] == 0, f"{name}: the demo shows scale-up from zero"


def test_fake_config_custom_resources_exist_on_the_cloud_clusters():
    """A job pinned by custom resource on the fake cluster must find the same names on AWS and GCP."""
    fake = {r for n in _worker_types(_load(FAKE_CONFIG)).values() for r in n["resources"]} - {"CPU"}
    for name in CLOUD_CONFIGS:
        cloud = {r for n in _worker_types(_load(name)).values() for r in n["resources"]}
        assert fake <= cloud, (name, fake - cloud)


@pytest.mark.parametrize("name", ALL_CONFIGS)
def test_min_workers_within_max_workers(name):
    config = _load(name)
    workers = _worker_types(config)
    for node_type, node in workers.items():
        assert 0 <= node["min_workers"] <= node["max_workers"] <= config["max_workers"], node_type
    assert sum(n["min_workers"] for n in workers.values()) <= config["max_workers"]
    assert config["available_node_types"][config["head_node_type"]].get("max_workers", 0) == 0


@pytest.mark.parametrize("name", CLOUD_CONFIGS)
def test_gpu_workers_scale_from_zero_and_head_takes_no_tasks(name):
    config = _load(name)
    gpu_types = [n for n in _worker_types(config).values() if n["resources"].get("GPU", 0) > 0]
    cpu_types = [n for n in _worker_types(config).values() if n["resources"].get("GPU", 0) == 0]
    assert len(gpu_types) == 1 and gpu_types[0]["resources"]["GPU"] == 8
    assert cpu_types, "a CPU worker type for Spark enrichment"
    assert all(n["min_workers"] == 0 for n in gpu_types)
    assert config["available_node_types"][config["head_node_type"]]["resources"] == {"CPU": 0}
    assert "--dashboard-port=8265" in " ".join(config["head_start_ray_commands"])


def _effective_init_commands(config: dict, node_type: str) -> list[str]:
    """Mirror of Ray's node-type override rule: a worker type's own list replaces the global one; the head always
    runs the global list (commands.get_or_create_head_node)."""
    if node_type == config["head_node_type"]:
        return config["initialization_commands"]
    return config["available_node_types"][node_type].get("initialization_commands", config["initialization_commands"])


def _effective_docker_run_options(config: dict, node_type: str) -> list[str]:
    """Mirror of Ray's DockerCommandRunner: run_options plus head_/worker_run_options, node-type docker overriding."""
    docker = dict(config["docker"])
    is_head = node_type == config["head_node_type"]
    if not is_head:
        docker.update(config["available_node_types"][node_type].get("docker", {}))
    return docker.get("run_options", []) + docker.get("head_run_options" if is_head else "worker_run_options", [])


@pytest.mark.parametrize("name", CLOUD_CONFIGS)
def test_every_node_mounts_the_shared_path_on_host_and_in_container(name):
    config = _load(name)
    shared = config["metadata"]["raytrain"]["shared_mount"]
    assert shared == "/mnt/shared"
    mount = re.compile(rf"\bmount -t (lustre|nfs)\b.*\s{re.escape(shared)};")
    for node_type in config["available_node_types"]:
        init = " ".join(_effective_init_commands(config, node_type))
        assert mount.search(init), f"{node_type}: no host mount of {shared}"
        assert f"mountpoint -q {shared} ||" in init, f"{node_type}: mount is not idempotent"
        assert f"-v {shared}:{shared}" in _effective_docker_run_options(config, node_type), node_type


def test_fake_config_shared_dir_is_absolute():
    shared = _load(FAKE_CONFIG)["metadata"]["raytrain"]["shared_mount"]
    assert Path(shared).is_absolute() and shared != "/"


def test_placeholders_in_configs_are_the_ones_the_readme_documents():
    in_configs = set()
    for name in ALL_CONFIGS:
        in_configs |= set(PLACEHOLDER.findall((CLUSTER_DIR / name).read_text()))
    documented = set(PLACEHOLDER.findall((CLUSTER_DIR / "README.md").read_text()))
    assert in_configs, "the cloud configs carry placeholders"
    assert in_configs == documented, {"undocumented": in_configs - documented, "stale": documented - in_configs}


@pytest.mark.parametrize("name", CLOUD_CONFIGS)
def test_setup_command_checks_the_ray_version_pyproject_pins(name, pyproject_requirements):
    setup = " ".join(_load(name)["setup_commands"])
    (checked,) = re.findall(r"ray\.__version__ == '([^']+)'", setup)
    ray_req = pyproject_requirements[canonicalize_name("ray")]
    assert str(ray_req.specifier) == f"=={checked}"


@pytest.mark.parametrize("name", CLOUD_CONFIGS)
def test_cloud_image_tag_matches_project_version(name, repo_root):
    version = tomllib.loads((repo_root / "pyproject.toml").read_text())["project"]["version"]
    assert _load(name)["docker"]["image"].endswith(f"/raytrain:{version}-gpu")


def _ray_start_commands(config: dict) -> list[str]:
    return [c for key in ("head_start_ray_commands", "worker_start_ray_commands") for c in config[key]
            if "ray start" in c]


@pytest.mark.parametrize("name", CLOUD_CONFIGS)
def test_every_node_runs_ray_with_token_auth(name, offline):
    """RAY_AUTH_MODE=token for every `ray start` and every process in every node's container (job drivers and the
    `ray` CLI included); the token goes to every node by file_mounts, and a node without it fails its setup."""
    config = _load(name)
    starts = _ray_start_commands(config)
    assert len(starts) == 2
    for command in starts:
        assert re.search(r"(^|;\s*)RAY_AUTH_MODE=token ray start ", command), command
    for node_type in config["available_node_types"]:
        assert "--env RAY_AUTH_MODE=token" in _effective_docker_run_options(config, node_type), node_type
    assert config["file_mounts"] == {"~/.ray/auth_token": "~/.ray/auth_token"}
    prepared = prepare_config(copy.deepcopy(config))  # what `ray up` syncs and runs on each node
    assert prepared["file_mounts"] == config["file_mounts"]
    for key in ("head_setup_commands", "worker_setup_commands"):
        assert "test -s ~/.ray/auth_token && chmod 600 ~/.ray/auth_token" in prepared[key], key


@pytest.mark.parametrize("name", CLOUD_CONFIGS)
def test_dashboard_listens_on_the_heads_private_address_only(name):
    """Never 0.0.0.0 (GCP nodes have public addresses); the shell expression picks a private address, checked by
    running it here."""
    import ipaddress
    import subprocess

    config = _load(name)
    text = "\n".join(_ray_start_commands(config))
    assert "0.0.0.0" not in text
    head = " ".join(config["head_start_ray_commands"])
    [host] = re.findall(r"--dashboard-host=(\$\(.*?\)) ", head)
    assert host == "$(hostname -I | awk '{print $1}')"
    assert "--dashboard-host" not in " ".join(config["worker_start_ray_commands"])
    address = subprocess.run(["bash", "-c", f"echo {host}"], capture_output=True, text=True).stdout.strip()
    if address:  # a sandbox without a network interface prints nothing
        ip = ipaddress.ip_address(address)
        assert not ip.is_unspecified and not ip.is_loopback and ip.is_private, address


def test_fake_cluster_start_command_documents_token_auth():
    """The fake cluster's head is started by the command in its header (no start commands in the file)."""
    header = (CLUSTER_DIR / FAKE_CONFIG).read_text().split("\ncluster_name:")[0]
    assert re.search(r"RAY_AUTH_MODE=token RAY_FAKE_CLUSTER=1 ray start --head .*--dashboard-host=127\.0\.0\.1", header)
    assert "ray get-auth-token --generate" in header
