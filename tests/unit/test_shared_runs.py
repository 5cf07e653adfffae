"""Many users on one cluster: who a run belongs to, what a job acting for someone else may do, file modes.

Real pieces throughout: the shipped cluster configs, the runner's open_run / run_sft (they refuse before Ray
starts), RunLock and CheckpointStore on a tmp dir. The environment a submitted job sees is what Ray 2.60's job
supervisor sets for the entrypoint (RAY_JOB_CONFIG_JSON_ENV_VAR with the submission's metadata, and the runtime_env's
env_vars such as RAYTRAIN_USER).
"""

import hashlib
import json
import os
import stat

import pytest

from raytrain.checkpoint.store import CheckpointStore
from raytrain.config import load_job_config
from raytrain.errors import ConfigError, RaytrainError
from raytrain.ownership import OWNER_NAME, RunOwnerError, claim, run_owner
from raytrain.runner import check_init_from_run, command_log, open_run, run_sft
from raytrain.storage import RUN_UMASK, apply_run_umask, resolve, run_root, secure_run_dir, submitting_user

SHIPPED = ("configs/mistral7b-1node-8gpu.yaml", "configs/mistral7b-2node-16gpu.yaml",
           "configs/mistral7b-1node-8gpu-corpus.yaml")


@pytest.fixture
def ray_job(monkeypatch):
    """The environment of a `ray job submit` entrypoint on a cluster whose processes run as `ray`; returns a
    function that adds what the submitter passed (runtime_env env var or metadata)."""
    for var in ("RAYTRAIN_USER", "LOGNAME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("USER", "ray")

    def submitted(env_user=None, metadata_user=None):
        metadata = {"job_submission_id": "raysubmit_abc", "job_name": "raysubmit_abc"}
        if metadata_user:
            metadata["user"] = metadata_user
        monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"runtime_env": {}, "metadata": metadata}))
        if env_user:
            monkeypatch.setenv("RAYTRAIN_USER", env_user)
        else:
            monkeypatch.delenv("RAYTRAIN_USER", raising=False)

    return submitted


@pytest.fixture(autouse=True)
def _restore_umask():
    old = os.umask(0o022)
    os.umask(old)
    yield
    os.umask(old)


def _tree_hashes(root):
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in files + dirs:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            digest = hashlib.sha256(open(path, "rb").read()).hexdigest() if stat.S_ISREG(st.st_mode) else "dir"
            out[os.path.relpath(path, root)] = (digest, st.st_mode, st.st_mtime_ns)
    return out


@pytest.mark.parametrize("config", SHIPPED)
def test_two_submitters_of_a_shipped_config_get_two_runs(config, ray_job, tmp_path):
    overrides = [f"storage.root={tmp_path}"]
    ray_job(env_user="alice")
    alice = open_run(load_job_config(config, overrides))
    ray_job(metadata_user="bob")  # `ray job submit --metadata-json '{"user": "bob"}'`
    bob = open_run(load_job_config(config, overrides))
    assert (alice.user, bob.user) == ("alice", "bob")
    assert alice.root.uri != bob.root.uri
    assert alice.root.path.startswith(str(tmp_path / "alice")) and bob.root.path.startswith(str(tmp_path / "bob"))


def test_a_submitted_job_naming_nobody_is_refused(ray_job, tmp_path):
    ray_job()
    job = load_job_config(SHIPPED[0], [f"storage.root={tmp_path}"])
    with pytest.raises(RaytrainError, match=r"raysubmit_abc names no user.*RAYTRAIN_USER.*--metadata-json"):
        open_run(job)
    assert os.listdir(tmp_path) == []


def test_the_service_account_outside_a_job_is_refused(monkeypatch):
    for var in ("RAYTRAIN_USER", "RAY_JOB_CONFIG_JSON_ENV_VAR", "LOGNAME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("USER", "ray")
    with pytest.raises(RaytrainError, match="'ray', a service account"):
        submitting_user()
    assert submitting_user("carol") == "carol"  # a name in the config is a person's
    monkeypatch.setenv("USER", "dave")
    assert submitting_user() == "dave"


def test_submitter_precedence(ray_job):
    ray_job(env_user="erin", metadata_user="frank")
    assert submitting_user("cfg") == "erin"
    ray_job(metadata_user="frank")
    assert submitting_user("cfg") == "frank"
    ray_job()
    assert submitting_user("cfg") == "cfg"
    ray_job(env_user="bad/name")
    with pytest.raises(RaytrainError, match="RAYTRAIN_USER"):
        submitting_user()


def _alices_run(tmp_path, ray_job):
    """Alice's run with a committed checkpoint and an owner record, as her first job leaves it."""
    ray_job(env_user="alice")
    job = load_job_config("configs/demo.yaml", [f"storage.root={tmp_path}", "storage.run_name=shared"])
    run = open_run(job)
    claim(run.root, run.user)
    store = CheckpointStore(run.root)
    staging = store.staging_dir(7)
    with open(os.path.join(staging, "weights.pt"), "wb") as f:
        f.write(os.urandom(4096))
    store.commit(7, {"metrics": {"loss": 1.5}})
    return run


def test_a_job_pointed_at_another_owners_run_is_refused_and_changes_nothing(ray_job, tmp_path):
    run = _alices_run(tmp_path, ray_job)
    assert run_owner(run.root) == "alice"
    before = _tree_hashes(tmp_path)
    ray_job(env_user="bob")
    job = load_job_config("configs/demo.yaml", [f"storage.root={tmp_path}", "storage.run_name=shared",
                                                "storage.user=alice"])
    for attempt in (run_sft, command_log):  # the job itself, and the CLI opening the run's log file first
        with pytest.raises(RunOwnerError) as info:
            attempt(job) if attempt is run_sft else attempt(job, "run")
        msg = str(info.value)
        assert "belongs to 'alice'" in msg and "acts for 'bob'" in msg
        assert f"storage.init_from_run={run.root.uri}" in msg
    assert _tree_hashes(tmp_path) == before


def test_a_run_from_before_owners_belongs_to_its_namespace(ray_job, tmp_path):
    legacy = run_root(resolve(str(tmp_path)), "ray", "mistral7b", "sft-1node-8gpu")
    os.makedirs(os.path.join(legacy.path, "checkpoints"))
    assert run_owner(legacy) == "ray"
    ray_job(env_user="alice")
    job = load_job_config(SHIPPED[0], [f"storage.root={tmp_path}", "storage.user=ray"])
    with pytest.raises(RunOwnerError, match="belongs to 'ray'"):
        open_run(job)
    assert not os.path.exists(os.path.join(legacy.path, OWNER_NAME))


def test_init_from_run_must_name_a_run_with_a_checkpoint(ray_job, tmp_path):
    run = _alices_run(tmp_path, ray_job)
    ray_job(env_user="bob")
    job = load_job_config("configs/demo.yaml", [f"storage.root={tmp_path}", f"storage.init_from_run={run.root.uri}"])
    check_init_from_run(job)
    assert open_run(job).root.path.startswith(str(tmp_path / "bob"))
    empty = load_job_config("configs/demo.yaml", [f"storage.root={tmp_path}",
                                                  f"storage.init_from_run={tmp_path / 'nobody' / 'p' / 'r'}"])
    with pytest.raises(ConfigError, match="storage.init_from_run=.*no committed checkpoint"):
        check_init_from_run(empty)


def test_run_folders_and_files_keep_other_users_out(tmp_path):
    """The umask every job process sets plus secure_run_dir: folders 0750, files 0640, checked with os.stat on a
    run a CheckpointStore wrote (a torch.save-style write and the store's own files); with storage.group the run
    folder carries the group and the setgid bit."""
    import grp

    os.chmod(tmp_path, 0o755)
    apply_run_umask()
    assert os.umask(RUN_UMASK) == RUN_UMASK
    run = run_root(resolve(str(tmp_path / "root")), "alice", "proj", "run1")
    run.mkdirs()
    # root may give any group: take one that is not its own, so inheriting it proves the setgid bit works
    team = next((g for g in grp.getgrall() if g.gr_gid != os.getgid()), None) if os.geteuid() == 0 else None
    team = team or grp.getgrgid(os.getgid())
    group, gid = team.gr_name, team.gr_gid
    for folder in (run.parent.parent, run.parent, run):
        secure_run_dir(folder, group)
    store = CheckpointStore(run)
    staging = store.staging_dir(3)
    with open(os.path.join(staging, "layer_00-model_states.pt"), "wb") as f:  # what DeepSpeed's torch.save does
        f.write(b"w" * 100)
    store.hash_share(3, 0, 1)
    store.commit(3, {})
    for dirpath, dirs, files in os.walk(run.path):
        for name in dirs:  # setgid is inherited by the folders below, so the group follows down the tree
            assert stat.S_IMODE(os.stat(os.path.join(dirpath, name)).st_mode) == 0o2750, name
        for name in files:
            st = os.stat(os.path.join(dirpath, name))
            assert stat.S_IMODE(st.st_mode) == 0o640 and st.st_gid == gid, name
    st = os.stat(run.path)
    assert stat.S_IMODE(st.st_mode) == 0o2750 and st.st_gid == gid
    assert stat.S_IMODE(os.stat(run.parent.parent.path).st_mode) == 0o2750
    with pytest.raises(RaytrainError, match="storage.group='no-such-group-x'"):
        secure_run_dir(run, "no-such-group-x")
