"""Enrichment (Spark on Ray) + tokenize/pack (Ray Data) only:
`ray job submit --working-dir . -- python jobs/enrich.py --config configs/demo.yaml`.

`raytrain enrich` with the same arguments (jobs/_entry.py)."""

import sys

from _entry import main

if __name__ == "__main__":
    sys.exit(main("enrich"))
