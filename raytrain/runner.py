"""Run the stages of a job on one Ray cluster: enrich + tokenize (Spark on Ray) -> pack (Ray Data) -> train.

`run_sft` is what `raytrain run` and `jobs/sft.py` call. Each stage skips itself when the run already holds its
output for the same settings, so running the same run name again resumes training where its checkpoint left off.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from raytrain.config import JobConfig
from raytrain.console import framework_output_captured, hook_worker_output
from raytrain.errors import ConfigError, CorruptCheckpointError, RaytrainError
from raytrain.redact import redact, redact_tree
from raytrain.storage import (
    RunPaths,
    StorageLocation,
    apply_run_umask,
    resolve,
    run_root,
    secure_run_dir,
    submitting_user,
)

if TYPE_CHECKING:
    from raytrain.runlock import Fence

log = logging.getLogger(__name__)

TRAIN_POLL_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
"""How often Ray Train's controller polls its workers: 0.5 s instead of Ray's 2 s, since it sees each change of the
worker group only at a poll (docs/decisions.md, "Ray Train polls its workers every half second"). A value in the
submitter's environment wins."""
# Environment every Ray worker needs: no hub downloads.
# RAY_TRAIN_ENABLE_PRINT_PATCH=0: Ray Train 2.60 turns a worker's print() into a root-logger record and also tees it to
# the worker's stdout, so every "[raytrain] step" line reached the driver console twice.
WORKER_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
              "RAY_TRAIN_ENABLE_PRINT_PATCH": "0", TRAIN_POLL_ENV: "0.5"}
PREEMPTION_WATCHER_ENV = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"
EMBEDDED_WORKER_ENV = {**WORKER_ENV, PREEMPTION_WATCHER_ENV: "0"}
"""WORKER_ENV on an embedded local Ray: one node that no autoscaler drains, so Ray Train's preemption watcher (an
actor of its own per launch, polling the nodes' drain state) has nothing to watch (docs/decisions.md, "No preemption
watcher on the embedded Ray"). A value in this process's environment wins."""
WORKER_SETUP_HOOK = "raytrain.storage.apply_run_umask"
"""Ray's worker_process_setup_hook: every worker (trainer, Ray Data tasks) creates run files 0640, whatever umask
the node's Ray was started with."""
# Settings (never credentials) that workers on other nodes need for s3:// and for run ownership. Ray writes a job's
# runtime_env into its logs on every node and shows it in the dashboard's job and actor APIs, so AWS_ACCESS_KEY_ID,
# AWS_SECRET_ACCESS_KEY and AWS_SESSION_TOKEN are not in this list: workers take credentials from the AWS chain of
# their own node (docs/security.md); on the embedded cluster they inherit this process's environment.
FORWARDED_ENV = ("AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE",
                 "RAYTRAIN_USER")

@dataclass(frozen=True)
class Run:
    job: JobConfig
    root: StorageLocation  # <storage.root>/<user>/<project>/<run_name>
    user: str = ""
    """The submitting user this job acts for (raytrain.storage.submitting_user): the run's owner."""
    fence: Fence | None = None
    """The run lock's token and generation while _with_run holds it: every write to the run checks it."""

    @property
    def paths(self) -> RunPaths:
        return RunPaths(self.root)

    @property
    def data_hash(self) -> str:
        """JobConfig.data_hash: settings that decide the packed sequences."""
        return self.job.data_hash()


def open_run(job: JobConfig) -> Run:
    """The run `job` names, for the user who submitted it: `<root>/<storage.user or that user>/<project>/<run>`.
    Raises RaytrainError when no submitting user can be told (a submitted job naming nobody) and RunOwnerError
    when the run belongs to someone else, before anything is written. Sets this process's umask (0750/0640)."""
    from raytrain.ownership import check_owner

    apply_run_umask()
    root = resolve(job.storage.root, s3_endpoint=job.storage.s3_endpoint or None)
    user = submitting_user(job.storage.user or None)
    location = run_root(root, job.storage.user or user, job.storage.project, job.storage.run_name)
    check_owner(location, user)
    return Run(job=job, root=location, user=user)


def connect_ray(job: JobConfig) -> bool:
    """Join the cluster (ray.address, RAY_ADDRESS, or the one `ray job submit` runs us in), else start an embedded
    local Ray with token authentication (unless RAY_AUTH_MODE says otherwise). Returns True when this call started
    Ray (so the caller shuts it down). Joining follows the cluster's RAY_AUTH_MODE and token (docs/security.md)."""
    import ray

    for k, v in WORKER_ENV.items():
        os.environ.setdefault(k, v)
    if ray.is_initialized():
        return False
    address = job.ray.address or os.environ.get("RAY_ADDRESS", "")
    runtime_env = job_runtime_env(embedded=not address)
    if framework_output_captured():
        os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")
    login = ""
    if address:
        log.info("joining Ray cluster at %s", redact(address))
        context = ray.init(address=address, runtime_env=runtime_env, log_to_driver=True)
    else:
        num_cpus = embedded_cpus(job)
        log.info("starting an embedded local Ray with %d logical CPUs", num_cpus)
        login = _embedded_auth()
        context = _init_embedded(num_cpus, runtime_env, job.ray.dashboard)
    hook_worker_output()
    global DASHBOARD_URL
    DASHBOARD_URL = _http(getattr(context, "dashboard_url", "") or "")
    if DASHBOARD_URL:
        log.info("Ray dashboard: %s%s", DASHBOARD_URL, login)
    return True


def job_runtime_env(embedded: bool = False) -> dict[str, Any]:
    """The runtime_env connect_ray gives the job, from this process's environment: WORKER_ENV (EMBEDDED_WORKER_ENV
    on an ``embedded`` local Ray), the S3 settings it was given (FORWARDED_ENV: endpoint, region, profile name; never
    keys, since Ray logs runtime_env on every node and serves it from the dashboard) and the worker setup hook that
    makes run files 0640."""
    # Inside `ray job submit` the job's own runtime_env is merged with ours, and Ray refuses a merge where both set
    # the same env var: add only the variables the job did not set.
    job_config = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}") or "{}")
    job_env = (job_config.get("runtime_env") or {}).get("env_vars") or {}
    worker_env = dict(EMBEDDED_WORKER_ENV if embedded else WORKER_ENV)
    # Workers on other nodes do not inherit this process's environment: forward the S3 settings it was given (and
    # the submitter's own Ray Train poll interval and, on the embedded Ray, preemption watcher setting, if set).
    own = (TRAIN_POLL_ENV, PREEMPTION_WATCHER_ENV) if embedded else (TRAIN_POLL_ENV,)
    worker_env.update({k: os.environ[k] for k in (*FORWARDED_ENV, *own) if os.environ.get(k)})
    runtime_env: dict[str, Any] = {"env_vars": {k: v for k, v in worker_env.items() if k not in job_env}}
    if "worker_process_setup_hook" not in (job_config.get("runtime_env") or {}):
        # every worker (trainer, Ray Data tasks) creates run files 0640: a node's own umask may be 022
        runtime_env["worker_process_setup_hook"] = WORKER_SETUP_HOOK
    if framework_output_captured():
        # Ray Data's progress bars (driver and the trainer workers' reads) would be carriage-return noise in the log
        runtime_env["env_vars"].setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")
    return runtime_env


DASHBOARD_URL = ""
"""The Ray dashboard of the cluster connect_ray joined or started ('' when it has none)."""


def _http(url: str) -> str:
    return url if not url or "://" in url else f"http://{url}"


def _embedded_auth() -> str:
    """Token authentication for the embedded Ray unless RAY_AUTH_MODE is set otherwise; returns the hint printed
    after the dashboard URL ('' without auth).

    Ray reads the token from RAY_AUTH_TOKEN, else the file RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token. When no token
    exists, one is written here with mode 0600 (Ray's own would follow the umask, often 0644: readable by every local
    user, and the token is the key to the job API). The hint names the file and `ray get-auth-token`, never the
    token: the console is copied into a log file other people may read."""
    from ray._raylet import AuthenticationTokenLoader, Config

    mode = os.environ.setdefault("RAY_AUTH_MODE", "token")  # explicit: Ray then starts without its opt-out warning
    Config.initialize("")  # the driver's cached Ray config must see the mode its raylet and GCS will read
    if mode.lower() != "token":
        log.warning("RAY_AUTH_MODE=%s: the embedded Ray's dashboard and job API accept anyone who can reach them",
                    mode)
        return ""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return " (token authentication: the token is the RAY_AUTH_TOKEN this process was started with)"
    from ray._private.authentication.authentication_token_generator import generate_new_authentication_token
    from ray._private.authentication.authentication_token_setup import _get_default_token_path

    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or str(_get_default_token_path())
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(generate_new_authentication_token())
        log.info("generated a Ray authentication token in %s (mode 0600)", path)
    except FileExistsError:
        if os.stat(path).st_mode & 0o077:
            log.warning("the Ray authentication token %s can be read by other users; fix: chmod 600 %s", path, path)
    AuthenticationTokenLoader.instance().reset_cache()
    return f" (token authentication: paste the token `ray get-auth-token` prints, from {path})"


def embedded_cpus(job: JobConfig) -> int:
    """Logical CPUs of the embedded local Ray (ray.num_cpus, else): at least 4 even on a 2-core laptop, and 2 more
    than the trainer's workers take, so the workers, Ray Data's read tasks and the Spark executors can all be
    scheduled (they mostly wait on each other, the OS shares the cores). pp 2 x dp 2 on 4 would leave the workers'
    reads waiting forever."""
    taken = math.ceil(job.train.num_workers * (job.train.worker_cpus or 1))
    return job.ray.num_cpus or max(4, os.cpu_count() or 1, taken + 2)


def _init_embedded(num_cpus: int, runtime_env: dict[str, Any], dashboard: bool) -> Any:
    """ray.init for the embedded local cluster, with its dashboard when ray.dashboard is on and Ray's dashboard
    extra (ray[default]) is installed. A dashboard that cannot start (missing extra, no free port, a crash) costs
    one line and the run goes on without it. Its State API also keeps Ray Train's placement-group cleaner quiet
    (without it that actor logs 'State API may be temporarily unavailable' every few seconds)."""
    import ray

    kwargs = {"num_cpus": num_cpus, "runtime_env": runtime_env, "log_to_driver": True}
    if dashboard:
        from ray._private.utils import get_dashboard_dependency_error

        missing = get_dashboard_dependency_error()
        if missing is None:
            try:
                return ray.init(include_dashboard=True, dashboard_host="127.0.0.1", **kwargs)
            except Exception as e:  # noqa: BLE001 - any dashboard failure: go on without it, said in one line
                log.warning("Ray dashboard could not start (%s); continuing without it", str(e).splitlines()[0])
                ray.shutdown()
        else:
            log.warning("Ray dashboard not available (%s; pip install 'ray[default]'); continuing without it",
                        missing)
    return ray.init(include_dashboard=False, **kwargs)


def _preference(job: JobConfig) -> bool:
    return job.train.objective == "dpo"


def stage_input(run: Run) -> StorageLocation:
    """The input root; 'sample' generates the shipped sample dataset inside the run (deterministic): the
    Nemotron-shaped one, or for train.objective=dpo the HelpSteer3-shaped one."""
    if run.job.input.path != "sample":
        return resolve(run.job.input.path, s3_endpoint=run.job.storage.s3_endpoint or None)
    from raytrain.sample_data import write_sample_dataset
    from raytrain.sample_data.preference import write_preference_sample

    write = write_preference_sample if _preference(run.job) else write_sample_dataset
    target = run.paths.data.join(PREFERENCE_SAMPLE) if _preference(run.job) else run.paths.sample
    if target.join("_SUCCESS").exists():
        return target
    if target.is_posix:
        write(target.path)
    else:  # object store / HDFS: write locally, then copy up
        import pyarrow.fs as pafs

        with tempfile.TemporaryDirectory() as tmp:
            write(tmp)
            pafs.copy_files(tmp, target.path, source_filesystem=pafs.LocalFileSystem(),
                            destination_filesystem=target.filesystem)
    target.join("_SUCCESS").write_atomic("")
    log.info("sample dataset written to %s", target.uri)
    return target


PREFERENCE_SAMPLE = "preference-sample"
"""The HelpSteer3-shaped sample's folder under the run's data/ (train.objective=dpo, input.path=sample)."""


def eval_set_paths(run: Run, input_root: StorageLocation) -> tuple[str, ...]:
    """enrich.eval_sets with 'sample' replaced by the sample dataset's eval set."""
    name = "preference_eval_set.jsonl" if _preference(run.job) else "eval_set.jsonl"
    return tuple(input_root.join("eval", name).uri if p == "sample" else p for p in run.job.enrich.eval_sets)


def check_init_from_run(job: JobConfig) -> None:
    """storage.init_from_run names a run with a committed checkpoint; ConfigError naming the field otherwise."""
    if not job.storage.init_from_run:
        return
    from raytrain.checkpoint.store import CheckpointStore

    source = resolve(job.storage.init_from_run, s3_endpoint=job.storage.s3_endpoint or None)
    if CheckpointStore(source, read_only=True).latest() is None:
        raise ConfigError(f"storage.init_from_run={job.storage.init_from_run!r}: no committed checkpoint under "
                          f"{source.join('checkpoints').uri}; name a run folder as `raytrain status` lists it")


def write_report(run: Run, name: str, report: dict[str, Any]) -> StorageLocation:
    """Write reports/<name> (JSON); refused (LockLostError) once another job holds the run's lock."""
    if run.fence is not None:
        from raytrain.runlock import check_fence

        check_fence(run.root, run.fence, f"write reports/{name}")
    loc = run.paths.reports.join(name)
    loc.parent.mkdirs()
    loc.write_atomic(json.dumps(redact_tree(report), indent=2, sort_keys=True, default=str))
    return loc


def run_enrich_and_pack(run: Run):
    """Enrich + tokenize/pack unless this run already holds packed sequences for the same settings."""
    from raytrain.dataset.stream import load_packed, pack_enriched
    from raytrain.enrich.job import run_enrich

    packed_loc = run.paths.packed
    packed = load_packed(packed_loc, run.data_hash)
    if packed is not None:
        return packed
    input_root = stage_input(run)
    eval_sets = eval_set_paths(run, input_root)
    if _preference(run.job):
        from raytrain.dataset.stream import pack_enriched_pairs
        from raytrain.enrich.pair_job import run_enrich_pairs

        inputs = _PLANS.pop((run.root.uri, run.job.config_hash()), None)  # preflight's, when it could find them
        result = run_enrich_pairs(run.job, input_root, run.root, eval_sets=eval_sets, inputs=inputs)
        write_report(run, "enrich_report.json", result.report)
        return pack_enriched_pairs(result.enriched, packed_loc, run.job.dataset, run.data_hash)
    plan = _PLANS.pop((run.root.uri, run.job.config_hash()), None)  # preflight's, when it could plan
    result = run_enrich(run.job, input_root, run.root, eval_sets=eval_sets, plan=plan)
    write_report(run, "enrich_report.json", result.report)
    # the eval sets' question/answer items also give the benchmark loss (raytrain.dataset.stream)
    return pack_enriched(result.enriched, packed_loc, run.job.dataset, run.data_hash,
                         eval_records=result.evals.records)


def command_log(job: JobConfig, command: str) -> str:
    """Where a command's framework output goes: ``<run>/reports/logs/<command>-<time>-<pid>.log`` on a POSIX run
    root; else a local file that finish_command_log copies up at the end. Runs the preflight first, so a bad setting
    fails before the run folder is created (and its message reaches the console)."""
    from raytrain.console import log_file_name

    run = open_run(job)
    preflight(run)
    logs = run.paths.logs
    if logs.local_path:
        return os.path.join(logs.local_path, log_file_name(command))
    return os.path.join(tempfile.gettempdir(), "raytrain-logs", log_file_name(command))


def finish_command_log(job: JobConfig, log_path: str) -> None:
    """Copy a local log of a run on an object store into its reports/logs/ (a no-op on POSIX run roots)."""
    logs = open_run(job).paths.logs
    if logs.local_path or not os.path.exists(log_path):
        return
    try:
        with open(log_path, "rb") as f:
            logs.join(os.path.basename(log_path)).write_atomic(f.read())
    except OSError as e:
        log.warning("could not copy the log %s to %s: %s", log_path, logs.uri, e)


def _with_run(job: JobConfig, body):
    """Open the run, join or start Ray, hold the run lock while `body(run)` runs, shut an embedded Ray down."""
    from raytrain.ownership import claim
    from raytrain.runlock import RunLock

    run = open_run(job)
    preflight(run)
    check_init_from_run(job)
    started_ray = connect_ray(job)
    try:
        run.root.mkdirs()
        for folder in (run.root.parent.parent, run.root.parent, run.root):  # <user>/<project>/<run>
            secure_run_dir(folder, job.storage.group)
        with RunLock(run.root, user=run.user) as lock:
            claim(run.root, run.user)
            run = dataclasses.replace(run, fence=lock.fence)
            log.info("run %s (owner %s, lock generation %d)", run.root.uri, run.user, run.fence.generation)
            write_session(run)
            result = body(run)
            lock.check("finish the job")
            return result
    finally:
        if started_ray:
            import ray

            ray.shutdown()


def write_session(run: Run) -> None:
    """reports/session.json: who runs the job, its dashboard and framework log (`raytrain status` reads it while
    the run's lock is held)."""
    import socket
    import time

    from raytrain.console import current

    write_report(run, "session.json", {"host": socket.gethostname(), "pid": os.getpid(),
                                       "started_unix_s": round(time.time(), 3), "dashboard_url": DASHBOARD_URL,
                                       "log_file": current().log_path or ""})


def _train(run: Run, packed, max_failures: int) -> dict[str, Any]:
    from raytrain.pipeline.lora import model_parameter_counts
    from raytrain.trainer.launch import train

    held_out, lora = packed.validation, run.job.model.lora
    result = train(run.job, run.root, packed, max_failures=max_failures, fence=run.fence)
    summary = {"run": run.root.uri, "checkpoints": result.checkpoint_dir, "final": result.final_metrics,
               "num_packs": packed.num_packs, "validation_packs": held_out.num_packs if held_out else 0,
               "benchmark_packs": packed.benchmark.num_packs if packed.benchmark else 0,
               "config_hash": run.job.config_hash(), "parameters": model_parameter_counts(run.job),
               "lora": dataclasses.asdict(lora) if lora.rank else None}
    summary["charts"] = write_charts(run)
    write_report(run, "run_summary.json", summary)
    return summary


def write_charts(run: Run) -> list[str]:
    """PNG charts of the run under reports/charts/ (raytrain.charts), driver side, at the end of training. A chart
    that cannot be drawn is a warning: the run's checkpoints are what matters."""
    if not run.root.local_path:
        log.info("charts: skipped, the run is on %s (they draw from local reports)", run.root.scheme)
        return []
    from raytrain.charts import write_run_charts

    try:
        return write_run_charts(run.root.local_path, run.job.dataset.seq_len)
    except Exception as e:  # noqa: BLE001 - see docstring
        log.warning("charts: not drawn (%s: %s)", type(e).__name__, e)
        return []


def run_sft(job: JobConfig, max_failures: int = 0) -> dict[str, Any]:
    """The whole chain for one run; returns a summary (also written to reports/run_summary.json)."""
    return _with_run(job, lambda run: _enrich_pack_and_train(run, max_failures))


def _enrich_pack_and_train(run: Run, max_failures: int) -> dict[str, Any]:
    """Enrich, pack, train; streamed (raytrain.streamed) when enrich.wave_rows cuts the input into several waves."""
    from raytrain.dataset.stream import load_packed

    job = run.job
    if not job.wave_rows:  # one wave (JobConfig.wave_rows: always for preference pairs)
        return _train(run, run_enrich_and_pack(run), max_failures)
    from raytrain.streamed import enrich_and_train, streamed_waves

    packed = load_packed(run.paths.packed, run.data_hash)
    if packed is not None:  # enriched and packed by an earlier launch
        return _train(run, packed, max_failures)
    from raytrain.enrich.plan import plan_enrichment

    input_root = stage_input(run)
    eval_sets = eval_set_paths(run, input_root)
    key = (run.root.uri, job.config_hash())
    plan = _PLANS.pop(key, None) or plan_enrichment(job, input_root, eval_sets)
    if streamed_waves(plan, job.wave_rows) > 1:
        return enrich_and_train(run, plan, input_root, eval_sets,
                                lambda run, packed: _train(run, packed, max_failures),
                                lambda name, report: write_report(run, name, report))
    _PLANS[key] = plan  # one wave: enriched and packed as without waves
    return _train(run, run_enrich_and_pack(run), max_failures)


def run_train(job: JobConfig, max_failures: int = 0) -> dict[str, Any]:
    """Training only, on the packed sequences an earlier enrich of this run wrote."""
    from raytrain.dataset.stream import load_packed

    def body(run: Run) -> dict[str, Any]:
        packed = load_packed(run.paths.packed, run.data_hash)
        if packed is None:
            raise RaytrainError(f"run {run.root.uri} has no packed data yet: run `raytrain enrich` "
                                "(or jobs/enrich.py) with the same config first, or `raytrain run` for both")
        return _train(run, packed, max_failures)

    return _with_run(job, body)


def run_enrich_only(job: JobConfig):
    """`raytrain enrich`: enrichment + tokenize/pack for a run, no training."""
    return _with_run(job, run_enrich_and_pack)


_PREFLIGHTED: set[tuple[str, str]] = set()
"""(run URI, config hash) pairs this process has checked: the CLI checks before opening the run's log file, the
stage then skips the second check."""


def preflight(run: Run) -> None:
    """Cheap checks before any cluster work, so a bad setting fails in seconds with a clear message: the
    cross-section rules that need the model's architecture or a file (raytrain.config's docstring), then the
    inputs."""
    key = (run.root.uri, run.job.config_hash())
    if key in _PREFLIGHTED:
        return
    _preflight(run)
    _PREFLIGHTED.add(key)


def _preflight(run: Run) -> None:
    from raytrain.enrich.spark import find_java
    from raytrain.pipeline.ds_config import derive_ds_config, load_ds_config
    from raytrain.pipeline.model import check_num_stages, model_config

    job = run.job
    derive_ds_config(load_ds_config(job.train.ds_config), job.train, ds_path=job.train.ds_config)
    model_cfg = model_config(job.model.preset, job.model.init_from)
    check_num_stages(model_cfg, job.train.pp)  # the rule build_pipeline_module applies on the workers
    if job.model.init_from and os.path.isdir(job.model.init_from):  # else the workers check it where it is mounted
        from raytrain.pipeline.hf_io import check_hf_config

        check_hf_config(job.model.init_from, model_cfg)
    _check_model_fits_tokenizer(job)
    from raytrain.dataset.stream import load_packed

    if load_packed(run.paths.packed, run.data_hash, say_reused=False) is None:
        _plan_enrichment_early(run)
        find_java()  # Spark will run: fail now, not inside RayDP, when there is no Java


_PLANS: dict[tuple[str, str], Any] = {}
"""The enrichment plan preflight made (for preference pairs: the files it found), per (run, config hash), for
run_enrich_and_pack to use instead of discovering, validating and hashing the inputs a second time."""


def _plan_enrichment_early(run: Run) -> None:
    """Layout, splits and every file's schema from the footers, the eval sets and the corpus files: seconds, before
    Ray or Spark start. What 'sample' names is written later, with the sample: only the other inputs are checked
    now, and the plan is made when the sample exists."""
    from raytrain.enrich.corpus import check_corpus
    from raytrain.enrich.inputs import discover_inputs, validate_inputs
    from raytrain.enrich.plan import plan_enrichment

    job, s3_endpoint = run.job, run.job.storage.s3_endpoint or None
    input_root = resolve(job.input.path, s3_endpoint=s3_endpoint)
    if _preference(job):
        if job.input.path != "sample":
            from raytrain.enrich.pair_inputs import discover_pair_inputs

            inputs = discover_pair_inputs(input_root)
            for line in inputs.describe():
                log.info("%s", line)
            _PLANS[(run.root.uri, job.config_hash())] = inputs
        return
    if job.input.path != "sample" and "sample" not in job.enrich.context_corpus:
        plan = plan_enrichment(job, input_root, eval_set_paths(run, input_root))
        for line in plan.inputs.describe():
            log.info("%s", line)
        footers, corpus_files = plan.footers, plan.corpus_files
        _PLANS[(run.root.uri, job.config_hash())] = plan
    else:
        footers = validate_inputs(discover_inputs(input_root, job.input.splits)) \
            if job.input.path != "sample" else None
        corpus = [c for c in job.enrich.context_corpus if c != "sample"]
        corpus_files = check_corpus(corpus, job.enrich.corpus_id_field, job.enrich.corpus_text_field,
                                    s3_endpoint=s3_endpoint) if corpus else None
    if footers:
        log.info("inputs: %s", ", ".join(f"{k} {v['rows']} rows" for k, v in footers.items()))
    if corpus_files:
        log.info("context corpus: %d file(s), %d records", len(corpus_files), sum(f.records for f in corpus_files))


def _check_model_fits_tokenizer(job: JobConfig) -> None:
    from raytrain.pipeline.model import model_config

    vocab = {"v1": 32000, "v3": 32768}[job.dataset.tokenizer]
    model_vocab = model_config(job.model.preset, job.model.init_from).vocab_size
    if model_vocab < vocab:
        raise ConfigError(f"model.preset={job.model.preset!r} has vocab {model_vocab} < {vocab} tokens of "
                            f"dataset.tokenizer={job.dataset.tokenizer!r}; pick a matching tokenizer or preset")


def export_latest(job: JobConfig, out_dir: str = "") -> str:
    """Merge the run's latest checkpoint into a Hugging Face Mistral directory; returns its path. A LoRA run also
    gets a PEFT adapter folder (raytrain.pipeline.lora.export_lora).

    Holds a lease on the step while it reads (retention keeps the step), checks every file's sha256 against the
    manifest first (CorruptCheckpointError naming the file), and on s3/hdfs downloads only the layer files it
    merges into a temp dir removed afterwards."""
    from raytrain.checkpoint.layout import step_dir_name
    from raytrain.checkpoint.store import CheckpointStore
    from raytrain.pipeline.engine import DS_TAG
    from raytrain.pipeline.hf_io import export_to_hf
    from raytrain.pipeline.lora import base_identity, check_resume_settings, export_lora
    from raytrain.pipeline.model import model_config
    from raytrain.trainer.launch import source_weights
    from raytrain.trainer.preference import started_from_layers

    run = open_run(job)
    store = CheckpointStore(run.root)
    latest = store.latest()
    if latest is None:
        raise RaytrainError(f"no committed checkpoint under {run.root.join('checkpoints').uri}; run training first")
    if not out_dir:
        exports = run.paths.exports.join(step_dir_name(latest.step))
        if not exports.is_posix:
            raise RaytrainError("exporting to an object store needs --out with a local directory")
        out_dir = exports.path
    with store.lease(latest.step, purpose="export"):
        ckpt = store.get(latest.step)  # retention may have run between latest() and the lease
        if ckpt is None:
            raise RaytrainError(f"checkpoint {latest.uri} was deleted by retention before export could hold it; "
                                "run the export again (it takes the newest checkpoint)")
        problem = store.find_problem(ckpt)
        if problem is not None:
            raise CorruptCheckpointError(
                f"export of {ckpt.uri}: {problem}; the checkpoint is corrupt. Run training again with "
                "train.on_corrupt_checkpoint=fallback to redo it from the previous good checkpoint, then export")
        layers = [rel for rel in ckpt.manifest["files"] if rel.startswith(f"{DS_TAG}/layer_")]
        lora, cfg = job.model.lora, model_config(job.model.preset, job.model.init_from)
        start = (ckpt.metadata.get("base") or {}).get("init_from_run")
        base = source_weights(job, ckpt) if start else base_identity(job) if lora.rank else {}
        check_resume_settings(ckpt.metadata.get("config") or {}, ckpt.metadata.get("base"), job, base,
                              f"checkpoint {ckpt.uri}")
        started = started_from_layers(base, job.storage.s3_endpoint or None, label="export-base") \
            if lora.rank and start else contextlib.nullcontext("")  # the adapters' base: that run's weights
        with store.local_copy(ckpt, layers, label="export") as local, started as start_dir:
            if lora.rank:
                written = export_lora(os.path.join(local, DS_TAG), cfg, lora, out_dir, seed=job.train.seed,
                                      init_from=job.model.init_from, tokenizer=job.dataset.tokenizer,
                                      base_layer_files=start_dir and os.path.join(start_dir, DS_TAG))
                log.info("export: merged model in %s, PEFT adapter in %s%s", written["merged"], written["adapter"],
                         f", its seeded base in {written['base']}" if "base" in written else "")
            else:
                export_to_hf(os.path.join(local, DS_TAG), cfg, out_dir, tokenizer=job.dataset.tokenizer)
    return out_dir
