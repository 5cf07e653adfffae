"""What the loop reads and evaluates besides its training stream: the packed sets a worker is handed
(``PackedFiles``), how it reads them (``PackSource``), the held-out evaluation (``Evaluator``) and the
generations at checkpoints (``Generations``).

``PackSource`` is the loop's seam for data: a worker reads packed Parquet (counts and ranges with pyarrow, the
training stream with Ray Data tasks); tests hand the loop packs held in memory instead.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from raytrain.config import JobConfig
from raytrain.dataset.labels import IGNORE_INDEX
from raytrain.dataset.pack_reader import PackCounts, PackReader
from raytrain.trainer.feed import validation_micro_batches
from raytrain.trainer.schedule import Topology, validation_micro_batches_of


@dataclass(frozen=True)
class PackedFiles:
    """Where a worker finds a packed set: folder URI, file names in the fixed order, number of packs."""

    uri: str
    files: tuple[str, ...]
    num_packs: int
    streamed: bool = False
    """A streamed run's training packs: ``files`` are the waves packed when the trainer started, and the worker
    reads more as the enrichment commits them (raytrain.trainer.wave_source)."""
    data_hash: str = ""
    """The run's data hash (a streamed run's wave records carry it)."""


class PackSource:
    """One packed set as a worker reads it: every pack's token / target counts, a range of packs, and the
    training stream of this replica's micro-batches (Ray Data tasks, ``stream_micro_batches``)."""

    def __init__(self, packed: PackedFiles, s3_endpoint: str | None) -> None:
        self.packed, self.s3_endpoint = packed, s3_endpoint
        self.read_stats: dict[str, int] = {}  # packs and bytes the training stream read
        self._reader: PackReader | None = None

    @property
    def num_packs(self) -> int:
        return self.packed.num_packs

    def counts(self) -> PackCounts:
        return self._pack_reader().counts()

    def read(self, packs: Sequence[int]) -> dict[str, np.ndarray]:
        return self._pack_reader().read(packs)

    def stream(self, own: list[np.ndarray], micro_batch_size: int) -> Iterator[dict[str, np.ndarray]]:
        from raytrain.dataset.stream import stream_micro_batches

        return stream_micro_batches(self.packed.uri, self.packed.files, self.s3_endpoint, own, micro_batch_size,
                                    self.read_stats)

    def _pack_reader(self) -> PackReader:
        if self._reader is None:
            self._reader = PackReader(self.packed.uri, self.packed.files, self.s3_endpoint)
        return self._reader


def evaluable(subset: Any, name: str, micro_batch_size: int, dp: int, warn: Callable[[str], None]) -> Any:
    """``subset`` (a raytrain.dataset.stream.PackedData or None) when it gives every dp replica at least one
    micro-batch to evaluate, else None (``warn`` told why)."""
    if subset is not None and -(-subset.num_packs // micro_batch_size) < dp:
        warn(f"{name}: {subset.num_packs} sequences make fewer micro-batches than train.dp={dp} replicas; no {name} "
             f"loss{' (raise dataset.validation_fraction)' if name == 'validation' else ''}")
        return None
    return subset


def packed_files(packed: Any, data_hash: str = "") -> PackedFiles:
    """Where a worker finds a packed set (a raytrain.dataset.stream.PackedData): folder URI, file paths relative to
    it in the fixed order, number of packs (a streamed run's training packs: those of the waves packed so far,
    ``streamed``)."""
    folder = packed.location.path.rstrip("/") + "/"
    names = tuple(p[len(folder):] if p.startswith(folder) else p.rsplit("/", 1)[-1] for p in packed.files)
    return PackedFiles(packed.location.uri, names, packed.num_packs, streamed=packed.waves is not None,
                       data_hash=data_hash)


OpenPacks = Callable[[PackedFiles], PackSource]
"""PackedFiles -> its PackSource (``PackSource(packed, endpoint)`` in a worker, in-memory packs in tests)."""


class Evaluator:
    """The held-out evaluation: each set (``validation_loss``: validation packs, ``benchmark_loss``: the eval-set items)
    evaluated whole, dp replicas sharing its micro-batches; a data-reading rank reads its micro-batches once and
    keeps them in memory. Every ``eval_every`` steps and at the last step."""

    def __init__(self, stage: Any, topo: Topology, job: JobConfig, sources: dict[str, PackSource],
                 ref_logps: dict[str, Any] | None = None) -> None:
        self.stage, self.topo, self.tc = stage, topo, job.train
        self.sources = sources  # metric name -> its packs
        self.ref_logps = ref_logps or {}  # metric name -> its packs' reference log-probabilities (preference packs)
        self._own: dict[str, list[Any]] = {}

    def due(self, step: int, end_step: int) -> bool:
        every = self.tc.eval_every
        return bool(self.sources) and (step == end_step or bool(every and step % every == 0))

    def run(self) -> dict[str, float]:
        """Every set's loss, plus ``eval_time_s``."""
        t0 = time.perf_counter()
        out: dict[str, float] = {}
        for metric in self.sources:
            out[metric] = self._loss(metric)
            if metric in self.ref_logps:  # DPO: TRL's metrics on the held-out pairs too
                from raytrain.trainer.preference import pair_metrics

                out.update(pair_metrics(self.stage, prefix=metric.removesuffix("_loss") + "/"))
        out["eval_time_s"] = time.perf_counter() - t0
        return out

    def _loss(self, metric: str) -> float:
        source, mbs, dp = self.sources[metric], self.tc.micro_batch_size, self.tc.dp
        count = validation_micro_batches_of(self.topo.dp_rank, dp, source.num_packs, mbs)
        eval_iter = None
        if self.topo.needs_data:
            if metric not in self._own:
                total = source.num_packs
                batches = (source.read(range(i, min(i + mbs, total))) for i in range(0, total, mbs))
                own, _targets = validation_micro_batches(batches, micro_batch_size=mbs, dp_rank=self.topo.dp_rank,
                                                         dp=dp, ref_logps=self.ref_logps.get(metric))
                assert len(own) == count, f"{metric}: read {len(own)} micro-batches, expected {count}"
                self._own[metric] = own
            eval_iter = iter(self._own[metric])
        return self.stage.eval_loss(eval_iter, count)


class Generations:
    """Greedy generations at each checkpoint on the first micro_batch_size validation prompts (the first document
    of each of the first validation packs, up to its first target token); rank 0 writes them with the reference
    answers to reports/generations.jsonl."""

    def __init__(self, stage: Any, job: JobConfig, topo: Topology, held: PackSource, reports_dir: str | None) -> None:
        from raytrain.dataset.tokenize import load_tokenizer

        self.stage, self.job = stage, job
        self.path = os.path.join(reports_dir, "generations.jsonl") if reports_dir and topo.world_rank == 0 else None
        self.tokenizer = load_tokenizer(job.dataset.tokenizer)
        self.count = min(job.train.micro_batch_size, held.num_packs)
        self.prompts: list[list[int]] | None = None
        self.references: list[list[int]] = []
        if topo.needs_data:
            batch = held.read(range(self.count))
            self.prompts = []
            for ids, labels, segments in zip(batch["input_ids"], batch["labels"], batch["segment_ids"], strict=True):
                first = segments == segments[0]  # the pack's first document
                start = int((labels[first] != IGNORE_INDEX).argmax())  # labels[t] is token t + 1: answer at t + 1
                self.prompts.append(ids[first][:start + 1].tolist())
                self.references.append(ids[first][start + 1:].tolist())

    def generate(self, step: int) -> None:
        tc = self.job.train
        inner = self.tokenizer.instruct_tokenizer.tokenizer
        new = self.stage.greedy_generate(self.prompts, num_prompts=self.count, micro_batch_size=tc.micro_batch_size,
                                         seq_len=self.job.dataset.seq_len, max_new_tokens=tc.generation_tokens,
                                         eos_id=inner.eos_id)
        if self.path is None:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            for prompt, reference, tokens in zip(self.prompts or [], self.references, new, strict=True):
                f.write(json.dumps({"step": step, "prompt": inner.decode(prompt), "reference": inner.decode(reference),
                                    "generated": inner.decode(tokens), "prompt_ids": prompt,
                                    "generated_ids": tokens}) + "\n")
        print(f"[raytrain] step {step}: {len(new)} generations -> {self.path}", flush=True)
