"""PackReader: random access to packed Parquet, checked against pyarrow's own reading of the same files."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raytrain.dataset.pack_reader import PackReader

SEQ = 8


def _write(folder, name, first, n, row_group_size, with_targets=True):
    """n packs numbered first..first+n-1: input ids filled with the pack number, targets on the first (k % 5) + 1
    positions, the last position padding."""
    k = np.arange(first, first + n)
    labels = np.full((n, SEQ), -100)
    for row, pack in enumerate(k):
        labels[row, :pack % 5 + 1] = 3
    segment_ids = np.zeros((n, SEQ), dtype=np.int64)
    segment_ids[:, -1] = -1
    columns = {"input_ids": list(np.repeat(k[:, None], SEQ, axis=1)), "position_ids": list(np.zeros((n, SEQ), int)),
               "segment_ids": list(segment_ids), "labels": list(labels), "doc_ids": [f"d{p}" for p in k],
               "num_tokens": np.full(n, SEQ - 1)}
    if with_targets:
        columns["num_targets"] = (labels != -100).sum(axis=1)
    pq.write_table(pa.table(columns), folder / name, row_group_size=row_group_size)
    return name


def test_reads_packs_in_any_order_across_files_and_counts_only_what_it_read(tmp_path):
    files = [_write(tmp_path, "a.parquet", 0, 10, 1), _write(tmp_path, "b.parquet", 10, 7, 1)]
    reader = PackReader(str(tmp_path), files)
    assert reader.num_packs == 17
    wanted = [16, 3, 10, 0, 9]
    batch = reader.read(wanted)
    reference = pa.concat_tables([pq.read_table(tmp_path / f) for f in files])  # pyarrow, the whole files
    for name in ("input_ids", "labels", "segment_ids", "position_ids"):
        expected = np.stack(reference.column(name).to_numpy(zero_copy_only=False)[wanted])
        np.testing.assert_array_equal(batch[name], expected)
        assert batch[name].shape == (5, SEQ) and batch[name].dtype == np.int64
    assert batch["doc_ids"].tolist() == [f"d{p}" for p in wanted]
    assert batch["pack_index"].tolist() == wanted
    whole = sum(pq.ParquetFile(tmp_path / f).metadata.row_group(g).total_byte_size
                for f in files for g in range(pq.ParquetFile(tmp_path / f).metadata.num_row_groups))
    assert 0 < reader.bytes_read < whole / 2 and reader.packs_read == 5


def test_larger_row_groups_and_old_files_without_target_counts(tmp_path):
    new = _write(tmp_path, "a.parquet", 0, 6, 4)
    old = _write(tmp_path, "b.parquet", 6, 5, 3, with_targets=False)  # packed before num_targets existed
    reader = PackReader(str(tmp_path), [new, old])
    assert reader.read([7, 5, 0])["input_ids"][:, 0].tolist() == [7, 5, 0]
    counts = reader.counts()
    assert counts.num_targets.tolist() == [k % 5 + 1 for k in range(11)]
    assert counts.num_tokens.tolist() == [SEQ - 1] * 11 and counts.num_packs == 11


def test_out_of_range_and_unreadable_files_are_errors(tmp_path):
    from raytrain.errors import RaytrainError

    name = _write(tmp_path, "a.parquet", 0, 3, 1)
    with pytest.raises(IndexError, match=r"\[0, 3\)"):
        PackReader(str(tmp_path), [name]).read([3])
    (tmp_path / "broken.parquet").write_bytes(b"not parquet")
    with pytest.raises(RaytrainError, match="broken.parquet.*pack again"):
        PackReader(str(tmp_path), [name, "broken.parquet"])
