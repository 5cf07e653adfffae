"""Shared inputs of the ops tests: the files under cluster/ and pyproject.toml's dependency pins."""

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO_ROOT = Path(__file__).resolve().parents[3]
CLUSTER_DIR = REPO_ROOT / "cluster"

# Shapes of credentials that must never sit in an image or a cluster file. Placeholders and environment variable
# *names* without a value are fine; these match values.
SECRET_PATTERNS = {
    "AWS access key id": re.compile(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b"),
    "AWS secret assignment": re.compile(r"AWS_SECRET_ACCESS_KEY\s*[=:]\s*\S+", re.IGNORECASE),
    "AWS session token assignment": re.compile(r"AWS_SESSION_TOKEN\s*[=:]\s*\S+", re.IGNORECASE),
    "private key block": re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
    "Hugging Face token": re.compile(r"\bhf_[A-Za-z0-9]{30,}\b"),
    "HF token assignment": re.compile(r"\b(HF_TOKEN|HUGGING_FACE_HUB_TOKEN)\s*[=:]\s*\S+"),
    "GitHub token": re.compile(r"\bgh[pousr]_[A-Za-z0-9]{36,}\b"),
    "GCP service account key": re.compile(r'"private_key_id"\s*:'),
    "password assignment": re.compile(r"\b(PASSWORD|PASSWD|SECRET|API_KEY|TOKEN)\s*[=:]\s*['\"]?[^\s'\"$]{4,}"),
}


@pytest.fixture(scope="session")
def repo_root() -> Path:
    """The repository root (holds pyproject.toml and cluster/)."""
    return REPO_ROOT


@pytest.fixture(scope="session")
def secret_patterns() -> dict[str, re.Pattern]:
    """Credential shapes, by a name the failure message shows."""
    return SECRET_PATTERNS


@pytest.fixture(scope="session")
def pyproject_requirements() -> dict[str, Requirement]:
    """pyproject.toml's [project].dependencies and its `tracking` extra (the cluster images can log to MLflow /
    W&B), keyed by canonical distribution name."""
    data = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    reqs = [Requirement(line) for line in [*data["project"]["dependencies"],
                                           *data["project"]["optional-dependencies"]["tracking"]]]
    return {canonicalize_name(r.name): r for r in reqs}
