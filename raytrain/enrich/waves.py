"""Waves: the enrichment's input cut into consecutive parts, processed front to back (``enrich.wave_rows``).

A wave is a run of whole Parquet row groups in the input order (``input.splits`` in order, each split's files by
name, each file's row groups in order), closed once it holds at least ``wave_rows`` rows; 0 makes the whole input one
wave. A file larger than a wave is cut between its row groups; a wave reads the rows of its part of each file
(passes.read_inputs). Each wave is enriched, written and committed on its own (``job.enrich_in_session``): a crash
redoes the wave it was in, not the ones before. Every verdict is the same as in one wave: duplicates keep the first
row in input order (``batches.INPUT_ORDER``: row group, then uuid), and a wave is checked against itself and the
dedup state of the waves before it (their exact survivors' keys, signatures and band keys, stored with the run); the
eval-set check and the length policy are per row.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from raytrain.enrich.batches import INPUT_ORDER
from raytrain.storage import RunPaths, StorageLocation

ORDER = ", ".join(INPUT_ORDER)
"""The duplicate order a commit record was made under: a record made under another (or none: a release that ordered
by file) is done again."""


@dataclass(frozen=True)
class InputFile:
    split: str
    loc: StorageLocation
    row_groups: tuple[int, ...]
    """Rows of each Parquet row group of the file, in order (its footer)."""
    first_group: int
    """The position of the file's first row group in the input order (``group_index`` of its rows)."""

    @property
    def rows(self) -> int:
        return sum(self.row_groups)

    def offset(self, group: int) -> int:
        """The file-local first row of row group ``group`` (the file's rows when ``group`` is past the last)."""
        return sum(self.row_groups[:group])


@dataclass(frozen=True)
class Part:
    """Row groups ``groups`` (a range, file-local) of one input file: its rows ``start`` to ``stop`` (excluded)."""

    file: InputFile
    groups: range

    @property
    def start(self) -> int:
        return self.file.offset(self.groups.start)

    @property
    def stop(self) -> int:
        return self.file.offset(self.groups.stop)

    @property
    def rows(self) -> int:
        return self.stop - self.start

    @property
    def whole(self) -> bool:
        return len(self.groups) == len(self.file.row_groups)

    @property
    def first_group(self) -> int:
        """``group_index`` of the part's first row group."""
        return self.file.first_group + self.groups.start

    def group_starts(self) -> list[int]:
        """The file-local first row of each of the part's row groups after the first (where ``group_index`` steps)."""
        return [self.file.offset(g) for g in self.groups[1:]]

    def identity(self) -> str:
        return self.file.loc.uri if self.whole else f"{self.file.loc.uri}#rows={self.start}-{self.stop}"


@dataclass(frozen=True)
class Wave:
    index: int
    parts: tuple[Part, ...]

    @property
    def rows(self) -> int:
        return sum(p.rows for p in self.parts)

    @property
    def name(self) -> str:
        return f"wave-{self.index:05d}"

    @property
    def first_group(self) -> int:
        return self.parts[0].first_group

    @property
    def num_files(self) -> int:
        return len({p.file.loc.uri for p in self.parts})

    def parts_by_split(self) -> dict[str, list[Part]]:
        out: dict[str, list[Part]] = {}
        for p in self.parts:
            out.setdefault(p.file.split, []).append(p)
        return out

    def identity(self) -> list[str]:
        """What the wave reads (its files' URIs in order, ``#rows=a-b`` for part of a file): a commit record is only
        valid for the same parts."""
        return [p.identity() for p in self.parts]


def input_files(files: dict[str, tuple[StorageLocation, ...]], row_groups: dict[str, list[list[int]]]
                ) -> list[InputFile]:
    """Every input file in the input order with its footer's row-group sizes (``row_groups``: per split, per file)."""
    out: list[InputFile] = []
    first = 0
    for split, locs in files.items():
        for loc, groups in zip(locs, row_groups[split], strict=True):
            out.append(InputFile(split, loc, tuple(groups), first))
            first += len(groups)
    return out


def plan_waves(files: list[InputFile], wave_rows: int) -> list[Wave]:
    """Consecutive runs of whole row groups, each closed once it holds >= ``wave_rows`` rows (the last may hold
    fewer); one wave of every file when ``wave_rows`` is 0. Depends only on the files and their row groups."""
    if not wave_rows:
        return [Wave(0, tuple(Part(f, range(len(f.row_groups))) for f in files))]
    waves: list[Wave] = []
    parts: list[Part] = []
    rows = 0
    for f in files:
        start = 0
        for g, n in enumerate(f.row_groups):
            rows += n
            if rows >= wave_rows:
                waves.append(Wave(len(waves), (*parts, Part(f, range(start, g + 1)))))
                parts, rows, start = [], 0, g + 1
        if start < len(f.row_groups):
            parts.append(Part(f, range(start, len(f.row_groups))))
    if parts:
        waves.append(Wave(len(waves), tuple(parts)))
    return waves


def wave_outputs(paths: RunPaths, name: str) -> list[StorageLocation]:
    """The folders wave ``name`` (``wave-NNNNN``) writes in a run (``paths``): its enriched rows, its quarantined
    rows, its dedup state and its statistics table; its commit record (commit_record) comes after them."""
    return [paths.enriched.join(name), paths.quarantine.join(name), paths.waves.join("dedup", name),
            paths.waves.join("stats", name)]


def commit_record(folder: StorageLocation, wave: Wave) -> StorageLocation:
    """``folder`` (the run's data/waves/) ``/wave-NNNNN.json``."""
    return folder.join(f"{wave.name}.json")


def committed(folder: StorageLocation, wave: Wave, data_hash: str) -> dict[str, Any] | None:
    """The wave's commit record when it was committed for the same parts, data settings and duplicate order, else
    None."""
    loc = commit_record(folder, wave)
    if not loc.exists():
        return None
    record = json.loads(loc.read_text())
    if record.get("files") != wave.identity() or record.get("data_hash") != data_hash or record.get("order") != ORDER:
        return None
    return record
