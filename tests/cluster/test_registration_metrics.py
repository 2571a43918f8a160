"""A worker's etcd registration as Prometheus metrics (cluster/registration_metrics.py), with a
real etcd: registered, then its lease revoked from outside (as when it expires while the worker
is cut off), and the re-registration counted; and on both workers' /metrics."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.cluster.registration_metrics import RegistrationCollector
from pdserve.cluster.registry import RegistrationState, Registry, WorkerInfo
from pdserve.decode.metrics import WorkerMetrics
from pdserve.prefill.metrics import PrefillMetrics
from pdserve.prefill.values import PrefillStats

pytestmark = pytest.mark.timeout(60)
TTL_S = 2.0
FAST = dict(backoff_initial_s=0.05, backoff_max_s=0.5, request_timeout_s=1.0)


def scrape(text: str) -> tuple[dict[str, float], float]:
    """(state -> value, re-registrations) of one /metrics page."""
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    states = {s.labels["state"]: s.value for s in fams["pdserve_etcd_registration"].samples}
    [again] = [s.value for s in fams["pdserve_etcd_reregistrations"].samples if s.name.endswith("_total")]
    return states, again


async def test_state_and_reregistrations_follow_a_lost_lease(etcd, cluster_name):
    prom = CollectorRegistry()
    async with Registry(etcd.endpoint, cluster_name, ttl_s=TTL_S, **FAST) as reg, \
            Registry(etcd.endpoint, cluster_name, ttl_s=TTL_S, **FAST) as other:
        prom.register(RegistrationCollector(reg, {"worker_id": "d0"}))
        states, again = scrape(generate_latest(prom).decode())
        assert states == {s.value: (1.0 if s is RegistrationState.UNREGISTERED else 0.0) for s in RegistrationState}
        await reg.register(WorkerInfo("d0", "decode"))
        states, again = scrape(generate_latest(prom).decode())
        assert states["registered"] == 1.0 and sum(states.values()) == 1.0 and again == 0.0

        lost = reg.lease_id
        await other.client().revoke_lease(lost)  # the lease is gone, as after an expiry
        async def reregistered():
            while not (reg.reregistrations == 1 and reg.state is RegistrationState.REGISTERED):
                await asyncio.sleep(0.02)
        await asyncio.wait_for(reregistered(), 10)
        assert reg.lease_id != lost
        states, again = scrape(generate_latest(prom).decode())
        assert states["registered"] == 1.0 and sum(states.values()) == 1.0 and again == 1.0
        await reg.deregister()
        states, _ = scrape(generate_latest(prom).decode())
        assert states["deregistered"] == 1.0 and sum(states.values()) == 1.0


async def test_both_roles_export_it_with_their_labels(etcd, cluster_name):
    async with Registry(etcd.endpoint, cluster_name, ttl_s=TTL_S, **FAST) as reg:
        await reg.register(WorkerInfo("p0", "prefill"))
        decode, prefill = WorkerMetrics("decode", "d0"), PrefillMetrics("p0", PrefillStats())
        decode.watch_registration(reg)
        prefill.watch_registration(reg)
        for metrics, labels in ((decode, {"role": "decode", "worker_id": "d0"}),
                                (prefill, {"role": "prefill", "worker_id": "p0"})):
            fams = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
            [sample] = [s for s in fams["pdserve_etcd_registration"].samples if s.labels["state"] == "registered"]
            assert sample.value == 1.0 and sample.labels == {**labels, "state": "registered"}
