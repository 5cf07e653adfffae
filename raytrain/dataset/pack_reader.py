"""Random access to the packed sequences: a trainer rank reads exactly the packs its replica consumes.

The packing stage writes one pack per Parquet row group (``stream.PACK_ROW_GROUP_ROWS``), so reading pack i reads
its own column chunks and nothing else. Files written with larger row groups still read correctly: the whole row
group is read and counted in ``bytes_read``.

``PackReader.counts()`` reads only the light per-pack columns (real tokens, target tokens): every data-reading rank
needs them for every pack, because a step's loss scale counts the targets of all replicas' micro-batches
(raytrain.trainer.feed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raytrain.errors import RaytrainError
from raytrain.storage import resolve

SEQUENCE_COLUMNS = ("input_ids", "position_ids", "segment_ids", "labels")
READ_COLUMNS = (*SEQUENCE_COLUMNS, "doc_ids")
PAIR_COUNT_COLUMNS = ("num_pairs", "chosen_targets")
"""A preference pack's counts (raytrain.dataset.pair_pack.pair_pack_batch); its ``pair_segments`` is read with it."""


@dataclass(frozen=True)
class PackCounts:
    """Per-pack token counts in the packed dataset's fixed order: real (non-padding) tokens and target tokens."""

    num_tokens: np.ndarray  # (num_packs,) int64
    num_targets: np.ndarray  # (num_packs,) int64
    num_pairs: np.ndarray | None = None
    """(num_packs,) int64 preference pairs per pack (packs of raytrain.dataset.pair_pack); None for conversations."""
    chosen_targets: np.ndarray | None = None
    """(num_packs,) int64 target tokens of the chosen responses (pair packs); None for conversations."""

    @property
    def num_packs(self) -> int:
        return len(self.num_tokens)


class PackReader:
    """Reads packs by their index in the fixed order of ``files`` (names under ``folder_uri``)."""

    def __init__(self, folder_uri: str, files: Sequence[str], s3_endpoint: str | None = None) -> None:
        self.folder_uri, self.file_names, self.s3_endpoint = folder_uri, tuple(files), s3_endpoint
        folder = resolve(folder_uri, s3_endpoint=s3_endpoint)
        self._fs = folder.filesystem
        self._paths = [folder.join(name).path for name in self.file_names]
        self._files: dict[int, pq.ParquetFile] = {}
        rows = [self._file(i).metadata.num_rows for i in range(len(self._paths))]
        self._file_start = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)  # (num_files + 1,)
        self._group_start: dict[int, np.ndarray] = {}
        self.bytes_read = 0
        self.packs_read = 0

    @property
    def num_packs(self) -> int:
        return int(self._file_start[-1])

    def _file(self, i: int) -> pq.ParquetFile:
        if i not in self._files:
            try:
                self._files[i] = pq.ParquetFile(self._fs.open_input_file(self._paths[i]))
            except (OSError, pa.ArrowException) as e:
                raise RaytrainError(f"cannot read packed file {self.folder_uri}/{self.file_names[i]}: {e}. "
                                    "Delete the run's data/packed/ to pack again.") from e
        return self._files[i]

    def _groups(self, i: int) -> np.ndarray:
        """Row offsets of file i's row groups (num_groups + 1,)."""
        if i not in self._group_start:
            md = self._file(i).metadata
            sizes = [md.row_group(g).num_rows for g in range(md.num_row_groups)]
            self._group_start[i] = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        return self._group_start[i]

    def counts(self) -> PackCounts:
        """Real and target tokens of every pack (reads the small ``num_tokens`` / ``num_targets`` columns; packs
        written before ``num_targets`` existed are counted from their labels)."""
        tokens, targets, pairs, chosen = [], [], [], []
        for i in range(len(self._paths)):
            f = self._file(i)
            names = f.schema_arrow.names
            columns = ["num_tokens", "num_targets"] if "num_targets" in names else ["num_tokens", "labels"]
            t = f.read(columns=columns + [c for c in PAIR_COUNT_COLUMNS if c in names])
            tokens.append(t.column("num_tokens").to_numpy())
            if "num_targets" in names:
                targets.append(t.column("num_targets").to_numpy())
            else:
                targets.append((_sequences(t.column("labels")) != -100).sum(axis=1))
            if "num_pairs" in names:
                pairs.append(t.column("num_pairs").to_numpy())
                chosen.append(t.column("chosen_targets").to_numpy())
        if not tokens:
            return PackCounts(np.zeros(0, np.int64), np.zeros(0, np.int64))
        return PackCounts(np.concatenate(tokens).astype(np.int64), np.concatenate(targets).astype(np.int64),
                          np.concatenate(pairs).astype(np.int64) if pairs else None,
                          np.concatenate(chosen).astype(np.int64) if chosen else None)

    def read(self, packs: Sequence[int]) -> dict[str, np.ndarray]:
        """The packs ``packs`` (indices into the fixed order), in that order, as a numpy batch: the four
        (n, seq_len) int64 sequence columns, ``doc_ids`` and ``pack_index``. Each row group is read once."""
        packs = np.asarray(packs, dtype=np.int64)
        if len(packs) and (packs.min() < 0 or packs.max() >= self.num_packs):
            raise IndexError(f"pack index out of range [0, {self.num_packs}) in {self.folder_uri}")
        file_of = np.searchsorted(self._file_start, packs, side="right") - 1
        tables: dict[tuple[int, int], pa.Table] = {}
        rows: list[tuple[tuple[int, int], int]] = []
        for pack, f in zip(packs.tolist(), file_of.tolist(), strict=True):
            in_file = pack - int(self._file_start[f])
            starts = self._groups(f)
            g = int(np.searchsorted(starts, in_file, side="right") - 1)
            key = (f, g)
            if key not in tables:
                columns = [*READ_COLUMNS, *(["pair_segments"] if "pair_segments" in self._file(f).schema_arrow.names
                                            else [])]
                tables[key] = self._file(f).read_row_group(g, columns=columns)
                md = self._file(f).metadata.row_group(g)
                self.bytes_read += sum(md.column(c).total_compressed_size for c in range(md.num_columns)
                                       if md.column(c).path_in_schema.split(".")[0] in columns)
            rows.append((key, in_file - int(starts[g])))
        self.packs_read += len(packs)
        if not rows:
            return {}
        picked = pa.concat_tables([tables[key].slice(offset, 1) for key, offset in rows]).combine_chunks()
        out: dict[str, np.ndarray] = {name: _sequences(picked.column(name)) for name in SEQUENCE_COLUMNS}
        out["doc_ids"] = np.array(picked.column("doc_ids").to_pylist(), dtype=object)
        if "pair_segments" in picked.column_names:
            out["pair_segments"] = _sequences(picked.column("pair_segments"))
        out["pack_index"] = packs
        return out


def _sequences(column: pa.ChunkedArray) -> np.ndarray:
    """A list<int64> column of equal-length lists as an (n, seq_len) int64 array."""
    arr = column.combine_chunks()
    if isinstance(arr, pa.ExtensionArray):  # Ray's tensor extension type, when Ray is imported in this process
        arr = arr.storage
    n = len(arr)
    flat = arr.flatten().to_numpy(zero_copy_only=False)
    return np.array(flat, dtype=np.int64).reshape(n, -1 if n else 0)
