"""House rules that a test can check: lint clean, and each heavy framework imported from one stage only."""

import ast
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

# framework -> the package paths allowed to import it (one package imports each framework)
ALLOWED = {
    "raydp": ("raytrain/enrich/",),
    "pyspark": ("raytrain/enrich/",),
    "deepspeed": ("raytrain/pipeline/",),
    "ray.train": ("raytrain/trainer/",),
}


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_heavy_frameworks_are_imported_from_one_stage_only():
    offenders = []
    for path in sorted((ROOT / "raytrain").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for name in _imports(path):
            for framework, allowed in ALLOWED.items():
                if (name == framework or name.startswith(framework + ".")) and not rel.startswith(allowed):
                    offenders.append(f"{rel} imports {name}")
    assert offenders == []


def test_ruff_is_clean():
    ruff = shutil.which("ruff") or str(pathlib.Path(sys.executable).parent / "ruff")
    if not pathlib.Path(ruff).exists():
        pytest.skip("ruff not installed (pip install -e '.[test]' brings it)")
    out = subprocess.run([ruff, "check", "raytrain", "jobs", "tests", "benchmarks"], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_public_surface_is_the_entry_points_and_imports_nothing_heavy():
    code = ("import sys, raytrain\n"
            "assert not {'pyarrow', 'ray', 'torch', 'yaml'} & set(sys.modules), sorted(sys.modules)\n"
            "from raytrain import runner, config\n"
            "assert raytrain.run_sft is runner.run_sft and raytrain.run_enrich_only is runner.run_enrich_only\n"
            "assert raytrain.run_train is runner.run_train and raytrain.export_latest is runner.export_latest\n"
            "assert raytrain.load_job_config is config.load_job_config\n"
            "assert all(hasattr(raytrain, name) for name in raytrain.__all__)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_nothing_cites_a_file_the_repo_does_not_hold():
    """A user who clones the repo has only the repo: docs it points to must be in it."""
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    held = set(listed)
    offenders = []
    for rel in listed:
        path = ROOT / rel
        if not path.is_file() or path.suffix in {".parquet", ".png", ".gz"} or rel == "tests/unit/test_house_rules.py":
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        for name in ("FACTS.md", "STYLE.md", "../shared/"):
            if name in text:
                offenders.append(f"{rel} cites {name}")
        offenders += [f"{rel} cites {doc}" for doc in _cited_docs(text) if doc not in held]
    assert not offenders, "\n".join(offenders)


def _cited_docs(text: str) -> set[str]:
    """Repo-relative Markdown paths a file names: docs/x.md, cluster/README.md, benchmarks/RESULTS.md."""
    import re

    return set(re.findall(r"\b((?:docs|cluster|benchmarks)/[A-Za-z0-9_./-]+\.md)\b", text))
