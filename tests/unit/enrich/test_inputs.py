"""discover_inputs / validate_inputs on every layout a user has: hub download, its data/ folder, the hub cache
(snapshot, symlinks into blobs/, refs/main), the split-folder layout; locally, through file:// and on S3 (moto)."""

import hashlib
import os
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from loopback_s3 import loopback_s3

from raytrain.enrich.inputs import HUB_REPO_DIR, InputFiles, discover_inputs, validate_inputs
from raytrain.enrich.schema import NEMOTRON_V1_SCHEMA
from raytrain.errors import RaytrainError
from raytrain.storage import resolve

# The hub's names: tool_calling's files are "tool-*"; chat has 2 shards, tool 2, code 1, math 3 (none of stem).
SHARDS = {
    "chat": ["chat-00000-of-00002.parquet", "chat-00001-of-00002.parquet"],
    "code": ["code-00000-of-00001.parquet"],
    "math": ["math-00000-of-00003.parquet", "math-00001-of-00003.parquet", "math-00002-of-00003.parquet"],
    "tool_calling": ["tool-00000-of-00002.parquet", "tool-00001-of-00002.parquet"],
}
SPLITS = ("chat", "code", "math", "tool_calling")
REVISION = "a1b2c3d4e5f60718293a4b5c6d7e8f9012345678"


def _rows(name: str, n: int = 2) -> list[dict]:
    return [{"uuid": f"{name}-{i}", "license": "CC BY 4.0", "generator": "g", "version": "v1", "category": "chat",
             "reasoning": "off", "metadata": "{}",
             "messages": [{"role": "user", "content": f"q {name} {i}", "tool_calls": None},
                          {"role": "assistant", "content": "a", "tool_calls": []}]} for i in range(n)]


def _write(path, name: str, n: int = 2) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pq.write_table(pa.Table.from_pylist(_rows(name, n), schema=NEMOTRON_V1_SCHEMA), path)


def _hub_download(root) -> str:
    """A dataset root as `huggingface-cli download --local-dir` leaves it."""
    for names in SHARDS.values():
        for name in names:
            _write(os.path.join(root, "data", name), name.split(".")[0])
    for extra in ("README.md", ".gitattributes", "data/_SUCCESS", "data/.chat-00009-of-00010.parquet"):
        with open(os.path.join(root, extra), "w") as f:
            f.write("not data")
    return str(root)


def _hub_cache(cache, download, revisions=(REVISION,), ref=REVISION) -> str:
    """The hub cache of the same files: blobs named by hash, snapshots/<rev>/... symlinks, refs/main."""
    repo = os.path.join(cache, HUB_REPO_DIR)
    os.makedirs(os.path.join(repo, "blobs"))
    for rev in revisions:
        for dirpath, _, names in os.walk(download):
            for name in names:
                src = os.path.join(dirpath, name)
                rel = os.path.relpath(src, download)
                digest = hashlib.sha256(open(src, "rb").read()).hexdigest()
                blob = os.path.join(repo, "blobs", digest)
                if not os.path.exists(blob):
                    shutil.copyfile(src, blob)
                link = os.path.join(repo, "snapshots", rev, rel)
                os.makedirs(os.path.dirname(link), exist_ok=True)
                os.symlink(os.path.relpath(blob, os.path.dirname(link)), link)
    if ref is not None:
        os.makedirs(os.path.join(repo, "refs"))
        with open(os.path.join(repo, "refs", "main"), "w") as f:
            f.write(ref)  # the hub writes the hash without a newline
    return repo


def _split_folders(root, download) -> str:
    """The project's older layout: <root>/<split>/*.parquet (the same files; sample_data writes part-00000)."""
    for split, names in SHARDS.items():
        for name in names:
            os.makedirs(os.path.join(root, split), exist_ok=True)
            shutil.copyfile(os.path.join(download, "data", name), os.path.join(root, split, name))
    with open(os.path.join(root, "chat", "_SUCCESS"), "w"):
        pass
    return str(root)


def _read_back(inputs: InputFiles) -> dict[str, list[tuple[str, list[str]]]]:
    """split -> (file name, uuids) read through the location's own filesystem."""
    out = {}
    for split, locs in inputs.files.items():
        out[split] = [(loc.name, pq.read_table(loc.path, filesystem=loc.filesystem, columns=["uuid"])
                       .column("uuid").to_pylist()) for loc in locs]
    return out


EXPECTED = {split: [(name, [f"{name.split('.')[0]}-{i}" for i in range(2)]) for name in names]
            for split, names in SHARDS.items()}


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    base = tmp_path_factory.mktemp("inputs")
    download = _hub_download(base / "download")
    repo = _hub_cache(str(base / "cache"), download)
    split_root = _split_folders(base / "split_folders", download)
    return {"download": download, "repo": repo, "split_folders": split_root}


def _pointers(trees):
    """Every path a user may point at -> (expected layout, expected root)."""
    snapshot = os.path.join(trees["repo"], "snapshots", REVISION)
    return {
        trees["download"]: ("hub", trees["download"]),
        os.path.join(trees["download"], "data"): ("hub", os.path.join(trees["download"], "data")),
        snapshot: ("hub", snapshot),
        os.path.join(snapshot, "data"): ("hub", os.path.join(snapshot, "data")),
        trees["repo"]: ("hub", snapshot),
        trees["split_folders"]: ("split_folders", trees["split_folders"]),
    }


def test_every_local_layout_gives_the_same_files(trees):
    for path, (layout, root) in _pointers(trees).items():
        inputs = discover_inputs(resolve(path), SPLITS)
        assert (inputs.layout, inputs.root.path) == (layout, root), path
        assert list(inputs.files) == list(SPLITS) and inputs.missing_shards == {}, path
        assert _read_back(inputs) == EXPECTED, path


def test_same_through_file_uris(trees):
    for path, (layout, root) in _pointers(trees).items():
        inputs = discover_inputs(resolve("file://" + path), ("tool_calling", "chat"))
        assert (inputs.layout, inputs.root.path) == (layout, root)
        assert list(inputs.files) == ["tool_calling", "chat"]  # the requested order
        assert _read_back(inputs) == {s: EXPECTED[s] for s in ("tool_calling", "chat")}


def test_symlinked_blobs_are_files(trees):
    link = resolve(os.path.join(trees["repo"], "snapshots", REVISION, "data", "chat-00000-of-00002.parquet"))
    assert os.path.islink(link.path) and link.is_file() and link.size() > 0
    inputs = discover_inputs(resolve(trees["repo"]), ("chat",))
    assert all(os.path.islink(loc.path) for loc in inputs.files["chat"])
    assert _counts(validate_inputs(inputs)) == {"chat": {"files": 2, "rows": 4, "file_row_groups": [[2], [2]]}}


def test_dangling_symlink_is_a_missing_shard(tmp_path):
    # pyarrow leaves a dangling symlink (a blob not downloaded yet) out of a listing: the shard reads as missing
    download = _hub_download(tmp_path / "download")
    repo = _hub_cache(str(tmp_path / "cache"), download)
    link = os.path.join(repo, "snapshots", REVISION, "data", "chat-00001-of-00002.parquet")
    os.unlink(os.path.realpath(link))
    inputs = discover_inputs(resolve(repo), ("chat",))
    assert [loc.name for loc in inputs.files["chat"]] == ["chat-00000-of-00002.parquet"]
    assert inputs.missing_shards == {"chat": ["chat-00001-of-00002.parquet"]}


def test_hub_cache_picks_refs_main_or_the_only_snapshot(tmp_path):
    download = _hub_download(tmp_path / "download")
    old = "0" * 40
    repo = _hub_cache(str(tmp_path / "two"), download, revisions=(old, REVISION))
    assert discover_inputs(resolve(repo), ("code",)).root.path == os.path.join(repo, "snapshots", REVISION)
    os.unlink(os.path.join(repo, "refs", "main"))
    with pytest.raises(RaytrainError) as e:
        discover_inputs(resolve(repo), ("code",))
    assert repo in str(e.value) and old in str(e.value) and REVISION in str(e.value) and "point" in str(e.value)
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write("f" * 40)
    with pytest.raises(RaytrainError, match="f{40}.*holds"):
        discover_inputs(resolve(repo), ("code",))
    single = _hub_cache(str(tmp_path / "one"), download, ref=None)
    assert discover_inputs(resolve(single), ("code",)).root.path == os.path.join(single, "snapshots", REVISION)


def test_describe_and_missing_shards_are_reported_not_raised(tmp_path):
    for name in ("chat-00000-of-00003.parquet", "chat-00002-of-00003.parquet", "tool-00000-of-00001.parquet"):
        _write(str(tmp_path / "data" / name), name)
    inputs = discover_inputs(resolve(str(tmp_path)), ("chat", "tool_calling"))
    assert inputs.missing_shards == {"chat": ["chat-00001-of-00003.parquet"]}
    assert inputs.describe() == [
        f"inputs: hub layout at file://{tmp_path}",
        "chat: 2 files (chat-00000-of-00003 .. chat-00002-of-00003); missing 1 of 3 shards: "
        "chat-00001-of-00003.parquet",
        "tool_calling: 1 file (tool-00000-of-00001)",
    ]


def test_split_folders_with_any_parquet_names(tmp_path):
    _write(str(tmp_path / "chat" / "part-00000.parquet"), "p", n=3)
    _write(str(tmp_path / "chat" / ".hidden.parquet"), "h")
    (tmp_path / "chat" / "_SUCCESS").write_text("")
    (tmp_path / "notes").mkdir()
    inputs = discover_inputs(resolve(str(tmp_path)), ("chat",))
    assert inputs.layout == "split_folders" and inputs.missing_shards == {}
    assert [loc.name for loc in inputs.files["chat"]] == ["part-00000.parquet"]
    assert inputs.describe()[1] == "chat: 1 file (part-00000)"
    assert _counts(validate_inputs(inputs)) == {"chat": {"files": 1, "rows": 3, "file_row_groups": [[3]]}}


def test_missing_path(tmp_path):
    gone = str(tmp_path / "nope")
    with pytest.raises(RaytrainError, match=f"{gone} does not exist.*input.path=sample"):
        discover_inputs(resolve(gone), ("chat",))


def test_nothing_matches_names_what_was_found(tmp_path):
    (tmp_path / "README.md").write_text("x")
    for i in range(12):
        (tmp_path / f"extra{i:02d}.txt").write_text("x")
    _write(str(tmp_path / "data" / "train-00000-of-00001.parquet"), "t")
    (tmp_path / "stem").mkdir()  # a split folder without Parquet files does not count
    with pytest.raises(RaytrainError) as e:
        discover_inputs(resolve(str(tmp_path)), ("chat",))
    msg = str(e.value)
    assert str(tmp_path) in msg and "README.md" in msg and "data/" in msg and "... and 5 more" in msg
    assert "in its data/: train-00000-of-00001.parquet" in msg
    assert "Accepted layouts" in msg and "<root>/<split>/*.parquet" in msg and HUB_REPO_DIR in msg


def test_hub_cache_parent_gets_a_hint(tmp_path):
    (tmp_path / HUB_REPO_DIR / "snapshots").mkdir(parents=True)
    with pytest.raises(RaytrainError, match=f"point input.path at file://{tmp_path}/{HUB_REPO_DIR}"):
        discover_inputs(resolve(str(tmp_path)), ("chat",))


def test_requested_split_without_files(trees):
    for path in (trees["download"], trees["split_folders"]):
        with pytest.raises(RaytrainError) as e:
            discover_inputs(resolve(path), ("chat", "stem"))
        msg = str(e.value)
        assert "['stem']" in msg and "['chat', 'code', 'math', 'tool_calling']" in msg and path in msg
        assert "drop 'stem' from input.splits" in msg


@pytest.mark.parametrize("names, words", [
    (["chat-00000-of-00002.parquet", "chat-00001-of-00003.parquet"],
     ["disagree", "chat-00000-of-00002.parquet", "chat-00001-of-00003.parquet"]),
    (["chat-00002-of-00002.parquet"], ["shard index 2", "chat-00002-of-00002.parquet"]),
    (["tool-00000-of-00001.parquet", "tool_calling-00000-of-00001.parquet"],
     ["twice", "tool-00000-of-00001.parquet", "tool_calling-00000-of-00001.parquet"]),
])
def test_inconsistent_shards(tmp_path, names, words):
    for name in names:
        _write(str(tmp_path / "data" / name), name)
    split = "tool_calling" if names[0].startswith("tool") else "chat"
    with pytest.raises(RaytrainError) as e:
        discover_inputs(resolve(str(tmp_path)), (split,))
    assert all(w in str(e.value) for w in words) and repr(split) in str(e.value)


def _counts(footers: dict) -> dict:
    return {split: {k: v for k, v in d.items() if k != "schema"} for split, d in footers.items()}


def test_validate_inputs_counts_footers_and_names_bad_files(tmp_path):
    _write(str(tmp_path / "data" / "chat-00000-of-00002.parquet"), "a", n=5)
    _write(str(tmp_path / "data" / "code-00000-of-00001.parquet"), "b", n=3)
    bad = tmp_path / "data" / "chat-00001-of-00002.parquet"
    bad.write_bytes(b"not parquet")
    inputs = discover_inputs(resolve(str(tmp_path)), ("chat", "code"))
    with pytest.raises(RaytrainError, match=f"{bad}: not a readable Parquet file"):
        validate_inputs(inputs)
    pq.write_table(pa.table({"uuid": ["x"], "messages": ["flat text"]}), str(bad))
    with pytest.raises(RaytrainError, match=f"{bad}: column 'license' is missing"):
        validate_inputs(inputs)
    _write(str(bad), "c", n=4)
    footers = validate_inputs(inputs)
    assert _counts(footers) == {"chat": {"files": 2, "rows": 9, "file_row_groups": [[5], [4]]},
                              "code": {"files": 1, "rows": 3, "file_row_groups": [[3]]}}
    # the files' own schema, for Spark to read with (no inference job); None when the files of a split differ
    assert footers["code"]["schema"].equals(pq.read_schema(str(tmp_path / "data" / "code-00000-of-00001.parquet"))
                                            .remove_metadata())
    table = pq.read_table(str(bad))
    pq.write_table(table.select(table.column_names[::-1]), str(bad))  # the same columns in another order
    assert validate_inputs(inputs)["chat"]["schema"] is None


# ---- S3 (moto loopback) ------------------------------------------------------------------------------------
def test_same_on_s3(trees, tmp_path):
    pytest.importorskip("moto.server")
    boto3 = pytest.importorskip("boto3")
    snapshot_rel = os.path.join(HUB_REPO_DIR, "snapshots", REVISION)
    with loopback_s3() as endpoint:
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        client.create_bucket(Bucket="nemotron")
        uploads = {"download": trees["download"], "split": trees["split_folders"],
                   "cache/" + HUB_REPO_DIR: trees["repo"]}  # S3 has no symlinks: the snapshot holds copies
        for prefix, local in uploads.items():
            for dirpath, _, names in os.walk(local):
                for name in names:
                    path = os.path.join(dirpath, name)
                    key = f"{prefix}/{os.path.relpath(path, local)}"
                    client.put_object(Bucket="nemotron", Key=key, Body=open(path, "rb").read())
        pointers = {
            "download": ("hub", "nemotron/download"),
            "download/data": ("hub", "nemotron/download/data"),
            "cache/" + snapshot_rel: ("hub", "nemotron/cache/" + snapshot_rel),
            "cache/" + HUB_REPO_DIR: ("hub", "nemotron/cache/" + snapshot_rel),
            "split": ("split_folders", "nemotron/split"),
        }
        for key, (layout, root) in pointers.items():
            inputs = discover_inputs(resolve(f"s3://nemotron/{key}", s3_endpoint=endpoint), SPLITS)
            assert (inputs.layout, inputs.root.path, inputs.root.scheme) == (layout, root, "s3"), key
            assert inputs.missing_shards == {} and _read_back(inputs) == EXPECTED, key
        assert _counts(validate_inputs(inputs))["math"] == {"files": 3, "rows": 6, "file_row_groups": [[2], [2], [2]]}
        with pytest.raises(RaytrainError, match="s3://nemotron/nope does not exist"):
            discover_inputs(resolve("s3://nemotron/nope", s3_endpoint=endpoint), SPLITS)
        with pytest.raises(RaytrainError, match="drop 'stem'.*"):
            discover_inputs(resolve("s3://nemotron/download", s3_endpoint=endpoint), ("stem",))
