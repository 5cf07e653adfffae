"""The training loop's control flow with a fake stage engine (as Ray Train v2 tests its controller with fakes):
resume position, eval cadence, checkpoint cadence, stop_at_step, the metrics files. Real: the loop, the
CheckpointStore on a temp dir, a one-process gloo group for its barriers, the feed's order. Fake: the DeepSpeed
stage (a scalar "weight" that accumulates what it trains on) and the packs (in memory instead of Parquet)."""

from __future__ import annotations

import json
import os
import socket
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist

from raytrain.checkpoint.store import CheckpointStore
from raytrain.config import load_job_config
from raytrain.storage import resolve
from raytrain.trainer.evaluation import PackedFiles
from raytrain.trainer.feed import in_memory_packs
from raytrain.trainer.loop import LoopConfig, train

SEQ = 8
NUM_PACKS = 24


@pytest.fixture(scope="module", autouse=True)
def process_group():
    """The loop's barriers and all_gather on a real one-process gloo group."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class FakeStage:
    """A one-stage, one-replica 'pipeline': train_batch pulls grad_accum micro-batches and adds their first token
    ids to a weight, so the weight is a fingerprint of exactly which packs were trained, in order."""

    num_stages, num_replicas, stage, dp_rank, world_rank = 1, 1, 0, 0, 0

    def __init__(self, grad_accum_steps: int) -> None:
        self.m = grad_accum_steps
        self.weight = 0.0
        self.trained: list[list[int]] = []  # first token of each pack of each micro-batch, per step
        self.eval_calls: list[int] = []
        self.engine = SimpleNamespace(module=torch.nn.Linear(1, 1))

    def train_batch(self, data_iter) -> float:
        firsts = []
        for _ in range(self.m):
            (input_ids, _pos, _seg), _labels = next(data_iter)
            firsts += input_ids[:, 0].tolist()
        self.trained.append(firsts)
        self.weight = self.weight * 0.5 + sum(firsts)
        return 10.0 / len(self.trained)

    def lr(self) -> float:
        return 1e-3

    def grad_norm(self) -> float:
        return 0.5

    def eval_loss(self, data_iter, num_micro_batches: int) -> float:
        for _ in range(num_micro_batches):
            next(data_iter)
        self.eval_calls.append(num_micro_batches)
        return 1.0 + self.weight / 1e6

    def save(self, directory: str, client_state: dict) -> None:
        with open(os.path.join(directory, "fake_stage.json"), "w") as f:
            json.dump({"weight": self.weight, "client_state": client_state}, f)

    def load(self, directory: str) -> dict:
        with open(os.path.join(directory, "fake_stage.json")) as f:
            saved = json.load(f)
        self.weight = saved["weight"]
        return saved["client_state"]


def _packs(num_packs: int, first_id: int = 0):
    ids = np.repeat(np.arange(first_id, first_id + num_packs)[:, None], SEQ, axis=1)
    labels = np.full((num_packs, SEQ), 5)
    labels[:, -1] = -100
    return in_memory_packs({"input_ids": ids, "position_ids": np.tile(np.arange(SEQ), (num_packs, 1)),
                            "segment_ids": np.zeros((num_packs, SEQ), int), "labels": labels,
                            "doc_ids": [f"doc-{k}" for k in range(first_id, first_id + num_packs)]})


class InMemoryPacks:
    """A PackSource over in-memory packs."""

    def __init__(self, packed: PackedFiles) -> None:
        first_id = 1000 if packed.uri == "mem://validation" else 0
        self._counts, self._read = _packs(packed.num_packs, first_id)
        self.num_packs, self.read_stats = packed.num_packs, {}

    def counts(self):
        return self._counts

    def read(self, packs):
        return next(self._read([np.asarray(list(packs))]))

    def stream(self, own, micro_batch_size):
        return self._read(own)


def _run(tmp_path, *overrides: str, validation: int = 4) -> tuple[FakeStage, list[dict], str]:
    job = load_job_config(None, ["train.pp=1", "train.dp=1", "train.micro_batch_size=2", "train.grad_accum_steps=2",
                                 "train.max_steps=7", "train.generation_tokens=0", f"storage.root={tmp_path}",
                                 *overrides])
    run_root = resolve(str(tmp_path / "run"))
    reports = tmp_path / "run" / "reports"
    reports.mkdir(parents=True, exist_ok=True)
    cfg = LoopConfig(job=job, run_uri=run_root.uri, ds_config={}, packed=PackedFiles("mem://train", (), NUM_PACKS),
                     validation=PackedFiles("mem://validation", (), validation) if validation else None,
                     local_reports_dir=str(reports))
    stage = FakeStage(job.train.grad_accum_steps)
    reported: list[dict] = []
    store = CheckpointStore(run_root, keep_last=job.train.keep_last)
    train(cfg, stage, store, InMemoryPacks, report=reported.append, mfu_of=lambda tokens_per_s: 0.0)
    return stage, reported, str(reports)


def _committed_steps(tmp_path) -> list[int]:
    return [c.step for c in CheckpointStore(resolve(str(tmp_path / "run")), keep_last=None).committed()]


def test_checkpoint_and_eval_cadence_and_every_output(tmp_path):
    stage, reported, reports = _run(tmp_path, "train.checkpoint_every=3", "train.eval_every=2",
                                    "train.keep_last=10")
    assert [r["step"] for r in reported] == [1, 2, 3, 4, 5, 6, 7]
    assert _committed_steps(tmp_path) == [3, 6, 7]  # every checkpoint_every steps and the last
    evaluated = [r["step"] for r in reported if "validation_loss" in r]
    assert evaluated == [2, 4, 6, 7]  # every eval_every steps and the last
    assert stage.eval_calls == [2] * 4  # 4 validation packs / micro_batch_size 2, the whole set each time
    lines = [json.loads(x) for x in open(os.path.join(reports, "metrics.jsonl"))]
    assert [m["step"] for m in lines] == [1, 2, 3, 4, 5, 6, 7]
    assert lines[-1]["data_position"] == 7 * 2 and lines[-1]["tokens_seen"] == 7 * 4 * SEQ
    trace = [json.loads(x) for x in open(os.path.join(reports, "data_trace_rank0.jsonl"))]
    assert [len(t["consumed"]) for t in trace] == [2] * 7  # grad_accum micro-batches a step


def test_no_eval_every_evaluates_only_the_last_step(tmp_path):
    stage, reported, _ = _run(tmp_path, "train.eval_every=0")
    assert [r["step"] for r in reported if "validation_loss" in r] == [7]
    _stage, reported_without, _ = _run(tmp_path / "b", "train.eval_every=2", validation=0)
    assert not any("validation_loss" in r for r in reported_without)  # no validation packs: no evaluation


def test_stop_then_resume_continues_at_the_exact_position(tmp_path):
    whole, _, _ = _run(tmp_path / "whole", "train.checkpoint_every=2")
    first, reported_first, _ = _run(tmp_path / "split", "train.checkpoint_every=2", "train.stop_at_step=3")
    assert [r["step"] for r in reported_first] == [1, 2, 3]
    assert _committed_steps(tmp_path / "split")[-1] == 3  # stop_at_step commits its last step
    second, reported_second, reports = _run(tmp_path / "split", "train.checkpoint_every=2")
    assert [r["step"] for r in reported_second] == [4, 5, 6, 7]  # resumed after step 3
    assert first.trained + second.trained == whole.trained  # no micro-batch repeated or skipped
    assert second.weight == whole.weight  # the fake's state came back from the checkpoint
    lines = [json.loads(x)["step"] for x in open(os.path.join(reports, "metrics.jsonl"))]
    assert lines == [1, 2, 3, 4, 5, 6, 7]
    ends = [json.loads(x)["tokens_seen"] for x in open(os.path.join(reports, "metrics.jsonl"))]
    assert ends[3] == 4 * 4 * SEQ  # tokens seen carried over the resume
