"""A streamed run's training packs as a worker reads them: the waves packed so far, and more as the enrichment
commits them (raytrain.dataset.wave_packs writes them; raytrain.trainer.pack_order orders them)."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from raytrain.config import TrainConfig
from raytrain.dataset.pack_reader import PackCounts, PackReader
from raytrain.dataset.wave_packs import WaveRecords, read_wave_records, streamed_packs
from raytrain.storage import StorageLocation, resolve
from raytrain.trainer.evaluation import PackedFiles, PackSource, evaluable, packed_files
from raytrain.trainer.pack_order import WaveState

POLL_S = 1.0
"""How often a worker that caught up with the enrichment looks for the next wave's commit record."""


def _wait_for_waves(folder: StorageLocation, data_hash: str, ready: Callable[[WaveRecords], bool],
                    waiting: Callable[[WaveRecords], str] | None, earlier: tuple[dict, ...] = ()) -> WaveRecords:
    """The run's wave records once ``ready(records)``, polling every POLL_S (``earlier``: records read before);
    ``waiting`` gives the console line said the first time it has to wait (None: it waits quietly)."""
    said = False
    while True:
        waves = read_wave_records(folder, data_hash, len(earlier), earlier)
        if ready(waves):
            return waves
        if waiting is not None and not said:
            print(f"[raytrain] {waiting(waves)}", flush=True)
            said = True
        time.sleep(POLL_S)


class WavePackSource(PackSource):
    """``PackSource`` of a streamed run. ``wait`` is WaveOrder's source: it returns the waves' state once it holds
    more than the state given (one more wave, or the enrichment complete), polling the run's wave records; the
    first time it has to wait for a wave it says so on the console (``announce``: one worker of the run does)."""

    def __init__(self, packed: PackedFiles, s3_endpoint: str | None, announce: bool = False) -> None:
        super().__init__(packed, s3_endpoint)
        self.folder = resolve(packed.uri, s3_endpoint=s3_endpoint)
        self.announce = announce
        self.waited_s = 0.0
        self._records: tuple[dict, ...] = ()
        self._counts: list[PackCounts] = []

    def wait(self, known: WaveState | None) -> WaveState:
        t0 = time.perf_counter()
        waves = _wait_for_waves(
            self.folder, self.packed.data_hash,
            lambda w: known is None or len(w.records) > len(known.wave_packs) or w.complete,
            (lambda w: f"waiting for wave {len(w.records) + 1} to be packed: training caught up with the enrichment "
                       f"({len(w.records)} wave{'' if len(w.records) == 1 else 's'} packed)")
            if self.announce else None,
            self._records)
        self.waited_s += time.perf_counter() - t0
        for record in waves.records[len(self._records):]:
            self._counts.append(PackReader(self.packed.uri, record["files"], self.s3_endpoint).counts())
        self._records = waves.records
        files = tuple(name for r in waves.records for name in r["files"])
        self.packed = PackedFiles(self.packed.uri, files, sum(waves.wave_packs), streamed=True,
                                  data_hash=self.packed.data_hash)
        self._reader = None
        counts = PackCounts(np.concatenate([c.num_tokens for c in self._counts] or [np.zeros(0, np.int64)]),
                            np.concatenate([c.num_targets for c in self._counts] or [np.zeros(0, np.int64)]))
        return WaveState(waves.wave_packs, counts, waves.complete)


def first_window(packed: PackedFiles, tc: TrainConfig, s3_endpoint: str | None, announce: bool = False
                 ) -> dict[str, PackedFiles | None]:
    """A streamed run's packed sets once its first ``train.shuffle_window_waves`` waves are packed (or every wave,
    when there are fewer): LoopConfig's ``packed`` (the waves so far), ``validation`` (the window's held-out packs)
    and ``benchmark`` (the eval-set items, packed with wave 0). The trainer starts with the enrichment, so a worker
    that has built its stage before then waits here, polling the wave records; ``announce`` (one worker of the run)
    says so on the console, and why a held-out set gives no loss."""
    folder, window = resolve(packed.uri, s3_endpoint=s3_endpoint), tc.shuffle_window_waves
    waves = _wait_for_waves(folder, packed.data_hash, lambda w: len(w.records) >= window or w.complete,
                            (lambda w: f"waiting for wave {len(w.records) + 1} to be packed: the trainer is ready "
                                       "before the enrichment packed its first waves") if announce else None)
    data = streamed_packs(folder, waves, window)

    def warn(text: str) -> None:
        if announce:
            print(f"[raytrain] {text}", flush=True)

    validation = evaluable(data.validation, "validation", tc.micro_batch_size, tc.dp, warn)
    benchmark = evaluable(data.benchmark, "benchmark", tc.micro_batch_size, tc.dp, warn)
    if validation is None and tc.eval_every:
        warn(f"train.eval_every={tc.eval_every} but the first {window} wave(s) hold out no validation set: no "
             "validation loss (set dataset.validation_fraction > 0)")
    return {"packed": packed_files(data, packed.data_hash),
            "validation": packed_files(validation) if validation is not None else None,
            "benchmark": packed_files(benchmark) if benchmark is not None else None}
