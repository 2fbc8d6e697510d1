"""Figures the docs and manifests state are the code's own (as the metric table already is: test_metrics.py).

A figure written once drifts from the code that sets it (the shutdown budget
read 15 s in two places and 10 s in the code). Each figure here is taken from
the code and looked for wherever a reader meets it.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from skillstats.cli.common import METRICS_PORTS
from skillstats.shutdown import DEFAULT_BUDGET_S, EXIT_SHUTDOWN_OVERRUN

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MANIFESTS = sorted((ROOT / "deploy" / "k8s").rglob("*.yaml"))


def lines_about(pattern: str, paths: list[Path]) -> list[tuple[str, str]]:
    found = []
    for path in paths:
        for line in path.read_text(encoding="utf-8").splitlines():
            if re.search(pattern, line, re.IGNORECASE):
                found.append((path.name, line))
    return found


def test_the_shutdown_budget_is_the_codes_wherever_it_is_stated() -> None:
    stated = []
    for where, line in lines_about(r"shutdown.budget|SHUTDOWN_BUDGET", DOCS + MANIFESTS):
        for seconds in re.findall(r"(?<!budget of )\b(\d+(?:\.\d+)?) ?s\b(?! per)", line):
            stated.append((where, float(seconds), line.strip()))
    assert stated, "no statement of the default shutdown budget found"
    wrong = [s for s in stated if s[1] != DEFAULT_BUDGET_S]
    assert wrong == []
    row = next(line for _w, line in lines_about(r"^\| `SKILLSTATS_SHUTDOWN_BUDGET`", DOCS))
    assert row.split("|")[3].strip() == f"{DEFAULT_BUDGET_S:g}"
    assert f"exits {EXIT_SHUTDOWN_OVERRUN}" in row


def pod_specs() -> list[tuple[str, dict]]:
    """(the skillstats command, pod spec) of every workload of the base."""
    found = []
    for path in sorted((ROOT / "deploy" / "k8s" / "base").glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if not isinstance(document, dict) or "spec" not in document:
                continue
            spec = document["spec"]
            template = spec.get("jobTemplate", {}).get("spec", spec).get("template", {})
            pod = template.get("spec")
            if pod is None:
                continue
            for container in pod.get("containers", []):
                if container.get("args"):
                    found.append((container["args"][0], {**pod, "container": container}))
    return found


def test_grace_periods_outlast_the_shutdown_budget() -> None:
    long_running = [(command, pod) for command, pod in pod_specs() if command in ("windows", "lag-exporter")]
    assert {command for command, _ in long_running} == {"windows", "lag-exporter"}
    for command, pod in long_running:
        assert pod.get("terminationGracePeriodSeconds", 30) > DEFAULT_BUDGET_S, command


def test_the_operations_table_lists_the_probes_and_ports_the_manifests_use() -> None:
    table = {}
    for _where, line in lines_about(r"^\| .* \| `skillstats ", [ROOT / "docs" / "operations.md"]):
        cells = [c.strip() for c in line.strip("|").split("|")]
        command = re.search(r"`skillstats ([a-z-]+)", cells[1])
        if command:
            table.setdefault(command.group(1), []).append(cells)
    for command, pod in pod_specs():
        container = pod["container"]
        paths = {
            container[probe]["httpGet"]["path"] for probe in ("livenessProbe", "readinessProbe") if probe in container
        }
        if not paths:
            continue
        rows = table[command]
        assert any(all(f"`{path}`" in row[3] for path in paths) for row in rows), (command, paths, rows)
        ports = {p["containerPort"] for p in container.get("ports", [])}
        assert ports == {METRICS_PORTS[command]}, (command, ports)
        assert any(row[2] == str(METRICS_PORTS[command]) for row in rows), (command, rows)
