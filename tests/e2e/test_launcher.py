"""`pdserve up / status / demo / down` as a user runs them (the README's first command, small)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdserve.cluster.runtime import cpu_list
from tests.harness import small_topology_yaml

REPO = Path(__file__).resolve().parents[2]

def pdserve(*args, timeout=300):
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "UCX_MODULES": "^ib"}
    return subprocess.run([sys.executable, "-m", "pdserve.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def nice(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().split(")")[-1].split()[16])


@pytest.fixture
def topology(tmp_path):
    path = tmp_path / "topology.yaml"
    # Its own model cache: this `up` makes the model, as a user's first one does.
    text = small_topology_yaml("launcher-test", tmp_path, REPO / "configs" / "router" / "default.yaml",
                               own_model_cache=True)
    # Each worker owns its cores (issue 16), as in the shipped 1p1d-local topology.
    path.write_text(text.replace("    resources: {num_cpus: 1}\n", "    cpus: auto\n"))
    return path


def test_up_status_demo_down(topology, tmp_path):
    up = pdserve("up", "--topology", str(topology))
    state_file = tmp_path / "runs" / "launcher-test.state.json"
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert "ready" in up.stdout and "gRPC 127.0.0.1:" in up.stdout
        assert "model     making a llama model" in up.stdout, up.stdout  # its own cache: `up` made it
        state = json.loads(state_file.read_text())
        assert {a["worker_id"] for a in state["actors"]} == {"prefill-0", "decode-0"}

        status = pdserve("status", "--topology", str(topology), "--json")
        assert status.returncode == 0, status.stderr
        body = json.loads(status.stdout)
        assert {m["role"] for m in body["members"].values()} == {"prefill", "decode"}
        # Core ownership: each worker process is pinned to the cores its load record shows.
        owned = {}
        for actor in state["actors"]:
            member = body["members"][actor["worker_id"]]
            owned[actor["worker_id"]] = sorted(os.sched_getaffinity(actor["pid"]))
            assert member["load"]["cpus"] == cpu_list(owned[actor["worker_id"]]), member["load"]
        if len(os.sched_getaffinity(0)) >= 2:
            assert not set(owned["prefill-0"]) & set(owned["decode-0"]), owned
        assert body["queue"]["depth"] == 0

        demo = pdserve("demo", "--topology", str(topology), "--route", "remote", "--long-tokens", "300",
                       "--max-tokens", "8")
        assert demo.returncode == 0, demo.stdout + demo.stderr
        assert "route REMOTE" in demo.stdout and "transfer:" in demo.stdout
        assert demo.stdout.count("completion (8 tokens") == 7
        # The remote prefills went over the queue's wire, not Ray actor calls.
        counters = json.loads(pdserve("status", "--topology", str(topology), "--json").stdout)["queue"]["counters"]
        assert counters["dispatched"] >= 1 and counters["wire_connections"] >= 2, counters
        assert counters["wire_calls"] >= 2 * counters["dispatched"] and counters.get("wire_errors", 0) == 0, counters
        # The workers run at the topology's niceness (0), not Ray's default 15.
        for actor in state["actors"]:
            assert nice(actor["pid"]) == 0, actor
    finally:
        down = pdserve("down", "--topology", str(topology))
    assert down.returncode == 0, down.stdout + down.stderr
    assert not state_file.exists()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and (alive(state["etcd_pid"]) or alive(state["ray_head_pid"])):
        time.sleep(0.2)
    assert not alive(state["etcd_pid"]) and not alive(state["ray_head_pid"])


def test_up_with_a_broken_topology_fails_naming_the_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("cluster: x\nmodel: {path: auto}\nroles: {decode: {replicas: -1}}\n")
    res = pdserve("up", "--topology", str(bad), timeout=60)
    assert res.returncode == 2
    assert "roles.decode.replicas" in res.stderr and "bad.yaml:3" in res.stderr
