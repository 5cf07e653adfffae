"""Which micro-batches a worker consumes, and where a resumed run picks up. Pure arithmetic, unit-tested.

Global micro-batch g is micro-batch g % E of epoch g // E (E = packs // micro_batch_size; which packs it holds is
the epoch's order, raytrain.trainer.pack_order.epoch_order). The sequence is dealt out step by step: optimizer step s
uses micro-batches [s * dp * m, (s + 1) * dp * m), replica r taking the m consecutive ones starting at
s * dp * m + r * m (m = grad_accum_steps). Sharding by *data-parallel* rank, not world rank, is what makes every stage
of one pipeline see the same micro-batches (Ray Data's own split is by world rank: ray#60439).
"""

from __future__ import annotations

from dataclasses import dataclass

from raytrain.errors import RaytrainError


@dataclass(frozen=True)
class Topology:
    """Where a worker sits, as DeepSpeed's pipeline grid placed it (raytrain.pipeline.engine.StageEngine reads
    stage and dp_rank from ``engine.grid``; nothing here recomputes DeepSpeed's rank layout)."""

    pp: int
    dp: int
    stage: int
    dp_rank: int
    world_rank: int

    def __post_init__(self) -> None:
        if not (0 <= self.stage < self.pp and 0 <= self.dp_rank < self.dp):
            raise ValueError(f"stage {self.stage} / dp_rank {self.dp_rank} outside pp {self.pp} x dp {self.dp}")

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.pp - 1

    @property
    def needs_data(self) -> bool:
        """Only the first stage (input ids) and the last (labels) read the dataset; middle stages only pass
        activations, so they never touch Ray Data."""
        return self.is_first_stage or self.is_last_stage


def micro_batches_per_step(dp: int, grad_accum_steps: int) -> int:
    return dp * grad_accum_steps


def owns_micro_batch(global_index: int, dp_rank: int, dp: int, grad_accum_steps: int) -> bool:
    """True when global micro-batch `global_index` belongs to data-parallel replica `dp_rank`."""
    return (global_index // grad_accum_steps) % dp == dp_rank


def validation_micro_batches_of(dp_rank: int, dp: int, num_packs: int, micro_batch_size: int) -> int:
    """Validation micro-batches replica `dp_rank` evaluates: micro-batch k of the whole set (the last one may be
    short) goes to replica k % dp. Every stage can compute it, including the middle ones that read no data."""
    total = -(-num_packs // micro_batch_size)
    return len(range(dp_rank, total, dp))


def data_position(step: int, dp: int, grad_accum_steps: int) -> int:
    """Global micro-batches consumed after `step` optimizer steps (what a checkpoint records)."""
    return step * micro_batches_per_step(dp, grad_accum_steps)


def check_resume_position(recorded: int, step: int, dp: int, grad_accum_steps: int, checkpoint: str,
                          saved_with: dict | None = None) -> None:
    """A checkpoint's recorded data position must be ``data_position(step, ...)`` under this run's batch layout;
    else RaytrainError naming the fields that changed and the fix. ``saved_with``: the checkpoint's train section."""
    if recorded == data_position(step, dp, grad_accum_steps):
        return
    saved = saved_with or {}
    then = (f" (it was saved with train.dp={saved['dp']}, train.grad_accum_steps={saved['grad_accum_steps']})"
            if "dp" in saved and "grad_accum_steps" in saved else "")
    raise RaytrainError(
        f"checkpoint {checkpoint} records data position {recorded} at step {step}, which this run's batch layout "
        f"(train.dp={dp}, train.grad_accum_steps={grad_accum_steps}) cannot reach{then}: set train.dp and "
        "train.grad_accum_steps back to the values it was saved with, or start a new run (storage.run_name)")


ORDER_SETTINGS = ("seed", "shuffle", "micro_batch_size")
"""The train settings that decide which packs each global micro-batch holds (raytrain.trainer.pack_order); a
streamed run's order also depends on shuffle_window_waves."""


def check_data_order(saved_with: dict, now: dict, streamed: bool, checkpoint: str) -> None:
    """A checkpoint resumes at a global micro-batch of one order of the packs: ``saved_with`` (its train section)
    and ``now`` (this run's) must agree on the settings that decide it (``ORDER_SETTINGS``, and in a streamed run
    ``shuffle_window_waves``, which also picks the validation set); else RaytrainError naming both values and the fix.
    A setting a checkpoint does not record (saved by an older version) is not compared."""
    names = ORDER_SETTINGS + (("shuffle_window_waves",) if streamed else ())
    changed = [f"train.{name}={saved_with[name]!r} (now {now[name]!r})" for name in names
               if name in saved_with and saved_with[name] != now[name]]
    if changed:
        raise RaytrainError(
            f"checkpoint {checkpoint} was trained on the packs in the order of {', '.join(changed)}: resumed with "
            "other values it would skip or repeat sequences. Set them back to the values it was saved with, or "
            "start a new run (storage.run_name)")


def check_enough_packs(num_packs: int, micro_batch_size: int, dp: int, grad_accum_steps: int) -> None:
    """One optimizer step needs dp x grad_accum_steps full micro-batches; else RaytrainError naming the fields."""
    micro_batches = num_packs // micro_batch_size
    if micro_batches < micro_batches_per_step(dp, grad_accum_steps):
        raise RaytrainError(
            f"the packed dataset holds {num_packs} sequences = {micro_batches} micro-batches of "
            f"train.micro_batch_size={micro_batch_size}, fewer than one optimizer step needs (train.dp={dp} x "
            f"train.grad_accum_steps={grad_accum_steps}); use more data (input.path), a smaller "
            "dataset.seq_len or smaller batches")


def epoch_and_offset(position: int, micro_batches_per_epoch: int) -> tuple[int, int]:
    """Split a global micro-batch position into (epoch, index within the epoch)."""
    if micro_batches_per_epoch <= 0:
        raise ValueError("the dataset holds no full micro-batch")
    return divmod(position, micro_batches_per_epoch)
