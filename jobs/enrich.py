"""Enrichment (Spark on Ray) + tokenize/pack (Ray Data) only:
`ray job submit --working-dir . -- python jobs/enrich.py --config configs/demo.yaml`."""

import sys

from _entry import main

if __name__ == "__main__":
    from raytrain.runner import run_enrich_only

    sys.exit(main(__doc__.splitlines()[0], run_enrich_only, takes_failures=False))
