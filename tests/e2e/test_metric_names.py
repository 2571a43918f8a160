"""Every metric the chart's dashboards and alerts (deploy/helm/pdserve) and docs/*.md name is
served by a running cluster, so none can drift from the code.

`pdserve up` starts a 1P1D CPU cluster with a gateway, the KV index and a planner (min = max = 1:
it runs and serves its metrics, never scales); a few requests go through the gateway. The test
scrapes the /metrics of every component that serves one: the decode worker and the gateway
(their HTTP port), the prefill worker (its metrics port), the KV index, the prefill queue and the
planner (their addresses from Ray and the planner's leader record in etcd). Then each name a
dashboard query, an alert rule or a doc names must be one the scrapes expose: as PromQL selects it
for queries (a counter `x` is `x_total`, a histogram `x_bucket`, `x_sum`, `x_count`), as a family
or a series for docs. Names the rules record themselves and the few that other exporters serve
(tests/deploy/promql_names.py EXTERNAL, none of them `pdserve_`) are the only exceptions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.api import Client
from tests.deploy.promql_names import (EXTERNAL, MONITORING, dashboard_queries, dashboards, doc_names, exposed,
                                       metric_names, recorded, render, rule_queries, substituted)
from tests.harness import small_topology_yaml

REPO = Path(__file__).resolve().parents[2]
CLUSTER = "metricnames"

pytestmark = [pytest.mark.timeout(420), pytest.mark.slow]

# min = max = 1: the planner runs (and serves /metrics) but never starts or stops a worker.
POLICY = """\
autoscale:
  prefill: {min_replicas: 1, max_replicas: 1, scale_up: {queue_length: 1000}, scale_down: {queue_length: 0}}
  decode: {min_replicas: 1, max_replicas: 1, scale_up: {queue_length: 1000}, scale_down: {queue_length: 0}}
"""

# The queue's and the planner's /metrics addresses: from the queue actor (Ray) and the planner's
# leader record (etcd), read by a driver of its own (Ray stays out of the test process).
ADDRESSES = textwrap.dedent("""
    import asyncio, json, sys
    import ray
    from pdserve.cluster.registry import Registry

    state = json.loads(open(sys.argv[1]).read())
    ray.init(address=state["ray_address"], namespace=state["namespace"], log_to_driver=False)
    try:
        queue = ray.get_actor(state["queue_name"], namespace=state["namespace"])
        stats = ray.get(queue.stats.remote(), timeout=60)
    finally:
        ray.shutdown()

    async def leader():
        async with Registry(state["etcd_endpoints"], state["cluster"]) as reg:
            got = await reg.client().get(reg.keys.planner_leader())
        return json.loads(got.value) if got else None

    print(json.dumps({"queue": stats.metrics, "planner": (asyncio.run(leader()) or {}).get("metrics")}))
""")


def pdserve(*args, timeout=300):
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "UCX_MODULES": "^ib"}
    return subprocess.run([sys.executable, "-m", "pdserve.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


def scrape(address: str) -> str:
    url = address if address.startswith("http") else f"http://{address}"
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=10) as r:
        assert r.status == 200
        return r.read().decode()


@pytest.fixture(scope="module")
def scraped(tmp_path_factory) -> dict[str, str]:
    """Component -> its /metrics page, from a running cluster."""
    tmp = tmp_path_factory.mktemp("metric-names")
    (tmp / "autoscale.yaml").write_text(POLICY)
    text = small_topology_yaml(CLUSTER, tmp).replace("engine: {device: cpu,", "engine: {kv_events: true, device: cpu,")
    # The decode worker speculates, so its pdserve_spec_decode_* metrics are served (docs/speculative.md).
    text = text.replace("33554432}\n    ports:", "33554432, speculative_config: {num_speculative_tokens: 2}}\n    ports:")
    topology = tmp / "topology.yaml"
    topology.write_text(text + "gateway: {replicas: 1}\nkv_index: {enabled: true}\nautoscale_policy: autoscale.yaml\n")
    up = pdserve("up", "--topology", str(topology))
    try:
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        state_file = tmp / "runs" / f"{CLUSTER}.state.json"
        state = json.loads(state_file.read_text())
        actors = {a["role"]: a for a in state["actors"]}
        with Client(actors["gateway"]["grpc"]) as c:  # through prefill and decode: every histogram observed
            for i in range(3):
                assert c.generate(f"metric names {i} " * 12, max_tokens=3, temperature=0.0).finish_reason == "length"
        status = pdserve("status", "--topology", str(topology), "--json")
        assert status.returncode == 0, status.stdout + status.stderr
        members = json.loads(status.stdout)["members"]
        found = subprocess.run([sys.executable, "-c", ADDRESSES, str(state_file)], capture_output=True, text=True,
                               timeout=120, env={**os.environ, "RAY_AUTH_MODE": "disabled"}, cwd=REPO)
        assert found.returncode == 0, found.stderr[-3000:]
        addresses = json.loads(found.stdout.strip().splitlines()[-1])
        assert addresses["queue"] and addresses["planner"], addresses
        yield {"decode": scrape(members["decode-0"]["endpoints"]["http"]),
               "prefill": scrape(members["prefill-0"]["endpoints"]["metrics"]),
               "gateway": scrape(actors["gateway"]["http"]), "kv-index": scrape(actors["kv-index"]["url"]),
               "queue": scrape(addresses["queue"]), "planner": scrape(addresses["planner"])}
    finally:
        down = pdserve("down", "--topology", str(topology), timeout=120)
        assert down.returncode == 0, down.stdout[-3000:] + down.stderr[-3000:]


@pytest.fixture(scope="module")
def names(scraped) -> tuple[set[str], set[str]]:
    series, families = set(), set()
    for page in scraped.values():
        s, f = exposed(page)
        series |= s
        families |= f
    return series, families


def test_every_component_serves_its_own_metrics(scraped):
    """A control: each page is the component's (so a wrong address cannot pass for another)."""
    own = {"decode": "pdserve_time_to_first_token_seconds", "prefill": "pdserve_prefill_batches",
           "gateway": "pdserve_gateway_routed", "kv-index": "pdserve_kvindex_blocks", "queue": "pdserve_queue_depth",
           "planner": "pdserve_planner_desired_replicas"}
    for component, family in own.items():
        assert family in exposed(scraped[component])[1], component
    for role in ("decode", "prefill"):  # the registration metrics the lease alerts read
        assert "pdserve_etcd_reregistrations_total" in exposed(scraped[role])[0], role
        states = {s.labels["state"]: s.value for f in text_string_to_metric_families(scraped[role])
                  if f.name == "pdserve_etcd_registration" for s in f.samples if s.labels["role"] == role}
        assert states["registered"] == 1 and sum(states.values()) == 1, (role, states)


def test_every_metric_a_dashboard_names_exists(names):
    series, _ = names
    missing = {}
    for board in dashboards().values():
        for where, expr in dashboard_queries(board):
            for name in metric_names(substituted(expr)) - series:
                missing.setdefault(name, []).append(where)
    assert not missing, f"named by the dashboards, served by no component: {missing}"


def test_every_metric_an_alert_names_is_served(names):
    series, _ = names
    objs = render(MONITORING)
    used = {n: where for where, expr in rule_queries(objs) for n in metric_names(expr)}
    assert not [n for n in EXTERNAL if n.startswith("pdserve")] and set(EXTERNAL) <= set(used)
    missing = {n: w for n, w in used.items() if n not in series and n not in recorded(objs) and n not in EXTERNAL}
    assert not missing, f"named by the alerts, served by no component: {missing}"


def test_every_metric_the_docs_name_exists(names):
    series, families = names
    named = doc_names()
    assert len(named) >= 20  # the docs' tables of metrics are read
    missing = {n: files for n, files in named.items() if n not in series and n not in families}
    assert not missing, f"named by docs/*.md, served by no component: {missing}"
