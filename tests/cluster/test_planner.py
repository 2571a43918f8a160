"""The planner loop against a real etcd: bounds over a sustained overload (from the decisions
it recorded), one planner per cluster, a restarted planner finishing a drain it had begun,
and policy reloads that refuse a bad version.

The workers here are etcd records with the load keys real workers publish (cluster/load.py),
registered under their own leases, and the backend registers them when asked to start one:
this module tests the planner's own logic with a fake clock. tests/e2e/test_planner_e2e.py
runs the planner against real workers on a real Ray cluster.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from pdserve.cluster.registry import Registry, WorkerInfo
from pdserve.cluster.planner.core import Planner
from pdserve.cluster.planner.policy import parse_autoscale
from pdserve.cluster.planner.state import read_decisions, read_planner

POLICY = """\
autoscale:
  prefill:
    min_replicas: 1
    max_replicas: 4
    scale_up: {queue_length: 8}
    scale_down: {queue_length: 1}
  decode:
    min_replicas: 1
    max_replicas: 1
    scale_up: {queue_length: 1000}
    scale_down: {queue_length: 0}
  interval_s: 1
  cooldown_s: 5
  down_stable_s: 0
  max_step: 1
  gpu_budget: 4
"""


class Clock:
    def __init__(self, t: float = 1_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


class FakeWorkers:
    """Worker records under their own leases; a drain request makes one leave unless held."""

    def __init__(self, endpoints, cluster):
        self.endpoints, self.cluster = endpoints, cluster
        self.regs: dict[str, Registry] = {}
        self.hold_drain: set[str] = set()

    async def add(self, role: str, wid: str, **load) -> None:
        reg = Registry(self.endpoints, self.cluster, ttl_s=3)
        await reg.register(WorkerInfo(worker_id=wid, role=role, load=dict(load)))
        await reg.watch_drain(wid, lambda why, wid=wid: asyncio.ensure_future(self._drained(wid)))
        self.regs[wid] = reg

    async def _drained(self, wid: str) -> None:
        if wid not in self.hold_drain:
            await self.remove(wid)

    async def remove(self, wid: str) -> None:
        reg = self.regs.pop(wid, None)
        if reg is not None:
            await reg.close()

    async def close(self) -> None:
        for wid in list(self.regs):
            await self.remove(wid)


class Backend:
    """Starts a worker by registering its record at once; records every call."""

    name = "test"

    def __init__(self, workers: FakeWorkers):
        self.workers = workers
        self.calls: list[tuple[str, str]] = []

    def actor_name(self, wid: str) -> str:
        return f"actor-{wid}"

    async def start(self, role: str, wid: str, flexible: bool = False) -> None:
        self.calls.append(("start", wid))
        await self.workers.add(role, wid, busy_s=0.0, tokens=0, tasks=0)

    async def stop(self, wid: str, actor: str | None = None) -> None:
        self.calls.append(("stop", wid))
        await self.workers.remove(wid)

    async def flip(self, wid: str, role: str, new: str, actor: str | None = None) -> None:
        self.calls.append(("flip", wid, new, actor))


def make_planner(etcd, cluster, backend, clock, queue: dict, text: str = POLICY, **kw) -> Planner:
    async def stats():
        return dict(queue)

    return Planner(cluster=cluster, etcd_endpoints=[etcd.endpoint], policy=parse_autoscale(text), backend=backend,
                   queue_stats=stats, units={"prefill": 1, "decode": 1}, parse_policy=parse_autoscale,
                   clock=clock, leader_ttl_s=2, **kw)


@pytest.fixture
async def workers(etcd, cluster_name):
    fw = FakeWorkers([etcd.endpoint], cluster_name)
    await fw.add("prefill", "prefill-0", busy_s=0.0, tokens=0, tasks=0)
    await fw.add("decode", "decode-0", running=0, waiting=0, kv_usage=0.1, busy_s=0.0)
    yield fw
    await fw.close()


async def test_sustained_overload_stays_within_every_bound(etcd, cluster_name, workers):
    clock, queue = Clock(), {"depth": 50, "queued_tokens": 50_000}
    backend = Backend(workers)
    planner = make_planner(etcd, cluster_name, backend, clock, queue, known_workers=["prefill-0", "decode-0"])
    await planner.start(acquire_timeout_s=10)
    try:
        for _ in range(40):
            await planner.tick()
            clock.t += 1.0
        decisions = await read_decisions(planner.registry, limit=1000)
    finally:
        await planner.close()
    ups = [d for d in decisions if d["role"] == "prefill" and d["action"] == "up"]
    # The budget (4 units: 1 decode + 3 prefill) stops it below max_replicas (4).
    assert [d["desired"] for d in ups] == [2, 3], decisions
    assert all(d["desired"] - d["current"] <= 1 for d in decisions)
    assert all(b["at"] - a["at"] >= 5 for a, b in zip(ups, ups[1:])), ups
    assert [d["reason"] for d in decisions if d["role"] == "prefill"][-1] == "budget"
    assert [c for c in backend.calls if c[0] == "start"] == [("start", "prefill-1"), ("start", "prefill-2")]


async def test_one_planner_per_cluster_and_a_restarted_one_finishes_the_drain(etcd, cluster_name, workers):
    clock, queue = Clock(), {"depth": 0, "queued_tokens": 0}
    await workers.add("prefill", "prefill-1", busy_s=0.0, tokens=0, tasks=0)
    workers.hold_drain.add("prefill-1")  # it keeps working on its last batch for now
    backend = Backend(workers)
    first = make_planner(etcd, cluster_name, backend, clock, queue)
    await first.start(acquire_timeout_s=10)
    second = make_planner(etcd, cluster_name, Backend(workers), clock, queue)
    try:
        assert not await second.acquire(timeout_s=1.5)  # the first one holds the leader key
        assert {d.reason for d in await first.tick()} == {"no_data"}  # no rates yet: no scale-down
        clock.t += 1.0
        await first.tick()  # idle: prefill 2 -> 1, drains the newest
        st = (await read_planner(first.registry))["state"]
        assert st.pending == {"prefill-1": {"role": "prefill", "state": "draining", "since": clock.t,
                                            "reason": "threshold_down"}}
        # The first planner dies without a word: no lease revoke, no state write.
        first._keepalive.cancel()
        await first.registry.close_client()
        assert await second.acquire(timeout_s=15)  # once its leader lease expired
        await second.load_state()
        assert any("resumed: prefill-1 draining" in e for e in second.log)
        clock.t += 60.0  # past the cooldown: were the drain forgotten, it would start another
        await second.tick()
        assert "prefill-1" in second.state.pending  # still draining: nothing new decided for prefill
        await workers.remove("prefill-1")  # its batch done, it leaves the registry
        await second.tick()
        assert second.state.pending == {}
        assert ("stop", "prefill-1") in second.backend.calls
        decisions = await read_decisions(second.registry, limit=100)
    finally:
        await second.close()
        first.leader = False
    downs = [d for d in decisions if d["role"] == "prefill" and d["action"] == "down"]
    assert len(downs) == 1, decisions
    assert "prefill-0" in workers.regs  # the minimum stays


async def test_a_bad_policy_is_refused_with_its_line_and_the_old_one_stays(etcd, cluster_name, workers, tmp_path):
    path = tmp_path / "autoscale.yaml"
    path.write_text(POLICY)
    clock = Clock()
    planner = make_planner(etcd, cluster_name, Backend(workers), clock, {"depth": 0, "queued_tokens": 0},
                           policy_path=str(path))
    await planner.start(acquire_timeout_s=10)
    try:
        old = planner.policy
        path.write_text(POLICY.replace("min_replicas: 1\n    max_replicas: 4", "min_replicas: 5\n    max_replicas: 4"))
        await planner.tick()
        assert planner.policy is old
        assert any("autoscale.yaml:2:3: autoscale.prefill: min_replicas (5) exceeds max_replicas (4)" in e
                   for e in planner.log), planner.log
        path.write_text(POLICY.replace("cooldown_s: 5", "cooldown_s: 7"))
        await asyncio.sleep(0.01)
        await planner.tick()
        assert planner.section.cooldown_s == 7
        # Through etcd: a bad version refused, a good one applied.
        await planner.registry.put_policy("autoscale", "autoscale:\n  max_step: 0\n")
        await _until(lambda: any("max_step" in e and "refused" in e for e in planner.log))
        assert planner.section.cooldown_s == 7
        await planner.registry.put_policy("autoscale", POLICY.replace("cooldown_s: 5", "cooldown_s: 9"))
        await _until(lambda: planner.section.cooldown_s == 9)
    finally:
        await planner.close()
    # The decisions it recorded say which policy they were taken under.
    async with Registry([etcd.endpoint], cluster_name) as reg:
        assert all("policy" in d for d in await read_decisions(reg))
        snaps = json.loads((await reg.client().get(reg.keys.planner_snapshots())).value)
        assert set(snaps["current"]["workers"]) == {"prefill-0", "decode-0"}


async def _until(cond, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.05)


FLIP_POLICY = """\
autoscale:
  prefill:
    min_replicas: 0
    max_replicas: 2
    scale_up: {queue_length: 4}
    scale_down: {queue_length: 0}
  decode:
    min_replicas: 1
    max_replicas: 2
    scale_up: {queue_length: 5}
    scale_down: {queue_length: 0}
  interval_s: 1
  cooldown_s: 5
  down_stable_s: 0
  max_step: 1
  gpu_budget: 2
"""


async def test_a_flip_is_followed_through_etcd_and_the_process_keeps_its_name(etcd, cluster_name):
    fw = FakeWorkers([etcd.endpoint], cluster_name)
    await fw.add("prefill", "prefill-0", busy_s=0.0, tokens=0, tasks=0)
    await fw.add("decode", "decode-0", running=20, waiting=9, kv_usage=0.5, busy_s=0.0)
    fw.hold_drain.add("prefill-0")
    clock, backend = Clock(), Backend(fw)
    planner = make_planner(etcd, cluster_name, backend, clock, {"depth": 0, "queued_tokens": 0}, text=FLIP_POLICY)
    await planner.start(acquire_timeout_s=10)
    try:
        await planner.tick()
        clock.t += 1.0
        decisions = await planner.tick()
        assert {d.role: d.reason for d in decisions} == {"prefill": "role_flip", "decode": "role_flip"}
        assert backend.calls == [("flip", "prefill-0", "decode-1", "actor-prefill-0")]
        assert planner.state.pending["prefill-0"]["state"] == "flipping"
        # While it drains as prefill, nothing else is decided for either role.
        clock.t += 10
        again = await planner.tick()
        assert {d.reason for d in again} == {"in_progress"}
        # The worker leaves as prefill-0 and comes back as decode-1 (same process).
        await fw.remove("prefill-0")
        await fw.add("decode", "decode-1", running=0, waiting=0, kv_usage=0.0, busy_s=0.0)
        await planner.tick()
        assert planner.state.pending == {}
        assert "prefill-0" in planner.state.stopped and ("stop", "prefill-0") not in backend.calls
        assert planner.state.actor_of == {"decode-1": "actor-prefill-0"}
    finally:
        await planner.close()
        await fw.close()
