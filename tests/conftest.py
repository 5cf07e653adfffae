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


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """The order in which pytest-xdist hands out the modules (`-n 2 --dist loadfile --no-loadscope-reorder`,
    pyproject's addopts: a module runs whole on one worker, so its module-scoped Ray and Spark start once).
    Integration modules come first, the first one that needs the shared demo run (tests/demo_run.py) at the head so
    that run starts at once, the other modules that read it after those that do not; the unit modules fill the
    workers' ends."""
    def module(item) -> str:
        return os.path.relpath(str(item.fspath), ROOT)

    def needs_demo(item) -> bool:
        return "demo_run" in getattr(item, "fixturenames", ())

    demo_modules = list(dict.fromkeys(module(i) for i in items if needs_demo(i)))  # in collection order

    def rank(item) -> int:
        m = module(item)
        if "/integration/" not in f"/{m}":
            return 3
        if m in demo_modules:
            return 0 if m == demo_modules[0] else 2
        return 1

    items.sort(key=rank)  # stable: the order within a rank (and within a module) is the collection's
