"""Preference training's part of the loop (train.objective: dpo): the reference pass, run once and stored with
the run, and the DPO metrics of a step or an evaluation gathered from the last stages.

Reference log-probabilities: every pack's pairs are scored once with the starting weights (for a LoRA run the base:
adapters off), before any checkpoint is loaded, by DeepSpeed's pipeline eval schedule with ``DpoLoss.recording``.
Each dp replica scores its share of the micro-batches; the last stages' records are gathered on every rank (the
data-reading stages attach them to their micro-batches). Rank 0 stores them under ``data/reference/<key>/``, the key
a hash of the packed data and the starting weights' identity, so a resumed run reads them instead of scoring again.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import time
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch.distributed as dist

from raytrain.config import JobConfig
from raytrain.errors import RaytrainError
from raytrain.pipeline.dpo import METRICS
from raytrain.storage import StorageLocation
from raytrain.trainer.feed import pad_rows, to_pair_micro_batch
from raytrain.trainer.schedule import Topology, validation_micro_batches_of


@contextlib.contextmanager
def started_from_layers(start: dict[str, Any], s3_endpoint: str | None, layers: Iterable[int] | None = None,
                        label: str = "start") -> Iterator[str]:
    """A local step folder holding the per-layer files (``layers``; None: all) of the checkpoint a preference run
    started from (``start``: trainer.launch.source_weights, another run's, storage.init_from_run) for the length of
    the block: that run's folder in place on POSIX, only these files fetched from s3/hdfs. Read only."""
    from raytrain.checkpoint.store import CheckpointStore
    from raytrain.pipeline.engine import DS_TAG
    from raytrain.pipeline.hf_io import layer_file_name
    from raytrain.storage import resolve

    source = CheckpointStore(resolve(start["init_from_run"], s3_endpoint=s3_endpoint), read_only=True)
    ckpt = source.get(start["step"])
    if ckpt is None:
        raise RaytrainError(f"{start['checkpoint']}, the checkpoint this run started from, vanished after the "
                            "driver checked it (deleted by its run's retention?); start a new storage.run_name")
    files = [rel for rel in ckpt.manifest["files"] if rel.startswith(f"{DS_TAG}/layer_")] if layers is None \
        else [f"{DS_TAG}/{layer_file_name(i)}" for i in layers]
    with source.local_copy(ckpt, files, label=label) as local:
        yield local


def reference_key(job: JobConfig, packed_uri: str, start: dict[str, Any]) -> str:
    """What the stored reference log-probabilities depend on: the packed data and the starting weights: ``start``
    (the source checkpoint of storage.init_from_run, or a LoRA run's base) or else ``model.init_from``'s files (a
    hash when it is a folder here) or the seed. The driver computes it once per launch."""
    from raytrain.pipeline.lora import base_identity

    identity = {"data": job.data_hash(), "packed": packed_uri, "base": start or base_identity(job),
                "tokenizer": job.dataset.tokenizer}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def _score(stage: Any, topo: Topology, job: JobConfig, source: Any) -> np.ndarray:
    """(num_packs, 2 * max_pairs) reference log-probabilities of every pack of ``source`` with the stage's weights
    as they are (module docstring); the same array on every rank. Micro-batch k (packs k * mbs ...) goes to replica
    k % dp, as the evaluation deals them; each is read when DeepSpeed pulls it, so one micro-batch is in memory at a
    time."""
    from raytrain.pipeline.lora import adapters_disabled

    tc = job.train
    mbs, total = tc.micro_batch_size, source.num_packs
    count = validation_micro_batches_of(topo.dp_rank, tc.dp, total, mbs)
    own = [k for k in range(-(-total // mbs)) if k % tc.dp == topo.dp_rank]
    assert len(own) == count, f"reference pass: {len(own)} micro-batches, expected {count}"
    own_packs: list[np.ndarray] = []

    def micro_batches():
        for k in own:
            batch = source.read(range(k * mbs, min((k + 1) * mbs, total)))
            own_packs.append(np.asarray(batch["pack_index"]))
            width = np.asarray(batch["pair_segments"]).shape[1]
            batch = pad_rows({**batch, "ref_logps": np.zeros((len(batch["doc_ids"]), width), np.float32)}, mbs)
            yield to_pair_micro_batch(batch, 0.0, 0.0)  # recording: the loss is 0, its scales unused

    loss_fn = stage.engine.module.loss_fn
    adapters = adapters_disabled(stage.engine.module) if job.model.lora.rank else contextlib.nullcontext()
    with adapters, loss_fn.recording() as recorded:
        stage.eval_loss(micro_batches() if topo.needs_data else None, count)
    mine: dict[int, list[float]] = {}
    if topo.is_last_stage:  # the last stage scored this replica's micro-batches, in order
        for packs, logps in zip(own_packs, recorded, strict=True):
            for row, pack in enumerate(packs.tolist()):
                mine[pack] = logps[row].reshape(-1).tolist()
    gathered: list[dict[int, list[float]] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    scores = {pack: values for part in gathered for pack, values in (part or {}).items()}
    if len(scores) != total:
        raise RuntimeError(f"reference pass scored {len(scores)} of {total} packs (a bug)")
    return np.array([scores[pack] for pack in range(total)], dtype=np.float32)


def reference_logps(stage: Any, topo: Topology, job: JobConfig, sources: dict[str, Any],
                    folder: StorageLocation, check_fence: Any) -> dict[str, np.ndarray]:
    """Each set's reference log-probabilities (name -> (num_packs, 2 * max_pairs)): read from ``folder`` when a
    launch of this run stored them, else scored now and stored by rank 0 (``check_fence`` first: a run whose lock
    another job holds writes nothing)."""
    out: dict[str, np.ndarray] = {}
    for name, source in sources.items():
        loc = folder.join(f"{name}.npy")
        stored = [loc.exists()]
        dist.broadcast_object_list(stored, src=0)  # every rank takes the same branch
        if stored[0]:
            out[name] = np.load(io.BytesIO(loc.read_bytes()))
            continue
        t0 = time.perf_counter()
        out[name] = _score(stage, topo, job, source)
        if dist.get_rank() == 0:
            check_fence(f"store the reference log-probabilities of {name}")
            buffer = io.BytesIO()
            np.save(buffer, out[name])
            folder.mkdirs()
            loc.write_atomic(buffer.getvalue())
            print(f"[raytrain] reference pass: {source.num_packs} {name} packs scored with the starting weights in "
                  f"{time.perf_counter() - t0:.1f}s -> {loc.uri}", flush=True)
        dist.barrier()
    return out


def pair_metrics(stage: Any, prefix: str = "") -> dict[str, float]:
    """TRL's DPO metrics (means over the pairs) of what the last stages scored since the last call: their sums are
    added up over every rank (the other stages add zeros), so every rank returns the same values."""
    loss_fn = stage.engine.module.loss_fn
    sums = loss_fn.take_sums() if hasattr(loss_fn, "take_sums") else {}
    gathered: list[dict[str, float] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sums)  # objects, not tensors: the same call on gloo and nccl
    totals = {name: sum((part or {}).get(name, 0.0) for part in gathered) for name in (*METRICS, "pairs")}
    if not totals["pairs"]:
        return {}
    return {f"{prefix}{name}": totals[name] / totals["pairs"] for name in METRICS}
