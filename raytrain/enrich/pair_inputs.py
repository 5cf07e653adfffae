"""Find the preference pairs' files: nvidia/HelpSteer3's ``preference`` config as the hub lays it out, or the same
names in a folder of one's own.

Accepted layouts, checked in this order at ``input.path``:

(a) the ``preference/`` folder itself, holding ``train.jsonl.gz`` and optionally ``validation.jsonl.gz`` (``.jsonl``
    uncompressed is accepted too);
(b) a dataset root (or one hub-cache snapshot, ``snapshots/<revision>/``) holding that ``preference/`` folder;
(c) the hub repo cache folder ``datasets--nvidia--HelpSteer3`` holding ``snapshots/``: the revision in
    ``refs/main`` when present, else the only snapshot.

The rows of ``train`` are trained; those of ``validation`` are the held-out pairs the validation metrics read. Both
go through the same doors. Pure listing through ``StorageLocation`` (local paths, file://, s3://).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pyarrow.fs as pafs

from raytrain.enrich.inputs import is_dir_entry, list_entries, named_entries, pick_snapshot, some_names
from raytrain.errors import RaytrainError
from raytrain.storage import StorageLocation

HUB_REPO_DIR = "datasets--nvidia--HelpSteer3"
CONFIG_DIR = "preference"
PAIR_SPLITS = ("train", "validation")
_FILE_RE = re.compile(r"^(train|validation)\.jsonl(\.gz)?$")


@dataclass(frozen=True)
class PairInputFiles:
    """What ``discover_pair_inputs`` found."""

    root: StorageLocation
    """The folder holding the split files (a ``preference/`` folder)."""
    files: dict[str, StorageLocation]
    """Split ("train", "validation") -> its file; train always, validation when present."""

    def describe(self) -> list[str]:
        return [f"inputs: preference pairs at {self.root.uri}",
                *(f"{split}: {loc.name}" for split, loc in self.files.items())]


def _split_files(folder: StorageLocation, entries: dict[str, pafs.FileType]) -> dict[str, StorageLocation]:
    files: dict[str, StorageLocation] = {}
    for name in sorted(entries):
        match = _FILE_RE.match(name)
        if match and entries[name] == pafs.FileType.File:
            if match.group(1) in files:
                raise RaytrainError(f"input.path: {folder.uri} holds both {files[match.group(1)].name} and {name}. "
                                    "Fix: keep one of them.")
            files[match.group(1)] = folder.join(name)
    return files


def _preference_folder(loc: StorageLocation) -> tuple[StorageLocation, dict[str, StorageLocation]] | None:
    """(a) or (b) at ``loc``: the folder and its split files, else None."""
    entries = list_entries(loc)
    files = _split_files(loc, entries)
    if files:
        return loc, files
    if is_dir_entry(entries, CONFIG_DIR):
        folder = loc.join(CONFIG_DIR)
        files = _split_files(folder, list_entries(folder))
        if files:
            return folder, files
    return None


def discover_pair_inputs(input_root: StorageLocation) -> PairInputFiles:
    """The preference files under ``input_root`` in any accepted layout (module docstring); RaytrainError naming
    the path, what is there and the fix otherwise."""
    info = input_root.filesystem.get_file_info(input_root.path)
    if info.type != pafs.FileType.Directory:
        what = "does not exist" if info.type == pafs.FileType.NotFound else "is a file, not a folder"
        raise RaytrainError(f"input.path: {input_root.uri} {what}. Fix: point it at HelpSteer3's dataset root, its "
                            f"{CONFIG_DIR}/ folder or the hub cache folder {HUB_REPO_DIR}/.")
    found = _preference_folder(input_root)
    if found is None and is_dir_entry(list_entries(input_root), "snapshots"):
        found = _preference_folder(pick_snapshot(input_root))
    if found is None:
        entries = list_entries(input_root)
        raise RaytrainError(
            f"input.path: no preference pairs at {input_root.uri} (found: "
            f"{some_names(named_entries(entries)) if entries else 'nothing (empty folder)'}). Accepted: a "
            f"{CONFIG_DIR}/ folder holding train.jsonl.gz (and validation.jsonl.gz), a dataset root or hub snapshot "
            f"holding that folder, or the hub cache folder {HUB_REPO_DIR}/. Fix: point input.path at one of these.")
    folder, files = found
    if "train" not in files:
        raise RaytrainError(f"input.path: {folder.uri} holds {sorted(f.name for f in files.values())} but no "
                            "train.jsonl.gz. Fix: download the train split too.")
    return PairInputFiles(root=folder, files={split: files[split] for split in PAIR_SPLITS if split in files})
