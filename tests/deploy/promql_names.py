"""What the chart's dashboards and alerts (deploy/helm/pdserve) and docs/*.md say about metrics,
read for the tests that keep them true: tests/deploy/test_dashboards.py (offline: the chart
renders them, PromQL parses, promtool accepts the rules) and tests/e2e/test_metric_names.py
(every metric they name is served by a running cluster).

PromQL is parsed with promql-parser (the dev extra), and metric names are read off its syntax
tree: every vector selector's name, or its `__name__="..."` matcher. A selector matching names
by regex is refused, so that every name stays checkable.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import helm_python
import promql_parser
import yaml
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "pdserve"
DASHBOARDS = CHART / "dashboards"
RELEASE, NAMESPACE = "demo", "llm"
# Every monitoring object on: the ServiceMonitors, the dashboards, the alerts.
MONITORING = {"metrics": {"serviceMonitor": {"enabled": True}, "dashboards": {"enabled": True},
                          "prometheusRule": {"enabled": True}},
              "gateway": {"enabled": True}, "kvIndex": {"enabled": True}}
# Metrics the alerts read that no pdserve component serves, with who serves them.
EXTERNAL = {"kube_pod_container_status_restarts_total": "kube-state-metrics (kube-prometheus-stack ships it)"}
# Grafana's built-in interval variables, given a value so that the query parses.
_GRAFANA_INTERVALS = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}
_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")
# `pdserve_...` right after a backtick in docs; a name followed by `*` is a family of names.
_DOC_NAME = re.compile(r"`(pdserve_[a-z0-9_]+)(?![a-z0-9_*])")


def render(values: dict | None) -> list[dict]:
    with helm_python.Chart.load(CHART) as chart:
        files = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    return [o for p, t in sorted(files.items()) if p.endswith(".yaml") for o in yaml.safe_load_all(t) if o]


def dashboards() -> dict[str, dict]:
    """File name (without .json) -> the dashboard."""
    return {p.stem: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


def panels(dashboard: dict):
    """Every panel, those inside collapsed rows too."""
    for p in dashboard["panels"]:
        yield p
        yield from p.get("panels", [])


def dashboard_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and every query variable (label_values' series)."""
    out = []
    for p in panels(dashboard):
        for t in p.get("targets", []):
            out.append((f"{dashboard['uid']} panel {p['title']!r} {t['refId']}", t["expr"]))
    for v in dashboard.get("templating", {}).get("list", []):
        if v["type"] == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", q.strip())
            assert m, f"{dashboard['uid']} variable {v['name']}: only label_values(series, label) is used: {q}"
            out.append((f"{dashboard['uid']} variable {v['name']}", m.group(1)))
    return out


def variable_names(dashboard: dict) -> set[str]:
    return {v["name"] for v in dashboard.get("templating", {}).get("list", [])}


def substituted(expr: str) -> str:
    """A dashboard query as Prometheus would get it: Grafana's intervals given a duration, every
    other variable `.*` (they are used only inside label matchers' strings)."""
    for name, value in _GRAFANA_INTERVALS.items():
        expr = expr.replace(name, value)
    return _VARIABLE.sub(".*", expr)


def used_variables(expr: str) -> set[str]:
    for name in _GRAFANA_INTERVALS:
        expr = expr.replace(name, "")
    return {a or b for a, b in _VARIABLE.findall(expr)}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (ValueError: it does not parse)."""
    names: set[str] = set()

    def visit(node):
        if isinstance(node, promql_parser.VectorSelector):
            by_name = [m for m in node.matchers.matchers if m.name == "__name__"]
            for m in by_name:
                if m.op != promql_parser.MatchOp.Equal:
                    raise ValueError(f"{expr}: a selector matching metric names by {m.op} cannot be checked")
                names.add(m.value)
            if node.name:
                names.add(node.name)
            elif not by_name:
                raise ValueError(f"{expr}: a selector without a metric name")
        return True

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


def rule_groups(objs: list[dict]) -> list[dict]:
    [rule] = [o for o in objs if o["kind"] == "PrometheusRule"]
    return rule["spec"]["groups"]


def rules(objs: list[dict]) -> list[dict]:
    return [r for g in rule_groups(objs) for r in g["rules"]]


def rule_queries(objs: list[dict]) -> list[tuple[str, str]]:
    return [(r.get("alert") or r["record"], r["expr"]) for r in rules(objs)]


def recorded(objs: list[dict]) -> set[str]:
    return {r["record"] for r in rules(objs) if "record" in r}


def doc_names() -> dict[str, list[str]]:
    """Metric name -> the docs/*.md files naming it (in backticks)."""
    out: dict[str, list[str]] = {}
    for path in sorted((ROOT / "docs").glob("*.md")):
        for name in _DOC_NAME.findall(path.read_text()):
            out.setdefault(name, []).append(path.name)
    return out


def exposed(text: str) -> tuple[set[str], set[str]]:
    """(series names, family names) of one /metrics page: the names PromQL selects (a counter
    `x` is `x_total`, a histogram `x_bucket`, `x_sum`, `x_count`), and the families' own."""
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
                "summary": ("", "_sum", "_count", "_created"), "gaugehistogram": ("_bucket", "_gsum", "_gcount")}
    series, families = set(), set()
    for fam in text_string_to_metric_families(text):
        families.add(fam.name)
        series.update(fam.name + s for s in suffixes.get(fam.type, ("",)))
        series.update(s.name for s in fam.samples)
    return series, families
