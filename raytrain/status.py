"""`raytrain status`: the runs under a storage root and their checkpoints, as a table."""

from __future__ import annotations

import math
from dataclasses import dataclass

from raytrain.errors import RaytrainError
from raytrain.storage import RunPaths, StorageLocation, resolve

COLUMNS = ("user", "project", "run", "latest step", "checkpoints", "loss", "saved at", "running (host:pid)")


@dataclass(frozen=True)
class RunRow:
    """One run folder `<root>/<user>/<project>/<run>/` as `raytrain status` shows it."""

    user: str
    """Namespace folder under the storage root."""
    project: str
    """Project folder under the user."""
    run: str
    """Run folder (storage.run_name)."""
    latest_step: int | None
    """Step of the newest committed checkpoint; None when the run has none yet."""
    num_checkpoints: int
    """Committed checkpoints kept (retention removes older ones)."""
    latest_loss: float | None
    """Training loss recorded in the newest checkpoint's manifest (metadata.metrics.loss), when present."""
    saved_at: str
    """When the newest checkpoint was committed (the manifest's created_at, ISO 8601), '' when none."""
    locked_by: str
    """'host:pid' of the job holding the run's lock, '' when no job holds it."""
    uri: str
    """The run folder's URI."""


def _loss(metadata: dict) -> float | None:
    value = metadata.get("metrics", {}).get("loss")
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def scan_runs(root: StorageLocation) -> list[RunRow]:
    """Walk <root>/<user>/<project>/<run>/ (three levels) and read each run's checkpoint state. Folders holding
    neither checkpoints/ nor data/ are not runs and are skipped."""
    from raytrain.checkpoint.store import CheckpointStore
    from raytrain.runlock import RunLock

    rows: list[RunRow] = []
    if not root.is_dir():
        return rows
    for user in sorted(root.listdir()):
        for project in sorted(root.join(user).listdir()) if root.join(user).is_dir() else []:
            pdir = root.join(user, project)
            for run in sorted(pdir.listdir()) if pdir.is_dir() else []:
                rdir = pdir.join(run)
                if not RunPaths(rdir).checkpoints.is_dir() and not RunPaths(rdir).data.is_dir():
                    continue
                committed = CheckpointStore(rdir).committed()
                latest = committed[-1] if committed else None
                holder = RunLock(rdir).holder()
                rows.append(RunRow(
                    user, project, run, latest.step if latest else None, len(committed),
                    _loss(latest.metadata) if latest else None,
                    str(latest.manifest.get("created_at", "")) if latest else "",
                    f"{holder.host}:{holder.pid}" if holder else "", rdir.uri))
    return rows


def format_cells(row: RunRow) -> tuple[str, ...]:
    """The table cells of one row, in COLUMNS order ('-' for a missing value)."""
    loss = "-" if row.latest_loss is None else ("nan" if math.isnan(row.latest_loss) else f"{row.latest_loss:.4f}")
    return (row.user, row.project, row.run, "-" if row.latest_step is None else str(row.latest_step),
            str(row.num_checkpoints), loss, row.saved_at or "-", row.locked_by or "-")


def print_status(root_uri: str) -> int:
    """Print the runs under `root_uri` as a table; returns how many runs it found. Raises RaytrainError when the
    root does not exist (a mistyped --root should not read as "no runs")."""
    from rich.console import Console
    from rich.table import Table

    root = resolve(root_uri)
    if root.is_posix and not root.is_dir():
        raise RaytrainError(f"--root {root.uri} does not exist; pass the storage.root of your runs "
                            "(runs live at <root>/<user>/<project>/<run>/)")
    rows = scan_runs(root)
    table = Table(title=f"raytrain runs under {root.uri}")
    for col in COLUMNS:
        # no_wrap: a run name split over two lines is hard to copy into storage.run_name=...
        table.add_column(col, no_wrap=col in ("user", "project", "run"))
    for r in rows:
        table.add_row(*format_cells(r))
    # Wide enough for the table when piped (rich falls back to 80 columns without a terminal).
    console = Console(width=160) if not Console().is_terminal else Console()
    console.print(table)
    for r in rows:
        if r.locked_by:
            session = _read_json(RunPaths(root.join(r.user, r.project, r.run)).reports.join("session.json")) or {}
            if session.get("dashboard_url"):
                console.print(f"{r.run}: running, Ray dashboard {session['dashboard_url']}", markup=False,
                              highlight=False)
    if not rows:
        console.print(f"no runs under {root.uri} (runs live at <root>/<user>/<project>/<run>/)")
    return len(rows)


def _read_json(loc: StorageLocation) -> dict | None:
    import json

    if not loc.is_file():
        return None
    try:
        value = json.loads(loc.read_text())
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def run_summary_lines(run_uri: str) -> list[str]:
    """A compact summary of one run folder: whether a job holds it (and its dashboard), steps and last losses,
    checkpoints, data counts, charts and logs. Raises RaytrainError when the folder is not a run."""
    from raytrain.charts import CHART_DIR, load_metrics
    from raytrain.checkpoint.store import CheckpointStore
    from raytrain.runlock import RunLock

    rdir = resolve(run_uri)
    if not any(rdir.join(d).is_dir() for d in ("checkpoints", "data", "reports")):
        raise RaytrainError(f"{rdir.uri} is not a run folder (no checkpoints/, data/ or reports/ in it); runs live at "
                            "<root>/<user>/<project>/<run>/, `raytrain status --root <root>` lists them")
    from raytrain.ownership import run_owner

    lines = [f"run {rdir.uri}"]
    lines.append(f"  owner        {run_owner(rdir) or '-'}")
    holder = RunLock(rdir).holder()
    session = _read_json(RunPaths(rdir).reports.join("session.json")) or {}
    if holder:
        lines.append(f"  running      on {holder.host}:{holder.pid} for {holder.user} (lock generation "
                     f"{holder.generation})"
                     + (f", dashboard {session['dashboard_url']}" if session.get("dashboard_url") else ""))
    else:
        lines.append("  running      no")

    metrics_loc = RunPaths(rdir).reports.join("metrics.jsonl")
    metrics = load_metrics(metrics_loc.local_path) if metrics_loc.local_path and metrics_loc.is_file() else []
    summary = _read_json(RunPaths(rdir).reports.join("run_summary.json")) or {}
    if metrics:
        last = metrics[-1]
        evals = [m for m in metrics if isinstance(m.get("validation_loss"), int | float)]
        text = f"  training     step {last['step']}, loss {last.get('loss', float('nan')):.4f}"
        if evals:
            text += f", validation loss {evals[-1]['validation_loss']:.4f} at step {evals[-1]['step']}"
        if last.get("tokens_seen"):
            text += f", {last['tokens_seen']:,} tokens seen"
        lines.append(text)
    else:
        lines.append("  training     no steps recorded")
    counts = summary.get("parameters") or {}
    if counts.get("total"):
        lora = summary.get("lora")
        kind = f"LoRA rank {lora['rank']} on {', '.join(lora['targets'])}" if lora else "full fine-tune"
        lines.append(f"  parameters   {kind}: {counts['trainable']:,} trainable of {counts['total']:,}")

    committed = CheckpointStore(rdir).committed()
    if committed:
        latest = committed[-1]
        lines.append(f"  checkpoints  {len(committed)} (steps {', '.join(str(c.step) for c in committed)}), latest "
                     f"step {latest.step} saved {latest.manifest.get('created_at', '?')}")
    else:
        lines.append("  checkpoints  none")

    lines += _waves_lines(rdir)
    report = _read_json(RunPaths(rdir).reports.join("enrich_report.json"))
    if report:
        reasons = ", ".join(f"{k} {v}" for k, v in (report.get("quarantined") or {}).items()) or "none"
        lines.append(f"  data         {report.get('rows_in')} rows in -> {report.get('rows_out')} kept, "
                     f"{report.get('quarantined_total')} quarantined ({reasons})")
    packed = _read_json(RunPaths(rdir).packed.join("_manifest.json"))
    if packed:
        held = (packed.get("validation") or {}).get("num_packs")
        lines.append(f"  packed       {packed.get('num_packs')} sequences of {packed.get('seq_len')} tokens from "
                     f"{packed.get('rows')} rows" + (f", {held} held out for validation" if held else ""))
    elif summary.get("num_packs"):
        lines.append(f"  packed       {summary['num_packs']} sequences")

    charts = rdir.join(*CHART_DIR)
    if charts.is_dir():
        names = sorted(n for n in charts.listdir() if n.endswith(".png"))
        lines.append(f"  charts       {charts.uri} ({', '.join(names) or 'none'})")
    logs = RunPaths(rdir).reports.join("logs")
    if logs.is_dir():
        names = sorted(logs.listdir())
        if names:
            lines.append(f"  logs         {logs.join(names[-1]).uri}" + (f" (+{len(names) - 1} older)"
                                                                         if len(names) > 1 else ""))
    return lines


def _waves_lines(rdir: StorageLocation) -> list[str]:
    """The committed waves of a streamed enrichment (raytrain.enrich.waves), while it runs and after."""
    def wave_records(folder: StorageLocation) -> list[dict]:
        return [r for r in (_read_json(folder.join(n)) for n in sorted(folder.listdir())
                            if n.startswith("wave-") and n.endswith(".json")) if r]

    records = wave_records(RunPaths(rdir).waves)
    if not records:
        return []
    lines = [f"  waves        {len(records)} enriched and committed: {sum(r['rows_in'] for r in records)} rows in -> "
             f"{sum(r['kept'] for r in records)} kept, {sum(r['quarantined'] for r in records)} quarantined"]
    wave_packs = [r["num_packs"] for r in wave_records(RunPaths(rdir).packed.join("waves"))]
    if wave_packs:
        lines.append(f"  streamed     {len(wave_packs)} waves packed ({sum(wave_packs)} sequences), "
                     f"{_waves_trained(rdir, wave_packs)} trained through")
    return lines


def _waves_trained(rdir: StorageLocation, wave_packs: list[int]) -> int:
    """Waves whose every pack the training's first epoch has trained (from the latest checkpoint's data position;
    a window of waves is trained through as a whole: raytrain.trainer.pack_order)."""
    from raytrain.checkpoint.store import CheckpointStore

    committed = CheckpointStore(rdir).committed()
    if not committed:
        return 0
    train = (committed[-1].metadata.get("config") or {}).get("train") or {}
    window = int(train.get("shuffle_window_waves") or 1)
    packs = int(committed[-1].metadata.get("data_position") or 0) * int(train.get("micro_batch_size") or 1)
    done, offset = 0, 0
    for start in range(0, len(wave_packs), window):
        offset += sum(wave_packs[start:start + window])
        if offset > packs:
            break
        done = min(start + window, len(wave_packs))
    return done


def print_run_summary(run_uri: str) -> None:
    """`raytrain status RUN`: run_summary_lines, printed."""
    for line in run_summary_lines(run_uri):
        print(line)
