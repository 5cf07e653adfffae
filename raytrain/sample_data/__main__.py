"""``python -m raytrain.sample_data OUT_DIR [--seed 0] [--rows-per-split 64] [--size-scale 0.04]``."""

from raytrain.sample_data import main

raise SystemExit(main())
