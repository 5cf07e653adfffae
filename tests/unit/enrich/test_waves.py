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
    assert job.data_hash() != load_job_config("configs/demo.yaml", []).data_hash()
    for overrides, match in ((["enrich.wave_rows=-1"], "must be >= 0"),
                             (["enrich.wave_rows=10", "input.max_rows=5"], "input.max_rows"),
                             (["enrich.wave_rows=10", "train.objective=dpo"], "preference pairs")):
        with pytest.raises(ConfigError, match=match):
            load_job_config("configs/demo.yaml" if "dpo" not in overrides[-1] else "configs/demo-dpo.yaml",
                            overrides)
