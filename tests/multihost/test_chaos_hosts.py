"""The chaos soak across hosts, short: the 1P1D cluster on three namespace hosts under mixed
load while the prefill worker is SIGKILLed, etcd restarted, the queue actor killed and the
prefill host's link pulled. Nothing may be lost, every completed request is token-exact,
no KV block leaks. (`sudo python bench/chaos.py --hosts` runs it for 10 minutes.)"""

from __future__ import annotations

import json

import pytest

from pdserve.bench.chaos import main

from tests.harness import small_topology_yaml


@pytest.mark.timeout(480)
def test_short_chaos_soak_across_hosts_loses_nothing_and_leaks_nothing(tmp_path):
    topology = tmp_path / "topology.yaml"
    topology.write_text(small_topology_yaml("chaos-hosts", tmp_path))  # 3 s lease: link down 7 s
    report_path = tmp_path / "report.json"
    faults = ["kill_prefill", "restart_etcd", "kill_queue", "link_prefill"]  # the one-host soak has the others
    # Faults at t=10, 20, 30, 40 (10 s apart, each watched 10 s for its recovery; the link stays
    # down 7 s) inside 50 s of load; the seeded arrivals at 1.5/s send 72 requests in 50 s.
    rc = main(["--hosts", "--topology", str(topology), "--duration", "50", "--rate", "1.5", "--faults",
               ",".join(faults), "--fault-every", "10", "--work-dir", str(tmp_path / "work"),
               "--output", str(report_path)])
    report = json.loads(report_path.read_text())
    print(json.dumps({k: report[k] for k in ("sent", "exact", "retriable", "lost", "leaked_blocks")}))
    for f in report["faults"]:
        print(f)
    assert [f["kind"] for f in report["faults"]] == faults
    assert all("could not fire" not in f["detail"] for f in report["faults"]), report["faults"]
    assert report["lost"] == 0, report["lost_details"]
    assert report["mismatch"] == 0, report["lost_details"]
    assert report["leaked_blocks"] == 0
    assert report["sent"] > 60 and report["exact"] > report["sent"] // 2
    assert rc == 0
