"""Waves (raytrain.enrich.waves): whole row groups in input order, cut by rows; commit records valid only for the same
parts, data settings and duplicate order."""

import json

import pytest

from raytrain.config import load_job_config
from raytrain.enrich.waves import ORDER, commit_record, committed, input_files, plan_waves
from raytrain.errors import ConfigError
from raytrain.storage import resolve


def _files(tmp_path, groups_per_split):
    """``groups_per_split``: per split, per file, its row groups' rows (an int: a file of one row group)."""
    groups = {split: [[g] if isinstance(g, int) else g for g in files] for split, files in groups_per_split.items()}
    files = {split: tuple(resolve(str(tmp_path / f"{split}-{i:05d}.parquet")) for i in range(len(rows)))
             for split, rows in groups.items()}
    return input_files(files, groups)


def _parts(wave):
    return [(p.file.loc.name, p.groups.start, p.groups.stop) for p in wave.parts]


def test_files_in_input_order_cut_after_the_file_that_reaches_wave_rows(tmp_path):
    """Files of one row group each: a wave is a run of whole files."""
    files = _files(tmp_path, {"chat": [30, 5, 40], "code": [100], "math": [1, 1]})
    assert [(f.split, f.first_group, f.rows) for f in files] == [
        ("chat", 0, 30), ("chat", 1, 5), ("chat", 2, 40), ("code", 3, 100), ("math", 4, 1), ("math", 5, 1)]
    waves = plan_waves(files, 35)
    assert [[p.first_group for p in w.parts] for w in waves] == [[0, 1], [2], [3], [4, 5]]
    assert all(p.whole for w in waves for p in w.parts)
    assert [w.rows for w in waves] == [35, 40, 100, 2] and [w.index for w in waves] == [0, 1, 2, 3]
    assert waves[0].name == "wave-00000" and list(waves[0].parts_by_split()) == ["chat"]
    assert waves[0].identity() == [f.loc.uri for f in files[:2]]
    assert [[p.first_group for p in w.parts] for w in plan_waves(files, 0)] == [[0, 1, 2, 3, 4, 5]]
    assert [[p.first_group for p in w.parts] for w in plan_waves(files, 1)] == [[i] for i in range(6)]
    assert [w.rows for w in plan_waves(files, 10**9)] == [177]


def test_a_file_larger_than_a_wave_is_cut_between_its_row_groups(tmp_path):
    """The cut falls after the row group that reaches wave_rows, inside a file when the file is larger; each part
    knows its rows (start, stop), its first group's position in the input order and where its later groups start."""
    files = _files(tmp_path, {"chat": [[10, 10, 10, 4], 20], "code": [[4, 4]]})
    assert [f.first_group for f in files] == [0, 4, 5]
    waves = plan_waves(files, 15)
    assert [_parts(w) for w in waves] == [
        [("chat-00000.parquet", 0, 2)],
        [("chat-00000.parquet", 2, 4), ("chat-00001.parquet", 0, 1)],
        [("code-00000.parquet", 0, 2)]]
    assert [w.rows for w in waves] == [20, 34, 8] and [w.first_group for w in waves] == [0, 2, 5]
    first, second = waves[0].parts[0], waves[1].parts[0]
    assert (first.start, first.stop, first.whole, first.group_starts()) == (0, 20, False, [10])
    assert (second.start, second.stop, second.first_group, second.group_starts()) == (20, 34, 2, [30])
    assert waves[1].identity() == [f"{files[0].loc.uri}#rows=20-34", files[1].loc.uri]
    assert waves[1].num_files == 2
    # every row group in exactly one wave, in order
    assert [(p.file.first_group + g) for w in waves for p in w.parts for g in p.groups] == list(range(7))
    assert [_parts(w) for w in plan_waves(files, 0)] == [
        [("chat-00000.parquet", 0, 4), ("chat-00001.parquet", 0, 1), ("code-00000.parquet", 0, 2)]]


def test_a_commit_record_counts_only_for_the_same_files_and_data(tmp_path):
    files = _files(tmp_path, {"chat": [10, 10]})
    wave = plan_waves(files, 10)[1]
    folder = resolve(str(tmp_path / "waves"))
    folder.mkdirs()
    assert committed(folder, wave, "h1") is None
    record = {"files": wave.identity(), "data_hash": "h1", "order": ORDER, "kept": 3}
    commit_record(folder, wave).write_atomic(json.dumps(record))
    assert committed(folder, wave, "h1")["kept"] == 3
    assert committed(folder, wave, "h2") is None  # other data settings
    commit_record(folder, wave).write_atomic(json.dumps({**record, "order": None}))
    assert committed(folder, wave, "h1") is None  # made when duplicates kept the first row by file, not row group
    commit_record(folder, wave).write_atomic(json.dumps(record))
    other = plan_waves(_files(tmp_path, {"chat": [10, 10, 10]}), 20)[1]  # wave 1 now reads another file
    assert other.name == wave.name and committed(folder, other, "h1") is None


def test_wave_rows_settings_refused_with_the_fix():
    job = load_job_config("configs/demo.yaml", ["enrich.wave_rows=100"])
    assert job.data_hash() != load_job_config("configs/demo.yaml", ["enrich.wave_rows=0"]).data_hash()
    for overrides, match in ((["enrich.wave_rows=-2"], "must be >= 0"),
                             (["enrich.wave_rows=10", "input.max_rows=5"], "input.max_rows"),
                             (["enrich.wave_rows=10", "train.objective=dpo"], "preference pairs")):
        with pytest.raises(ConfigError, match=match):
            load_job_config("configs/demo.yaml" if "dpo" not in overrides[-1] else "configs/demo-dpo.yaml",
                            overrides)


def test_a_fine_tune_streams_by_default_and_the_demo_in_three_waves(tmp_path):
    """enrich.wave_rows's default (-1): waves of AUTO_WAVE_ROWS for a fine-tune, one wave where waves cannot apply
    (preference pairs, input.max_rows); a value set is kept. The demo sets 100: the sample's files (32 or 64 rows
    each, as the sample writes them) in three waves."""
    import pyarrow.parquet as pq

    from raytrain.config import AUTO_WAVE_ROWS
    from raytrain.enrich.inputs import discover_inputs
    from raytrain.sample_data import write_sample_dataset

    defaults = ["enrich.wave_rows=-1"]
    assert load_job_config("configs/cpu-tiny.yaml", defaults).wave_rows == AUTO_WAVE_ROWS
    assert load_job_config("configs/cpu-tiny.yaml", [*defaults, "input.max_rows=10"]).wave_rows == 0
    assert load_job_config("configs/demo-dpo.yaml", defaults).wave_rows == 0
    assert load_job_config("configs/demo.yaml", ["enrich.wave_rows=7"]).wave_rows == 7
    demo = load_job_config("configs/demo.yaml")
    assert demo.wave_rows == demo.enrich.wave_rows == 100

    sample = tmp_path / "sample"
    write_sample_dataset(str(sample))
    files = discover_inputs(resolve(str(sample)), demo.input.splits).files
    metas = {split: [pq.ParquetFile(f.path).metadata for f in locs] for split, locs in files.items()}
    groups = {split: [[m.row_group(g).num_rows for g in range(m.num_row_groups)] for m in split_metas]
              for split, split_metas in metas.items()}
    waves = plan_waves(input_files(files, groups), demo.wave_rows)
    assert [w.rows for w in waves] == [128, 128, 64] and sum(groups.values(), []) == [[32]] * 4 + [[64]] * 3
