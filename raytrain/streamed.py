"""A streamed run (``enrich.wave_rows`` cutting the input into more than one wave): training starts on the first
waves while the enrichment goes on, on the same Ray cluster.

The enrichment (Spark on Ray) runs in a thread of the driver. Each wave it commits is packed at once (Ray Data,
raytrain.dataset.wave_packs) and its pack record written. The driver starts the TorchTrainer with the enrichment:
its workers build their pipeline stages while the first waves are enriched, take the validation and benchmark sets
from the first ``train.shuffle_window_waves`` waves' records once they are packed, read more waves as their records
appear, and wait ("waiting for wave k" on the console) when training catches up with the enrichment
(raytrain.trainer.wave_source).
A resumed run enriches from its first uncommitted wave on and trains from its checkpoint: the pack order depends
only on the config and the waves' pack counts (raytrain.trainer.pack_order), so the micro-batches are the same.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from raytrain.dataset.wave_packs import (
    FAILED,
    WAVES,
    WaveRecords,
    finish_waves,
    pack_wave,
    read_wave_records,
    streamed_packs,
    wave_fraction,
)
from raytrain.storage import StorageLocation

if TYPE_CHECKING:
    from raytrain.dataset.stream import PackedData
    from raytrain.enrich.plan import EnrichPlan

log = logging.getLogger(__name__)


def streamed_waves(plan: EnrichPlan, wave_rows: int) -> int:
    """How many waves the enrichment cuts the input into (1 = not streamed)."""
    from raytrain.enrich.waves import input_files, plan_waves

    groups = {split: footers["file_row_groups"] for split, footers in plan.footers.items()}
    return len(plan_waves(input_files(plan.inputs.files, groups), wave_rows))


def enrich_and_train(run: Any, plan: EnrichPlan, input_root: StorageLocation, eval_sets: tuple[str, ...],
                     train: Callable[[Any, PackedData], dict[str, Any]],
                     write_report: Callable[[str, dict[str, Any]], Any]) -> dict[str, Any]:
    """Enrich and pack ``run``'s (a raytrain.runner.Run) waves in a thread, start ``train(run, packed)`` at once
    with the waves packed so far (none on a fresh run), then wait for the enrichment; returns train's summary, with
    the waves, written again by ``write_report(name, report)`` (which also writes the enrichment's report). An error
    of either side is raised here."""
    from raytrain.enrich.job import run_enrich

    job, packed, data_hash = run.job, run.paths.packed, run.data_hash
    fraction = wave_fraction(job.dataset, plan.rows_in)
    failed = packed.join(WAVES, FAILED)
    failed.delete_file()
    # one packing thread: wave k is packed while Spark enriches wave k + 1, and the waves are packed in order
    packer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="raytrain-pack")
    packing: list[Future] = []

    def on_wave(wave, _committed: dict[str, Any]) -> None:
        failed_before = next((f.exception() for f in packing if f.done() and f.exception()), None)
        if failed_before is not None:
            raise failed_before  # an earlier wave could not be packed: stop enriching
        packing.append(packer.submit(pack_wave, run.paths.enriched.join(wave.name), packed, wave.index, job.dataset,
                                     data_hash, fraction, tuple(plan.evals.records) if wave.index == 0 else ()))

    outcome: dict[str, Any] = {}
    records: list[dict[str, Any]] = []

    def enrich() -> None:
        try:
            result = run_enrich(job, input_root, run.root, eval_sets=eval_sets, plan=plan, on_wave=on_wave)
            write_report("enrich_report.json", result.report)
            records.extend(f.result() for f in packing)
            finish_waves(packed, records, job.dataset, data_hash, fraction, job.train.shuffle_window_waves)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread, and to the waiting workers
            outcome["error"] = e
            failed.write_atomic(json.dumps({"error": f"{type(e).__name__}: {e}"}))
        finally:
            packer.shutdown(wait=True, cancel_futures=True)

    thread = threading.Thread(target=enrich, name="raytrain-enrich", daemon=True)
    thread.start()
    waves = read_wave_records(packed, data_hash)  # none on a fresh run; a resumed run's waves packed before
    log.info("stream: training starts with the enrichment (%d wave(s) packed so far): its workers build their stages "
             "while the first waves are enriched", len(waves.records))
    try:
        summary = train(run, streamed_packs(packed, waves, job.train.shuffle_window_waves))
    except BaseException as e:
        if "error" in outcome:  # the workers stopped because the enrichment failed: its error, not theirs
            raise outcome["error"] from e
        raise
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    final = streamed_packs(packed, WaveRecords(tuple(records), True), job.train.shuffle_window_waves)
    summary.update(num_packs=final.num_packs, waves=list(final.waves or ()), waves_at_start=len(waves.records),
                   validation_packs=final.validation.num_packs if final.validation else 0,
                   benchmark_packs=final.benchmark.num_packs if final.benchmark else 0)
    write_report("run_summary.json", summary)
    return summary
