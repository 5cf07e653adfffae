"""raytrain.charts on a synthetic run folder: valid PNGs of the expected size, drawn from the run's own files (the
bytes change when the metrics change and stay the same when they do not), clear errors on bad input; and
`raytrain status RUN` on the same folder."""

from __future__ import annotations

import json
import re
import struct

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from cli_runs import cli, commit_checkpoint

from raytrain.charts import DPI, FIGSIZE_IN, load_metrics, write_run_charts
from raytrain.errors import RaytrainError
from raytrain.status import run_summary_lines

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path) -> tuple[int, int]:
    """(width, height) from the IHDR chunk; asserts the file is a PNG."""
    data = open(path, "rb").read()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR", path
    return struct.unpack(">II", data[16:24])


def write_metrics(run_dir, losses, eval_at=(5, 10)):
    reports = run_dir / "reports"
    reports.mkdir(parents=True, exist_ok=True)
    with open(reports / "metrics.jsonl", "w") as f:
        for step, loss in enumerate(losses, 1):
            record = {"step": step, "loss": loss, "lr": 3e-3 * min(1.0, step / 2), "tokens_seen": 1000 * step}
            if step in eval_at:
                record["validation_loss"] = loss + 0.05
            f.write(json.dumps(record) + "\n")


def write_enriched(run_dir, seed=0):
    rng = np.random.default_rng(seed)
    enriched = run_dir / "data" / "enriched"
    enriched.mkdir(parents=True)
    rows = []
    for i in range(60):
        scores = rng.uniform(-0.1, 1.0, size=int(rng.integers(0, 6))).astype(np.float32).tolist()
        rows.append({"split": ("chat", "code", "math")[i % 3], "num_tokens": int(rng.integers(20, 1000)),
                     "sentence_scores": scores, "kept_indices": [j for j, s in enumerate(scores) if s > 0.5],
                     "question_scores": scores, "answer_scores": [s * 0.9 for s in scores]})
    pq.write_table(pa.Table.from_pylist(rows), enriched / "part-00000.parquet")


LOSSES = [10.4, 10.4, 10.3, 10.1, 9.9, 9.8, 9.7, 9.6, 9.5, 9.4]


def test_charts_are_pngs_drawn_from_the_run_files(tmp_path):
    run = tmp_path / "run"
    write_metrics(run, LOSSES)
    write_enriched(run)
    paths = write_run_charts(str(run), seq_len=1024)
    names = sorted(p.rsplit("/", 1)[-1] for p in paths)
    assert names == ["loss.png", "lr.png", "similarity.png", "token_lengths.png"]
    for p in paths:
        assert png_size(p) == (FIGSIZE_IN[0] * DPI, FIGSIZE_IN[1] * DPI)
        assert open(p, "rb").read().__len__() > 10_000  # a drawn chart, not an empty canvas
    before = {p: open(p, "rb").read() for p in paths}

    assert write_run_charts(str(run), seq_len=1024) == paths  # same inputs: the same bytes
    assert {p: open(p, "rb").read() for p in paths} == before

    write_metrics(run, [x - 1.0 for x in LOSSES])  # other metrics: loss and lr charts follow, data charts do not
    write_run_charts(str(run), seq_len=1024)
    changed = {p.rsplit("/", 1)[-1] for p in paths if open(p, "rb").read() != before[p]}
    assert changed == {"loss.png"}


def test_resumed_steps_keep_their_last_record(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0},
                                                      {"step": 2, "loss": 1.5}, {"step": 3, "loss": 1.0}]) + "\n")
    assert [(m["step"], m["loss"]) for m in load_metrics(str(path))] == [(1, 3.0), (2, 1.5), (3, 1.0)]


@pytest.mark.parametrize("line, message", [("{not json", "not JSON"), ('{"loss": 1.0}', "integer 'step'")])
def test_bad_metrics_name_file_and_line(tmp_path, line, message):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n" + line + "\n")
    with pytest.raises(RaytrainError, match=rf"metrics.jsonl:2: .*{message}"):
        load_metrics(str(path))


def test_a_run_without_training_gets_only_the_data_charts(tmp_path):
    run = tmp_path / "run"
    write_enriched(run)
    assert sorted(p.rsplit("/", 1)[-1] for p in write_run_charts(str(run), 1024)) == ["similarity.png",
                                                                                       "token_lengths.png"]


def test_the_data_charts_of_an_enrichment_in_waves(tmp_path):
    """A streamed enrichment's rows under wave-NNNNN/ folders draw the same data charts as the same rows flat."""
    flat, waves = tmp_path / "flat", tmp_path / "waves"
    write_enriched(flat)
    table = pq.read_table(flat / "data" / "enriched" / "part-00000.parquet")
    for i, part in enumerate((table.slice(0, 25), table.slice(25))):
        (waves / "data" / "enriched" / f"wave-{i:05d}").mkdir(parents=True)
        pq.write_table(part, waves / "data" / "enriched" / f"wave-{i:05d}" / "part-00000.parquet")
    drawn = {name: [open(p, "rb").read() for p in write_run_charts(str(name), 1024)] for name in (flat, waves)}
    assert len(drawn[waves]) == 2 and drawn[waves] == drawn[flat]


def test_status_of_one_run(tmp_path):
    run = tmp_path / "runs" / "ci" / "demo" / "r1"
    write_metrics(run, LOSSES)
    write_enriched(run)
    write_run_charts(str(run), 1024)
    commit_checkpoint(run, 5, 9.9)
    commit_checkpoint(run, 10, 9.4)
    (run / "reports" / "enrich_report.json").write_text(json.dumps(
        {"rows_in": 70, "rows_out": 60, "quarantined_total": 10, "quarantined": {"too_many_tokens": 10}}))
    lines = run_summary_lines(str(run))
    text = "\n".join(lines)
    assert lines[0] == f"run file://{run}"
    assert "owner        ci" in text  # no owner.json (written by a job): the namespace folder's user
    assert "running      no" in text
    assert "step 10, loss 9.4000, validation loss 9.4500 at step 10, 10,000 tokens seen" in text
    assert "checkpoints  2 (steps 5, 10)" in text
    assert "70 rows in -> 60 kept, 10 quarantined (too_many_tokens 10)" in text
    assert "loss.png" in text and "similarity.png" in text

    out = cli("status", str(run))
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == lines
    out = cli("status", str(tmp_path))
    assert out.returncode == 1 and "is not a run folder" in out.stderr


def test_status_shows_the_dashboard_of_a_running_run(tmp_path):
    """A job holding the run's lock wrote reports/session.json (raytrain.runner.write_session): both the table and
    the one-run summary show its dashboard; a run nobody holds shows none."""
    from raytrain.runlock import RunLock
    from raytrain.storage import resolve

    root = tmp_path / "runs"
    run = root / "ci" / "demo" / "live"
    commit_checkpoint(run, 1, 9.0)
    (run / "reports").mkdir(parents=True, exist_ok=True)
    (run / "reports" / "session.json").write_text(json.dumps({"dashboard_url": "http://127.0.0.1:8265"}))
    assert "dashboard" not in cli("status", "--root", str(root)).stdout  # not running: no dashboard to visit
    with RunLock(resolve(str(run)), heartbeat_interval_s=None, user="ci"):
        table = cli("status", "--root", str(root))
        one = cli("status", str(run))
    assert table.returncode == 0 and one.returncode == 0, table.stderr + one.stderr
    assert "live: running, Ray dashboard http://127.0.0.1:8265" in table.stdout
    assert re.search(r"running +on \S+:\d+ for ci \(lock generation 1\), dashboard http://127\.0\.0\.1:8265",
                     one.stdout), one.stdout
