"""failures.user_error: the RaytrainError a worker raised, found inside Ray Train's WorkerGroupError, whatever wraps it.
Uses Ray's own exception classes (no cluster)."""

import pytest
from fresh_imports import loaded_by
from ray.exceptions import RayTaskError
from ray.train import WorkerGroupError

from raytrain.errors import RaytrainError
from raytrain.trainer.failures import user_error


def _task_error(cause: Exception) -> Exception:
    """What Ray hands back for an exception raised in a remote task: a RayTaskError carrying the cause."""
    return RayTaskError("train_fn", "Traceback (most recent call last): ...", cause)


def test_finds_the_worker_raytrain_error_through_ray_wrappers():
    refused = RaytrainError("checkpoint file:///x/step_000004 is corrupt: layer_01-model_states.pt sha256 differs")
    failure = WorkerGroupError("worker 0 failed", {1: _task_error(RuntimeError("peer gone")), 0: _task_error(refused)})
    assert user_error(failure) is refused


def test_none_for_crashes_and_other_errors():
    assert user_error(WorkerGroupError("crash", {0: _task_error(RuntimeError("segfault"))})) is None
    assert user_error(RuntimeError("not a worker group error")) is None


def test_plain_and_chained_errors():
    refused = RaytrainError("bad layout")
    try:
        try:
            raise refused
        except RaytrainError as inner:
            raise RuntimeError("wrapped") from inner
    except RuntimeError as outer:
        chained = outer
    assert user_error(WorkerGroupError("x", {0: chained})) is refused
    assert user_error(WorkerGroupError("x", {0: refused})) is refused


def test_corrupt_checkpoint_stops_ray_train_at_the_controller():
    """Ray Train 2.60 retries every worker-group error; StopOnUnretryableError (run in its controller after a poll
    that found worker errors) raises for a CorruptCheckpointError only, which Ray Train's policy does not retry, and
    user_error finds it again inside the ControllerError that fit() raises."""
    from ray.train import ControllerError
    from ray.train.v2._internal.execution.failure_handling import DefaultFailurePolicy, FailureDecision

    from raytrain.errors import CorruptCheckpointError
    from raytrain.trainer.failures import StopOnUnretryableError

    corrupt = CorruptCheckpointError("checkpoint s3://b/r/checkpoints/step_00000004 is corrupt: file "
                                     "'ds/layer_01-model_states.pt' has sha256 0123…, manifest says 4567…")
    callback = StopOnUnretryableError()
    callback.after_exception(None, {0: _task_error(RuntimeError("peer gone"))})  # a crash: Ray Train retries it
    callback.after_exception(None, {0: _task_error(RaytrainError("bad layout"))})
    with pytest.raises(CorruptCheckpointError) as raised:
        callback.after_exception(None, {1: _task_error(RuntimeError("peer gone")), 0: _task_error(corrupt)})
    stopped = raised.value
    assert str(stopped) == str(corrupt)
    # what the controller does with a callback's exception: a ControllerError, which its policy raises at once
    from ray.train import FailureConfig

    policy = DefaultFailurePolicy(FailureConfig(max_failures=5))
    assert policy.make_decision(ControllerError(stopped)) == FailureDecision.RAISE
    assert policy.make_decision(WorkerGroupError("x", {0: _task_error(corrupt)})) == FailureDecision.RETRY
    assert user_error(ControllerError(stopped)) is stopped


def test_lost_run_lock_stops_ray_train_at_the_controller():
    """A job whose run lock was taken over fails the same way on every retry: it is not retried either."""
    from raytrain.runlock import LockLostError
    from raytrain.trainer.failures import StopOnUnretryableError

    lost = LockLostError("run file:///r: this job lost its run lock to bob@h pid 7 (generation 3). Refused to "
                         "commit checkpoint step 6")
    with pytest.raises(LockLostError) as raised:
        StopOnUnretryableError().after_exception(None, {0: _task_error(lost)})
    assert str(raised.value) == str(lost)


def test_the_controllers_callback_module_imports_none_of_the_trainer():
    """The Train controller unpickles StopOnUnretryableError, importing its module in a process of its own at every
    launch: that module brings none of the worker's code (the loop, DeepSpeed, the tokenizer)."""
    assert loaded_by(["raytrain.trainer.failures"], ["raytrain.trainer.loop", "deepspeed", "mistral_common",
                                                     "raytrain.trainer.launch"]) == []
