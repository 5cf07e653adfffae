"""read_enriched (raytrain.dataset.stream): Ray Data's Parquet reads of enriched files keep the files' row order and
read the footers on one actor (Ray Data 2.60 starts 32 for every read), unless the environment says otherwise."""

import os
from types import SimpleNamespace

import ray.data

from raytrain.dataset.stream import FOOTER_ACTORS_ENV, read_enriched


def _fake_reads(monkeypatch) -> list[tuple]:
    seen = []

    def read_parquet(files, filesystem=None, columns=None):
        seen.append((files, columns, os.environ.get(FOOTER_ACTORS_ENV)))
        return SimpleNamespace(context=SimpleNamespace(execution_options=SimpleNamespace(preserve_order=False)))

    monkeypatch.setattr(ray.data, "read_parquet", read_parquet)
    return seen


def test_one_footer_reader_and_the_files_order(monkeypatch):
    monkeypatch.setenv(FOOTER_ACTORS_ENV, "0")
    monkeypatch.delenv(FOOTER_ACTORS_ENV)  # unset here, restored (unset) afterwards
    seen = _fake_reads(monkeypatch)
    ds = read_enriched(("a.parquet", "b.parquet"), None, ("input_ids",))
    assert seen == [(["a.parquet", "b.parquet"], ["input_ids"], "1")]
    assert ds.context.execution_options.preserve_order
    # the variable is the one Ray Data's Parquet file indexer reads when a read is created
    from ray.data._internal.datasource_v2.formats.parquet.footer_file_indexer import FooterFileIndexer

    assert FooterFileIndexer(ignore_missing_paths=False)._num_actors == 1


def test_the_environment_wins(monkeypatch):
    monkeypatch.setenv(FOOTER_ACTORS_ENV, "8")
    seen = _fake_reads(monkeypatch)
    read_enriched(["a.parquet"], None, ["uuid"])
    assert seen[-1][2] == "8"
