"""How the Spark driver JVM is launched: never with Python code between fork and exec (spark._popen_without_preexec_fn).
The real launch is checked in tests/integration/test_storage_forms.py (the JVM leads a session of its own)."""

import os
import subprocess
import sys

from raytrain.enrich.spark import _gateway_launch_without_preexec_fn, _popen_without_preexec_fn

_SID = [sys.executable, "-c", "import os; print(os.getpid(), os.getsid(0))"]


def test_preexec_fn_becomes_a_new_session():
    ran = []
    proc = _popen_without_preexec_fn(_SID, stdout=subprocess.PIPE, text=True, preexec_fn=lambda: ran.append(1))
    pid, sid = map(int, proc.communicate(timeout=60)[0].split())
    assert proc.returncode == 0 and not ran
    assert sid == pid != os.getsid(0)  # the child leads its own session, so a terminal's Ctrl-C does not reach it


def test_without_preexec_fn_nothing_changes():
    proc = _popen_without_preexec_fn(_SID, stdout=subprocess.PIPE, text=True)
    pid, sid = map(int, proc.communicate(timeout=60)[0].split())
    assert sid == os.getsid(0) != pid


def test_patch_is_scoped_to_the_launch():
    from pyspark import java_gateway
    from raydp.spark import ray_cluster, ray_cluster_master

    original, master = java_gateway.Popen, ray_cluster.RayDPSparkMaster
    with _gateway_launch_without_preexec_fn():
        assert java_gateway.Popen is _popen_without_preexec_fn
        assert ray_cluster.RayDPSparkMaster is not master
    assert java_gateway.Popen is original is subprocess.Popen
    assert ray_cluster.RayDPSparkMaster is master is ray_cluster_master.RayDPSparkMaster


def test_jvm_options_reach_every_spark_jvm_and_decide_no_data():
    """enrich.jvm_options follow the --add-opens Spark needs in the driver's, the app master's and the executors'
    options; they change no row, so not the data hash (a run's enriched data stays valid)."""
    from raytrain.config import load_job_config
    from raytrain.enrich.spark import JAVA_OPTIONS, spark_configs

    quick = load_job_config("configs/demo.yaml")
    assert quick.enrich.jvm_options == "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
    plain = load_job_config("configs/demo.yaml", ["enrich.jvm_options="])
    for key in ("spark.driver.extraJavaOptions", "spark.ray.raydp_app_master.extraJavaOptions",
                "spark.executor.extraJavaOptions"):
        assert spark_configs(quick.enrich)[key] == f"{JAVA_OPTIONS} -XX:TieredStopAtLevel=1 -XX:+UseSerialGC", key
        assert spark_configs(plain.enrich)[key] == JAVA_OPTIONS, key
    assert quick.data_hash() == plain.data_hash()
