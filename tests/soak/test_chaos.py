"""The chaos soak, short: a live 1P1D cluster behind a gateway under mixed load while a prefill
worker is SIGKILLed, then SIGSTOPped (hung, its lease alive), 50 remote streams are dropped by
their clients, etcd is killed and restarted, the queue actor is killed, request ids are reused
right after a disconnect, the prefill worker's compute thread hangs while its loop beats on,
poison requests (failed by every engine) go through the gateway, and a second cluster is
started, served and stopped on the same host. Nothing may be lost, every completed request is
token-exact, no reused id gets another request's tokens, every poison request comes back as its
own error while the gateway goes on serving, the second cluster serves token-exact, and no KV
block leaks. (`python
bench/chaos.py` runs the same for 10 minutes; docs/PERFORMANCE.md has its report.)"""

from __future__ import annotations

import pytest

from pdserve.bench.chaos import ChaosConfig, format_report, run_chaos

from tests.harness import small_topology_yaml


@pytest.mark.timeout(600)
def test_short_chaos_soak_loses_nothing_and_leaks_nothing(tmp_path):
    topology = tmp_path / "topology.yaml"
    topology.write_text(small_topology_yaml("chaos-ci", tmp_path))
    faults = ("kill_prefill", "stop_prefill", "abort_storm", "restart_etcd", "kill_queue", "reuse_ids",
              "hang_compute", "poison_request", "second_cluster")
    # Faults every 6 s from t=4: the ninth (second_cluster) fires at t=52, inside the 56 s of load.
    # Each fault's recovery is watched for 6 s after it has fired (the slowest measured: a killed
    # prefill worker back in 3.9 s; stop_prefill 1 s after its SIGCONT), and the test asserts that
    # every one recovered. The seeded arrivals send 96 requests in 56 s (130 in the former 72).
    cfg = ChaosConfig(topology=str(topology), duration_s=56.0, request_rate=2.0, fault_every_s=6.0,
                      first_fault_s=4.0, num_prompts=12, long_len=(200, 400), max_tokens=6, faults=faults,
                      stop_s=5.0, hang_s=5.0, settle_timeout_s=75.0, work_dir=str(tmp_path / "work"))
    report = run_chaos(cfg, log=print)
    print(format_report(report))
    assert [f["kind"] for f in report.faults] == list(faults)
    assert report.client_faults["aborted"] == 50
    c = report.client_faults
    assert c["reused"] > 0 and c["crossed"] == 0, c
    assert c["poison_sent"] > 0 and c["poison_returned"] == c["poison_sent"] and c["poison_other"] == 0, c
    assert c["poison_probe_ok"] == c["poison_probes"] > 0, c  # the gateway kept serving right after
    assert c["second_sent"] > 0 and c["second_exact"] == c["second_sent"], c
    assert all("could not fire" not in f["detail"] for f in report.faults)
    assert all(f["recovered_s"] is not None for f in report.faults), report.faults
    assert report.sent > 40
    assert report.lost == 0, report.lost_details
    assert report.mismatch == 0, report.lost_details
    assert report.leaked_blocks == 0
    assert report.exact > report.sent // 2
