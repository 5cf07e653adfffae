"""Integration tests start real Ray (in-process local cluster, one per module), real Spark via RayDP, real
DeepSpeed engines in Ray Train workers. They are slower: run them alone with `pytest tests/integration`."""

import os

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # test_console_run / test_s3_run turn token auth on
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pytest_collection_modifyitems(items):
    for item in items:
        if "/integration/" in str(item.fspath):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="module")
def ray_local():
    """One embedded Ray per test module (4 logical CPUs: trainer workers + Ray Data + a Spark executor)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    from raytrain.runner import EMBEDDED_WORKER_ENV, WORKER_SETUP_HOOK

    ray.init(num_cpus=4, include_dashboard=False,
             runtime_env={"env_vars": dict(EMBEDDED_WORKER_ENV), "worker_process_setup_hook": WORKER_SETUP_HOOK})
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def ray_six_cpus():
    """One embedded Ray per test module with 6 logical CPUs: pp 2 x dp 2 trainer workers take four, and their
    Ray Data reads need CPUs of their own beside them."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    from raytrain.runner import EMBEDDED_WORKER_ENV

    ray.init(num_cpus=6, include_dashboard=False, runtime_env={"env_vars": dict(EMBEDDED_WORKER_ENV)})
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory):
    """The quick start's run (tests/demo_run.py), once per session: its console for test_console_run, its enriched
    and packed sample for the modules that would otherwise enrich the same sample again. Under pytest-xdist the
    first worker that asks runs it, in the folder all workers share, while the others wait on a file lock and then
    read its record."""
    from demo_run import DemoRun, run_demo
    from filelock import FileLock

    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return run_demo(str(tmp_path_factory.mktemp("demo-runs")))
    shared = tmp_path_factory.getbasetemp().parent / "demo-runs"  # this session's folder above each worker's own
    with FileLock(f"{shared}.lock"):
        record = shared / "demo_run.json"
        if record.exists():
            return DemoRun.load(str(record))
        shared.mkdir(exist_ok=True)
        demo = run_demo(str(shared))
        demo.save(str(record))
        return demo


@pytest.fixture(scope="session")
def demo_data(demo_run):
    """The shared run, for a module that reads its data: setup fails (with the console's tail) when it failed."""
    out = demo_run.process
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    return demo_run
