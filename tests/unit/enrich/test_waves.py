"""Waves (raytrain.enrich.waves): whole files in input order, cut by rows; commit records valid only for the same
files and data settings."""

import json

import pytest

from raytrain.config import load_job_config
from raytrain.enrich.waves import Wave, commit_record, committed, input_files, plan_waves
from raytrain.errors import ConfigError
from raytrain.storage import resolve


def _files(tmp_path, rows_per_split):
    files = {split: tuple(resolve(str(tmp_path / f"{split}-{i:05d}.parquet")) for i in range(len(rows)))
             for split, rows in rows_per_split.items()}
    return input_files(files, rows_per_split)


def test_files_in_input_order_cut_after_the_file_that_reaches_wave_rows(tmp_path):
    files = _files(tmp_path, {"chat": [30, 5, 40], "code": [100], "math": [1, 1]})
    assert [(f.split, f.index, f.rows) for f in files] == [("chat", 0, 30), ("chat", 1, 5), ("chat", 2, 40),
                                                           ("code", 3, 100), ("math", 4, 1), ("math", 5, 1)]
    waves = plan_waves(files, 35)
    assert [[f.index for f in w.files] for w in waves] == [[0, 1], [2], [3], [4, 5]]
    assert [w.rows for w in waves] == [35, 40, 100, 2] and [w.index for w in waves] == [0, 1, 2, 3]
    assert waves[0].name == "wave-00000" and list(waves[0].files_by_split()) == ["chat"]
    assert [[f.index for f in w.files] for w in plan_waves(files, 0)] == [[0, 1, 2, 3, 4, 5]]
    assert [[f.index for f in w.files] for w in plan_waves(files, 1)] == [[i] for i in range(6)]
    assert plan_waves(files, 10**9) == [Wave(0, tuple(files))]


def test_a_commit_record_counts_only_for_the_same_files_and_data(tmp_path):
    files = _files(tmp_path, {"chat": [10, 10]})
    wave = plan_waves(files, 10)[1]
    folder = resolve(str(tmp_path / "waves"))
    folder.mkdirs()
    assert committed(folder, wave, "h1") is None
    commit_record(folder, wave).write_atomic(json.dumps({"files": wave.identity(), "data_hash": "h1", "kept": 3}))
    assert committed(folder, wave, "h1")["kept"] == 3
    assert committed(folder, wave, "h2") is None  # other data settings
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
    rows = {split: [pq.ParquetFile(f.path).metadata.num_rows for f in locs] for split, locs in files.items()}
    waves = plan_waves(input_files(files, rows), demo.wave_rows)
    assert [w.rows for w in waves] == [128, 128, 64] and sum(rows.values(), []) == [32, 32, 32, 32, 64, 64, 64]
