"""`pdserve up` with `gateway.replicas: 1` and `kv_index.enabled`: the gateway and the KV index
start after the decode workers (Ray actors) on a head sized for them too (a 1P2D cluster whose
workers ask 1 CPU each, the gateway and index their default 0.5 and 0.25: before the head
counted them, the gateway actor never fit and `up` timed out); the gateway serves through both workers and
explains its pick, `pdserve kv status --topology` finds the index (no --url) following both,
`pdserve status` lists both services, and `pdserve down` stops them."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from pdserve.api import Client
from tests.harness import small_topology_yaml, wait_until

REPO = Path(__file__).resolve().parents[2]


def pdserve(*args, timeout=300):
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "UCX_MODULES": "^ib"}
    return subprocess.run([sys.executable, "-m", "pdserve.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def test_up_starts_a_gateway_in_front_of_the_decode_workers(tmp_path):
    path = tmp_path / "topology.yaml"
    text = small_topology_yaml("gateway-up", tmp_path)
    text = text.replace("  decode:\n    replicas: 1\n", "  decode:\n    replicas: 2\n")
    head, decode = text.split("  decode:\n")  # the index follows the decode workers only
    text = head + "  decode:\n" + decode.replace("engine: {device: cpu,", "engine: {kv_events: true, device: cpu,")
    path.write_text(text + "gateway: {replicas: 1}\nkv_index: {enabled: true}\n")  # their default num_cpus
    up = pdserve("up", "--topology", str(path))
    state_file = tmp_path / "runs" / "gateway-up.state.json"
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert "(4 CPUs," in up.stdout, up.stdout  # 3 workers x 1 + 0.5 + 0.25
        assert "gateway   gateway-0 started: gRPC" in up.stdout, up.stdout
        state = json.loads(state_file.read_text())
        gw = next(a for a in state["actors"] if a["role"] == "gateway")
        seen = set()
        with Client(gw["grpc"]) as c:
            for i in range(8):
                out = c.generate(f"hello number {i}", max_tokens=4, temperature=0.0)
                assert out.finish_reason == "length" and out.breakdown["migrations"] == 0
                seen.add(out.breakdown["worker_id"])
        assert seen <= {"decode-0", "decode-1"} and seen
        ex = pdserve("gateway", "explain", "--url", f"http://{gw['http']}", "--prompt", "Hello there")
        assert ex.returncode == 0, ex.stderr
        assert "decode-0" in ex.stdout and "decode-1" in ex.stdout and "->" in ex.stdout
        index = next(a for a in state["actors"] if a["role"] == "kv-index")
        assert f"kv index  {index['url']}" in up.stdout, up.stdout
        with Client(gw["grpc"]) as c:  # a prompt of several full blocks: the index must see them
            c.generate("the cluster index follows " * 20, max_tokens=2, temperature=0.0)
        wait_until(lambda: sum(w["blocks"] for w in _get(index["url"] + "/status")["workers"].values()) > 0, 30)
        kv = pdserve("kv", "status", "--topology", str(path), "--json")
        assert kv.returncode == 0, kv.stdout + kv.stderr
        followed = json.loads(kv.stdout)["workers"]
        assert set(followed) == {"decode-0", "decode-1"}, kv.stdout
        assert all(w["synced"] for w in followed.values()), kv.stdout
        st = pdserve("status", "--topology", str(path))
        assert st.returncode == 0 and "MISSING" not in st.stdout, st.stdout + st.stderr
        assert "gateway-0" in st.stdout and index["url"] in st.stdout, st.stdout
        assert re.search(r"family \w+, KV \w+, layout (HND|NHD)", st.stdout), st.stdout  # what each pool holds
    finally:
        down = pdserve("down", "--topology", str(path))
    assert down.returncode == 0, down.stdout + down.stderr
    assert "worker    gateway-up-gateway-0 stopped" in down.stdout, down.stdout
    assert "worker    gateway-up-kv-index stopped" in down.stdout, down.stdout


def test_a_1p3d_cluster_behind_its_gateway_loses_no_stream_when_a_decode_worker_is_killed(tmp_path):
    """Issue 33's acceptance on a cluster `pdserve up` starts: one prefill worker, three decode
    workers, one gateway; every prompt prefilled remote. kill -9 the decode worker holding the
    most of 48 streams: every stream completes through the gateway with the tokens of an
    undisturbed run, and neither the surviving decode workers nor the prefill worker hold
    anything afterwards."""
    from tests.gateway.test_gateway_processes import (STREAMS, TOKENS, assert_the_victims_streams_migrated, metric,
                                                      run_all, victim_of)

    policy = tmp_path / "router.yaml"
    policy.write_text("router:\n  mode: always_remote\nqos:\n  enable_early_rejection: false\n")
    path = tmp_path / "topology.yaml"
    text = small_topology_yaml("gateway-kill", tmp_path, policy)
    text = text.replace("  decode:\n    replicas: 1\n", "  decode:\n    replicas: 3\n")
    text = text.replace("    resources: {num_cpus: 1}\n", "    resources: {num_cpus: 0}\n")  # 4 workers, 2 cores
    path.write_text(text + "gateway: {replicas: 1, num_cpus: 0}\n")
    up = pdserve("up", "--topology", str(path))
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        state = json.loads((tmp_path / "runs" / "gateway-kill.state.json").read_text())
        gw = next(a for a in state["actors"] if a["role"] == "gateway")
        decodes = {a["worker_id"]: a for a in state["actors"] if a["role"] == "decode"}
        assert len(decodes) == 3, state["actors"]
        gw_http = f"http://{gw['http']}"
        want, _ = asyncio.run(run_all(gw["grpc"]))
        assert all(f == "length" and len(t) == TOKENS and b.route == "remote" for t, f, b, _ in want)

        def kill():
            counted = time.monotonic()
            wid, n = victim_of(gw_http)
            os.kill(decodes[wid]["pid"], signal.SIGKILL)
            return wid, n, counted, time.monotonic()

        got, (dead, held, counted, killed) = asyncio.run(run_all(gw["grpc"], kill))
        migrated = assert_the_victims_streams_migrated(want, got, dead, held, counted, killed)
        # A resumed stream is prefilled by the worker that takes it over (docs/gateway.md "migration").
        assert all(b.route == "local" and b.reason.startswith("resumed:") for b in migrated), migrated
        print(f"killed {dead} holding {held} of {STREAMS} streams: all {STREAMS} completed token-exact")
        for wid, rec in decodes.items():
            if wid == dead:
                continue
            wait_until(lambda: metric(f"http://{rec['http']}", "pdserve_kv_cache_usage_ratio") == 0
                       and metric(f"http://{rec['http']}", "pdserve_num_requests_running") == 0, 30)

        def prefill_idle():
            body = json.loads(pdserve("status", "--topology", str(path), "--json").stdout)
            return body["members"]["prefill-0"]["load"]["inflight"] == 0 and body["queue"]["depth"] == 0

        wait_until(prefill_idle, 30)
    finally:
        down = pdserve("down", "--topology", str(path))
    assert down.returncode == 0, down.stdout + down.stderr
