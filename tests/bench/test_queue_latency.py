"""bench/queue_latency.py end to end, tiny: both transports run, as themselves, and lose nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_queue_latency_compares_wire_and_ray_side_by_side(tmp_path):
    out = tmp_path / "q.json"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    run = subprocess.run(
        [sys.executable, "bench/queue_latency.py", "--rounds", "2", "--latency-tasks", "60", "--rate-hz", "300",
         "--throughput-tasks", "300", "--json", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(out.read_text())
    for transport in ("wire", "ray"):
        res = result["transports"][transport]
        assert res["in_use"] == [transport]  # "wire" really went over the socket, "ray" over actor calls
        assert res["latency"]["tasks"] == 2 * 60 and res["throughput"]["tasks"] == 2 * 300
        assert res["rejected_puts"] == 0
        assert 0 < res["latency"]["p50_ms"] <= res["latency"]["p99_ms"] <= res["latency"]["max_ms"]
    assert set(result["ray_over_wire"]) == {"p50", "p99", "throughput"}
    assert "wire vs ray:" in run.stdout
    counters = result["queue_counters"]
    assert counters["put"] == counters["dispatched"] == counters["completed"]  # nothing stranded
    assert counters["wire_connections"] == 2 and counters.get("wire_errors", 0) == 0


def test_queue_latency_refuses_an_unknown_transport():
    run = subprocess.run([sys.executable, "bench/queue_latency.py", "--transports", "wire,carrier-pigeon"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--transports" in run.stderr and "carrier-pigeon" in run.stderr
