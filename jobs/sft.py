"""Enrich, pack and train in one job: `ray job submit --working-dir . -- python jobs/sft.py --config configs/demo.yaml`.

Inside `ray job submit` it joins the job's cluster (RAY_ADDRESS is set for it); run bare it starts an embedded Ray.
"""

import sys

from _entry import main

if __name__ == "__main__":
    from raytrain.runner import run_sft

    sys.exit(main(__doc__.splitlines()[0], run_sft))
