import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
# shared test helpers (tests/loopback_s3.py) importable from any test folder
TESTS = os.path.dirname(os.path.abspath(__file__))
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

# Nothing in the test suite may reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Most tests start Ray without Ray's token auth (no token file under ~/.ray); the quick-start run
# (integration/test_console_run.py) and the S3 run (integration/test_s3_run.py) run with it on.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


MODULE_SECONDS = {
    "test_streamed.py": 400, "test_enrich_spark.py": 340, "test_console_run.py": 300, "test_storage_forms.py": 250,
    "test_dpo_run.py": 250, "test_sft_e2e.py": 225, "test_s3_run.py": 205, "test_topologies.py": 205,
    "test_lora.py": 190, "test_faults.py": 175, "test_bench_pipeline.py": 155, "test_autoscaling.py": 125,
    "test_ops_cluster.py": 95, "test_export.py": 45,
}
"""Seconds each integration module took on one worker of a whole run on the 2-core development machine
(2026-12-07, `.ci/run` on a fresh clone, from its junit report; test_streamed and test_enrich_spark estimated from
runs of the module alone after they were cut to fewer steps and waves); a module not listed counts as 0."""


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """The order in which pytest-xdist hands out the modules (`-n 2 --dist loadfile --no-loadscope-reorder`,
    pyproject's addopts: a module runs whole on one worker, so its module-scoped Ray and Spark start once; a worker
    takes the next module when it is almost done with its own). Integration modules come first: the first one that
    needs the shared demo run (tests/demo_run.py) at the head so that run starts at once, then the longest module
    that does not read it (the other worker's while the demo runs), then the rest the longest first
    (``MODULE_SECONDS``): a long module started last would leave the other worker idle at the end. The unit modules
    fill the workers' ends."""
    def module(item) -> str:
        return os.path.relpath(str(item.fspath), ROOT)

    def needs_demo(item) -> bool:
        return "demo_run" in getattr(item, "fixturenames", ())

    demo_modules = list(dict.fromkeys(module(i) for i in items if needs_demo(i)))  # in collection order
    integration = [m for m in dict.fromkeys(module(i) for i in items) if "/integration/" in f"/{m}"]

    def seconds(m: str) -> int:
        return MODULE_SECONDS.get(os.path.basename(m), 0)

    # the longest module that does not read the demo run keeps the other worker busy while that run goes on
    cover = max((m for m in integration if m not in demo_modules), key=seconds, default=None)

    def rank(item) -> tuple[int, int]:
        m = module(item)
        if m not in integration:
            return 3, 0
        if demo_modules and m == demo_modules[0]:
            return 0, 0
        return (1 if m == cover else 2), -seconds(m)

    items.sort(key=rank)  # stable: the order within a rank (and within a module) is the collection's
