"""`pdserve up` with `gateway.replicas: 1`: the gateway starts after the decode workers (a Ray
actor), serves through both of them, explains its pick, and `pdserve down` stops it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from pdserve.api import Client
from tests.harness import small_topology_yaml

REPO = Path(__file__).resolve().parents[2]


def pdserve(*args, timeout=300):
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "UCX_MODULES": "^ib"}
    return subprocess.run([sys.executable, "-m", "pdserve.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


def test_up_starts_a_gateway_in_front_of_the_decode_workers(tmp_path):
    path = tmp_path / "topology.yaml"
    text = small_topology_yaml("gateway-up", tmp_path)
    text = text.replace("  prefill:\n    replicas: 1\n", "  prefill:\n    replicas: 0\n")
    text = text.replace("  decode:\n    replicas: 1\n", "  decode:\n    replicas: 2\n")
    path.write_text(text + "gateway: {replicas: 1, num_cpus: 0}\n")
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
    finally:
        down = pdserve("down", "--topology", str(path))
    assert down.returncode == 0, down.stdout + down.stderr
    assert "worker    gateway-up-gateway-0 stopped" in down.stdout, down.stdout
