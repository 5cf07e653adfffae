"""House rules that a test can check: lint clean, each heavy framework imported from one stage only, test helpers
shared through helper modules, integration tests in tests/integration."""

import ast
import pathlib
import posixpath
import re
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
    held_names = {posixpath.basename(rel) for rel in listed}
    offenders = []
    for rel in listed:
        path = ROOT / rel
        if not path.is_file() or path.suffix in {".parquet", ".png", ".gz"}:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        offenders += [f"{rel} cites {doc}" for doc in _cited_docs(text) if doc not in held]
        # a Markdown file by name alone (a notebook page), and any path that climbs out of the clone
        offenders += [f"{rel} cites {name}" for name in set(re.findall(r"\b[A-Z][A-Za-z_-]*\.md\b", text))
                      if name not in held_names]
        offenders += [f"{rel} cites {up}" for up in set(re.findall(r"(?<![\w.])\.\./[A-Za-z][\w-]*/", text))]
    assert not offenders, "\n".join(offenders)


def _cited_docs(text: str) -> set[str]:
    """Repo-relative Markdown paths a file names: docs/<page>.md, cluster/README.md, benchmarks/RESULTS.md."""
    return set(re.findall(r"\b((?:docs|cluster|benchmarks)/[A-Za-z0-9_./-]+\.md)\b", text))


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _raytrain_imports(path: pathlib.Path, modules: set[str]) -> set[str]:
    """raytrain modules `path` imports anywhere (top level or inside functions), `from x import y` resolved to the
    module x.y when that is a module."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module in modules:
            subs = {f"{node.module}.{a.name}" for a in node.names} & modules
            found.update(subs or {node.module})
    return found


def test_no_import_cycle_between_raytrain_modules():
    """Each module's imports (including those inside functions) point one way: no module needs one that needs it."""
    paths = {_module_name(p): p for p in (ROOT / "raytrain").rglob("*.py")}
    graph = {m: _raytrain_imports(p, set(paths)) - {m} for m, p in paths.items()}
    cycles = []
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if n.startswith(m + ".") or m.startswith(n + "."):
                continue  # a package and its own modules (__init__ re-exports) are one unit
            if state.get(n) == 1:
                cycles.append(" -> ".join(stack[stack.index(n):] + [n]))
            elif n not in state:
                visit(n, stack + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "\n".join(cycles)


def test_no_test_module_imports_another_and_unit_holds_no_integration_test():
    """A test module imports no other test module (that imports its tests a second time, under another name): shared
    helpers live in tests/*.py helper modules or conftest fixtures. And nothing under tests/unit carries the
    integration mark: tests that start Ray, Spark or several processes live in tests/integration."""
    offenders = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or "", *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                names = []
            offenders += [f"{rel} imports {n}" for n in names if n.rsplit(".", 1)[-1].startswith("test_")]
            if (rel.startswith("tests/unit/") and isinstance(node, ast.Attribute) and node.attr == "integration"
                    and isinstance(node.value, ast.Attribute) and node.value.attr == "mark"):
                offenders.append(f"{rel}:{node.lineno} marks a test integration")
    assert not offenders, "\n".join(offenders)
