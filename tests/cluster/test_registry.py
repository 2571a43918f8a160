"""Registry against a real etcd: records, leases, expiry, conflicts, watches."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from pdserve.cluster.registry import RegistrationState, Registry, WorkerIdConflictError, WorkerInfo

pytestmark = pytest.mark.timeout(120)  # any hang fails fast, not after the suite-wide 600 s
TTL_S = 2.0  # etcd's minimum lease TTL with default election settings
FAST = dict(backoff_initial_s=0.05, backoff_max_s=0.5, request_timeout_s=2.0)


def worker(worker_id: str, role: str = "prefill", **load) -> WorkerInfo:
    return WorkerInfo(
        worker_id=worker_id,
        role=role,
        endpoints={"grpc": "127.0.0.1:1"},
        model="tiny-llama",
        kv_layout={"dtype": "float32", "block_size": 16, "num_kv_heads": 2, "head_dim": 16},
        capacity={"num_blocks": 128},
        version="0.1.0",
        load=dict(load),
    )


def test_worker_info_round_trips_through_json_and_ignores_unknown_fields():
    info = worker("p0", queue_depth=3)
    assert WorkerInfo.from_json(info.to_json()) == info
    newer = info.to_json().replace(b'"format":1', b'"format":1,"future_field":7')
    assert WorkerInfo.from_json(newer) == info


def test_worker_info_rejects_bad_role_and_id():
    with pytest.raises(ValueError, match="role"):
        WorkerInfo(worker_id="w", role="router")
    with pytest.raises(ValueError, match="worker_id"):
        WorkerInfo(worker_id="a/b", role="decode")


async def test_register_writes_record_and_nixl_metadata_under_the_documented_keys(etcd, cluster_name):
    async with Registry(etcd.endpoint, cluster_name, ttl_s=TTL_S, **FAST) as reg:
        await reg.register(worker("p0"), nixl_metadata=b"\x00nixl\xff")
        client = reg.client()
        record = await client.get(f"/pdserve/{cluster_name}/workers/prefill/p0".encode())
        assert WorkerInfo.from_json(record.value) == worker("p0")
        assert record.lease == reg.lease_id
        assert await reg.get_nixl_metadata("p0") == b"\x00nixl\xff"
        assert (await client.get(f"/pdserve/{cluster_name}/nixl/p0".encode())).lease == reg.lease_id
        assert set(await reg.members()) == {"p0"}
        assert await reg.members("decode") == {}


async def test_two_workers_are_seen_by_a_watcher_with_add_and_update_callbacks(etcd, cluster_name):
    seen: list[tuple[str, str]] = []
    async with Registry(etcd.endpoint, cluster_name, ttl_s=TTL_S, **FAST) as observer, \
            Registry(etcd.endpoint, cluster_name, ttl_s=TTL_S, **FAST) as p0, \
            Registry(etcd.endpoint, cluster_name, ttl_s=TTL_S, **FAST) as d0:
        view = await observer.watch_members(
            on_add=lambda i: seen.append(("add", i.worker_id)),
            on_update=lambda i: seen.append(("update", i.worker_id)),
        )
        await view.wait_synced()
        await p0.register(worker("p0"))
        await d0.register(worker("d0", role="decode"))
        await view.wait_for(lambda m: set(m) == {"p0", "d0"}, timeout_s=5)
        assert await d0.update(worker("d0", role="decode", running=5))
        await view.wait_for(lambda m: m["d0"].load == {"running": 5}, timeout_s=5)
        assert seen == [("add", "p0"), ("add", "d0"), ("update", "d0")]
        assert set(await observer.members("decode")) == {"d0"}


async def test_deregister_removes_the_worker_immediately(etcd, cluster_name):
    removed = []
    async with Registry(etcd.endpoint, cluster_name, ttl_s=TTL_S, **FAST) as observer, \
            Registry(etcd.endpoint, cluster_name, ttl_s=TTL_S, **FAST) as p0:
        view = await observer.watch_members(on_remove=lambda i: removed.append(i.worker_id), role="prefill")
        await p0.register(worker("p0"), nixl_metadata=b"md")
        await view.wait_for(lambda m: "p0" in m, timeout_s=5)
        await p0.deregister()
        await view.wait_for(lambda m: "p0" not in m, timeout_s=1)
        assert removed == ["p0"] and p0.state is RegistrationState.DEREGISTERED
        assert await observer.get_nixl_metadata("p0") is None


async def test_a_second_live_worker_with_the_same_id_is_refused(etcd, cluster_name):
    async with Registry(etcd.endpoint, cluster_name, ttl_s=TTL_S, **FAST) as first, \
            Registry(etcd.endpoint, cluster_name, ttl_s=TTL_S, **FAST) as second:
        await first.register(worker("p0"))
        with pytest.raises(WorkerIdConflictError, match="p0"):
            await second.register(worker("p0"))


async def test_a_restarted_worker_takes_over_the_record_of_its_earlier_process(etcd, cluster_name):
    """A process that died without deregistering leaves a live lease behind for up to its TTL;
    its restarted successor (replace_stale) revokes it instead of failing on the conflict."""
    async with Registry(etcd.endpoint, cluster_name, ttl_s=60, **FAST) as dead, \
            Registry(etcd.endpoint, cluster_name, ttl_s=TTL_S, **FAST) as restarted:
        await dead.register(worker("p0"), nixl_metadata=b"old")
        dead._keepalive_task.cancel()  # the old process is gone: nothing keeps it alive any more
        stale_lease = dead.lease_id
        with pytest.raises(WorkerIdConflictError):
            await restarted.register(worker("p0"), nixl_metadata=b"new")
        await restarted.register(worker("p0"), nixl_metadata=b"new", replace_stale=True)
        assert restarted.lease_id != stale_lease
        assert set(await restarted.members()) == {"p0"}
        assert await restarted.get_nixl_metadata("p0") == b"new"
        ttl = await restarted.client().get_lease_info(stale_lease)
        assert ttl.TTL == -1  # revoked


async def test_keepalive_holds_the_record_well_past_the_ttl(etcd, cluster_name):
    async with Registry(etcd.endpoint, cluster_name, ttl_s=TTL_S, **FAST) as reg:
        await reg.register(worker("p0"))
        await asyncio.sleep(TTL_S + 1.0)
        assert set(await reg.members()) == {"p0"}
        assert reg.state is RegistrationState.REGISTERED and reg.reregistrations == 0


WORKER_SCRIPT = textwrap.dedent(
    """
    import asyncio, sys
    from pdserve.cluster.registry import Registry, WorkerInfo

    async def main(endpoint, cluster):
        reg = Registry(endpoint, cluster, ttl_s={ttl})
        await reg.register(WorkerInfo(worker_id="victim", role="prefill"), nixl_metadata=b"md")
        print("registered", flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main(sys.argv[1], sys.argv[2]))
    """
).format(ttl=TTL_S)


async def test_killed_worker_disappears_from_the_watcher_within_ttl_plus_2s(etcd, cluster_name):
    removed_at: list[float] = []
    proc = subprocess.Popen(
        [sys.executable, "-c", WORKER_SCRIPT, etcd.endpoint, cluster_name],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), timeout=30)
        assert line.strip() == "registered"
        async with Registry(etcd.endpoint, cluster_name, ttl_s=TTL_S, **FAST) as observer:
            view = await observer.watch_members(on_remove=lambda i: removed_at.append(time.monotonic()))
            await view.wait_for(lambda m: "victim" in m, timeout_s=5)
            os.kill(proc.pid, signal.SIGKILL)
            killed_at = time.monotonic()
            await view.wait_for(lambda m: "victim" not in m, timeout_s=TTL_S + 2)
            assert removed_at and removed_at[0] - killed_at <= TTL_S + 2
            assert await observer.get_nixl_metadata("victim") is None
    finally:
        proc.kill()
        proc.wait(timeout=10)
