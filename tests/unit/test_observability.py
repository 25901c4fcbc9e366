"""The Grafana dashboard, the Prometheus alert rules and the scrape configuration in deploy/, checked as CI can
without a Prometheus or a Grafana: promtool (Debian's `prometheus` package) checks and unit-tests the rules, and
every metric and label they and the dashboard name must be one apiary.metrics exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from apiary import metrics

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "apiary.json"
# PromQL's own words, and Prometheus's `instance`/`job` target labels.
PROMQL_WORDS = {"sum", "max", "min", "avg", "by", "on", "and", "or", "rate", "increase", "histogram_quantile",
                "le", "instance", "job", "ignoring", "without", "unless", "count"}


def promtool(*args: str, cwd: Path) -> str:
    """promtool's output; fails the test if it is missing or says no."""
    tool = shutil.which("promtool")
    if tool is None:
        pytest.fail("promtool is not installed: apt-get install prometheus (scripts/services-up does)",
                    pytrace=False)
    result = subprocess.run([tool, *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.fixture(scope="module")
def exported() -> tuple[set[str], set[str]]:
    """The series names and label names of a /metrics page on which every instrument has a value."""
    metrics.shutdown()
    metrics.setup("apiary-test", "prometheus")
    try:
        metrics.message_sent("rabbitmq", "worker.done", "Unroutable")
        metrics.message_handled("rabbitmq", "apiary.aggregator", "worker.done", "dead", 0.0)
        metrics.round_started()
        metrics.round_ended("aggregated", 1.0)
        metrics.round_timeout_used(0.5)
        metrics.contribution("accepted")
        metrics.aggregated(0.1, 10)
        metrics.transferred("upload", 10)
        metrics.outbox_backlog("scheduler_outbox", 0)
        metrics.dependency_retry("the database")
        metrics.jobs({"running": 1})
        metrics.workers_online({"any": 1})
        metrics.queue_depth("assign.pool", 0)
        metrics.gpu("w1", {"index": 0, "utilization": 1.0, "memory_used": 1})
        metrics.exporter_backlog("mlflow", 0)
        metrics.exporter_failed("mlflow")
        page = metrics.exposition()[0].decode()
    finally:
        metrics.shutdown()
    series, labels = set(), set()
    for line in page.splitlines():
        if line and not line.startswith("#"):
            series.add(re.split(r"[{ ]", line, maxsplit=1)[0])
            labels |= set(re.findall(r'(\w+)="', line))
    return series, labels


def names_in(expr: str) -> set[str]:
    """The identifiers of a PromQL expression (metrics and labels), without strings, numbers and ranges."""
    bare = re.sub(r'"[^"]*"|\[[^\]]*\]|\b\d+(\.\d+)?\b', " ", expr)
    return set(re.findall(r"[a-zA-Z_][a-zA-Z0-9_]*", bare)) - PROMQL_WORDS


def alert_rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


def test_the_alert_rules_pass_promtool_and_their_unit_tests() -> None:
    assert "SUCCESS: 5 rules found" in promtool("check", "rules", "alerts.yml", cwd=ALERTS.parent)
    assert "SUCCESS" in promtool("test", "rules", "alerts-test.yml", cwd=ALERTS.parent)


def test_the_issue_s_alerts_exist_each_with_a_severity_and_a_summary() -> None:
    rules = {rule["alert"]: rule for rule in alert_rules()}

    assert {"ApiaryRoundNearTimeout", "ApiaryDeadLetters", "ApiaryNoWorkerForQueuedJob",
            "ApiaryDependencyRetriesClimbing"} <= set(rules)
    for rule in rules.values():
        assert rule["labels"]["severity"] in ("info", "warning", "critical")
        assert rule["annotations"]["summary"]


def test_every_name_the_rules_and_the_dashboard_query_is_exported(exported: tuple[set[str], set[str]]) -> None:
    series, labels = exported
    queries = [rule["expr"] for rule in alert_rules()]
    queries += [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]

    unknown = {name for expr in queries for name in names_in(expr)} - series - labels

    assert not unknown, f"not exported by apiary.metrics: {sorted(unknown)}"


def test_the_dashboard_has_the_panels_operators_asked_for() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    titles = [p["title"] for p in dashboard["panels"]]

    assert dashboard["uid"] and dashboard["schemaVersion"] >= 36
    assert {"Rounds per minute", "Round duration p50 / p95", "Contributions by outcome", "Assignment pool depth",
            "Workers online", "Dead letters", "Dependency retries"} <= set(titles)
    assert len({p["id"] for p in dashboard["panels"]}) == len(titles)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    for panel in dashboard["panels"]:
        assert set(panel["gridPos"]) == {"h", "w", "x", "y"}
        assert panel["targets"] and all(t["expr"].strip() for t in panel["targets"])
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"


def test_the_compose_scrape_config_passes_promtool_and_covers_every_process(tmp_path: Path) -> None:
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    shutil.copy(ALERTS, tmp_path / "alerts.yml")
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({**config, "rule_files": ["alerts.yml"]}))

    promtool("check", "config", "prometheus.yml", cwd=tmp_path)

    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs["apiary"]["static_configs"][0]["targets"]) == {
        "scheduler:9464", "sharder:9464", "aggregator:9464", "tracker:8080"}
    assert jobs["apiary-workers"]["dns_sd_configs"][0] == {"names": ["worker"], "type": "A", "port": 9464,
                                                            "refresh_interval": "30s"}


def test_the_kubernetes_monitoring_resources_match_the_base_and_the_rules() -> None:
    base = [doc for path in (DEPLOY / "k8s" / "base").glob("*.yaml") for doc in yaml.safe_load_all(path.read_text())
            if doc and doc["kind"] == "Deployment"]
    pods = {d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"]: d["spec"]["template"] for d in base}
    monitors = list(yaml.safe_load_all((DEPLOY / "k8s" / "monitoring" / "podmonitor.yaml").read_text()))
    rule = yaml.safe_load((DEPLOY / "k8s" / "monitoring" / "prometheusrule.yaml").read_text())

    assert rule["spec"] == yaml.safe_load(ALERTS.read_text())
    covered = set()
    for monitor in monitors:
        selector = monitor["spec"]["selector"]
        names = (selector["matchExpressions"][0]["values"] if "matchExpressions" in selector
                 else [selector["matchLabels"]["app.kubernetes.io/name"]])
        port = monitor["spec"]["podMetricsEndpoints"][0]["port"]
        for name in names:
            template = pods[name]
            ports = {p["name"]: p["containerPort"] for p in template["spec"]["containers"][0]["ports"]}
            assert str(ports[port]) == template["metadata"]["annotations"]["prometheus.io/port"]
            covered.add(name)
    assert covered == set(pods)
