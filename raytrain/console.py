"""What a `raytrain` command shows: raytrain's own stage lines on the console, every other program's output (Spark
and log4j, py4j, Ray core, Ray Data, DeepSpeed, the JVMs and Ray's workers) in the run's ``reports/logs/`` file.

How: `capture` points file descriptors 1 and 2 of this process at the log file (so child processes such as the
Spark driver JVM and C++ code writing to stderr land there too) and keeps a duplicate of the original descriptors
as the console. raytrain's log records reach the console through a handler on the ``raytrain`` logger; lines that
Ray forwards from its workers (``log_to_driver``) reach the console only when they carry ``[raytrain]`` (the
trainer's step, eval and checkpoint lines); all of them are also in the log file. Under a terminal rich styles the
lines and keeps a status line (spinner and the latest stage) under them; without one (``ray job submit``, a pipe)
they are plain text with no control characters. ``-v`` captures
nothing: everything on the console as before.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TextIO

from raytrain.redact import redact

WORKER_MARK = "[raytrain]"
"""Worker output that carries this mark is raytrain's own and goes to the console (see trainer/loop.py)."""

QUIET = "console"
"""``log.info(..., extra={QUIET: False})`` keeps a raytrain record off the console (log file only)."""


def worker_console_lines(data: dict[str, Any]) -> list[str]:
    """The console lines of one batch Ray forwards from a worker (a dict with ``lines``, ``pid`` and maybe
    ``actor_name`` / ``task_name``): only the lines carrying WORKER_MARK, prefixed as Ray prefixes them."""
    who = data.get("actor_name") or data.get("task_name") or ""
    prefix = f"({who} pid={data.get('pid')}) " if who else f"(pid={data.get('pid')}) "
    return [prefix + line for line in data.get("lines") or [] if WORKER_MARK in line]


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


@dataclass
class Console:
    """The user's console: ``out`` and ``err`` are the streams the process had before any capture."""

    out: TextIO
    err: TextIO
    log_path: str | None = None
    """The log file holding the frameworks' output; None when nothing is captured (``-v``)."""
    _live: Any = field(default=None, repr=False)
    """On a terminal while captured: a rich console with a status line (spinner + the latest stage line) kept
    below the printed lines."""
    _status: Any = field(default=None, repr=False)
    _spinner: Any = field(default=None, repr=False)

    def line(self, text: str, *, err: bool = False, style: str | None = None) -> None:
        """One line on the console: styled on a terminal, plain text otherwise."""
        if self._live is not None:
            self._live.print(text, style=style, markup=False, highlight=False)
            if text.strip():
                self._spinner.update(text=f"[dim]{_escape(_short(text))}[/dim]")
            return
        stream = self.err if err else self.out
        if style and _is_terminal(stream):
            from rich.console import Console as RichConsole

            RichConsole(file=stream, soft_wrap=True, highlight=False).print(text, style=style, markup=False)
        else:
            stream.write(text + "\n")
        stream.flush()

    def start_status(self) -> None:
        """On a terminal: a spinner line under the output that shows the latest stage line (rich)."""
        if not _is_terminal(self.out):
            return
        from rich.console import Console as RichConsole
        from rich.live import Live
        from rich.spinner import Spinner

        self._live = RichConsole(file=self.out, soft_wrap=True, highlight=False)
        # Live, not Console.status: status() redirects sys.stdout/sys.stderr into the console, and those are the
        # log file's while captured.
        self._spinner = Spinner("dots", text="[dim]starting[/dim]")
        self._status = Live(self._spinner, console=self._live, transient=True, refresh_per_second=4,
                            redirect_stdout=False, redirect_stderr=False)
        self._status.start()

    def stop_status(self) -> None:
        if self._status is not None:
            self._status.stop()
        self._live = self._status = None


def _short(text: str, width: int = 100) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


_active = Console(out=sys.stdout, err=sys.stderr)


def current() -> Console:
    """The console of this process (the real stdout/stderr when nothing is captured)."""
    return _active


def framework_output_captured() -> bool:
    """True while frameworks write to a log file: interactive extras such as Spark's progress bar are turned off."""
    return _active.log_path is not None


class _ConsoleHandler(logging.Handler):
    """raytrain's log records on the console: 'HH:MM:SS raytrain: message', the level when WARNING or above; no
    tracebacks (they go to the log file)."""

    def emit(self, record: logging.LogRecord) -> None:
        if not getattr(record, QUIET, True):
            return
        try:
            level = f"{record.levelname} " if record.levelno >= logging.WARNING else ""
            stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
            style = "bold red" if record.levelno >= logging.ERROR else "yellow" if record.levelno >= logging.WARNING \
                else None
            # uncaptured (export, generate, before the run's log opens) every record goes to stderr as before, so a
            # command's stdout stays its result
            _active.line(f"{stamp} {level}raytrain: {redact(record.getMessage())}",
                         err=record.levelno >= logging.WARNING or _active.log_path is None, style=style)
        except Exception:  # noqa: BLE001 - logging must never raise into the job
            self.handleError(record)


def _print_worker_lines(data: dict[str, Any]) -> None:
    for text in worker_console_lines(data):
        _active.line(text, style="cyan" if "validation loss" in text or "checkpoint" in text else None)


def hook_worker_output() -> None:
    """After ray.init: show the [raytrain] lines Ray forwards from its workers on the console (Ray itself prints
    every forwarded line to sys.stdout/sys.stderr, which is the log file while captured). No-op without capture."""
    if not framework_output_captured():
        return
    from ray._private.ray_logging import global_worker_stdstream_dispatcher

    global_worker_stdstream_dispatcher.remove_handler("raytrain_console")
    global_worker_stdstream_dispatcher.add_handler("raytrain_console", _print_worker_lines)


class RedactFilter(logging.Filter):
    """Credentials inside URIs (raytrain.redact) taken out of every record a handler writes, whichever library
    logged it."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, None
        return True


class _NotOurs(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.name.startswith("raytrain")


def configure_logging(verbose: bool) -> None:
    """Logging before (or without) a capture. ``verbose``: every record on stderr as 'time LEVEL name: message',
    DEBUG and up. Else raytrain's records come as on the captured console ('time raytrain: message') and other
    loggers' records, WARNING and up, on stderr."""
    if verbose:
        logging.basicConfig(level=logging.DEBUG, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                            datefmt="%H:%M:%S")
        for h in logging.getLogger().handlers:
            h.addFilter(RedactFilter())
        return
    root = logging.getLogger()
    if not root.handlers:  # a process of its own (the CLI); one embedding raytrain keeps its handlers untouched
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
        handler.addFilter(_NotOurs())  # raytrain's records reach the console through _ConsoleHandler, once
        handler.addFilter(RedactFilter())
        root.addHandler(handler)
        root.setLevel(logging.WARNING)
    ours = logging.getLogger("raytrain")
    ours.setLevel(logging.INFO)
    if not any(isinstance(h, _ConsoleHandler) for h in ours.handlers):
        ours.addHandler(_ConsoleHandler(logging.INFO))


def log_file_name(command: str) -> str:
    """``<command>-<YYYYmmdd-HHMMSS>-<pid>.log``: one file per invocation, sorted by time."""
    return f"{command}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"


@contextmanager
def capture(log_path: str) -> Iterator[Console]:
    """Send descriptors 1 and 2 (and so sys.stdout, sys.stderr, child processes, C++ and JVM output) to
    ``log_path`` until the block ends; raytrain's records and [raytrain] worker lines go to the console the process
    had before. Yields that console (``Console.out`` / ``.err`` print to the user)."""
    global _active
    os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    saved_out, saved_err = os.dup(1), os.dup(2)
    out = open(saved_out, "w", buffering=1, encoding="utf-8", errors="replace")  # noqa: SIM115 - closed below
    err = open(saved_err, "w", buffering=1, encoding="utf-8", errors="replace")  # noqa: SIM115
    previous = _active
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    _active = Console(out=out, err=err, log_path=log_path)
    _active.start_status()

    root = logging.getLogger()
    saved_root = (root.level, list(root.handlers))
    for h in saved_root[1]:
        root.removeHandler(h)
    file_handler = logging.StreamHandler(sys.stderr)  # fd 2: the log file, in order with everything else
    file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    file_handler.addFilter(RedactFilter())
    root.addHandler(file_handler)
    root.setLevel(logging.INFO)
    ours = logging.getLogger("raytrain")
    console_handler = None
    if not any(isinstance(h, _ConsoleHandler) for h in ours.handlers):  # configure_logging(False) put one there
        console_handler = _ConsoleHandler(logging.INFO)
        ours.addHandler(console_handler)
    logging.captureWarnings(True)  # warnings.warn of any library: the log file, through the root logger
    try:
        yield _active
    finally:
        _active.stop_status()
        logging.captureWarnings(False)
        if console_handler is not None:
            ours.removeHandler(console_handler)
        root.removeHandler(file_handler)
        root.setLevel(saved_root[0])
        for h in saved_root[1]:
            root.addHandler(h)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved_out, 1)
        os.dup2(saved_err, 2)
        _active = previous
        out.close()
        err.close()
