"""load_packed (raytrain.dataset.stream): a run's packed sequences read back from their manifest; the reuse is
told once per launch, not by the checks before the stage."""

import json
import logging

import pytest

from raytrain.dataset.stream import load_packed
from raytrain.errors import RaytrainError
from raytrain.storage import resolve


def test_manifest_read_back_reuse_logged_only_when_asked(tmp_path, caplog):
    packed = resolve(str(tmp_path / "packed"))
    assert load_packed(packed, "h1") is None  # nothing packed yet
    (tmp_path / "packed").mkdir()
    (tmp_path / "packed" / "_manifest.json").write_text(json.dumps(
        {"data_hash": "h1", "files": ["a.parquet"], "num_packs": 3, "num_real_tokens": 100,
         "validation": {"files": ["v.parquet"], "num_packs": 1, "num_real_tokens": 9}}))
    with caplog.at_level(logging.INFO, logger="raytrain.dataset.stream"):
        quiet = load_packed(packed, "h1", say_reused=False)
        assert not [r for r in caplog.records if "reusing" in r.getMessage()]
        told = load_packed(packed, "h1")
    assert [r.getMessage() for r in caplog.records if "reusing" in r.getMessage()] == [
        f"dataset: reusing 3 packed sequences from {packed.uri}"]
    assert quiet == told and told.num_packs == 3 and told.validation.num_packs == 1 and told.benchmark is None
    assert told.files == (str(tmp_path / "packed" / "a.parquet"),)
    with pytest.raises(RaytrainError, match="other input/enrich/dataset settings"):
        load_packed(packed, "h2")
