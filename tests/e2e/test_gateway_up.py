"""`pdserve up` with `gateway.replicas: 1` and `kv_index.enabled`: the gateway and the KV index
start after the decode workers (Ray actors); the gateway serves through both workers and
explains its pick, `pdserve kv status --topology` finds the index (no --url) following both,
`pdserve status` lists both services, and `pdserve down` stops them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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
    text = text.replace("  prefill:\n    replicas: 1\n", "  prefill:\n    replicas: 0\n")
    text = text.replace("  decode:\n    replicas: 1\n", "  decode:\n    replicas: 2\n")
    text = text.replace("engine: {device: cpu,", "engine: {kv_events: true, device: cpu,")
    path.write_text(text + "gateway: {replicas: 1, num_cpus: 0}\nkv_index: {enabled: true, num_cpus: 0}\n")
    up = pdserve("up", "--topology", str(path))
    state_file = tmp_path / "runs" / "gateway-up.state.json"
    try:
        assert up.returncode == 0, up.stdout + up.stderr
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
    finally:
        down = pdserve("down", "--topology", str(path))
    assert down.returncode == 0, down.stdout + down.stderr
    assert "worker    gateway-up-gateway-0 stopped" in down.stdout, down.stdout
    assert "worker    gateway-up-kv-index stopped" in down.stdout, down.stdout
