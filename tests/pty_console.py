"""Run a command with a pseudo-terminal as its console, as a user's terminal would be (shared test helper)."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import time


def run_in_pty(args: list[str], *, env: dict[str, str], cwd: str | None = None,
               timeout_s: float = 600) -> tuple[int, str]:
    """Run ``args`` with a pty as stdin, stdout and stderr; returns the exit code and everything it wrote
    (decoded; the terminal turns each newline into CR LF)."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(args, cwd=cwd, env=env, stdin=follower, stdout=follower, stderr=follower)
    os.close(follower)
    chunks, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([leader], [], [], 5)
        if ready:
            try:
                data = os.read(leader, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    try:
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
    os.close(leader)
    return code, b"".join(chunks).decode("utf-8", "replace")
