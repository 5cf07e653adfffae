"""Shared entrypoint plumbing for jobs/*.py (what `ray job submit` runs): parse, log the resolved config, run."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

# `ray job submit --working-dir .` ships the repo; make its raytrain/ importable even when not pip-installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(description: str, stage: Callable[..., Any], takes_failures: bool = True) -> int:
    from raytrain.config import load_job_config
    from raytrain.errors import ConfigError, RaytrainError

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", default="configs/demo.yaml", help="job YAML")
    if takes_failures:
        parser.add_argument("--max-failures", type=int, default=0, help="worker failures to recover from")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.max_steps=20")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        job = load_job_config(args.config, args.overrides)
        logging.info("resolved config: %s", json.dumps(job.to_dict(), sort_keys=True))
        result = stage(job, max_failures=args.max_failures) if takes_failures else stage(job)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except RaytrainError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2, default=str) if isinstance(result, dict) else result)
    return 0
