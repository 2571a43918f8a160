"""The chart's Grafana dashboards and Prometheus alerts (deploy/helm/pdserve/dashboards/*.json,
templates/prometheusrule.yaml), offline: they render as the objects Grafana's sidecar and the
Prometheus Operator load, every query parses as PromQL (promql-parser) and uses only variables
the dashboard defines, `promtool check rules` accepts the rendered rules and the panels' queries
(as recording rules), and the values reach them. That every metric they name is served by a
running cluster is tests/e2e/test_metric_names.py.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess

import helm_python
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from pdserve.decode.metrics import WorkerMetrics
from tests.deploy.promql_names import (CHART, DASHBOARDS, MONITORING, NAMESPACE, dashboard_queries, dashboards,
                                       metric_names, panels, recorded, render, rule_groups, rule_queries, rules,
                                       substituted, used_variables, variable_names)

RELEASE_BASE = "demo-llama-3-1-8b-instruct"  # <release>-<model.name>, as the chart names objects
PROMTOOL_MISSING = ("promtool is not installed (Debian package prometheus; `make test` installs it as root: "
                    "tests/prereqs.sh)")


@pytest.fixture(scope="module")
def objs() -> list[dict]:
    return render(MONITORING)


def promtool(path) -> subprocess.CompletedProcess:
    exe = shutil.which("promtool")
    if exe is None:
        pytest.skip(PROMTOOL_MISSING)
    return subprocess.run([exe, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)


# -- the dashboards --------------------------------------------------------------------------
def test_each_dashboard_is_a_configmap_the_grafana_sidecar_loads(objs):
    maps = {o["metadata"]["name"]: o for o in objs if o["kind"] == "ConfigMap" and "dashboard" in o["metadata"]["name"]}
    files = dashboards()
    assert set(files) == {"cluster", "worker", "handoff", "planner"}
    assert sorted(maps) == sorted(f"{RELEASE_BASE}-dashboard-{n}" for n in files)
    for name, board in files.items():
        cm = maps[f"{RELEASE_BASE}-dashboard-{name}"]
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"  # kube-prometheus-stack's sidecar default
        assert "annotations" not in cm["metadata"]
        assert json.loads(cm["data"][f"pdserve-{name}.json"]) == board  # the file, verbatim
    # The label, its value and a folder are values; off by default.
    objs2 = render({"metrics": {"dashboards": {"enabled": True, "label": "dash", "labelValue": "yes",
                                               "folder": "LLM serving", "labels": {"team": "ml"}}}})
    cms = [o for o in objs2 if o["kind"] == "ConfigMap" and "-dashboard-" in o["metadata"]["name"]]
    assert len(cms) == len(files)
    for cm in cms:
        assert cm["metadata"]["labels"]["dash"] == "yes" and cm["metadata"]["labels"]["team"] == "ml"
        assert cm["metadata"]["annotations"] == {"grafana_folder": "LLM serving"}
    assert not [o for o in render(None) if "-dashboard-" in o["metadata"]["name"]]



@pytest.mark.parametrize("name", ["cluster", "worker", "handoff", "planner"])
def test_every_dashboard_query_parses_and_uses_only_its_variables(name):
    board = dashboards()[name]
    assert board["uid"] == f"pdserve-{name}" and board["title"].startswith("pdserve / ")
    defined = variable_names(board)
    assert "datasource" in defined
    queries = dashboard_queries(board)
    assert len(queries) >= 5
    for where, expr in queries:
        assert used_variables(expr) <= defined, (where, expr)
        assert metric_names(substituted(expr)), (where, expr)  # parses, and reads a metric
    for p in panels(board):
        if p["type"] != "row":
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
            assert p["description"] and p["targets"], p["title"]


@pytest.mark.parametrize("name", ["cluster", "worker", "handoff", "planner"])
def test_panels_fit_the_grid_without_overlapping(name):
    taken: set[tuple[int, int]] = set()
    ids = []
    for p in panels(dashboards()[name]):
        g = p["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24, p["title"]
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & taken, f"{p['title']} overlaps another panel"
        taken |= cells
        ids.append(p["id"])
    assert len(ids) == len(set(ids))


def test_the_slo_variables_offer_bucket_bounds_of_the_histograms():
    """The cluster dashboard's TTFT/TPOT SLO choices and the chart's schema are `le` values the
    worker's histograms really have: a query for another bound would find no series."""
    families = {f.name: f for f in text_string_to_metric_families(WorkerMetrics("decode", "decode-0").render().decode())}
    bounds = {m: {s.labels["le"] for s in families[m].samples if s.name == m + "_bucket"} - {"+Inf"}
              for m in ("pdserve_time_to_first_token_seconds", "pdserve_time_per_output_token_seconds")}
    board = {v["name"]: v for v in dashboards()["cluster"]["templating"]["list"]}
    assert {o["value"] for o in board["ttft_slo"]["options"]} <= bounds["pdserve_time_to_first_token_seconds"]
    assert {o["value"] for o in board["tpot_slo"]["options"]} <= bounds["pdserve_time_per_output_token_seconds"]
    schema = json.loads((CHART / "values.schema.json").read_text())
    slo = schema["properties"]["metrics"]["properties"]["prometheusRule"]["properties"]["slo"]["properties"]
    assert set(slo["ttftSeconds"]["enum"]) == bounds["pdserve_time_to_first_token_seconds"]
    assert set(slo["tpotSeconds"]["enum"]) == bounds["pdserve_time_per_output_token_seconds"]


def test_promtool_accepts_the_dashboard_queries(tmp_path):
    """Each panel's query as a recording rule: promtool parses it as Prometheus itself would."""
    groups = [{"name": name, "rules": [{"record": f"dashboard:{name}_q{i}", "expr": substituted(expr)}
                                       for i, (_, expr) in enumerate(dashboard_queries(board))]}
              for name, board in dashboards().items()]
    (tmp_path / "panels.yaml").write_text(yaml.safe_dump({"groups": groups}))
    out = promtool(tmp_path / "panels.yaml")
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {sum(len(g['rules']) for g in groups)} rules found" in out.stdout


def test_promtool_refuses_a_broken_query(tmp_path):
    """The control: promtool (and promql-parser) do refuse what Prometheus would."""
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({"groups": [{"name": "g", "rules": [
        {"record": "dashboard:bad", "expr": "rate(pdserve_requests_total)"}]}]}))
    out = promtool(tmp_path / "bad.yaml")
    assert out.returncode != 0 and "range vector" in out.stdout + out.stderr
    with pytest.raises(ValueError):
        metric_names("rate(pdserve_requests_total)")
    with pytest.raises(ValueError, match="matching metric names by"):
        metric_names('{__name__=~"pdserve_.*"}')


# -- the alerts ------------------------------------------------------------------------------
def test_promtool_accepts_the_rendered_rules(objs, tmp_path):
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rule_groups(objs)}))
    out = promtool(tmp_path / "rules.yaml")
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(rules(objs))} rules found" in out.stdout


def test_the_alerts_cover_the_issue_and_say_what_they_mean(objs):
    alerts = {r["alert"]: r for r in rules(objs) if "alert" in r}
    assert set(alerts) == {
        "PdserveTTFTBudgetBurnFast", "PdserveTTFTBudgetBurnSlow", "PdserveTPOTBudgetBurnFast",
        "PdserveTPOTBudgetBurnSlow", "PdserveRemotePrefillFallbacksHigh", "PdserveKVPoolFull",
        "PdserveKVPoolFullRefusals", "PdservePrefillQueueDeep", "PdserveQueueWaitHigh", "PdserveLeaseLost",
        "PdserveWorkerUnregistered", "PdserveEngineDead", "PdserveWorkerRestarts"}
    for name, r in alerts.items():
        assert r["labels"]["severity"] in ("warning", "critical"), name
        assert r["annotations"]["summary"] and r["annotations"]["description"], name
    for where, expr in rule_queries(objs):
        names = metric_names(expr)
        assert names, where
        # Every selector is this release's: its namespace, and its pods or its recording rules.
        assert f'namespace="{NAMESPACE}"' in expr, where
        assert f'pod=~"{RELEASE_BASE}-' in expr or f'pdserve_release="{RELEASE_BASE}"' in expr, where
    # The burn alerts read the recording rules the same object defines.
    burn = {n for w, e in rule_queries(objs) if "BudgetBurn" in w for n in metric_names(e)}
    assert burn and burn <= recorded(objs)
    # The docs describe every alert (docs/deploy.md, "Dashboards and alerts").
    docs = (CHART.parents[2] / "docs" / "deploy.md").read_text().split("### Dashboards and alerts", 1)[1]
    assert [a for a in alerts if f"`{a}`" not in docs] == []


def test_the_thresholds_are_values(objs):
    values = copy.deepcopy(MONITORING)
    values["metrics"]["prometheusRule"].update({
        "slo": {"objective": 0.999, "ttftSeconds": "0.5", "tpotSeconds": "0.1"}, "fallbackRatio": 0.25,
        "kvUsageRatio": 0.9, "queueDepthFraction": 0.5, "queueWaitSeconds": 4, "workerRestarts": 3,
        "labels": {"release": "prometheus"}})
    values["topology"] = {"queue": {"capacity": 100}}
    out = render(values)
    [rule] = [o for o in out if o["kind"] == "PrometheusRule"]
    assert rule["metadata"]["labels"]["release"] == "prometheus"
    exprs = {r.get("alert") or r["record"]: " ".join(r["expr"].split()) for r in rules(out)}
    assert 'le="0.5"' in exprs["pdserve:ttft_slo_misses:ratio_rate5m"]
    assert 'le="0.1"' in exprs["pdserve:tpot_slo_misses:ratio_rate6h"]
    assert exprs["PdserveTTFTBudgetBurnFast"].count("> 0.0144") == 2  # 14.4 x (1 - 0.999)
    assert exprs["PdserveTPOTBudgetBurnSlow"].count("> 0.006") == 2  # 6 x (1 - 0.999)
    assert exprs["PdserveRemotePrefillFallbacksHigh"].endswith("> 0.25")
    assert exprs["PdserveKVPoolFull"].endswith("> 0.9")
    assert exprs["PdservePrefillQueueDeep"].endswith("> 0.5 * 100")
    assert exprs["PdserveQueueWaitHigh"].endswith("> 4")
    assert exprs["PdserveWorkerRestarts"].endswith(">= 3")
    assert not [o for o in render(None) if o["kind"] == "PrometheusRule"]


@pytest.mark.parametrize("values, key", [
    ({"slo": {"objective": 0.99, "ttftSeconds": "0.6", "tpotSeconds": "0.05"}}, "/metrics/prometheusRule/slo/ttftSeconds"),
    ({"slo": {"objective": 0.99, "ttftSeconds": 1.0, "tpotSeconds": "0.05"}}, "/metrics/prometheusRule/slo/ttftSeconds"),
    ({"slo": {"objective": 1, "ttftSeconds": "1.0", "tpotSeconds": "0.05"}}, "/metrics/prometheusRule/slo/objective"),
    ({"kvUsageRatio": 1.5}, "/metrics/prometheusRule/kvUsageRatio"),
    ({"workerRestarts": 0}, "/metrics/prometheusRule/workerRestarts"),
    ({"fallbackRatio": "high"}, "/metrics/prometheusRule/fallbackRatio"),
    ({"treshold": 1}, "treshold"),
])
def test_a_threshold_that_cannot_work_is_refused_naming_the_value(values, key):
    with pytest.raises(helm_python.HelmError, match=re.escape(key)):
        render({"metrics": {"prometheusRule": {"enabled": True, **values}}})


def test_the_dashboards_option_names_are_refused_when_misspelt():
    with pytest.raises(helm_python.HelmError, match="lable"):
        render({"metrics": {"dashboards": {"enabled": True, "lable": "x"}}})


# -- the monitors ----------------------------------------------------------------------------
def test_every_component_serving_metrics_on_a_port_of_its_own_is_scraped(objs):
    """Decode, gateway and KV index through their Services' http port, prefill through its pods'
    metrics port; HTTPS with security.tls, verified for the Service's name."""
    monitors = {o["metadata"]["name"].removeprefix(RELEASE_BASE + "-"): o for o in objs
                if o["kind"] in ("ServiceMonitor", "PodMonitor")}
    assert set(monitors) == {"decode", "gateway", "prefill", "kv-index"}
    services = [o for o in objs if o["kind"] == "Service"]
    for component in ("decode", "gateway", "kv-index"):
        sm = monitors[component]
        [svc] = [s for s in services if sm["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()]
        assert {e["port"] for e in sm["spec"]["endpoints"]} <= {p["name"] for p in svc["spec"]["ports"]}
        assert all(e["path"] == "/metrics" and "scheme" not in e for e in sm["spec"]["endpoints"])
    secured = render({**MONITORING, "security": {"tls": {"secretName": "pd-tls", "mutual": True}}})
    for o in secured:
        if o["kind"] == "ServiceMonitor" and o["metadata"]["name"].endswith(("-decode", "-gateway")):
            [e] = o["spec"]["endpoints"]
            service = o["metadata"]["name"]
            assert e["scheme"] == "https" and e["tlsConfig"] == {
                "serverName": f"{service}.{NAMESPACE}.svc", "ca": {"secret": {"name": "pd-tls", "key": "ca.crt"}},
                "cert": {"secret": {"name": "pd-tls", "key": "tls.crt"}},
                "keySecret": {"name": "pd-tls", "key": "tls.key"}}
