"""Which modules an import brings, checked in a fresh interpreter (this test process has imported everything)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def loaded_by(imports: list[str], watched: list[str]) -> list[str]:
    """The modules of ``watched`` in sys.modules after importing ``imports`` in a new Python process run from the
    repository root."""
    code = (f"import json, sys; import {', '.join(imports)}; "
            f"print(json.dumps(sorted(m for m in {watched!r} if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": ROOT})
    return json.loads(out.stdout.strip().splitlines()[-1])
