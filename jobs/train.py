"""Train on the packed data an earlier enrich of the same run wrote:
`ray job submit --working-dir . -- python jobs/train.py --config configs/demo.yaml train.max_steps=100`."""

import sys

from _entry import main

if __name__ == "__main__":
    from raytrain.runner import run_train

    sys.exit(main(__doc__.splitlines()[0], run_train))
