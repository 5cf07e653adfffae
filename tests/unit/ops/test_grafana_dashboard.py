"""cluster/grafana/raytrain.json: parses, shows every raytrain metric under Ray's export name, and is wired to a
datasource variable the way Ray's own generated dashboards are."""

import json
import re
from pathlib import Path

import pytest
from ray.dashboard.modules.metrics.grafana_dashboard_factory import generate_default_grafana_dashboard

DASHBOARD = Path(__file__).resolve().parents[3] / "cluster" / "grafana" / "raytrain.json"
# Metric name as raytrain records it -> tags its panels must filter or group on.
TRAIN_TAGS = ("run", "stage", "dp_rank")
METRICS = {
    "raytrain_train_loss": TRAIN_TAGS,
    "raytrain_train_tokens_per_s": TRAIN_TAGS,
    "raytrain_train_step_time_s": TRAIN_TAGS,
    "raytrain_train_mfu": TRAIN_TAGS,
    "raytrain_enrich_rows_per_s": ("run", "stage"),
    "raytrain_enrich_quarantined_rows": ("run", "reason"),
}
GRAFANA_BUILTINS = {"__interval", "__rate_interval", "__range", "__all"}


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _panels(dashboard: dict) -> list[dict]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def _exprs(dashboard: dict) -> list[str]:
    return [t["expr"] for p in _panels(dashboard) for t in p["targets"]]


@pytest.mark.parametrize("metric", sorted(METRICS))
def test_every_metric_is_queried_under_rays_export_name(dashboard, metric):
    exported = f"ray_{metric}"  # Ray prefixes ray.util.metrics names with its namespace
    exprs = [e for e in _exprs(dashboard) if re.search(rf"\b{exported}\{{", e)]
    assert exprs, f"no panel queries {exported}"
    for expr in exprs:
        assert 'run=~"$run"' in expr and 'SessionName=~"$SessionName"' in expr, expr
    used = " ".join(exprs)
    for tag in METRICS[metric]:
        assert re.search(rf"\b{tag}\b", used), f"{exported}: tag {tag} neither filtered nor grouped"


def test_datasource_variable_matches_rays_own_dashboards(dashboard):
    ours = next(v for v in dashboard["templating"]["list"] if v["type"] == "datasource")
    rays_json, _uid = generate_default_grafana_dashboard()
    theirs = next(v for v in json.loads(rays_json)["templating"]["list"] if v["type"] == "datasource")
    assert (ours["name"], ours["query"]) == (theirs["name"], theirs["query"]) == ("datasource", "prometheus")


def test_every_query_uses_the_datasource_variable(dashboard):
    for panel in _panels(dashboard):
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            assert var["datasource"]["uid"] == "${datasource}", var["name"]


def test_every_variable_used_is_defined(dashboard):
    defined = {v["name"] for v in dashboard["templating"]["list"]} | GRAFANA_BUILTINS
    texts = _exprs(dashboard) + [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    used = {m for text in texts for m in re.findall(r"\$\{?(\w+)", text)}
    assert used <= defined, used - defined


def test_queries_have_balanced_brackets_and_quotes(dashboard):
    pairs = {")": "(", "]": "[", "}": "{"}
    for expr in _exprs(dashboard):
        assert expr.count('"') % 2 == 0, expr
        stack = []
        for ch in re.sub(r'"[^"]*"', '""', expr):  # brackets inside label values do not count
            if ch in "([{":
                stack.append(ch)
            elif ch in pairs:
                assert stack and stack.pop() == pairs[ch], expr
        assert not stack, expr


def test_panel_ids_unique_and_layout_does_not_overlap(dashboard):
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    cells = set()
    for panel in dashboard["panels"]:
        g = panel["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, panel["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not (mine & cells), f"{panel['title']} overlaps another panel"
        cells |= mine
