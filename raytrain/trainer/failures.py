"""Which failures of a Ray Train run end it at once, and the RaytrainError inside Ray's wrappers.

The Train controller, a process of its own for each launch, unpickles StopOnUnretryableError: this module imports
Ray Train and raytrain's error types only, so that process loads none of the workers' code (the loop, DeepSpeed, the
tokenizer)."""

from __future__ import annotations

from typing import Any

import ray.train

from raytrain.errors import CorruptCheckpointError, RaytrainError
from raytrain.runlock import LockLostError


def user_error(error: BaseException) -> RaytrainError | None:
    """The first RaytrainError a failed worker group raised (rank order), looking through Ray's task-error
    wrappers, or the one a controller-side callback raised (StopOnUnretryableError); None when the failure was
    something else (a crash, a lost node)."""
    failures = getattr(error, "worker_failures", None) or {}
    if not failures and getattr(error, "controller_failure", None) is not None:
        failures = {0: error.controller_failure}
    for _, failure in sorted(failures.items()):
        seen: set[int] = set()
        while failure is not None and id(failure) not in seen:
            seen.add(id(failure))
            if isinstance(failure, RaytrainError):
                return failure
            failure = getattr(failure, "cause", None) or failure.__cause__
    return None


UNRETRYABLE = (CorruptCheckpointError, LockLostError)
"""Worker errors a retry would meet again: a corrupt checkpoint (the same bytes are read), a lost run lock
(another job holds the run)."""


class StopOnUnretryableError(ray.train.UserCallback):
    """Ends the run at the first worker error in UNRETRYABLE, whatever FailureConfig.max_failures.

    Ray Train 2.60's failure policy retries every worker-group error up to max_failures and takes no user rule.
    This callback runs in the Train controller after each poll that found worker errors: raising there is a
    controller error, which the policy does not retry, so fit() ends at once (the error is found again by
    user_error)."""

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
        refused = user_error(ray.train.WorkerGroupError("worker error", worker_exceptions))
        if isinstance(refused, UNRETRYABLE):
            raise type(refused)(str(refused))
