"""`raytrain generate` finds the model to serve: an export folder itself, or the newest export of a run."""

from __future__ import annotations

import pytest

from raytrain.errors import RaytrainError
from raytrain.generate import resolve_model_dir


def _export(folder):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    return folder


def test_an_export_folder_is_used_as_is(tmp_path):
    export = _export(tmp_path / "hf")
    assert resolve_model_dir(export) == export


def test_a_run_folder_gives_its_newest_complete_export(tmp_path):
    _export(tmp_path / "exports" / "step_00000005")
    newest = _export(tmp_path / "exports" / "step_00000010")
    (tmp_path / "exports" / "step_00000020").mkdir()  # an export still being written: no config.json yet
    (tmp_path / "exports" / "notes").mkdir()
    assert resolve_model_dir(tmp_path) == newest


def test_nothing_to_serve_says_how_to_export(tmp_path):
    (tmp_path / "exports").mkdir()
    with pytest.raises(RaytrainError, match=r"neither an exported model .* raytrain export"):
        resolve_model_dir(tmp_path)
