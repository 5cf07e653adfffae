"""Find the input Parquet files of nvidia/Nemotron-Post-Training-Dataset-v1 in whatever layout the user has.

Accepted layouts, checked in this order at the path the user gives (``input.path``):

(a) the hub's ``data/`` folder itself, holding ``<prefix>-NNNNN-of-NNNNN.parquet``;
(b) a dataset root (or one hub-cache snapshot, ``snapshots/<revision>/``) holding that ``data/`` folder;
(c) the hub repo cache folder ``datasets--nvidia--Nemotron-Post-Training-Dataset-v1`` holding ``snapshots/``:
    the revision in ``refs/main`` when present, else the only snapshot;
(d) the project's older layout, one folder per split: ``<root>/<split>/*.parquet`` (the shipped sample).

The card maps splits to file prefixes: chat, code, math, stem by name, and **tool_calling to ``tool-*``**
(``tool_calling-*`` is accepted too). A split with fewer shards than its ``-of-NNNNN`` count is reported in
``missing_shards`` and ``describe()``, not refused: partial downloads are how smoke runs start.

Pure listing through ``StorageLocation`` (local paths, file://, s3://); no Spark or Ray. On a local disk the hub
cache's snapshot files are symlinks into ``blobs/``: pyarrow's LocalFileSystem follows them (a symlinked file is
a File), and leaves a dangling one (blob not downloaded) out of a listing altogether.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raytrain.config import SPLITS
from raytrain.enrich.schema import null_typed_paths, validate_schema
from raytrain.errors import RaytrainError
from raytrain.storage import StorageLocation

HUB_REPO_DIR = "datasets--nvidia--Nemotron-Post-Training-Dataset-v1"
LAYOUT_HUB = "hub"
LAYOUT_SPLIT_FOLDERS = "split_folders"

# <prefix>-NNNNN-of-NNNNN.parquet as the hub publishes them; the card calls tool_calling's files "tool-*".
SHARD_RE = re.compile(r"^(chat|code|math|stem|tool|tool_calling)-(\d{5})-of-(\d{5})\.parquet$")
PREFIX_TO_SPLIT = {"chat": "chat", "code": "code", "math": "math", "stem": "stem", "tool": "tool_calling",
                   "tool_calling": "tool_calling"}
_MAX_NAMES = 10  # entries named in an error or a describe() line before "... and N more"

_ACCEPTED = (
    "Accepted layouts: (a) the hub's data/ folder holding <prefix>-NNNNN-of-NNNNN.parquet "
    "(prefixes chat, code, math, stem, tool); (b) a dataset root or hub snapshot folder holding that data/; "
    f"(c) the hub cache folder {HUB_REPO_DIR}/ holding snapshots/ and refs/main; "
    f"(d) one folder per split: <root>/<split>/*.parquet with split in {', '.join(SPLITS)}"
)


@dataclass(frozen=True)
class InputFiles:
    """What `discover_inputs` found: the requested splits' files, and how complete they are."""

    root: StorageLocation
    """The folder the layout was found at: the data/ folder (a), the dataset root or snapshot (b, c; a hub
    cache folder resolves to its snapshot), or the split-folder root (d)."""
    layout: str
    """"hub" (data/<prefix>-NNNNN-of-NNNNN.parquet) or "split_folders" (<root>/<split>/*.parquet)."""
    files: dict[str, tuple[StorageLocation, ...]]
    """Requested split -> its files, sorted by name; every requested split has at least one."""
    missing_shards: dict[str, list[str]]
    """Split -> expected shard file names (from -of-NNNNN) not present; only splits with gaps appear."""

    def describe(self) -> list[str]:
        """Human lines for the log and the run report: the layout and root, then one line per split."""
        lines = [f"inputs: {self.layout} layout at {self.root.uri}"]
        for split, locs in self.files.items():
            stems = [_stem(loc.name) for loc in locs]
            shown = stems[0] if len(stems) == 1 else f"{stems[0]} .. {stems[-1]}"
            line = f"{split}: {len(locs)} file{'s' if len(locs) != 1 else ''} ({shown})"
            missing = self.missing_shards.get(split)
            if missing:
                total = len(locs) + len(missing)
                line += f"; missing {len(missing)} of {total} shards: {some_names(missing)}"
            lines.append(line)
        return lines


def discover_inputs(input_root: StorageLocation, splits: tuple[str, ...]) -> InputFiles:
    """Find the files of the requested `splits` under `input_root` in any accepted layout (module docstring).

    Raises RaytrainError naming the path, what was found there and the fix when the path does not exist,
    nothing matches a layout, a requested split has no files, or shards of one split disagree on their count.
    """
    info = input_root.filesystem.get_file_info(input_root.path)
    if info.type == pafs.FileType.NotFound:
        raise RaytrainError(
            f"input.path: {input_root.uri} does not exist. Fix: point it at the dataset root, its data/ "
            f"folder or the hub cache folder {HUB_REPO_DIR}/, or use input.path=sample.")
    if info.type != pafs.FileType.Directory:
        raise RaytrainError(f"input.path: {input_root.uri} is a file, not a folder. Fix: point it at the "
                            "folder holding the Parquet files (or their data/ folder).")
    entries = list_entries(input_root)

    found = _hub_layout(input_root, entries)
    if found is None and is_dir_entry(entries, "snapshots"):
        snapshot = pick_snapshot(input_root)
        found = _hub_layout(snapshot, list_entries(snapshot))
        if found is None:
            raise RaytrainError(
                f"input.path: hub cache snapshot {snapshot.uri} holds no data/<prefix>-NNNNN-of-NNNNN.parquet "
                f"files (found: {some_names(named_entries(list_entries(snapshot)))}). Fix: finish the download "
                "(huggingface-cli download nvidia/Nemotron-Post-Training-Dataset-v1 --repo-type dataset) "
                "or point input.path at another snapshot.")
    if found is not None:
        root, data_dir, data_entries = found
        by_split = _group_hub_files(data_dir, data_entries)
        layout = LAYOUT_HUB
    else:
        by_split = _group_split_folders(input_root, entries)
        if not by_split:
            raise _nothing_matches(input_root, entries)
        root, layout = input_root, LAYOUT_SPLIT_FOLDERS

    absent = [s for s in splits if s not in by_split]
    if absent:
        raise RaytrainError(
            f"input.splits: no files for split(s) {absent} under {root.uri} ({layout} layout); found splits "
            f"{sorted(by_split)}. Fix: drop {', '.join(repr(s) for s in absent)} from input.splits "
            f"(e.g. input.splits=[{', '.join(s for s in splits if s in by_split) or '...'}]) or download "
            "their files.")
    files: dict[str, tuple[StorageLocation, ...]] = {}
    missing: dict[str, list[str]] = {}
    for split in splits:
        locs = tuple(sorted(by_split[split], key=lambda loc: loc.name))
        files[split] = locs
        gaps = _missing_shards(split, locs)
        if gaps:
            missing[split] = gaps
    return InputFiles(root=root, layout=layout, files=files, missing_shards=missing)


def validate_inputs(inputs: InputFiles) -> dict[str, dict[str, Any]]:
    """Check every file's schema from its footer (no rows read); returns {split: {"files": n, "rows": rows,
    "file_row_groups": [[rows of each row group] of each file, in order], "schema": the files' pyarrow schema when
    they all have the same one, else None}} (Spark reads with that schema instead of inferring it: one job per read
    saved).

    Raises RaytrainError naming the file: not readable as Parquet, or a missing/mistyped column
    (schema.validate_schema); or naming two files of one split where one wrote a field as all-null (type null)
    and the other with its type (Spark reads a split with one schema and fails the task on the other file)."""
    counts: dict[str, dict[str, Any]] = {}
    for split, locs in inputs.files.items():
        rows, schemas, file_row_groups = 0, [], []
        for loc in locs:
            try:
                with loc.filesystem.open_input_file(loc.path) as f:  # seekable: Parquet reads the footer
                    meta = pq.ParquetFile(f).metadata
            except Exception as e:  # pyarrow raises ArrowInvalid/OSError (a directory, non-Parquet bytes)
                raise RaytrainError(f"{loc.uri}: not a readable Parquet file ({e}). Fix or remove it.") from None
            schema = meta.schema.to_arrow_schema()
            validate_schema(schema, loc.uri)
            rows += meta.num_rows
            file_row_groups.append([meta.row_group(g).num_rows for g in range(meta.num_row_groups)])
            schemas.append(schema.remove_metadata())
        same = all(s.equals(schemas[0]) for s in schemas)
        if not same:
            _refuse_mixed_null_types(split, locs, schemas)
        counts[split] = {"files": len(locs), "rows": rows, "file_row_groups": file_row_groups,
                         "schema": schemas[0] if schemas and same else None}
    return counts


def _refuse_mixed_null_types(split: str, locs: tuple[StorageLocation, ...], schemas: list) -> None:
    """RaytrainError naming the field and a file of each kind when the files of ``split`` disagree on whether a
    field is null-typed; a file-level mismatch is refused before Spark starts rather than quarantined row by row:
    it is a property of how the file was written, not of one row, and the fix is to rewrite the file."""
    typed: dict[str, StorageLocation] = {}
    null: dict[str, StorageLocation] = {}
    for loc, schema in zip(locs, schemas, strict=True):
        for path, is_null in null_typed_paths(schema).items():
            (null if is_null else typed).setdefault(path, loc)
    mixed = sorted(set(typed) & set(null), key=len)  # the outermost field first
    if mixed:
        path = mixed[0]
        raise RaytrainError(
            f"split {split!r}: column {path} is all-null (type null) in {null[path].uri} but typed in "
            f"{typed[path].uri}; Spark reads one split with one schema and cannot read both. Fix: rewrite "
            f"{null[path].name} with the Nemotron v1 schema (pyarrow: pq.write_table(raytrain.enrich.schema."
            "conform_table(pq.read_table(path), path), path)), or enrich the two files in separate runs.")


# ---- layouts -----------------------------------------------------------------------------------------------
def _hub_layout(loc: StorageLocation, entries: dict[str, pafs.FileType]
                ) -> tuple[StorageLocation, StorageLocation, dict[str, pafs.FileType]] | None:
    """(root, data folder, data folder entries) when `loc` is (a) a data/ folder or (b) holds one, else None."""
    if _shard_names(entries):
        return loc, loc, entries
    if is_dir_entry(entries, "data"):
        data = loc.join("data")
        data_entries = list_entries(data)
        if _shard_names(data_entries):
            return loc, data, data_entries
    return None


def pick_snapshot(repo: StorageLocation) -> StorageLocation:
    """The snapshot of a hub repo cache folder: refs/main's revision, else the only one; else RaytrainError."""
    snapshots_dir = repo.join("snapshots")
    snapshots = sorted(n for n, t in list_entries(snapshots_dir).items() if t == pafs.FileType.Directory)
    ref = repo.join("refs", "main")
    if ref.is_file():
        revision = ref.read_text().strip()
        if revision in snapshots:
            return snapshots_dir.join(revision)
        raise RaytrainError(
            f"input.path: {ref.uri} names revision {revision!r} but {snapshots_dir.uri} holds "
            f"{snapshots or 'no snapshots'}. Fix: finish the download or point input.path at one of "
            f"{snapshots_dir.uri}/<revision>.")
    if len(snapshots) == 1:
        return snapshots_dir.join(snapshots[0])
    raise RaytrainError(
        f"input.path: {repo.uri} has no refs/main and {len(snapshots)} snapshots ({some_names(snapshots)}). "
        f"Fix: point input.path at one of them, e.g. {snapshots_dir.uri}/<revision>.")


def _group_hub_files(data_dir: StorageLocation, entries: dict[str, pafs.FileType]) -> dict[str, list[StorageLocation]]:
    by_split: dict[str, list[StorageLocation]] = {}
    for name in _shard_names(entries):
        split = PREFIX_TO_SPLIT[name.split("-", 1)[0]]  # _shard_names only returns SHARD_RE matches
        by_split.setdefault(split, []).append(data_dir.join(name))
    return by_split


def _group_split_folders(root: StorageLocation, entries: dict[str, pafs.FileType]) -> dict[str, list[StorageLocation]]:
    """(d): every known split's folder that holds at least one visible *.parquet file."""
    by_split: dict[str, list[StorageLocation]] = {}
    for split in SPLITS:
        if not is_dir_entry(entries, split):
            continue
        folder = root.join(split)
        names = sorted(n for n, t in list_entries(folder).items()
                       if t == pafs.FileType.File and n.endswith(".parquet") and not n.startswith((".", "_")))
        if names:
            by_split[split] = [folder.join(n) for n in names]
    return by_split


def _missing_shards(split: str, locs: tuple[StorageLocation, ...]) -> list[str]:
    """Expected shard names absent from `locs` (only names in the hub's pattern count); raises when shards of
    the split disagree on their -of- count, an index is out of range, or one index appears twice."""
    shards = [(loc, m) for loc in locs if (m := SHARD_RE.match(loc.name))]
    if not shards:
        return []
    totals = {int(m.group(3)) for _, m in shards}
    if len(totals) > 1:
        listed = ", ".join(loc.name for loc, _ in shards[:_MAX_NAMES])
        raise RaytrainError(
            f"split {split!r}: shards in {shards[0][0].parent.uri} disagree on their shard count "
            f"(-of- {sorted(totals)}: {listed}). Fix: keep the files of one download (one revision) only.")
    total = totals.pop()
    seen: dict[int, str] = {}
    for loc, m in shards:
        index = int(m.group(2))
        if index >= total:
            raise RaytrainError(f"split {split!r}: {loc.uri} has shard index {index} but a count of {total}. "
                                "Fix: remove or re-download the file.")
        if index in seen:
            raise RaytrainError(f"split {split!r}: shard {index} appears twice in {loc.parent.uri} ({seen[index]} "
                                f"and {loc.name}). Fix: remove one of them.")
        seen[index] = loc.name
    prefix = shards[0][1].group(1)
    return [f"{prefix}-{i:05d}-of-{total:05d}.parquet" for i in range(total) if i not in seen]


def _nothing_matches(root: StorageLocation, entries: dict[str, pafs.FileType]) -> RaytrainError:
    found = f"found: {some_names(named_entries(entries)) if entries else 'nothing (empty folder)'}"
    if is_dir_entry(entries, "data"):
        data_entries = list_entries(root.join("data"))
        found += f"; in its data/: {some_names(named_entries(data_entries)) if data_entries else 'nothing'}"
    hint = ""
    if is_dir_entry(entries, HUB_REPO_DIR):
        hint = f" This looks like a hub cache: point input.path at {root.join(HUB_REPO_DIR).uri}."
    return RaytrainError(
        f"input.path: no Nemotron-Post-Training-Dataset-v1 Parquet files at {root.uri} ({found}). "
        f"{_ACCEPTED}.{hint} Fix: point input.path at one of these, or use input.path=sample.")


# ---- listing helpers ---------------------------------------------------------------------------------------
def list_entries(loc: StorageLocation) -> dict[str, pafs.FileType]:
    """Visible children of `loc` -> their type, in one listing call; {} when missing or not a folder."""
    try:
        infos = loc.filesystem.get_file_info(pafs.FileSelector(loc.path, allow_not_found=True))
    except (NotADirectoryError, FileNotFoundError):
        return {}
    out: dict[str, pafs.FileType] = {}
    for info in infos:
        name = info.base_name or info.path.rstrip("/").rsplit("/", 1)[-1]
        if name and not name.startswith("."):  # .gitattributes, .cache/, editor and checksum files
            out[name] = info.type
    return dict(sorted(out.items()))


def is_dir_entry(entries: dict[str, pafs.FileType], name: str) -> bool:
    return entries.get(name) == pafs.FileType.Directory


def _shard_names(entries: dict[str, pafs.FileType]) -> list[str]:
    return sorted(n for n, t in entries.items() if t == pafs.FileType.File and SHARD_RE.match(n))


def named_entries(entries: dict[str, pafs.FileType]) -> list[str]:
    return [n + "/" if t == pafs.FileType.Directory else n for n, t in entries.items()]


def some_names(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_NAMES])
    return shown + (f" ... and {len(names) - _MAX_NAMES} more" if len(names) > _MAX_NAMES else "")


def _stem(name: str) -> str:
    return name[: -len(".parquet")] if name.endswith(".parquet") else name
