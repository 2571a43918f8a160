"""The prefill queue as a real Ray actor: order, budgets, cancel, capacity, fail-back.

The actor-level tests run twice: through Ray actor calls and through the
queue's wire (`QueueClient`), which must behave the same.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import threading
import time
import uuid

import pytest
import ray

from pdserve.common import Priority
from pdserve.cluster.registry import Registry, WorkerInfo
from pdserve.kvtransfer import PrefillTask
from pdserve.cluster.queue import QueueClient, get_or_create_queue, requeue_on_worker_loss
from pdserve.cluster.queue.client import QueueCallError
from pdserve.cluster.queue.core import QueueCore
from pdserve.cluster.queue.frames import from_wire, pack_frame, read_frame, to_wire

pytestmark = pytest.mark.timeout(120)  # any hang fails fast, not after the suite-wide 600 s
_ids = itertools.count()


class SyncQueue:
    """The queue's API as blocking calls, through the product's client over one transport:
    "ray" (its Ray fallback: coded calls on the actor handle) or "wire" (its socket), each
    client on an event loop in a thread."""

    def __init__(self, handle, transport: str):
        self.handle, self.transport = handle, transport
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.client = QueueClient(handle, transport)

    def submit(self, method: str, *args, **kwargs) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(getattr(self.client, method)(*args, **kwargs), self._loop)

    def __getattr__(self, method: str):
        return lambda *args, **kwargs: self.submit(method, *args, **kwargs).result(timeout=60)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.client.close(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


def new_queue(transport: str, capacity: int = 64) -> SyncQueue:
    return SyncQueue(get_or_create_queue(f"q-{uuid.uuid4().hex[:8]}", "pdserve-tests", capacity=capacity), transport)


@pytest.fixture(params=["ray", "wire"])
def transport(request) -> str:
    return request.param


@pytest.fixture
def queue(ray_local, transport):
    q = new_queue(transport)
    yield q
    q.close()
    ray.kill(q.handle)


def task(num_tokens: int = 10, *, cached: int = 0, priority=Priority.NORMAL, deadline=None,
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
    assert t.num_prefill_tokens == 68 and t.priority is Priority.HIGH and t.origin == "d0"
    assert task(priority=2).priority is Priority.LOW and task(priority=Priority.HIGH).priority is Priority.HIGH
    # The one serialiser: the wire's (msgpack maps of the fields, the priority as its int).
    body = asyncio.run(_read_frame(pack_frame(to_wire(t))))
    assert body["priority"] == 0 and type(body["priority"]) is int
    back = from_wire(PrefillTask, body, "task")
    assert back == t and back.priority is Priority.HIGH
    with pytest.raises(ValueError, match="cached_len"):
        task(10, cached=11)
    with pytest.raises(ValueError, match="high, normal, low"):
        task(priority="urgent")


async def _read_frame(frame: bytes):
    reader = asyncio.StreamReader()
    reader.feed_data(frame)
    reader.feed_eof()
    return await read_frame(reader)


def test_tasks_leave_by_priority_then_deadline_then_arrival(queue):
    now = time.time()
    puts = [
        task(request_id="low", priority=Priority.LOW, arrival=now - 9),
        task(request_id="normal-late-deadline", deadline=now + 60, arrival=now - 8),
        task(request_id="normal-no-deadline-old", arrival=now - 7),
        task(request_id="normal-no-deadline-new", arrival=now - 1),
        task(request_id="normal-early-deadline", deadline=now + 30, arrival=now),
        task(request_id="high", priority=Priority.HIGH, arrival=now),
    ]
    for t in puts:
        assert queue.put(t).ok
    batch = queue.get_batch("p0", max_tokens=10_000)
    assert ids(batch) == [
        "high", "normal-early-deadline", "normal-late-deadline",
        "normal-no-deadline-old", "normal-no-deadline-new", "low",
    ]


def test_batch_fills_the_token_budget_in_order_and_stops_at_the_first_misfit(queue):
    for n, rid in [(100, "a"), (200, "b"), (300, "c"), (50, "d")]:
        queue.put(task(n, request_id=rid, arrival=time.time()))
    assert ids(queue.get_batch("p0", max_tokens=350)) == ["a", "b"]
    assert ids(queue.get_batch("p0", max_tokens=350)) == ["c", "d"]
    assert queue.get_batch("p0", max_tokens=350) == []


def test_budget_counts_uncached_tokens_and_max_tasks_caps_the_batch(queue):
    for rid in "abc":
        queue.put(task(1000, cached=900, request_id=rid, arrival=time.time()))
    assert ids(queue.get_batch("p0", max_tokens=300)) == ["a", "b", "c"]
    for rid in "def":
        queue.put(task(10, request_id=rid, arrival=time.time()))
    assert ids(queue.get_batch("p0", max_tokens=300, max_tasks=2)) == ["d", "e"]


def test_a_task_larger_than_the_budget_is_still_handed_out_alone(queue):
    queue.put(task(5000, request_id="huge", arrival=1.0))
    queue.put(task(10, request_id="small", arrival=2.0))
    assert ids(queue.get_batch("p0", max_tokens=512)) == ["huge"]
    assert ids(queue.get_batch("p0", max_tokens=512)) == ["small"]


def test_get_batch_waits_for_the_first_task_up_to_max_wait_ms(queue):
    started = time.monotonic()
    assert queue.get_batch("p0", max_tokens=100, max_wait_ms=200) == []
    assert time.monotonic() - started >= 0.2
    waiting = queue.submit("get_batch", "p0", max_tokens=100, max_wait_ms=5000)
    time.sleep(0.2)
    put_at = time.monotonic()
    queue.put(task(request_id="late"))
    assert ids(waiting.result(timeout=10)) == ["late"]
    assert time.monotonic() - put_at < 1.0  # woken by the put, not by the timeout


def test_cancel_removes_a_queued_task_and_reports_in_flight_ones(queue):
    for rid in ["keep", "drop", "taken"]:
        queue.put(task(request_id=rid, priority=0 if rid == "taken" else 1))
    assert ids(queue.get_batch("p0", max_tokens=10)) == ["taken"]
    assert queue.cancel("drop") == "queued"
    assert queue.cancel("taken") == "in_flight"
    assert queue.cancel("never-seen") == "unknown"
    assert ids(queue.get_batch("p1", max_tokens=1000)) == ["keep"]
    stats = queue.stats()
    assert stats.depth == 0 and stats.in_flight == {"p1": 1} and stats.counters["cancelled"] == 2
    assert queue.worker_gone("p0")["requeued"] == 0  # a cancelled task is not requeued


def test_a_worker_learns_from_its_next_beat_which_held_tasks_were_cancelled(queue):
    """Over both transports: a cancel of a task a worker holds is told to that worker (only to
    it, once), so it can stop computing it; a cancel of a queued task tells nobody."""
    for rid in ["a", "b", "queued"]:
        queue.put(task(request_id=rid, priority=0 if rid != "queued" else 1))
    assert ids(queue.get_batch("p0", max_tokens=20)) == ["a", "b"]
    instance = queue.instance_id()
    assert queue.beat("p0") == {"instance": instance, "cancelled": []}
    assert queue.cancel("b") == "in_flight" and queue.cancel("queued") == "queued"
    assert queue.beat("p1") == {"instance": instance, "cancelled": []}
    assert queue.beat("p0") == {"instance": instance, "cancelled": [["b", 0]]}
    assert queue.beat("p0")["cancelled"] == []
    # The worker stops computing it and, its writes over, fails it: the origin frees its blocks.
    assert not queue.fail("p1", "b", "cancelled", "not its task")
    assert queue.fail("p0", "b", "cancelled", "stopped at step 3")
    (failed,) = queue.take_failed("d0")
    assert (failed.task.request_id, failed.reason, failed.detail) == ("b", "cancelled", "stopped at step 3")
    assert not queue.fail("p0", "b", "cancelled")  # once
    queue.cancel("a")
    queue.complete("p0", ["a", "b"])  # the batch is over before the next beat: nothing left to tell
    assert queue.beat("p0")["cancelled"] == [] and queue.stats().in_flight == {}
    assert not queue.fail("p0", "a", "cancelled") and queue.take_failed("d0") == []


def test_put_is_refused_explicitly_when_full_duplicate_or_late(ray_local, transport):
    small = new_queue(transport, capacity=2)
    try:
        assert small.put(task(request_id="a")).ok
        assert small.put(task(request_id="b")).ok
        full = small.put(task(request_id="c"))
        assert (full.ok, full.reason, full.depth) == (False, "queue_full", 2)
        assert small.put(task(request_id="a")).reason == "duplicate"
        assert small.put(task(request_id="x", deadline=time.time() - 1)).reason == "deadline_passed"
        assert small.put(task(10, cached=10, request_id="y")).reason == "nothing_to_prefill"
        counters = small.stats().counters
        assert counters["rejected_queue_full"] == 1 and counters["put"] == 2
    finally:
        small.close()
        ray.kill(small.handle)


def test_a_vanished_workers_tasks_are_requeued_once_then_failed_back_to_their_origin(queue):
    queue.put(task(request_id="a", target="d0", arrival=1.0))
    queue.put(task(request_id="b", target="d1", arrival=2.0))
    queue.put(task(request_id="c", target="d0", arrival=3.0))
    assert ids(queue.get_batch("p0", max_tokens=20)) == ["a", "b"]
    assert queue.worker_gone("p0") == {
        "requeued": 2, "failed": 0, "dropped_queued": 0, "dropped_failed": 0}
    # Requeued tasks keep their place ahead of later arrivals.
    assert ids(queue.get_batch("p1", max_tokens=30)) == ["a", "b", "c"]
    assert queue.complete("p1", "c")
    assert queue.worker_gone("p1")["failed"] == 2
    failed = queue.take_failed("d0")
    assert ids(f.task for f in failed) == ["a"] and failed[0].reason == "worker_vanished"
    # The decode worker's periodic poll: its failed tasks and the stats in one call.
    failed_d1, stats = queue.take_failed_and_stats("d1")
    assert ids(f.task for f in failed_d1) == ["b"] and stats.failed_pending == 0 and stats.depth == 0
    assert queue.take_failed("d0") == []  # taken once
    assert queue.worker_gone("p1")["failed"] == 0  # idempotent


def test_stats_report_depth_tokens_wait_and_in_flight_per_worker(queue):
    queue.put(task(100, cached=20))
    queue.put(task(50))
    queue.put(task(70))
    batch = queue.get_batch("p0", max_tokens=80)
    time.sleep(0.05)
    stats = queue.stats()
    assert (stats.depth, stats.queued_tokens, stats.in_flight, stats.in_flight_tokens) == (2, 120, {"p0": 1}, 80)
    assert stats.oldest_wait_ms >= 50 and stats.capacity == 64
    assert queue.complete("p0", [t.request_id for t in batch])  # a whole batch at once
    assert queue.stats().in_flight == {}
    # Or piggybacked on the next request, as a prefill worker's loop does.
    batch = queue.get_batch("p0", max_tokens=50)
    assert queue.stats().in_flight == {"p0": 1}
    queue.get_batch("p0", max_tokens=1, completed=[t.request_id for t in batch])
    assert queue.stats().in_flight == {"p0": 1}  # the old one done, a new one taken
    assert queue.stats().counters["completed"] == 2


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


def test_a_worker_not_heard_from_within_the_stall_bound_has_its_tasks_failed_back():
    """Liveness beyond the lease: p0 took a task and then went silent (hung, SIGSTOPped),
    p1 took one and keeps calling `alive`. Past the bound only p0's task is failed back,
    unsettled (WORKER_STALLED: p0 may resume and write), and p0's late complete is a no-op."""
    now = [1000.0]
    core = QueueCore(capacity=8, clock=lambda: now[0], stall_s=3.0)
    for rid in ("held-by-p0", "held-by-p1"):
        assert core.put(task(request_id=rid, deadline=5000.0)).ok
    assert ids(core.take("p0", max_tokens=10)) == ["held-by-p0"]
    assert ids(core.take("p1", max_tokens=10)) == ["held-by-p1"]
    for t in (1001.0, 1002.0, 1002.9):
        now[0] = t
        assert core.alive("p1") == core.instance_id
        assert core.fail_stalled() == {}
    now[0] = 1003.6  # p0: 3.6 s silent; p1: 0.7 s
    assert core.fail_stalled() == {"p0": 1}
    [failed] = core.take_failed("d0")
    assert failed.task.request_id == "held-by-p0" and failed.reason == "worker_stalled"
    assert "not been heard from" in failed.detail and "not been heard from" in core.stalled_why["p0"]
    assert core.counters["stalled_silent"] == 1 and core.counters["stalled_compute"] == 0
    assert core.stats().in_flight == {"p1": 1}
    assert core.complete("p0", "held-by-p0") is False  # resumed too late: nothing to complete
    assert core.put(task(request_id="held-by-p0", deadline=5000.0)).reason == "already_done"


def test_liveness_comes_from_progress_and_queued_tasks_fail_back_when_nobody_is_live():
    """`live_workers` counts the prefill workers heard from within the stall bound, whatever
    their etcd leases say. When none is, a task queued longer than the bound is failed back
    as no_live_worker (settled: nobody took it), so its decode worker frees its blocks and
    prefills locally instead of waiting for the deadline."""
    now = [1000.0]
    core = QueueCore(capacity=8, clock=lambda: now[0], stall_s=3.0)
    assert core.stats().live_workers == 0
    core.alive("p0")
    assert core.stats().live_workers == 1
    assert core.put(task(request_id="waits", deadline=5000.0)).ok
    now[0] = 1002.0
    assert core.fail_stalled() == {} and len(core) == 1  # p0 is live: it may still take it
    now[0] = 1003.5  # p0 silent for 3.5 s, the task queued for 3.5 s
    assert core.stats().live_workers == 0
    assert core.fail_stalled() == {"": 1} and len(core) == 0
    [failed] = core.take_failed("d0")
    assert failed.task.request_id == "waits" and failed.reason == "no_live_worker"


def test_a_requeued_task_is_never_failed_back_as_untaken():
    """A task requeued after its worker left the registry may still be held by that worker
    (partitioned, stopped): failed back for want of a live worker or by its deadline, it
    goes as worker_vanished (its decode worker quarantines), never as an untaken task."""
    now = [1000.0]
    core = QueueCore(capacity=8, clock=lambda: now[0], stall_s=3.0)
    assert core.put(task(request_id="held", deadline=1010.0)).ok
    assert core.put(task(request_id="plain", deadline=1010.0)).ok
    assert ids(core.take("p0", max_tokens=10)) == ["held"]
    assert core.worker_gone("p0")["requeued"] == 1
    now[0] = 1004.0  # nobody live for 4 s: both fail back
    assert core.fail_stalled() == {"": 2}
    assert {f.task.request_id: f.reason for f in core.take_failed("d0")} == {
        "held": "worker_vanished", "plain": "no_live_worker"}


def progress(steps: int, since_s: float, within_s: float) -> dict:
    """A beat's compute progress (common/compute_thread.py `ComputeProgress.snapshot`)."""
    return {"steps": steps, "since_s": since_s, "within_s": within_s}


def beat_until(core, now, worker_id: str, until: float, steps: int, stuck_since: float, within_s: float):
    """`worker_id` beats every 0.25 s up to `until` (as its event loop does), reporting a
    compute that has made no progress since `stuck_since`; what `fail_stalled` did meanwhile."""
    failed = {}
    while now[0] + 0.25 <= until + 1e-9:
        now[0] += 0.25
        core.beat(worker_id, progress(steps, now[0] - stuck_since, within_s))
        failed.update(core.fail_stalled())
    return failed


def test_a_worker_that_beats_but_whose_compute_stands_still_has_its_tasks_failed_back():
    """p0's event loop beats every 0.25 s, but its compute thread is hung in a step: the
    progress it reports stands still (7 marks), its age grows. Past the progress bound
    (max(stall bound 3 s, its allowance 0.5 s) = 3 s) its task is failed back as
    worker_stalled, counted as a compute stall apart from silence, and p0 is not live though
    it beats. p1, whose progress advances, keeps its task."""
    now = [1000.0]
    core = QueueCore(capacity=8, clock=lambda: now[0], stall_s=3.0)
    for rid in ("held-by-p0", "held-by-p1"):
        assert core.put(task(request_id=rid, deadline=5000.0)).ok
    assert ids(core.take("p0", max_tokens=10)) == ["held-by-p0"]
    assert ids(core.take("p1", max_tokens=10)) == ["held-by-p1"]
    core.beat("p0", progress(7, 0.0, 0.5))
    core.beat("p1", progress(1, 0.0, 0.5))
    assert beat_until(core, now, "p0", 1003.0, 7, 1000.0, 0.5) == {}  # at the bound, not past it
    core.beat("p1", progress(9, 0.1, 0.5))  # p1 advances
    assert core.stats().live_workers == 2
    assert beat_until(core, now, "p0", 1003.25, 7, 1000.0, 0.5) == {"p0": 1}
    [failed] = core.take_failed("d0")
    assert failed.task.request_id == "held-by-p0" and failed.reason == "worker_stalled"
    assert "still beats" in failed.detail and "progress bound 3 s" in failed.detail, failed.detail
    assert core.stalled_why["p0"] == failed.detail
    assert core.counters["stalled_compute"] == 1 and core.counters["stalled_silent"] == 0
    assert core.stats().in_flight == {"p1": 1}
    core.beat("p1", progress(12, 0.05, 0.5))
    # Beating on, still stuck: not live (a decode worker routes elsewhere), nothing more to fail.
    assert beat_until(core, now, "p0", 1004.0, 7, 1000.0, 0.5) == {}
    core.beat("p1", progress(15, 0.05, 0.5))
    assert core.stats().live_workers == 1
    # Its step ends at last: progress advances, it is live again; its late complete is a no-op.
    core.beat("p0", progress(8, 0.0, 0.5))
    assert core.stats().live_workers == 2
    assert core.complete("p0", "held-by-p0") is False


def test_the_progress_bound_is_the_workers_own_allowance_when_longer_than_the_stall_bound():
    """A worker whose next step is predicted long (its allowance, 8 s: a multiple of its
    slowest step, or a write's timeout) is not failed back at the 3 s stall bound, but only
    past its allowance; a silent worker is still held to the stall bound."""
    now = [1000.0]
    core = QueueCore(capacity=8, clock=lambda: now[0], stall_s=3.0)
    assert core.put(task(request_id="long", deadline=5000.0)).ok
    assert ids(core.take("p0", max_tokens=10)) == ["long"]
    core.beat("p0", progress(3, 0.0, 8.0))
    assert beat_until(core, now, "p0", 1008.0, 3, 1000.0, 8.0) == {}
    assert core.stats().live_workers == 1
    assert beat_until(core, now, "p0", 1008.25, 3, 1000.0, 8.0) == {"p0": 1}
    assert "progress bound 8 s" in core.take_failed("d0")[0].detail


def test_advancing_progress_or_a_finished_batch_is_never_a_compute_stall():
    """Progress that advances within its bound, a beat without progress (the compute thread
    runs nothing of the batch yet: judged by silence alone) and a worker that took or
    completed since its last stuck-looking beat (the batch is over) are not compute stalls."""
    now = [1000.0]
    core = QueueCore(capacity=8, clock=lambda: now[0], stall_s=3.0)
    assert core.put(task(request_id="a", deadline=5000.0)).ok
    assert ids(core.take("p0", max_tokens=10)) == ["a"]
    for i in range(40):  # 10 s of steps of 2 s each, beaten every 0.25 s
        now[0] += 0.25
        core.beat("p0", progress(i // 8, (i % 8) * 0.25, 0.5))
        assert core.fail_stalled() == {}
    for _ in range(20):  # 5 s before the compute thread starts the batch: no progress to judge
        now[0] += 0.25
        core.beat("p0")
        assert core.fail_stalled() == {}
    assert core.stats().in_flight == {"p0": 1}
    core.beat("p0", progress(50, 2.9, 0.5))  # a record about to pass its bound ...
    assert core.complete("p0", "a")  # ... but the batch is over
    now[0] += 5
    assert core.alive("p0") and core.stats().live_workers == 1
    assert core.put(task(request_id="b", deadline=5000.0)).ok
    core.beat("p0", progress(50, 2.9, 0.5))
    assert ids(core.take("p0", max_tokens=10)) == ["b"]  # pulling: its previous batch is over
    now[0] += 1
    assert core.fail_stalled() == {} and core.stats().live_workers == 1


@pytest.mark.parametrize("bad", [
    {"steps": 1, "since_s": 0.0},
    {"steps": -1, "since_s": 0.0, "within_s": 0.0},
    {"steps": True, "since_s": 0.0, "within_s": 0.0},
    {"steps": 1, "since_s": float("nan"), "within_s": 0.0},
    {"steps": 1, "since_s": 0.0, "within_s": float("inf")},
    {"steps": 1, "since_s": "0", "within_s": 0.0},
    {"steps": 1, "since_s": 0.0, "within_s": 0.0, "extra": 1},
    [1, 0.0, 0.0],
])
def test_a_malformed_progress_is_refused_and_that_beat_does_not_count(bad):
    now = [1000.0]
    core = QueueCore(capacity=8, clock=lambda: now[0], stall_s=3.0)
    with pytest.raises(ValueError, match="progress"):
        core.beat("p0", bad)
    assert core.stats().live_workers == 0


def test_a_beat_carries_the_compute_progress_over_both_transports(queue):
    """The heartbeat with progress, over Ray calls and over the wire (a plain msgpack map, no
    pickle): the answer is the usual one, the queue keeps the record, and the beat without it
    (a worker of an earlier version) is still served."""
    queue.put(task(request_id="a"))
    assert ids(queue.get_batch("p0", max_tokens=20)) == ["a"]
    instance = queue.instance_id()
    assert queue.beat("p0", progress(4, 0.1, 2.0)) == {"instance": instance, "cancelled": []}
    assert queue.beat("p0") == {"instance": instance, "cancelled": []}
    stats = queue.stats()
    assert stats.live_workers == 1 and stats.in_flight == {"p0": 1}
    with pytest.raises(QueueCallError, match="ValueError: beat: progress.since_s"):  # typed, both ways
        queue.beat("p0", progress(4, -1.0, 2.0))


async def test_worker_removed_from_the_registry_gets_its_tasks_requeued(ray_local, transport, etcd, cluster_name):
    handle = get_or_create_queue(f"q-{uuid.uuid4().hex[:8]}", "pdserve-tests", capacity=64)
    client = QueueClient(handle, transport)  # on this test's event loop, as in a decode worker
    async with Registry(etcd.endpoint, cluster_name, ttl_s=2.0, backoff_initial_s=0.05) as janitor_reg, \
            Registry(etcd.endpoint, cluster_name, ttl_s=2.0) as p0:
        view = await requeue_on_worker_loss(janitor_reg, client, grace_s=0.1)
        await p0.register(WorkerInfo("p0", "prefill"))
        await view.wait_for(lambda m: "p0" in m, timeout_s=5)
        await client.put(task(request_id="a"))
        assert ids(await client.get_batch("p0", max_tokens=100)) == ["a"]
        await p0.deregister()

        async def requeued():
            while (await client.stats()).depth != 1:
                await asyncio.sleep(0.02)

        await asyncio.wait_for(requeued(), timeout=5)
        assert ids(await client.get_batch("p1", max_tokens=100)) == ["a"]
        assert client.in_use == transport
    await client.close()
    ray.kill(handle)


def test_a_poll_left_behind_by_a_vanished_worker_takes_nothing(queue):
    # A prefill worker killed while its get_batch waits: the call lives on in the queue actor.
    orphan = queue.submit("get_batch", "p-dead", 100, 5000)
    time.sleep(0.3)  # the poll is waiting in the actor
    queue.worker_gone("p-dead")
    assert orphan.result(timeout=10) == []  # woken and ended empty, not after its 5 s
    assert queue.put(task(request_id="late")).ok
    # The task stays queued for a live worker instead of going to the dead one.
    assert ids(queue.get_batch("p-live", 100)) == ["late"]
    assert queue.stats().in_flight == {"p-live": 1}
    # A poll the same worker id starts afterwards (a restarted worker) is served again.
    assert queue.put(task(request_id="again")).ok
    assert ids(queue.get_batch("p-dead", 100, 1000)) == ["again"]


def test_a_worker_fails_a_task_it_holds_back_to_its_origin_with_the_kind(queue):
    queue.put(task(request_id="a", target="d0"))
    queue.put(task(request_id="b", target="d0"))
    assert ids(queue.get_batch("p0", max_tokens=30)) == ["a", "b"]
    assert queue.fail("p0", "a", "transfer_error", "UCX endpoint closed")
    assert not queue.fail("p1", "b", "bad_task")  # p1 does not hold it
    failed = queue.take_failed("d0")
    assert [(f.task.request_id, f.reason, f.detail) for f in failed] == [("a", "transfer_error", "UCX endpoint closed")]
    assert queue.stats().in_flight == {"p0": 1}


def test_fail_refuses_a_reason_that_is_not_a_short_name():
    core = QueueCore()
    core.put(task(request_id="a"))
    core.take("p0", 100)
    for reason in ("", "x" * 65, None):
        with pytest.raises(ValueError, match="reason"):
            core.fail("p0", "a", reason)
    assert core.fail("p0", "a", "bad_task", "temperature: must be a finite number")


def test_a_restarted_queue_reports_a_new_instance_and_held_tasks_are_not_handed_out_twice(ray_local, transport):
    """A restart loses the queue's state; a prefill worker reports what it holds (`hold`) and
    a decode worker re-puts what it awaits: the held one is a duplicate, the other runs once."""
    q = new_queue(transport)
    try:
        a, b = task(request_id="a"), task(request_id="b")
        q.put(a)
        q.put(b)
        assert ids(q.get_batch("p0", max_tokens=10, max_tasks=1)) == ["a"]
        before = q.stats()
        ray.kill(q.handle, no_restart=False)
        wait_for = time.monotonic() + 60
        while True:
            try:  # ray.kill returns at once: the old instance may still answer first
                if ray.get(q.handle.stats.remote(), timeout=5).instance_id != before.instance_id:
                    break
            except Exception:  # noqa: BLE001  (restarting)
                assert time.monotonic() < wait_for, "the queue did not come back"
                time.sleep(0.2)
        after = q.stats()
        assert after.instance_id != before.instance_id and after.depth == 0 and after.recovering
        assert q.put(b).ok
        assert q.put(a).ok  # re-put before its holder reported: queued, not yet handed out
        assert q.get_batch("p1", max_tokens=100, max_wait_ms=100) == []  # recovering: nothing out
        assert q.hold("p0", [a]) == 1  # the holder takes its task out of the queue
        assert q.put(a).reason == "duplicate"
        # Until its recovery grace (RECOVERY_GRACE_S from the restart) has passed, nothing goes out.
        grace_ends = time.monotonic() + 10
        while q.stats().recovering:
            assert time.monotonic() < grace_ends, "the queue never left its recovery grace"
            time.sleep(0.05)
        assert ids(q.get_batch("p1", max_tokens=100)) == ["b"]
        assert q.stats().in_flight == {"p0": 1, "p1": 1}
        assert q.complete("p0", "a")
    finally:
        q.close()
        ray.kill(q.handle)


class RecordingHandle:
    """An actor handle that records which actor methods a client calls over Ray."""

    def __init__(self, handle):
        self._handle, self.called = handle, []

    def __getattr__(self, name):
        self.called.append(name)
        return getattr(self._handle, name)


def test_the_ray_fallback_moves_only_coded_bytes(ray_local):
    """Over Ray the client calls one actor method, `call_coded`, with msgpack bytes, and gets
    bytes back: no task, result or exception object is pickled across nodes. A task round-trips
    exactly, and an actor's error comes back typed."""
    from pdserve.cluster.queue.frames import unpack_body
    from pdserve.cluster.queue.operations import pack_call

    q = new_queue("ray")
    recorder = RecordingHandle(q.handle)
    q.client.handle = recorder
    try:
        sent = task(request_id="coded", cached=2, deadline=time.time() + 60)
        assert q.put(sent).ok
        (got,) = q.get_batch("p0", max_tokens=100)
        assert got == sent
        with pytest.raises(QueueCallError, match="ValueError"):
            q.beat("p0", progress(4, -1.0, 2.0))
        assert set(recorder.called) == {"call_coded"}, recorder.called
        raw = ray.get(q.handle.call_coded.remote(pack_call("stats", [])), timeout=30)
        assert isinstance(raw, bytes) and unpack_body(raw, "stats")["ok"] is True
        bad = unpack_body(ray.get(q.handle.call_coded.remote(b"\xc1not msgpack"), timeout=30), "bad")
        assert bad["ok"] is False and bad["error"]["type"] == "WireError"
    finally:
        q.close()
        ray.kill(q.handle)
