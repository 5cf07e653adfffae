"""`raytrain status`: the runs under a storage root and their checkpoints, as a table."""

from __future__ import annotations

from dataclasses import dataclass

from raytrain.storage import StorageLocation, resolve


@dataclass(frozen=True)
class RunRow:
    user: str
    project: str
    run: str
    latest_step: int | None
    num_checkpoints: int
    locked_by: str
    uri: str


def scan_runs(root: StorageLocation) -> list[RunRow]:
    """Walk <root>/<user>/<project>/<run>/ (three levels) and read each run's checkpoint state."""
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
                if not rdir.join("checkpoints").is_dir() and not rdir.join("data").is_dir():
                    continue
                store = CheckpointStore(rdir)
                committed = store.committed()
                holder = RunLock(rdir).holder()
                rows.append(RunRow(user, project, run, committed[-1].step if committed else None, len(committed),
                                   f"{holder.host}:{holder.pid}" if holder else "", rdir.uri))
    return rows


def print_status(root_uri: str) -> None:
    from rich.console import Console
    from rich.table import Table

    root = resolve(root_uri)
    rows = scan_runs(root)
    table = Table(title=f"raytrain runs under {root.uri}")
    for col in ("user", "project", "run", "latest step", "checkpoints", "running (host:pid)"):
        table.add_column(col)
    for r in rows:
        table.add_row(r.user, r.project, r.run, "-" if r.latest_step is None else str(r.latest_step),
                      str(r.num_checkpoints), r.locked_by)
    Console().print(table)
    if not rows:
        Console().print(f"no runs under {root.uri} (runs live at <root>/<user>/<project>/<run>/)")
