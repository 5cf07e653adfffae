"""`raytrain run ARGS` (the CLI, in this process) with its streamed enrichment held after wave 1's commit until the
run's first checkpoint is committed: a test that kills this driver once the checkpoint exists knows that the
enrichment was still going on (wave 2 not committed), however fast the machine. Used by test_streamed's kill test:
``python tests/held_stream_driver.py configs/demo.yaml OVERRIDE...``."""

import sys
import time

from raytrain import cli
from raytrain.checkpoint.store import CheckpointStore
from raytrain.config import load_job_config
from raytrain.enrich import job as enrich_job
from raytrain.runner import open_run


def main(argv: list[str]) -> int:
    run_root = open_run(load_job_config(argv[0], argv[1:])).root
    real_run_enrich = enrich_job.run_enrich

    def run_enrich(*args, on_wave=None, **kwargs):
        def held(wave, record):
            if wave.index == 1:
                while CheckpointStore(run_root).latest() is None:
                    time.sleep(0.2)
            on_wave(wave, record)

        return real_run_enrich(*args, on_wave=held if on_wave is not None else None, **kwargs)

    enrich_job.run_enrich = run_enrich  # raytrain.streamed imports it from the module when it runs
    return cli.main(["run", *argv])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
