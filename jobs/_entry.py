"""Shared entrypoint for jobs/*.py (what `ray job submit` runs): each is one `raytrain` command, through the same
parser, logging and error handling as the CLI (raytrain.cli): `python jobs/sft.py --config X k=v` is
`raytrain run --config X k=v`."""

from __future__ import annotations

import os
import sys

# `ray job submit --working-dir .` ships the repo; make its raytrain/ importable even when not pip-installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(command: str) -> int:
    """Exit code of `raytrain <command> <this script's arguments>`."""
    from raytrain.cli import main as cli_main

    return cli_main([command, *sys.argv[1:]])
