"""launch.user_error: the RaytrainError a worker raised, found inside Ray Train's WorkerGroupError, whatever wraps it.
Uses Ray's own exception classes (no cluster)."""

from ray.exceptions import RayTaskError
from ray.train import WorkerGroupError

from raytrain.errors import RaytrainError
from raytrain.trainer.launch import user_error


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
