"""etcd goes away and comes back: registrations and watches recover on their own."""

from __future__ import annotations

import asyncio
import shutil

import pytest

from pdserve.cluster.etcd_server import EmbeddedEtcd, EtcdBinaryNotFoundError, find_etcd_binary
from pdserve.cluster.registry import RegistrationState, Registry, WorkerInfo

pytestmark = pytest.mark.timeout(120)  # any hang fails fast, not after the suite-wide 600 s
TTL_S = 2.0
FAST = dict(backoff_initial_s=0.05, backoff_max_s=0.5, request_timeout_s=1.0)
CONVERGE_S = 10.0  # generous on a loaded 2-core CI machine; typically ~2 s


def test_embedded_etcd_reports_a_missing_binary_clearly(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_ETCD_BIN", str(tmp_path / "no-such-etcd"))
    with pytest.raises(EtcdBinaryNotFoundError, match="PDSERVE_ETCD_BIN"):
        find_etcd_binary()
    with pytest.raises(EtcdBinaryNotFoundError):
        EmbeddedEtcd(tmp_path / "data").start()


def test_embedded_etcd_restarts_on_the_same_port(fresh_etcd):
    endpoint = fresh_etcd.endpoint
    fresh_etcd.restart()
    assert fresh_etcd.is_running() and fresh_etcd.endpoint == endpoint


async def test_workers_reregister_and_watchers_converge_after_etcd_loses_its_data(fresh_etcd, cluster_name):
    infos = {"p0": WorkerInfo("p0", "prefill"), "d0": WorkerInfo("d0", "decode")}
    regs = {wid: Registry(fresh_etcd.endpoint, cluster_name, ttl_s=TTL_S, **FAST) for wid in infos}
    observer = Registry(fresh_etcd.endpoint, cluster_name, ttl_s=TTL_S, **FAST)
    try:
        for wid, reg in regs.items():
            await reg.register(infos[wid], nixl_metadata=wid.encode())
        view = await observer.watch_members()
        await view.wait_for(lambda m: set(m) == {"p0", "d0"}, timeout_s=5)

        fresh_etcd.kill()
        await asyncio.sleep(1.0)
        shutil.rmtree(fresh_etcd.data_dir)  # a brand-new etcd at the same address
        await asyncio.to_thread(fresh_etcd.start)

        def converged(members) -> bool:
            reregistered = all(r.reregistrations >= 1 and r.state is RegistrationState.REGISTERED
                               for r in regs.values())
            return reregistered and set(members) == {"p0", "d0"} and view.resyncs >= 1

        await view.wait_for(converged, timeout_s=CONVERGE_S)
        for wid in regs:
            assert await observer.get_nixl_metadata(wid) == wid.encode()
        assert view.members == infos
    finally:
        for reg in [*regs.values(), observer]:
            await reg.close()


async def test_watchers_resume_and_updates_land_after_etcd_restarts_with_its_data(fresh_etcd, cluster_name):
    policies = []
    async with Registry(fresh_etcd.endpoint, cluster_name, ttl_s=TTL_S, **FAST) as p0, \
            Registry(fresh_etcd.endpoint, cluster_name, ttl_s=TTL_S, **FAST) as observer:
        await p0.register(WorkerInfo("p0", "prefill"))
        view = await observer.watch_members()
        policy = await observer.watch_policy("router", validate=str.strip, on_change=policies.append)
        await view.wait_for(lambda m: "p0" in m, timeout_s=5)
        await policy.wait_synced()

        await asyncio.to_thread(fresh_etcd.stop)
        # An update made while etcd is down is kept and published once it is back.
        assert not await p0.update(WorkerInfo("p0", "prefill", load={"running": 3}))
        await asyncio.to_thread(fresh_etcd.start)

        await view.wait_for(lambda m: m["p0"].load == {"running": 3} and view.resyncs >= 1, timeout_s=CONVERGE_S)
        # New writes after the restart reach the re-established watches.
        async with Registry(fresh_etcd.endpoint, cluster_name, ttl_s=TTL_S, **FAST) as p1:
            await p1.register(WorkerInfo("p1", "prefill"))
            await view.wait_for(lambda m: set(m) == {"p0", "p1"}, timeout_s=CONVERGE_S)
        await _until(lambda: policy.synced, CONVERGE_S)
        await observer.put_policy("router", "policy: threshold\n")
        await _until(lambda: policy.current == "policy: threshold", CONVERGE_S)
        assert policies == ["policy: threshold"]
        assert p0.reregistrations == 0  # etcd kept the lease: nothing to redo


async def _until(predicate, timeout_s: float) -> None:
    async def poll():
        while not predicate():
            await asyncio.sleep(0.02)

    await asyncio.wait_for(poll(), timeout_s)
