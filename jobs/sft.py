"""Enrich, pack and train in one job: `ray job submit --working-dir . -- python jobs/sft.py --config configs/demo.yaml`.

`raytrain run` with the same arguments (jobs/_entry.py).

Inside `ray job submit` it joins the job's cluster (RAY_ADDRESS is set for it); run bare it starts an embedded Ray.
On a shared cluster name yourself when submitting, so the run is yours (docs/shared-runs.md):
`ray job submit --runtime-env-json '{"env_vars": {"RAYTRAIN_USER": "'$USER'"}}' ... -- python jobs/sft.py ...`.
"""

import sys

from _entry import main

if __name__ == "__main__":
    sys.exit(main("run"))
