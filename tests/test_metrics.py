"""The metrics module, the README's metric table, and the alert rules (skillstats/metrics.py, deploy/prometheus)."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import yaml
from prometheus_client import REGISTRY

from skillstats.metrics import PipelineMetrics, Probes, exported_series_names, serve, watch_health
from skillstats.sinks.batch import ApplyOutcome
from skillstats.sinks.recovery import Health
from tests.helpers import free_port, get
from tests.promql import metric_names

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy" / "prometheus" / "skillstats-rules.yml"


def readme_metrics() -> set[str]:
    return set(re.findall(r"^\| `(skillstats_\w+)` \|", (ROOT / "README.md").read_text(), re.MULTILINE))


def test_readme_table_lists_exactly_the_exported_metrics() -> None:
    exported = exported_series_names()  # series name -> family name
    families = set(exported.values())
    listed = readme_metrics()
    # A counter is listed as PromQL sees it (`_total`), a histogram by its family name.
    listed_families = {exported.get(name, name) for name in listed}
    assert listed_families - families == set(), "listed in the README, not exported"
    assert families - listed_families == set(), "exported, missing from the README's metric table"
    assert all(name in exported or name in families for name in listed)


def test_pipeline_hooks_count_by_kind_outcome_and_reason() -> None:
    metrics = PipelineMetrics("g-hooks")
    outcome = ApplyOutcome(applied=5, replayed=2, applied_kinds={"download": 4, "install_new": 1})
    outcome.replayed_kinds = {"download": 2}
    metrics.batch(outcome, records=7, seconds=0.25)
    metrics.invalid({"malformed": 3}, parked=True)
    metrics.newest({0: 2_000}, {0: 3_000})
    metrics.newest({0: 1_000}, {0: 4_000})  # older event time: the gauge keeps the newest

    def value(name: str, **labels: str) -> float | None:
        return REGISTRY.get_sample_value(name, {"group": "g-hooks", **labels})

    assert value("skillstats_events_total", kind="download", outcome="applied") == 4
    assert value("skillstats_events_total", kind="install_new", outcome="applied") == 1
    assert value("skillstats_events_total", kind="download", outcome="replayed") == 2
    assert value("skillstats_invalid_events_total", reason="malformed") == 3
    assert value("skillstats_dlq_writes_total", reason="malformed") == 3
    assert value("skillstats_batch_records_count") == 1 and value("skillstats_batch_records_sum") == 7
    assert value("skillstats_sql_apply_seconds_sum") == 0.25
    assert value("skillstats_newest_applied_event_timestamp_seconds", partition="0") == 2.0
    assert value("skillstats_newest_applied_record_timestamp_seconds", partition="0") == 4.0


def test_health_is_read_at_scrape_time() -> None:
    health = Health()
    watch_health("g-health", health)
    assert REGISTRY.get_sample_value("skillstats_degraded", {"group": "g-health"}) == 0
    health.failing(RuntimeError("down"))
    assert REGISTRY.get_sample_value("skillstats_degraded", {"group": "g-health"}) == 1
    assert REGISTRY.get_sample_value("skillstats_sql_retries_total", {"group": "g-health"}) == 1
    health.ok()
    assert REGISTRY.get_sample_value("skillstats_degraded", {"group": "g-health"}) == 0


def test_server_serves_metrics_and_probes() -> None:
    problems: dict[str, str | None] = {"live": None, "ready": "not yet joined the consumer group"}
    server = serve("127.0.0.1", free_port(), Probes(lambda: problems["live"], lambda: problems["ready"]))
    base = f"http://127.0.0.1:{server.port}"
    try:
        assert get(base + "/healthz") == (200, "ok\n")
        assert get(base + "/readyz") == (503, "not yet joined the consumer group\n")
        problems["ready"] = None
        assert get(base + "/readyz") == (200, "ok\n")
        status, body = get(base + "/metrics")
        assert status == 200 and "skillstats_degraded" in body
        with urllib.request.urlopen(base + "/metrics", timeout=5) as response:
            assert response.headers["Content-Type"].startswith("text/plain; version=")
        assert get(base + "/other")[0] == 404
    finally:
        server.close()


def test_every_alert_has_its_annotations_a_runbook_and_only_exported_metrics() -> None:
    rules = [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]
    operations = (ROOT / "docs" / "operations.md").read_text()
    headings = {line[4:].strip().lower() for line in operations.splitlines() if line.startswith("### ")}
    exported = exported_series_names()
    assert len(rules) >= 9
    for rule in rules:
        name = rule["alert"]
        annotations = rule["annotations"]
        assert annotations.get("summary") and annotations.get("description"), name
        assert annotations["runbook"] == f"docs/operations.md#{name.lower()}", name
        assert name.lower() in headings, f"docs/operations.md has no runbook section for {name}"
        assert rule["labels"]["severity"] in ("page", "ticket"), name
        unknown = metric_names(rule["expr"]) - set(exported)
        assert unknown == set(), f"{name} names metrics nothing exports: {unknown}"
