"""The operators' Grafana dashboard (deploy/grafana/skillstats.json) names only metrics skillstats exports.

Every PromQL expression of the dashboard (panel targets, rows' nested panels,
template variable queries) is read, its metric names extracted and looked up in
`exported_series_names()`, so renaming a metric without the dashboard (or the
reverse) fails here. The dashboard must also keep a panel for each area operators
need, every panel a description and a place on the grid, and, when promtool is
installed, every expression must parse as PromQL.

`dashboard_problems` and `promtool_problems` take the path of a dashboard, so the
tests below also run them on broken copies: a check that cannot fail is no check.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from skillstats.metrics import exported_series_names
from tests.promql import NAME_MATCHER, metric_names

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "skillstats.json"
DATASOURCE_UID = "${datasource}"

# Areas the dashboard must cover: (metric, pattern the expression must also match).
REQUIRED: dict[str, tuple[str, str]] = {
    "lag in seconds": ("skillstats_consumer_lag_seconds", r""),
    "lag in records": ("skillstats_consumer_lag_records", r""),
    "throughput (events by outcome)": ("skillstats_events_total", r"\brate\(.*\boutcome\b|\boutcome\b.*\brate\("),
    "SQL apply latency": ("skillstats_sql_apply_seconds_bucket", r"\bhistogram_quantile\("),
    "DLQ growth": ("skillstats_dlq_records_total", r"\bincrease\("),
    "DLQ writes": ("skillstats_dlq_writes_total", r"\brate\("),
    "docsync last success": ("skillstats_docsync_last_success_timestamp_seconds", r"\btime\(\)"),
    "degraded": ("skillstats_degraded", r""),
}


def all_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, rows and their nested panels (collapsed rows keep theirs in `panels`) included."""
    for panel in panels:
        yield panel
        yield from all_panels(panel.get("panels") or [])


def variable_promql(query: str) -> str | None:
    """The PromQL inside a Grafana Prometheus variable query, None when it has none (label_values(label), ...)."""
    query = query.strip()
    match = re.fullmatch(r"label_values\((.*),\s*[A-Za-z_]\w*\s*\)", query, re.DOTALL)
    if match:
        return match.group(1)
    match = re.fullmatch(r"query_result\((.*)\)", query, re.DOTALL)
    if match:
        return match.group(1)
    if re.fullmatch(r"(label_values|label_names|metrics)\(.*\)", query, re.DOTALL):
        return None
    return query


def expressions(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable of the dashboard."""
    found: list[tuple[str, str]] = []
    for panel in all_panels(dashboard.get("panels") or []):
        for target in panel.get("targets") or []:
            if "expr" in target:
                found.append(
                    (f"panel {panel.get('id')} {panel.get('title')!r} target {target.get('refId')}", target["expr"])
                )
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") != "query":
            continue
        query = variable.get("query")
        if isinstance(query, dict):
            query = query.get("query")
        promql = variable_promql(query or "")
        if promql is not None:
            found.append((f"variable {variable.get('name')!r}", promql))
    return found


def dashboard_problems(path: Path) -> list[str]:
    """Everything wrong with the dashboard at `path`; empty when it is fine."""
    text = path.read_text()
    dashboard = json.loads(text)
    problems: list[str] = []

    if any("\t" in line or (len(line) - len(line.lstrip(" "))) % 2 for line in text.splitlines()):
        problems.append("indent the JSON with 2 spaces (no tabs)")
    if dashboard.get("title") != "skillstats" or not dashboard.get("uid"):
        problems.append("the dashboard needs the title 'skillstats' and a uid")
    if not isinstance(dashboard.get("schemaVersion"), int) or dashboard["schemaVersion"] < 36:
        problems.append("schemaVersion should be a recent one (36 or later)")

    variables = {v.get("name"): v for v in dashboard.get("templating", {}).get("list", [])}
    datasource = variables.get("datasource", {})
    if datasource.get("type") != "datasource" or datasource.get("query") != "prometheus":
        problems.append("a `datasource` template variable of Prometheus data sources is missing")
    if variables.get("group", {}).get("type") != "query":
        problems.append("a `group` query template variable is missing")

    seen_ids: set[int] = set()
    for panel in all_panels(dashboard.get("panels") or []):
        name = f"panel {panel.get('id')} {panel.get('title')!r}"
        if not isinstance(panel.get("id"), int) or panel["id"] in seen_ids:
            problems.append(f"{name}: panel ids must be unique integers")
        else:
            seen_ids.add(panel["id"])
        grid = panel.get("gridPos")
        if not isinstance(grid, dict) or not all(isinstance(grid.get(k), int) for k in "hwxy"):
            problems.append(f"{name}: gridPos with integer h, w, x, y is missing")
        elif grid["x"] < 0 or grid["w"] < 1 or grid["x"] + grid["w"] > 24:
            problems.append(f"{name}: gridPos does not fit the 24 columns")
        if not str(panel.get("title") or "").strip():
            problems.append(f"{name}: no title")
        if not str(panel.get("description") or "").strip():
            problems.append(f"{name}: no description")
        if panel.get("type") == "row":
            continue
        if (panel.get("datasource") or {}).get("uid") != DATASOURCE_UID:
            problems.append(f"{name}: datasource must be the {DATASOURCE_UID} variable")
        targets = panel.get("targets") or []
        if not targets:
            problems.append(f"{name}: no targets")
        ref_ids = [target.get("refId") for target in targets]
        if len(set(ref_ids)) != len(ref_ids) or not all(ref_ids):
            problems.append(f"{name}: every target needs a refId, unique in its panel")
        for target in targets:
            if not str(target.get("expr") or "").strip():
                problems.append(f"{name}: target {target.get('refId')} has no expr")
            if (target.get("datasource") or {}).get("uid", DATASOURCE_UID) != DATASOURCE_UID:
                problems.append(f"{name}: target {target.get('refId')} datasource must be {DATASOURCE_UID}")

    exported = exported_series_names()
    exprs = expressions(dashboard)
    multi = [name for name, v in variables.items() if v.get("multi") or v.get("includeAll")]
    for where, expr in exprs:
        names = metric_names(expr)
        if not names:
            problems.append(f"{where}: selects no metric: {expr}")
        for metric in sorted(names - exported.keys()):
            hint = f" (the family; PromQL sees {sorted(k for k, v in exported.items() if v == metric)})"
            problems.append(f"{where}: {metric} is not exported{hint if metric in exported.values() else ''}")
        for matcher, _ in NAME_MATCHER.findall(expr):
            if matcher != "=":
                problems.append(f"{where}: match __name__ with = only, so the metric can be checked")
        for variable in multi:
            if re.search(r'\w\s*!?=\s*"[^"]*\$\{?' + re.escape(variable) + r"\b", expr):
                problems.append(f"{where}: ${variable} takes several values: match it with =~ or !~")

    for area, (metric, pattern) in REQUIRED.items():
        in_panels = (expr for where, expr in exprs if where.startswith("panel "))
        if not any(metric in metric_names(expr) and re.search(pattern, expr) for expr in in_panels):
            problems.append(f"no panel shows {area} ({metric}{', ' + pattern if pattern else ''})")
    return problems


# Grafana's variables, replaced by values of the right kind before promtool parses an expression.
_GRAFANA_VALUES = {
    "__rate_interval": "5m",
    "__interval": "1m",
    "__range": "6h",
    "__interval_ms": "60000",
    "__range_s": "21600",
    "__range_ms": "21600000",
}


def concrete_promql(expr: str) -> str:
    """`expr` with Grafana variables replaced: built-in durations by durations, the dashboard's own by "x"."""

    def value(match: re.Match[str]) -> str:
        return _GRAFANA_VALUES.get(match.group(1), "x")

    expr = re.sub(r"\$\{(\w+)(?::[\w-]+)?\}", value, expr)
    return re.sub(r"\$(\w+)", value, expr)


def promtool_problems(path: Path, workdir: Path) -> list[str]:
    """promtool's complaints about the dashboard's expressions, each as one recording rule."""
    exprs = expressions(json.loads(path.read_text()))
    rules = [
        {"record": f"grafana:expr_{n}:{re.sub(r'[^A-Za-z0-9_]+', '_', where)}", "expr": concrete_promql(expr)}
        for n, (where, expr) in enumerate(exprs)
    ]
    rules_file = workdir / "grafana-exprs.rules.yml"
    rules_file.write_text(json.dumps({"groups": [{"name": "grafana", "rules": rules}]}, indent=2))  # JSON is YAML
    result = subprocess.run(
        ["promtool", "check", "rules", str(rules_file)], capture_output=True, text=True, timeout=60, check=False
    )
    if result.returncode != 0 or f"SUCCESS: {len(rules)} rules found" not in result.stdout:
        return [f"promtool check rules exited {result.returncode}:\n{result.stdout}{result.stderr}"]
    return []


# ---------------------------------------------------------------------------------------------- tests


def test_dashboard_names_only_exported_metrics_and_covers_every_area() -> None:
    assert dashboard_problems(DASHBOARD) == []


def test_dashboard_expressions_parse_with_promtool(tmp_path: Path) -> None:
    if shutil.which("promtool") is None:
        pytest.skip("promtool is not on PATH")
    assert promtool_problems(DASHBOARD, tmp_path) == []


def test_metric_names_skip_labels_strings_functions_and_variables() -> None:
    expr = (
        'sum by (group, skillstats_label) (rate(skillstats_events_total{group=~"$group", '
        'kind="skillstats_not_a_metric", outcome!~"x{1,2}"}[$__rate_interval] offset 5m)) '
        "/ on (group) group_left (skillstats_other_label) max by (group) (skillstats_degraded) "
        '> bool 1e3 and histogram_quantile(0.99, {__name__="skillstats_sql_apply_seconds_bucket"}) + ${x} + $y'
    )
    assert metric_names(expr) == {
        "skillstats_events_total",
        "skillstats_degraded",
        "skillstats_sql_apply_seconds_bucket",
    }
    assert metric_names("time() - max(skillstats_docsync_last_success_timestamp_seconds)") == {
        "skillstats_docsync_last_success_timestamp_seconds"
    }
    assert variable_promql('label_values(skillstats_consumer_lag_records{role="windows"}, group)') == (
        'skillstats_consumer_lag_records{role="windows"}'
    )
    assert variable_promql("label_values(group)") is None


def _broken_copy(tmp_path: Path, change: str) -> Path:
    broken = json.loads(DASHBOARD.read_text())
    panels = broken["panels"]
    if change == "panel":  # the family name instead of the counter's series name
        target = next(p for p in panels if "skillstats_events_total" in json.dumps(p.get("targets", [])))
        for t in target["targets"]:
            t["expr"] = t["expr"].replace("skillstats_events_total", "skillstats_events")
    elif change == "nested":  # a panel inside a collapsed row
        row = next(p for p in panels if p.get("type") == "row" and p.get("panels"))
        row["panels"][0]["targets"][0]["expr"] = "max by (instance) (skillstats_lag_exporter_upp)"
    elif change == "variable":
        group = next(v for v in broken["templating"]["list"] if v["name"] == "group")
        group["query"]["query"] = "label_values(skillstats_consumer_lags, group)"
    elif change == "emptied":
        broken["panels"] = []
    path = tmp_path / "skillstats.json"
    path.write_text(json.dumps(broken, indent=2))
    return path


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ("panel", "skillstats_events is not exported"),
        ("nested", "skillstats_lag_exporter_upp is not exported"),
        ("variable", "skillstats_consumer_lags is not exported"),
        ("emptied", "no panel shows SQL apply latency"),
    ],
)
def test_the_check_fails_on_a_broken_dashboard(tmp_path: Path, change: str, named: str) -> None:
    problems = dashboard_problems(_broken_copy(tmp_path, change))
    assert any(named in problem for problem in problems), problems
    if change == "emptied":
        assert len([p for p in problems if p.startswith("no panel shows")]) == len(REQUIRED)


def test_promtool_check_fails_on_a_syntax_error(tmp_path: Path) -> None:
    if shutil.which("promtool") is None:
        pytest.skip("promtool is not on PATH")
    dashboard = json.loads(DASHBOARD.read_text())
    target = next(p for p in all_panels(dashboard["panels"]) if p.get("targets"))["targets"][0]
    target["expr"] = "sum by (group) (rate(skillstats_events_total[$__rate_interval])"  # one ")" short
    path = tmp_path / "skillstats.json"
    path.write_text(json.dumps(dashboard, indent=2))
    problems = promtool_problems(path, tmp_path)
    assert problems and "unclosed left parenthesis" in problems[0], problems
