"""Static lint of cluster/Dockerfile (GPU) and cluster/Dockerfile.cpu: pins equal pyproject.toml's, Java 17,
a pinned base image, a non-root user, no secrets. Docker itself is not needed."""

import re
import shlex
from pathlib import Path

import pytest
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

CLUSTER_DIR = Path(__file__).resolve().parents[3] / "cluster"
DOCKERFILES = ["Dockerfile", "Dockerfile.cpu"]
# pip options that take a value: the token after them is not a requirement.
PIP_VALUE_OPTIONS = {"--index-url", "-i", "--extra-index-url", "-f", "--find-links", "-c", "--constraint", "-r"}


def _instructions(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs: comment lines dropped, backslash continuations joined."""
    logical, current = [], ""
    for line in (CLUSTER_DIR / name).read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        current += line.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        logical.append(current.strip())
        current = ""
    assert not current, f"{name} ends inside a line continuation"
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1] if " " in ln else "") for ln in logical]


def _env(name: str) -> dict[str, str]:
    """Every ENV key=value of the file (last one wins)."""
    env = {}
    for instr, args in _instructions(name):
        if instr == "ENV":
            for token in shlex.split(args):
                key, _, value = token.partition("=")
                env[key] = value
    return env


def _pip_installs(name: str) -> list[list[str]]:
    """The arguments of every `pip install` in RUN instructions, one list per command."""
    installs = []
    for instr, args in _instructions(name):
        if instr != "RUN":
            continue
        tokens = shlex.split(args)
        command: list[str] = []
        for token in tokens + ["&&"]:
            if token in ("&&", "||", ";"):
                if command[:2] == ["pip", "install"]:
                    installs.append(command[2:])
                command = []
            else:
                command.append(token)
    return installs


def _requirements(name: str) -> list[Requirement]:
    """Requirements named on pip command lines (options, their values and local paths skipped)."""
    reqs = []
    for args in _pip_installs(name):
        skip_next = False
        for token in args:
            if skip_next:
                skip_next = False
            elif token in PIP_VALUE_OPTIONS:
                skip_next = True
            elif token.startswith("-") or token.startswith("/") or token.startswith("."):
                continue
            else:
                try:
                    reqs.append(Requirement(token))
                except InvalidRequirement as e:  # a typo must fail the test, not drop a pin silently
                    raise AssertionError(f"{name}: unparsable pip argument {token!r}") from e
    return reqs


@pytest.mark.parametrize("name", DOCKERFILES)
def test_base_image_is_pinned_to_an_exact_tag(name):
    froms = [args for instr, args in _instructions(name) if instr == "FROM"]
    assert len(froms) == 1, froms
    image = froms[0].split()[0]
    assert "$" not in image, "the base image must not come from a build argument"
    repo, _, tag = image.rpartition(":")
    assert repo and "/" not in tag, f"{image}: no explicit tag"
    assert tag != "latest" and re.match(r"^\d+\.\d+\.\d+", tag), f"{image}: tag is not an exact version"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_java_17_installed_and_java_home_set(name):
    apt = " ".join(args for instr, args in _instructions(name) if instr == "RUN" and "apt-get install" in args)
    assert "openjdk-17-jre-headless" in apt.split()
    java_home = _env(name).get("JAVA_HOME", "")
    assert java_home.startswith("/usr/lib/jvm/") and "17" in java_home
    # The path is either Debian's own JDK directory or a link this Dockerfile creates.
    links = [args for instr, args in _instructions(name) if instr == "RUN" and "ln -s" in args]
    assert "openjdk" in java_home or any(args.rstrip().endswith(f" {java_home}") for args in links), java_home


@pytest.mark.parametrize("name", DOCKERFILES)
def test_runtime_environment(name):
    env = _env(name)
    assert env["HF_HUB_OFFLINE"] == "1"
    # docs/decisions.md: Spark's Python workers start `python3` from PATH unless PYSPARK_PYTHON says otherwise.
    assert env["PYSPARK_PYTHON"].startswith("/opt/venv/")
    assert env["PATH"].startswith("/opt/venv/bin:")


@pytest.mark.parametrize("name", DOCKERFILES)
def test_runs_as_a_non_root_user(name):
    instructions = _instructions(name)
    users = [args.strip() for instr, args in instructions if instr == "USER"]
    assert users, "no USER instruction: the image would run as root"
    final = users[-1].split(":")[0]
    assert final not in ("root", "0")
    useradd = [args for instr, args in instructions if instr == "RUN" and "useradd" in args and final in args]
    assert useradd, f"USER {final} is never created"
    uid = re.search(r"--uid (\d+)", useradd[0])
    assert uid and int(uid.group(1)) != 0


@pytest.mark.parametrize("name", DOCKERFILES + [n + ".dockerignore" for n in DOCKERFILES])
def test_no_secrets(name, secret_patterns):
    text = (CLUSTER_DIR / name).read_text()
    found = {label: p.search(text).group(0) for label, p in secret_patterns.items() if p.search(text)}
    assert not found, found


def test_secret_patterns_catch_what_they_claim(secret_patterns):
    """The lint is only as good as its patterns: each known-bad line is caught, the Dockerfile idioms are not."""
    bad = [
        "ENV AWS_ACCESS_KEY_ID=AKIAABCDEFGHIJKLMNOP",
        "ENV AWS_SECRET_ACCESS_KEY=abc123",
        "-----BEGIN RSA PRIVATE KEY-----",
        "ENV HF_TOKEN=hf_abcdefghijklmnopqrstuvwxyz0123456789",
        "ARG API_KEY=s3cr3tvalue",
    ]
    for line in bad:
        assert any(p.search(line) for p in secret_patterns.values()), line
    assert not any(p.search("ENV HF_HUB_OFFLINE=1 PIP_NO_CACHE_DIR=1") for p in secret_patterns.values())


@pytest.mark.parametrize("name", DOCKERFILES)
def test_pins_equal_pyproject(name, pyproject_requirements):
    in_docker: dict[str, list[Requirement]] = {}
    for req in _requirements(name):
        in_docker.setdefault(canonicalize_name(req.name), []).append(req)
    for key, want in pyproject_requirements.items():
        assert key in in_docker, f"{name} does not install {want}"
        for got in in_docker[key]:
            assert got.specifier == want.specifier, f"{name}: {got} but pyproject.toml has {want}"
            assert set(want.extras) <= set(got.extras), f"{name}: {got} lacks extras of {want}"
    extra = set(in_docker) - set(pyproject_requirements) - {"pip"}
    assert not extra, f"{name} installs packages pyproject.toml does not declare: {extra}"


@pytest.mark.parametrize(("name", "index_suffix"), [("Dockerfile", "/whl/cu128"), ("Dockerfile.cpu", "/whl/cpu")])
def test_torch_comes_from_the_matching_index(name, index_suffix):
    args = [a for instr, a in _instructions(name) if instr == "ARG" and a.startswith("TORCH_INDEX_URL=")]
    assert args and args[0].endswith(index_suffix)
    torch_installs = [a for a in _pip_installs(name) if "--index-url" in a]
    assert torch_installs and any(t.startswith("torch==") for t in torch_installs[0])


def test_gpu_base_image_cuda_matches_torch_build():
    """DeepSpeed JIT-compiles with the image's nvcc, whose CUDA must match torch's build (cu128 <-> 12.8)."""
    image = next(a for i, a in _instructions("Dockerfile") if i == "FROM").split()[0]
    cuda = re.match(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-.*devel", image)
    assert cuda, f"{image}: need a CUDA devel image for nvcc"
    index = next(a for i, a in _instructions("Dockerfile") if i == "ARG" and a.startswith("TORCH_INDEX_URL="))
    assert index.endswith(f"/cu{cuda.group(1)}{cuda.group(2)}")


@pytest.mark.parametrize("name", DOCKERFILES)
def test_build_context_excludes_venv_and_git(name):
    ignored = (CLUSTER_DIR / f"{name}.dockerignore").read_text().split()
    assert {".venv", ".git"} <= set(ignored)
