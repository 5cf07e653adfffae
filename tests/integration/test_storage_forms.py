"""One resolver, every framework, the same files: for each storage form that runs here (a plain POSIX path, a file://
URI, s3:// on a loopback moto server) pyarrow, Ray Data, Ray Train and Spark (RayDP) write and read each other's files
through raytrain.storage.resolve. A Spark session whose fs.defaultFS points elsewhere still writes to the resolved
path, because Spark is always handed `spark_uri` (explicit scheme), never a bare path.

Spark reaches s3:// through s3a:// with the hadoop-aws + AWS SDK jars that pyspark does not ship: the module fetches
them once from PyPI (raytrain.enrich.jars.fetch_s3a_jars, cached in ~/.cache/raytrain/jars or $RAYTRAIN_JARS_DIR),
the way `raytrain fetch-jars` does for users. The whole enrichment then runs from s3:// input to an s3:// run root.

HDFS is not exercised: it needs a running namenode/datanode, and Hadoop's server side is neither on PyPI nor in Debian;
its URI forms are covered by the unit tests (tests/unit/storage).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
from loopback_s3 import loopback_s3

from raytrain.config import load_job_config
from raytrain.enrich.spark import spark_conf, spark_uri
from raytrain.storage import StorageLocation, resolve
from raytrain.trainer.launch import ray_storage

pytest.importorskip("moto.server")
boto3 = pytest.importorskip("boto3")

BUCKET = "raytrain-forms"
TABLE = pa.table({"uuid": [f"id-{i:03d}" for i in range(40)], "value": list(range(40))})
FORMS = ("posix", "file_uri", "s3")


@pytest.fixture(scope="module")
def s3_endpoint():
    with loopback_s3() as endpoint:
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=BUCKET)
        yield endpoint


@pytest.fixture(scope="module")
def roots(s3_endpoint, tmp_path_factory) -> dict[str, StorageLocation]:
    base = tmp_path_factory.mktemp("forms")
    return {
        "posix": resolve(str(base / "posix")),
        "file_uri": resolve(f"file://{base / 'file_uri'}"),
        "s3": resolve(f"s3://{BUCKET}/forms", s3_endpoint=s3_endpoint),
    }


@pytest.fixture(scope="module")
def spark(roots, ray_local):
    """One Spark session for the module, started as run_enrich starts it: with the roots' settings and the s3a jars
    (fetched from PyPI on first use)."""
    from raytrain.enrich.jars import fetch_s3a_jars, spark_jar_configs
    from raytrain.enrich.spark import spark_session

    fetch_s3a_jars()
    job = load_job_config("configs/demo.yaml", ["enrich.num_partitions=2"])
    configs = spark_conf(roots["s3"]) | spark_jar_configs((), roots.values())
    assert "hadoop-aws" in configs["spark.jars"]
    with spark_session(job.enrich, app_name="raytrain-storage-forms", extra_configs=configs) as session:
        yield session


def test_jvms_lead_their_own_sessions(spark):
    """The driver JVM and RayDP's app master JVM were launched without pyspark's preexec_fn (raytrain.enrich.spark:
    forking with Python in the child hung CI once), each in a session of its own, which keeps a terminal's Ctrl-C
    from them as the preexec_fn did."""
    from pyspark import SparkContext

    pid = SparkContext._gateway.proc.pid
    assert os.getsid(pid) == pid != os.getsid(0)
    masters = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if b"org.apache.spark.deploy.raydp.AppMasterEntryPoint" in f.read():
                    masters.append(int(entry))
        except (OSError, ValueError):
            continue
    assert masters, "no RayDP app master JVM found"
    assert all(os.getsid(p) == p for p in masters)


def test_jvm_command_lines_carry_no_s3_credentials(spark):
    """Every local user can read a process's arguments (`ps`). The Spark driver JVM, RayDP's app master and the
    executor JVMs started for this S3 session carry no S3A key setting and not the driver's secret: S3A reads the
    credentials from the AWS chain (the environment, on this one machine)."""
    secret = os.environ["AWS_SECRET_ACCESS_KEY"].encode()
    jvms = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except (OSError, ValueError):
            continue
        if args and os.path.basename(args[0]) == b"java":
            jvms.append(args)
    assert len(jvms) >= 2, "expected the driver and RayDP's JVMs"
    for args in jvms:
        assert not [a for a in args if b"fs.s3a.access.key" in a or b"fs.s3a.secret.key" in a
                    or b"fs.s3a.session.token" in a or a.endswith(b"=" + secret)], args[:3]


def _pyarrow_write(loc: StorageLocation) -> None:
    target = loc.join("pyarrow", "part-00000.parquet")
    target.parent.mkdirs()
    with target.filesystem.open_output_stream(target.path) as f:
        pq.write_table(TABLE, f)


def _read_ids(table: pa.Table) -> list[str]:
    return sorted(table.column("uuid").to_pylist())


def test_resolved_views_agree(roots):
    posix, file_uri, s3 = roots["posix"], roots["file_uri"], roots["s3"]
    assert posix.scheme == file_uri.scheme == "file"
    assert spark_uri(posix) == posix.uri == f"file://{posix.path}"  # never a bare path for Spark
    assert spark_uri(file_uri).startswith("file:///") and resolve(spark_uri(file_uri)) == file_uri
    assert spark_uri(s3) == f"s3a://{BUCKET}/forms" and resolve(spark_uri(s3), s3_endpoint=s3.s3_endpoint) == s3
    assert ray_storage(posix) == (posix.path, None) and ray_storage(s3) == (f"{BUCKET}/forms", s3.filesystem)


@pytest.mark.parametrize("form", FORMS)
def test_pyarrow_and_ray_data_share_files(form, roots, ray_local, s3_endpoint):
    loc = roots[form]
    _pyarrow_write(loc)
    # boto3 / os (not our code) see the object where the resolver says it is
    if loc.scheme == "s3":
        client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
        assert client.head_object(Bucket=BUCKET, Key="forms/pyarrow/part-00000.parquet")["ContentLength"] > 0
    else:
        assert os.path.getsize(os.path.join(loc.path, "pyarrow", "part-00000.parquet")) > 0
    ds = ray.data.read_parquet(loc.join("pyarrow").path, filesystem=loc.filesystem)
    assert sorted(r["uuid"] for r in ds.take_all()) == _read_ids(TABLE)
    ds.write_parquet(loc.join("raydata").path, filesystem=loc.filesystem)
    files = [loc.join("raydata", n) for n in loc.join("raydata").listdir() if n.endswith(".parquet")]
    assert files
    back = pa.concat_tables([pq.read_table(f.path, filesystem=f.filesystem) for f in files])
    assert _read_ids(back) == _read_ids(TABLE)


def _train_loop(config: dict) -> None:
    """Ray Train worker: read the pyarrow-written file through the resolver, report a checkpoint holding a count."""
    import ray.train

    from raytrain.storage import resolve as resolve_in_worker

    loc = resolve_in_worker(config["uri"], s3_endpoint=config["endpoint"])
    table = pq.read_table(loc.join("pyarrow", "part-00000.parquet").path, filesystem=loc.filesystem)
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "rows.txt"), "w") as f:
            f.write(str(table.num_rows))
        ray.train.report({"rows": table.num_rows}, checkpoint=ray.train.Checkpoint.from_directory(d))


@pytest.mark.parametrize("form", FORMS)
def test_ray_train_storage_and_workers_share_files(form, roots, ray_local):
    from ray import cloudpickle
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this test module
    loc = roots[form]
    if not loc.join("pyarrow", "part-00000.parquet").exists():
        _pyarrow_write(loc)
    ray_root = loc.join("ray")
    storage_path, storage_filesystem = ray_storage(ray_root)
    trainer = TorchTrainer(
        _train_loop, train_loop_config={"uri": loc.uri, "endpoint": loc.s3_endpoint},
        scaling_config=ScalingConfig(num_workers=1, use_gpu=False),
        run_config=RunConfig(name="forms", storage_path=storage_path, storage_filesystem=storage_filesystem))
    result = trainer.fit()
    assert result.metrics["rows"] == TABLE.num_rows
    # the checkpoint Ray Train persisted is under the resolved location, readable with the resolver's filesystem
    ckpt_path = result.checkpoint.path
    assert ckpt_path.startswith(ray_root.join("forms").path), (ckpt_path, ray_root.uri)
    with loc.filesystem.open_input_stream(ckpt_path.rstrip("/") + "/rows.txt") as f:
        assert f.read().decode() == str(TABLE.num_rows)
    assert any(name.startswith("checkpoint") for name in ray_root.join("forms").listdir())


@pytest.mark.parametrize("form", FORMS)
def test_spark_and_pyarrow_share_files(form, roots, spark):
    loc = roots[form]
    if not loc.join("pyarrow", "part-00000.parquet").exists():
        _pyarrow_write(loc)
    # Spark reads what pyarrow wrote
    df = spark.read.parquet(spark_uri(loc.join("pyarrow")))
    assert sorted(r["uuid"] for r in df.select("uuid").collect()) == _read_ids(TABLE)
    # pyarrow reads what Spark wrote, at the resolved path
    df.repartition(2).write.mode("overwrite").parquet(spark_uri(loc.join("spark")))
    assert loc.join("spark", "_SUCCESS").exists()  # Spark's commit marker, seen through pyarrow's filesystem
    assert _read_ids(pq.read_table(loc.join("spark").path, filesystem=loc.filesystem)) == _read_ids(TABLE)


def test_spark_with_foreign_default_fs_still_writes_to_resolved_path(roots, spark, tmp_path):
    """A cluster whose fs.defaultFS is HDFS would take a bare '/mnt/x' as hdfs://nn/mnt/x; spark_uri prevents it."""
    hconf = spark.sparkContext._jsc.hadoopConfiguration()
    jvm = spark.sparkContext._jvm
    previous = hconf.get("fs.defaultFS")
    hconf.set("fs.defaultFS", "hdfs://no-such-namenode.invalid:8020")
    try:
        # Hadoop itself (not our code) now qualifies a bare path against the foreign default
        default_uri = jvm.org.apache.hadoop.fs.FileSystem.getDefaultUri(hconf).toString()
        assert default_uri == "hdfs://no-such-namenode.invalid:8020"
        loc = resolve(str(tmp_path / "bare" / "out"))
        assert spark_uri(loc) == f"file://{loc.path}"
        spark.createDataFrame(TABLE.to_pandas()).coalesce(1).write.mode("overwrite").parquet(spark_uri(loc))
        assert os.path.exists(os.path.join(loc.path, "_SUCCESS"))
        assert _read_ids(pq.read_table(loc.path)) == _read_ids(TABLE)
    finally:
        hconf.set("fs.defaultFS", previous)


def test_enrichment_from_s3_to_s3(roots, spark, tmp_path):
    """The whole enrichment with its input and its run root on s3:// (the loopback server): Spark reads the Nemotron
    Parquet through s3a://, writes the enriched + quarantine Parquet there, and the manifest and report land beside
    them. pyarrow, reading the bucket directly, finds every input row exactly once: enriched or quarantined."""
    import pyarrow.fs as pafs

    from raytrain.enrich.job import enrich_in_session
    from raytrain.sample_data import write_sample_dataset
    from raytrain.storage import MANIFEST

    s3 = roots["s3"]
    sample = write_sample_dataset(str(tmp_path / "sample"), rows_per_split=20)
    input_root = s3.join("enrich-input")
    pafs.copy_files(sample.out_dir, input_root.path, destination_filesystem=input_root.filesystem)
    run_root = s3.join("runs", "ci", "forms", "enrich-s3")
    job = load_job_config("configs/demo.yaml", ["enrich.num_partitions=2", "enrich.wave_rows=0",
                                                f"storage.s3_endpoint={s3.s3_endpoint}"])
    result = enrich_in_session(spark, job, input_root, run_root, eval_sets=("sample",))
    report = result.report
    assert result.enriched.uri.startswith("s3://") and report["enriched_uri"] == result.enriched.uri

    fs = s3.filesystem
    enriched = pq.read_table(result.enriched.path, filesystem=fs)
    quarantine = pq.read_table(result.quarantine.path, filesystem=fs)
    raw = pa.concat_tables([pq.read_table(p) for p in sample.all_files()])
    assert enriched.num_rows == report["rows_out"] > 0
    assert enriched.num_rows + quarantine.num_rows == raw.num_rows == report["rows_in"]
    raw_ids = sorted(u for u in raw.column("uuid").to_pylist() if u)
    out_ids = sorted(u for u in enriched.column("uuid").to_pylist() + quarantine.column("uuid").to_pylist() if u)
    assert out_ids == raw_ids  # every input row once, no row lost or duplicated on the way through S3
    manifest = json.loads(result.enriched.join(MANIFEST).read_bytes())
    assert manifest["enriched"]["rows"] == enriched.num_rows and manifest["quarantine"]["rows"] == quarantine.num_rows
    assert run_root.join("reports", "enrich_summary.txt").is_file()


def test_preference_enrichment_from_s3_to_s3(roots, spark, tmp_path):
    """HelpSteer3's preference files as the hub lays them out, in the bucket: found through s3://, read by Spark
    through s3a:// (gzip by the name), enriched to the s3:// run root. Every line leaves through one door, as on a
    POSIX root, the written files agree with the lines read, and the truncated pairs and those given context
    sentences (from their own context, or from a corpus in the bucket) are the report's."""
    import gzip

    import pyarrow.fs as pafs

    from raytrain.enrich.corpus import check_corpus
    from raytrain.enrich.pair_inputs import discover_pair_inputs
    from raytrain.enrich.pair_job import enrich_pairs_in_session
    from raytrain.enrich.plan import load_eval_texts
    from raytrain.sample_data.preference import write_preference_sample

    s3 = roots["s3"]
    local = tmp_path / "helpsteer3"
    sample = write_preference_sample(str(local))
    input_root = s3.join("helpsteer3")
    pafs.copy_files(str(local), input_root.path, destination_filesystem=input_root.filesystem)
    corpus = input_root.join("corpus", "facts.jsonl")  # a corpus in the bucket too, read through s3a
    corpus.write_atomic("\n".join(json.dumps(doc) for doc in (
        {"id": "speed", "text": "Average speed is the distance travelled divided by the time taken. A train that "
                                "covers more kilometres in the same hours has a higher average speed."},
        {"id": "weather", "text": "Fog rolls in from the sea on autumn mornings."})) + "\n")
    # a short seq_len under truncate and the context selection with the corpus on: their work runs in Spark's
    # workers too
    job = load_job_config("configs/demo-dpo.yaml", ["enrich.num_partitions=2", f"storage.s3_endpoint={s3.s3_endpoint}",
                                                    "dataset.seq_len=384", "dataset.length_policy=truncate",
                                                    "enrich.pair_context=true", f"enrich.context_corpus=[{corpus.uri}]"])
    inputs = discover_pair_inputs(input_root)
    assert {split: loc.uri for split, loc in inputs.files.items()} == {
        split: input_root.join("preference", f"{split}.jsonl.gz").uri for split in ("train", "validation")}
    evals = load_eval_texts((input_root.join("eval", "preference_eval_set.jsonl").uri,), input_root, s3.s3_endpoint)
    run_root = s3.join("runs", "ci", "forms", "pairs-s3")
    corpus_files = check_corpus(job.enrich.context_corpus, "id", "text", input_root, s3.s3_endpoint)
    result = enrich_pairs_in_session(spark, job, inputs, evals, run_root, corpus_files)
    lines = sum(1 for path in (sample.train_path, sample.validation_path)
                for line in gzip.open(path, "rt", encoding="utf-8") if line.strip())
    fs = s3.filesystem
    enriched = pq.read_table(result.enriched.path, filesystem=fs)
    quarantine = pq.read_table(result.quarantine.path, filesystem=fs)
    assert result.enriched.uri.startswith("s3://") and enriched.num_rows == result.report["rows_out"] > 0
    assert enriched.num_rows + quarantine.num_rows == lines == result.report["rows_in"]
    assert sorted(set(quarantine.column("reason").to_pylist())) == sorted(result.report["quarantined"])
    assert "tie" in result.report["quarantined"] and "contaminated" in result.report["quarantined"]
    truncated = [r for r in enriched.to_pylist() if r["length_action"] == "truncate"]
    assert len(truncated) == result.report["length"]["rows_truncated"] > 0
    assert sum(r["tokens_truncated"] for r in truncated) == result.report["length"]["tokens_truncated"]
    assert max(enriched.column("num_tokens").to_pylist()) <= 384
    context = result.report["context"]
    assert sum(enriched.column("context_sentences_kept").to_pylist()) == context["context_sentences_kept"] > 0
    with_context = [json.loads(r["pair_json"]) for r in enriched.to_pylist() if r["context_sentences_kept"]]
    assert len(with_context) == context["rows_with_context"]
    assert all("<context>" in pair["prompt"][-1]["content"] for pair in with_context)
    from_corpus = [json.loads(r["pair_json"])["prompt"][-1]["content"] for r in enriched.to_pylist()
                   if r["corpus_sentences_added"]]
    assert len(from_corpus) == context["rows_with_corpus_context"] > 0
    assert all("Average speed is the distance travelled divided by the time taken." in p for p in from_corpus)
    assert result.report["corpus"]["table"]["sentences"] == 3
    assert run_root.join("reports", "enrich_summary.txt").is_file()


def test_near_duplicate_chains_and_stars_collapse_in_spark(spark):
    """passes.duplicates on real Spark (borrowing this module's session, so CI starts no other): one bucket holds a
    chain a~b~c~d, whose ends are not near duplicates of each other, a star around e, whose leaves are not, a row x
    like none, and an exact duplicate pair in two files. The later row of each verified pair in input order is the
    near duplicate, its detail naming its most similar earlier partner; of the exact pair the row in the earlier
    file stays, though its uuid is the larger. Only the two counts reached the driver."""
    import numpy as np

    from raytrain.enrich import batches, passes

    rng = np.random.default_rng(7)

    def changed(sig, lo):  # 15 of 128 entries replaced: 113/128 = 0.883 alike, two such steps 98/128 = 0.766
        out = sig.copy()
        out[lo : lo + 15] = rng.integers(0, 2**32, 15, dtype=np.uint32)
        return out

    a, e, x = (rng.integers(0, 2**32, 128, dtype=np.uint32) for _ in range(3))
    b = changed(a, 0)
    c = changed(b, 15)
    d = changed(c, 30)
    sigs = {"a": a, "b": b, "c": c, "d": d, "e": e, "f": changed(e, 0), "g": changed(e, 15), "h": changed(e, 30),
            "x": x}
    rows = [(i, 0, uuid, batches.OK, f"key-{uuid}", sig.tobytes(), [1]) for i, (uuid, sig) in enumerate(sigs.items())]
    rows += [(20, 1, "y1", batches.OK, "same", x.tobytes(), [2]), (21, 0, "y2", batches.OK, "same", x.tobytes(), [2])]
    prepared = spark.createDataFrame(rows, "row_id long, group_index long, uuid string, status string, "
                                           "exact_key string, signature binary, band_keys array<bigint>")
    job = load_job_config("configs/demo.yaml", ["enrich.num_partitions=2"])
    dups = passes.duplicates(spark, prepared, job)
    try:
        got = {r["row_id"]: (r["dup_reason"], r["dup_detail"]) for r in dups.flags.collect()}
    finally:
        dups.unpersist()
    uuid = {i: u for i, u in enumerate(sigs)}
    near = {uuid[i]: detail for i, (reason, detail) in got.items() if reason == batches.NEAR_DUPLICATE}
    assert sorted(near) == ["b", "c", "d", "f", "g", "h"]  # a and e kept; x alone
    assert {m: near[m] for m in "bcd"} == {m: f"near-duplicate of {p} (estimated Jaccard 0.883)"
                                           for m, p in zip("bcd", "abc", strict=True)}  # each its one earlier link
    assert all(near[m].startswith("near-duplicate of e ") for m in "fgh")
    assert got[20] == (batches.EXACT_DUPLICATE, "duplicate of y2 (same normalized text)")
    assert len(got) == 7
    assert (dups.pairs, dups.near_drops) == (6, 6)  # a~b, b~c, c~d, e~f, e~g, e~h; nothing else reaches 0.8


def test_bad_rows_are_quarantined_and_the_rest_kept(spark, tmp_path):
    """The rows a footer check cannot see, in one hub-layout file with four good rows, through the whole enrichment
    on this module's Spark session: invalid UTF-8 inside a message (it used to fail the Python worker's Arrow ->
    pandas conversion, and so the job), a null message, one 50 MB row and a row of 10,000 turns (the last two
    refused in the JVM, before any Python worker or shuffle sees their text). Each leaves through its door, the
    good rows are kept, and the report counts each reason exactly."""
    from raytrain.enrich.job import enrich_in_session
    from raytrain.sample_data.bad_rows import write_bad_rows_file

    bad = write_bad_rows_file(str(tmp_path / "bad"))
    job = load_job_config("configs/demo.yaml", ["enrich.num_partitions=2", "input.splits=[chat]",
                                                "enrich.context_corpus=[]"])
    result = enrich_in_session(spark, job, resolve(bad.out_dir), resolve(str(tmp_path / "run")), eval_sets=())
    report = result.report
    want = {u: r for u, r in bad.expected.items() if r != "ok"}
    assert report["rows_in"] == 8 and report["rows_out"] == 4
    assert report["quarantined"] == {r: 1 for r in want.values()}
    assert report["steps"][0] == {"step": "derive", "rows_in": 8, "rows_out": 4,
                                  "quarantined": {r: 1 for r in sorted(want.values())}}
    kept = pq.read_table(result.enriched.path, columns=["uuid"]).column("uuid").to_pylist()  # pyarrow reads Spark's
    assert sorted(kept) == sorted(u for u, r in bad.expected.items() if r == "ok")
    quarantine = {r["uuid"]: r for r in pq.read_table(result.quarantine.path).to_pylist()}
    assert {u: q["reason"] for u, q in quarantine.items()} == want
    assert all(q["split"] == "chat" and q["category"] == "chat" for q in quarantine.values())
    assert quarantine["bad-utf8"]["detail"] == \
        "messages[].content holds bytes that are not valid UTF-8 (the row was not decoded)"
    assert quarantine["bad-nested"]["detail"] == "message 1 is a NoneType, not a mapping with 'role' and 'content'."
    assert quarantine["huge-row"]["detail"] == f"{len(_huge_text(bad))} characters > max_chars=1000000"
    assert quarantine["many-turns"]["detail"] == "10000 messages > 1000 (the most a conversation may hold)"


def _huge_text(bad) -> str:
    """The huge row's message text (all of it: what derive_example's max_chars counts), read by pyarrow."""
    table = pq.read_table(bad.path, filters=[("uuid", "=", "huge-row")], columns=["messages"])
    return "".join(m["content"] for m in table.column("messages").to_pylist()[0])
