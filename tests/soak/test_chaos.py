"""The chaos soak, short: a live 1P1D cluster under mixed load while a prefill worker is
SIGKILLed, then SIGSTOPped (hung, its lease alive), 50 remote streams are dropped by their
clients, etcd is killed and restarted, the queue actor is killed, and request ids are reused
right after a disconnect. Nothing may be lost, every completed request is token-exact, no
reused id gets another request's tokens, and no KV block leaks. (`python
bench/chaos.py` runs the same for 10 minutes; docs/PERFORMANCE.md has its report.)"""

from __future__ import annotations

import pytest

from pdserve.bench.chaos import ChaosConfig, format_report, run_chaos

from tests.harness import small_topology_yaml


@pytest.mark.timeout(480)
def test_short_chaos_soak_loses_nothing_and_leaks_nothing(tmp_path):
    topology = tmp_path / "topology.yaml"
    topology.write_text(small_topology_yaml("chaos-ci", tmp_path))
    faults = ("kill_prefill", "stop_prefill", "abort_storm", "restart_etcd", "kill_queue", "reuse_ids")
    cfg = ChaosConfig(topology=str(topology), duration_s=66.0, request_rate=2.0, fault_every_s=10.0,
                      first_fault_s=6.0, num_prompts=12, long_len=(200, 400), max_tokens=6, faults=faults,
                      stop_s=5.0, settle_timeout_s=75.0, work_dir=str(tmp_path / "work"))
    report = run_chaos(cfg, log=print)
    print(format_report(report))
    assert [f["kind"] for f in report.faults] == list(faults)
    assert report.client_faults["aborted"] == 50
    assert report.client_faults["reused"] > 0 and report.client_faults["crossed"] == 0, report.client_faults
    assert all("could not fire" not in f["detail"] for f in report.faults)
    assert all(f["recovered_s"] is not None for f in report.faults), report.faults
    assert report.sent > 40
    assert report.lost == 0, report.lost_details
    assert report.mismatch == 0, report.lost_details
    assert report.leaked_blocks == 0
    assert report.exact > report.sent // 2
