"""A streamed run's training packs as a worker reads them: the waves packed so far, and more as the enrichment
commits them (raytrain.dataset.wave_packs writes them; raytrain.trainer.pack_order orders them)."""

from __future__ import annotations

import time

import numpy as np

from raytrain.dataset.pack_reader import PackCounts, PackReader
from raytrain.dataset.wave_packs import read_wave_records
from raytrain.storage import resolve
from raytrain.trainer.evaluation import PackedFiles, PackSource
from raytrain.trainer.pack_order import WaveState

POLL_S = 1.0
"""How often a worker that caught up with the enrichment looks for the next wave's commit record."""


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
        announced, t0 = False, time.perf_counter()
        while True:
            waves = read_wave_records(self.folder, self.packed.data_hash, len(self._records), self._records)
            if known is None or len(waves.records) > len(known.wave_packs) or waves.complete:
                break
            if self.announce and not announced:
                print(f"[raytrain] waiting for wave {len(waves.records) + 1}: training caught up with the enrichment "
                      f"({len(waves.records)} waves packed)", flush=True)
                announced = True
            time.sleep(POLL_S)
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
