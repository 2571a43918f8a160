"""The prefill queue as a real Ray actor: order, budgets, cancel, capacity, fail-back."""

from __future__ import annotations

import asyncio
import itertools
import os
import time
import uuid

import pytest
import ray

from pdserve.cluster.queue import (
    PRIORITY_HIGH,
    PRIORITY_LOW,
    PRIORITY_NORMAL,
    PrefillTask,
    QueueCore,
    get_or_create_queue,
    requeue_on_worker_loss,
)
from pdserve.cluster.registry import Registry, WorkerInfo

pytestmark = pytest.mark.timeout(120)  # any hang fails fast, not after the suite-wide 600 s
_ids = itertools.count()


@pytest.fixture(scope="module")
def ray_local():
    """One local Ray for the module (start-up costs ~2.5 s on 2 cores)."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="pdserve-tests")
    yield
    ray.shutdown()


@pytest.fixture
def queue(ray_local):
    handle = get_or_create_queue(f"q-{uuid.uuid4().hex[:8]}", "pdserve-tests", capacity=64)
    yield handle
    ray.kill(handle)


def task(num_tokens: int = 10, *, cached: int = 0, priority=PRIORITY_NORMAL, deadline=None,
         arrival: float | None = None, target: str = "d0", request_id: str | None = None) -> PrefillTask:
    return PrefillTask(
        request_id=request_id or f"r{next(_ids)}",
        epoch=0,
        token_ids=list(range(num_tokens)),
        cached_len=cached,
        target_worker_id=target,
        target_block_ids=[0, 1],
        sampling_params={"temperature": 0.0},
        priority=priority,
        deadline=deadline,
        arrival_time=time.time() if arrival is None else arrival,
    )


def ids(tasks) -> list[str]:
    return [t.request_id for t in tasks]


def test_task_counts_only_uncached_tokens_and_round_trips():
    t = task(100, cached=32, priority="high")
    assert t.num_prefill_tokens == 68 and t.priority == PRIORITY_HIGH and t.origin == "d0"
    assert PrefillTask.from_dict(t.to_dict()) == t
    with pytest.raises(ValueError, match="cached_len"):
        task(10, cached=11)


def test_tasks_leave_by_priority_then_deadline_then_arrival(queue):
    now = time.time()
    puts = [
        task(request_id="low", priority=PRIORITY_LOW, arrival=now - 9),
        task(request_id="normal-late-deadline", deadline=now + 60, arrival=now - 8),
        task(request_id="normal-no-deadline-old", arrival=now - 7),
        task(request_id="normal-no-deadline-new", arrival=now - 1),
        task(request_id="normal-early-deadline", deadline=now + 30, arrival=now),
        task(request_id="high", priority=PRIORITY_HIGH, arrival=now),
    ]
    for t in puts:
        assert ray.get(queue.put.remote(t)).ok
    batch = ray.get(queue.get_batch.remote("p0", max_tokens=10_000))
    assert ids(batch) == [
        "high", "normal-early-deadline", "normal-late-deadline",
        "normal-no-deadline-old", "normal-no-deadline-new", "low",
    ]


def test_batch_fills_the_token_budget_in_order_and_stops_at_the_first_misfit(queue):
    for n, rid in [(100, "a"), (200, "b"), (300, "c"), (50, "d")]:
        ray.get(queue.put.remote(task(n, request_id=rid, arrival=time.time())))
    assert ids(ray.get(queue.get_batch.remote("p0", max_tokens=350))) == ["a", "b"]
    assert ids(ray.get(queue.get_batch.remote("p0", max_tokens=350))) == ["c", "d"]
    assert ray.get(queue.get_batch.remote("p0", max_tokens=350)) == []


def test_budget_counts_uncached_tokens_and_max_tasks_caps_the_batch(queue):
    for rid in "abc":
        ray.get(queue.put.remote(task(1000, cached=900, request_id=rid, arrival=time.time())))
    assert ids(ray.get(queue.get_batch.remote("p0", max_tokens=300))) == ["a", "b", "c"]
    for rid in "def":
        ray.get(queue.put.remote(task(10, request_id=rid, arrival=time.time())))
    assert ids(ray.get(queue.get_batch.remote("p0", max_tokens=300, max_tasks=2))) == ["d", "e"]


def test_a_task_larger_than_the_budget_is_still_handed_out_alone(queue):
    ray.get(queue.put.remote(task(5000, request_id="huge", arrival=1.0)))
    ray.get(queue.put.remote(task(10, request_id="small", arrival=2.0)))
    assert ids(ray.get(queue.get_batch.remote("p0", max_tokens=512))) == ["huge"]
    assert ids(ray.get(queue.get_batch.remote("p0", max_tokens=512))) == ["small"]


def test_get_batch_waits_for_the_first_task_up_to_max_wait_ms(queue):
    started = time.monotonic()
    assert ray.get(queue.get_batch.remote("p0", max_tokens=100, max_wait_ms=200)) == []
    assert time.monotonic() - started >= 0.2
    waiting = queue.get_batch.remote("p0", max_tokens=100, max_wait_ms=5000)
    time.sleep(0.2)
    put_at = time.monotonic()
    ray.get(queue.put.remote(task(request_id="late")))
    assert ids(ray.get(waiting)) == ["late"]
    assert time.monotonic() - put_at < 1.0  # woken by the put, not by the timeout


def test_cancel_removes_a_queued_task_and_reports_in_flight_ones(queue):
    for rid in ["keep", "drop", "taken"]:
        ray.get(queue.put.remote(task(request_id=rid, priority=0 if rid == "taken" else 1)))
    assert ids(ray.get(queue.get_batch.remote("p0", max_tokens=10))) == ["taken"]
    assert ray.get(queue.cancel.remote("drop")) == "queued"
    assert ray.get(queue.cancel.remote("taken")) == "in_flight"
    assert ray.get(queue.cancel.remote("never-seen")) == "unknown"
    assert ids(ray.get(queue.get_batch.remote("p1", max_tokens=1000))) == ["keep"]
    stats = ray.get(queue.stats.remote())
    assert stats.depth == 0 and stats.in_flight == {"p1": 1} and stats.counters["cancelled"] == 2
    assert ray.get(queue.worker_gone.remote("p0"))["requeued"] == 0  # a cancelled task is not requeued


def test_put_is_refused_explicitly_when_full_duplicate_or_late(ray_local):
    small = get_or_create_queue(f"q-{uuid.uuid4().hex[:8]}", "pdserve-tests", capacity=2)
    try:
        assert ray.get(small.put.remote(task(request_id="a"))).ok
        assert ray.get(small.put.remote(task(request_id="b"))).ok
        full = ray.get(small.put.remote(task(request_id="c")))
        assert (full.ok, full.reason, full.depth) == (False, "queue_full", 2)
        assert ray.get(small.put.remote(task(request_id="a"))).reason == "duplicate"
        assert ray.get(small.put.remote(task(request_id="x", deadline=time.time() - 1))).reason == "deadline_passed"
        assert ray.get(small.put.remote(task(10, cached=10, request_id="y"))).reason == "nothing_to_prefill"
        counters = ray.get(small.stats.remote()).counters
        assert counters["rejected_queue_full"] == 1 and counters["put"] == 2
    finally:
        ray.kill(small)


def test_a_vanished_workers_tasks_are_requeued_once_then_failed_back_to_their_origin(queue):
    ray.get(queue.put.remote(task(request_id="a", target="d0", arrival=1.0)))
    ray.get(queue.put.remote(task(request_id="b", target="d1", arrival=2.0)))
    ray.get(queue.put.remote(task(request_id="c", target="d0", arrival=3.0)))
    assert ids(ray.get(queue.get_batch.remote("p0", max_tokens=20))) == ["a", "b"]
    assert ray.get(queue.worker_gone.remote("p0")) == {
        "requeued": 2, "failed": 0, "dropped_queued": 0, "dropped_failed": 0}
    # Requeued tasks keep their place ahead of later arrivals.
    assert ids(ray.get(queue.get_batch.remote("p1", max_tokens=30))) == ["a", "b", "c"]
    assert ray.get(queue.complete.remote("p1", "c"))
    assert ray.get(queue.worker_gone.remote("p1"))["failed"] == 2
    failed = ray.get(queue.take_failed.remote("d0"))
    assert ids(f.task for f in failed) == ["a"] and failed[0].reason == "worker_vanished"
    # The decode worker's periodic poll: its failed tasks and the stats in one call.
    failed_d1, stats = ray.get(queue.take_failed_and_stats.remote("d1"))
    assert ids(f.task for f in failed_d1) == ["b"] and stats.failed_pending == 0 and stats.depth == 0
    assert ray.get(queue.take_failed.remote("d0")) == []  # taken once
    assert ray.get(queue.worker_gone.remote("p1"))["failed"] == 0  # idempotent


def test_stats_report_depth_tokens_wait_and_in_flight_per_worker(queue):
    ray.get(queue.put.remote(task(100, cached=20)))
    ray.get(queue.put.remote(task(50)))
    ray.get(queue.put.remote(task(70)))
    batch = ray.get(queue.get_batch.remote("p0", max_tokens=80))
    time.sleep(0.05)
    stats = ray.get(queue.stats.remote())
    assert (stats.depth, stats.queued_tokens, stats.in_flight, stats.in_flight_tokens) == (2, 120, {"p0": 1}, 80)
    assert stats.oldest_wait_ms >= 50 and stats.capacity == 64
    assert ray.get(queue.complete.remote("p0", [t.request_id for t in batch]))  # a whole batch at once
    assert ray.get(queue.stats.remote()).in_flight == {}
    # Or piggybacked on the next request, as a prefill worker's loop does.
    batch = ray.get(queue.get_batch.remote("p0", max_tokens=50))
    assert ray.get(queue.stats.remote()).in_flight == {"p0": 1}
    ray.get(queue.get_batch.remote("p0", max_tokens=1, completed=[t.request_id for t in batch]))
    assert ray.get(queue.stats.remote()).in_flight == {"p0": 1}  # the old one done, a new one taken
    assert ray.get(queue.stats.remote()).counters["completed"] == 2


def test_get_or_create_returns_the_same_named_actor(ray_local):
    name = f"q-{uuid.uuid4().hex[:8]}"
    first = get_or_create_queue(name, "pdserve-tests", capacity=8)
    again = get_or_create_queue(name, "pdserve-tests", capacity=999)
    try:
        ray.get(first.put.remote(task(request_id="shared")))
        assert ray.get(again.stats.remote()).depth == 1
        assert ray.get(again.stats.remote()).capacity == 8
    finally:
        ray.kill(first)


def test_queued_tasks_for_a_vanished_decode_worker_are_dropped():
    core = QueueCore(capacity=8)
    core.put(task(request_id="for-d0", target="d0"))
    core.put(task(request_id="for-d1", target="d1"))
    assert core.worker_gone("d0")["dropped_queued"] == 1
    assert ids(core.take("p0", max_tokens=1000)) == ["for-d1"]
    assert core.take_failed("d0") == []  # its origin is gone too: nobody to tell


def test_expired_tasks_are_failed_back_instead_of_dispatched():
    now = [1000.0]
    core = QueueCore(capacity=8, clock=lambda: now[0])
    assert core.put(task(request_id="soon", deadline=1001.0, arrival=1.0)).ok
    assert core.put(task(request_id="later", deadline=2000.0, arrival=2.0)).ok
    now[0] = 1500.0
    assert ids(core.take("p0", max_tokens=1000)) == ["later"]
    [failed] = core.take_failed("d0")
    assert failed.task.request_id == "soon" and failed.reason == "deadline_expired"


async def test_worker_removed_from_the_registry_gets_its_tasks_requeued(queue, etcd, cluster_name):
    async with Registry(etcd.endpoint, cluster_name, ttl_s=2.0, backoff_initial_s=0.05) as janitor_reg, \
            Registry(etcd.endpoint, cluster_name, ttl_s=2.0) as p0:
        view = await requeue_on_worker_loss(janitor_reg, queue, grace_s=0.1)
        await p0.register(WorkerInfo("p0", "prefill"))
        await view.wait_for(lambda m: "p0" in m, timeout_s=5)
        await queue.put.remote(task(request_id="a"))
        assert ids(await queue.get_batch.remote("p0", max_tokens=100)) == ["a"]
        await p0.deregister()

        async def requeued():
            while (await queue.stats.remote()).depth != 1:
                await asyncio.sleep(0.02)

        await asyncio.wait_for(requeued(), timeout=5)
        assert ids(await queue.get_batch.remote("p1", max_tokens=100)) == ["a"]


def test_a_poll_left_behind_by_a_vanished_worker_takes_nothing(queue):
    # A prefill worker killed while its get_batch waits: the call lives on in the queue actor.
    orphan = queue.get_batch.remote("p-dead", 100, 5000)
    time.sleep(0.3)  # the poll is waiting in the actor
    ray.get(queue.worker_gone.remote("p-dead"))
    assert ray.get(orphan, timeout=10) == []  # woken and ended empty, not after its 5 s
    assert ray.get(queue.put.remote(task(request_id="late"))).ok
    # The task stays queued for a live worker instead of going to the dead one.
    assert ids(ray.get(queue.get_batch.remote("p-live", 100))) == ["late"]
    assert ray.get(queue.stats.remote()).in_flight == {"p-live": 1}
    # A poll the same worker id starts afterwards (a restarted worker) is served again.
    assert ray.get(queue.put.remote(task(request_id="again"))).ok
    assert ids(ray.get(queue.get_batch.remote("p-dead", 100, 1000))) == ["again"]
