"""Waves: the enrichment's input cut into consecutive parts, processed front to back (``enrich.wave_rows``).

A wave is a run of whole input files, in the input order (``input.splits`` in order, each split's files by name),
closed once it holds at least ``wave_rows`` rows; 0 makes the whole input one wave. Each wave is enriched, written
and committed on its own (``job.enrich_in_session``): a crash redoes the wave it was in, not the ones before. Every
verdict is the same as in one wave: duplicates keep the first row in input order (``batches.INPUT_ORDER``), and a
wave is checked against itself and the dedup state of the waves before it (their exact survivors' keys, signatures
and band keys, stored with the run); the eval-set check and the length policy are per row.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from raytrain.storage import StorageLocation


@dataclass(frozen=True)
class InputFile:
    split: str
    loc: StorageLocation
    rows: int
    index: int
    """The file's position in the input order (``file_index`` of its rows)."""


@dataclass(frozen=True)
class Wave:
    index: int
    files: tuple[InputFile, ...]

    @property
    def rows(self) -> int:
        return sum(f.rows for f in self.files)

    @property
    def name(self) -> str:
        return f"wave-{self.index:05d}"

    def files_by_split(self) -> dict[str, list[InputFile]]:
        out: dict[str, list[InputFile]] = {}
        for f in self.files:
            out.setdefault(f.split, []).append(f)
        return out

    def identity(self) -> list[str]:
        """What the wave reads (its files' URIs in order): a commit record is only valid for the same files."""
        return [f.loc.uri for f in self.files]


def input_files(files: dict[str, tuple[StorageLocation, ...]], rows: dict[str, list[int]]) -> list[InputFile]:
    """Every input file in the input order with its footer row count (``rows``: per split, per file)."""
    out: list[InputFile] = []
    for split, locs in files.items():
        for loc, n in zip(locs, rows[split], strict=True):
            out.append(InputFile(split, loc, n, len(out)))
    return out


def plan_waves(files: list[InputFile], wave_rows: int) -> list[Wave]:
    """Consecutive runs of whole files, each closed once it holds >= ``wave_rows`` rows (the last may hold
    fewer); one wave of every file when ``wave_rows`` is 0. Depends only on the files and their row counts."""
    if not wave_rows:
        return [Wave(0, tuple(files))]
    waves: list[Wave] = []
    current: list[InputFile] = []
    rows = 0
    for f in files:
        current.append(f)
        rows += f.rows
        if rows >= wave_rows:
            waves.append(Wave(len(waves), tuple(current)))
            current, rows = [], 0
    if current:
        waves.append(Wave(len(waves), tuple(current)))
    return waves


def commit_record(folder: StorageLocation, wave: Wave) -> StorageLocation:
    """``folder`` (the run's data/waves/) ``/wave-NNNNN.json``."""
    return folder.join(f"{wave.name}.json")


def committed(folder: StorageLocation, wave: Wave, data_hash: str) -> dict[str, Any] | None:
    """The wave's commit record when it was committed for the same files and data settings, else None."""
    loc = commit_record(folder, wave)
    if not loc.exists():
        return None
    record = json.loads(loc.read_text())
    if record.get("files") != wave.identity() or record.get("data_hash") != data_hash:
        return None
    return record
