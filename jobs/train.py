"""Train on the packed data an earlier enrich of the same run wrote:
`ray job submit --working-dir . -- python jobs/train.py --config configs/demo.yaml train.max_steps=100`.

`raytrain train` with the same arguments (jobs/_entry.py)."""

import sys

from _entry import main

if __name__ == "__main__":
    sys.exit(main("train"))
