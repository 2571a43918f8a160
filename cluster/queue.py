"""The prefill queue: decode workers put `PrefillTask`s, prefill workers pull batches.

`QueueCore` is the whole policy, pure and synchronous (no Ray, no waiting), so
it reads top to bottom and is testable with plain values. `PrefillQueue` is the
named Ray actor around it: it adds the long poll of `get_batch` and nothing
else. `requeue_on_worker_loss` connects it to the registry.

Ordering: tasks leave in (priority, deadline, arrival_time) order. Priority is
an int, lower = more urgent (`PRIORITY_HIGH`=0, `PRIORITY_NORMAL`=1,
`PRIORITY_LOW`=2; `priority_value("high")` maps the names). A task without a
deadline sorts after every task with one at the same priority. Deadlines and
arrival times are absolute unix seconds from the producer's clock (hosts are
assumed NTP-synchronised).

Batching: `get_batch` takes tasks in that order while their prefill tokens
(`len(token_ids) - cached_len`) fit `max_tokens`, and stops at the first one
that does not fit, so a long prompt is never overtaken indefinitely by short
ones. A batch always holds at least one task when any is queued, even if that
task alone exceeds `max_tokens`: otherwise a prompt longer than the budget
would starve forever. Tasks whose deadline has passed are never handed out;
they are failed back to their origin with reason "deadline_expired".

Restarts: the actor is created with Ray `max_restarts`, so a dead queue comes
back empty under a new `instance_id` (in `stats()`). Decode workers notice the
new id and re-put the tasks they still await; prefill workers report the tasks
they hold (`hold`), and for `RECOVERY_GRACE_S` after a restart the queue hands
out nothing, so a task that a prefill worker already holds is never handed to
a second one (see docs/cluster.md, "The queue restarts").
"""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
import logging
import math
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import ray

from .keys import DEFAULT_NAMESPACE, DEFAULT_QUEUE_CAPACITY, DEFAULT_QUEUE_NAME

if TYPE_CHECKING:
    from .registry import Registry

log = logging.getLogger(__name__)

PRIORITY_HIGH, PRIORITY_NORMAL, PRIORITY_LOW = 0, 1, 2
WIRE_BINDS = ("loopback", "node", "off")
PRIORITY_NAMES = {"high": PRIORITY_HIGH, "normal": PRIORITY_NORMAL, "low": PRIORITY_LOW}
MAX_FAILED_PER_ORIGIN = 10_000  # failed tasks nobody collects must not grow without bound
MAX_FAIL_REASON_CHARS = 64
MAX_FAIL_DETAIL_CHARS = 300
# After a restart, how long the queue hands out nothing: prefill workers check the queue's
# instance every HOLD_CHECK_S while they hold a batch and report it (`hold`) well within it.
RECOVERY_GRACE_S = 2.0
QUEUE_MAX_RESTARTS = -1  # Ray restarts the queue actor without limit (it holds no state worth a crash loop)

# Why put() refused a task.
QUEUE_FULL, DUPLICATE, DEADLINE_PASSED, NOTHING_TO_PREFILL = (
    "queue_full", "duplicate", "deadline_passed", "nothing_to_prefill")


def priority_value(priority: int | str) -> int:
    """An int priority as is, or the int for "high" / "normal" / "low"."""
    if isinstance(priority, str):
        try:
            return PRIORITY_NAMES[priority.lower()]
        except KeyError:
            raise ValueError(f"priority {priority!r} must be an int or one of {sorted(PRIORITY_NAMES)}") from None
    return int(priority)


@dataclass
class PrefillTask:
    """One remote-prefill request, from a decode worker to the prefill pool.

    The prefill worker computes KV for positions [cached_len, len(token_ids))
    and writes it into `target_block_ids` of `target_worker_id`; the
    completion it sends carries (request_id, epoch), so the decode worker can
    ignore late results of an abandoned attempt. `origin` (default: the
    target) is where failed tasks are returned, via `take_failed(origin)`.
    """

    request_id: str
    epoch: int
    token_ids: list[int]
    cached_len: int
    target_worker_id: str
    target_block_ids: list[int]
    sampling_params: dict[str, Any] = field(default_factory=dict)
    priority: int = PRIORITY_NORMAL
    deadline: float | None = None  # absolute unix time; None = no deadline
    arrival_time: float = field(default_factory=time.time)
    origin: str = ""

    def __post_init__(self) -> None:
        self.priority = priority_value(self.priority)
        if not 0 <= self.cached_len <= len(self.token_ids):
            raise ValueError(f"cached_len={self.cached_len} outside [0, {len(self.token_ids)}]")
        if not self.origin:
            self.origin = self.target_worker_id

    @property
    def num_prefill_tokens(self) -> int:
        return len(self.token_ids) - self.cached_len

    @property
    def key(self) -> tuple[str, int]:
        return (self.request_id, self.epoch)

    def sort_key(self) -> tuple[int, float, float]:
        return (self.priority, math.inf if self.deadline is None else self.deadline, self.arrival_time)

    def to_dict(self) -> dict[str, Any]:
        """JSON/msgpack-ready form (the queue wire's). Shallow: the lists are shared, not copied."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> "PrefillTask":
        return cls(**body)


@dataclass(frozen=True)
class PutResult:
    """put()'s answer: `ok`, or the refusal `reason` (QUEUE_FULL, DUPLICATE, ...)."""

    ok: bool
    reason: str | None = None
    depth: int = 0  # tasks queued after this put


@dataclass(frozen=True)
class FailedTask:
    """A task handed back to its origin: the origin prefills locally instead."""

    task: PrefillTask
    # "deadline_expired" | "worker_vanished" | "target_gone", or the failure kind a prefill
    # worker gave with `fail` (kvtransfer.messages.FAILURE_KINDS)
    reason: str
    detail: str
    failed_at: float


@dataclass(frozen=True)
class QueueStats:
    """A snapshot for routers (queue depth, token backlog) and operators."""

    depth: int
    queued_tokens: int
    oldest_wait_ms: float  # 0 when empty; measured on the queue's own clock
    in_flight: dict[str, int]  # worker_id -> tasks taken and not completed
    in_flight_tokens: int
    failed_pending: int  # failed tasks not yet taken by their origin
    capacity: int
    counters: dict[str, int]  # put, rejected_<reason>, dispatched, completed, requeued, failed_<reason>, ...
    instance_id: str = ""  # new on every start of the queue actor: a change means its state was lost
    recovering: bool = False  # just restarted: handing out nothing until held tasks are reported
    metrics: str = ""  # "host:port" of the actor's Prometheus /metrics, "" when off


class QueueCore:
    """Ordering, budgeted batching, in-flight accounting and fail-back; no I/O.

    Owns the heap of queued tasks (lazy deletion on cancel), the tasks each
    worker has taken, how often each task was requeued, and the failed tasks
    waiting for their origin.
    """

    def __init__(self, capacity: int = DEFAULT_QUEUE_CAPACITY, *, max_requeues: int = 1,
                 clock: Callable[[], float] = time.time, on_dispatch: Callable[[float], None] | None = None):
        if capacity < 1:
            raise ValueError(f"capacity={capacity} must be >= 1")
        self.instance_id = uuid.uuid4().hex[:12]
        self.capacity = capacity
        self.max_requeues = max_requeues
        self._clock = clock
        self._heap: list[tuple[tuple, int, tuple[str, int]]] = []
        self._seq = 0
        self._queued: dict[tuple[str, int], tuple[int, PrefillTask, float]] = {}  # key -> (seq, task, enqueued_at)
        self._queued_tokens = 0
        self._in_flight: dict[str, dict[tuple[str, int], PrefillTask]] = {}
        self._requeues: Counter = Counter()
        self._failed: dict[str, list[FailedTask]] = {}
        self._gone: Counter = Counter()  # worker_id -> how often worker_gone was called for it
        self.counters: Counter = Counter()
        self.on_dispatch = on_dispatch  # called with each dispatched task's queue wait (s)

    def __len__(self) -> int:
        return len(self._queued)

    def put(self, task: PrefillTask) -> PutResult:
        reason = None
        if task.num_prefill_tokens <= 0:
            reason = NOTHING_TO_PREFILL
        elif task.key in self._queued or any(task.key in tasks for tasks in self._in_flight.values()):
            reason = DUPLICATE
        elif task.deadline is not None and task.deadline <= self._clock():
            reason = DEADLINE_PASSED
        elif len(self._queued) >= self.capacity:
            reason = QUEUE_FULL
        if reason is not None:
            self.counters[f"rejected_{reason}"] += 1
            return PutResult(False, reason, len(self._queued))
        self._push(task)
        self.counters["put"] += 1
        return PutResult(True, None, len(self._queued))

    def _push(self, task: PrefillTask) -> None:
        self._seq += 1
        self._queued[task.key] = (self._seq, task, self._clock())
        self._queued_tokens += task.num_prefill_tokens
        heapq.heappush(self._heap, (task.sort_key(), self._seq, task.key))

    def _pop_head(self) -> PrefillTask | None:
        """The most urgent live task without removing it (drops stale heap entries)."""
        while self._heap:
            _, seq, key = self._heap[0]
            entry = self._queued.get(key)
            if entry is not None and entry[0] == seq:
                return entry[1]
            heapq.heappop(self._heap)  # cancelled or superseded
        return None

    def _remove(self, task: PrefillTask) -> None:
        del self._queued[task.key]
        self._queued_tokens -= task.num_prefill_tokens

    def take(self, worker_id: str, max_tokens: int, max_tasks: int | None = None) -> list[PrefillTask]:
        """The next batch for `worker_id` (see the module docstring); [] if none queued."""
        now = self._clock()
        batch: list[PrefillTask] = []
        tokens = 0
        while (task := self._pop_head()) is not None:
            if task.deadline is not None and task.deadline <= now:
                self._remove(task)
                self._fail(task, "deadline_expired", "deadline passed before any worker took it")
                continue
            if batch and (tokens + task.num_prefill_tokens > max_tokens
                          or (max_tasks is not None and len(batch) >= max_tasks)):
                break
            if self.on_dispatch is not None:
                self.on_dispatch(max(0.0, now - self._queued[task.key][2]))
            self._remove(task)
            batch.append(task)
            tokens += task.num_prefill_tokens
        if batch:
            taken = self._in_flight.setdefault(worker_id, {})
            for task in batch:
                taken[task.key] = task
            self.counters["dispatched"] += len(batch)
        return batch

    def complete(self, worker_id: str, request_id: str | list[str]) -> bool:
        """The worker finished (or gave up on) a task, or a list of them: stop
        tracking them. True if any was in flight on that worker."""
        wanted = {request_id} if isinstance(request_id, str) else set(request_id)
        taken = self._in_flight.get(worker_id, {})
        keys = [key for key in taken if key[0] in wanted]
        for key in keys:
            del taken[key]
            self._requeues.pop(key, None)
        if not taken:
            self._in_flight.pop(worker_id, None)
        self.counters["completed"] += len(keys)
        return bool(keys)

    def cancel(self, request_id: str) -> str:
        """"queued" if removed before any worker took it, "in_flight" if a worker
        already has it (it will not be requeued; its result will be ignored by
        epoch), "unknown" otherwise. Covers every epoch of the request."""
        queued = [entry[1] for key, entry in self._queued.items() if key[0] == request_id]
        for task in queued:
            self._remove(task)
        in_flight = False
        for worker_id in list(self._in_flight):
            taken = self._in_flight[worker_id]
            for key in [k for k in taken if k[0] == request_id]:
                del taken[key]
                self._requeues.pop(key, None)
                in_flight = True
            if not taken:
                del self._in_flight[worker_id]
        if queued or in_flight:
            self.counters["cancelled"] += 1
        return "queued" if queued else "in_flight" if in_flight else "unknown"

    def worker_gone(self, worker_id: str) -> dict[str, int]:
        """A worker left the registry. Tasks it had taken are requeued (at their
        original place in the order) up to `max_requeues` times, then failed
        back to their origin. Queued tasks whose KV target it was are dropped
        (failed back if their origin is another worker), and failed tasks
        waiting for it are discarded. Idempotent."""
        requeued = failed = 0
        for key, task in self._in_flight.pop(worker_id, {}).items():
            if self._requeues[key] < self.max_requeues:
                self._requeues[key] += 1
                self._push(task)  # bypasses capacity: it was admitted once already
                requeued += 1
            else:
                self._requeues.pop(key, None)
                self._fail(task, "worker_vanished",
                           f"prefill worker {worker_id} vanished holding it after {self.max_requeues} requeue(s)")
                failed += 1
        orphans = [entry[1] for entry in self._queued.values() if entry[1].target_worker_id == worker_id]
        for task in orphans:
            self._remove(task)
            if task.origin != worker_id:
                self._fail(task, "target_gone", f"decode worker {worker_id} that was to receive its KV is gone")
        dropped_failed = len(self._failed.pop(worker_id, []))
        self._gone[worker_id] += 1
        self.counters["requeued"] += requeued
        self.counters["dropped_target_gone"] += len(orphans)
        return {"requeued": requeued, "failed": failed, "dropped_queued": len(orphans),
                "dropped_failed": dropped_failed}

    def _fail(self, task: PrefillTask, reason: str, detail: str) -> None:
        pending = self._failed.setdefault(task.origin, [])
        pending.append(FailedTask(task, reason, detail, self._clock()))
        del pending[:-MAX_FAILED_PER_ORIGIN]
        self.counters[f"failed_{reason}"] += 1

    def take_failed(self, origin: str) -> list[FailedTask]:
        return self._failed.pop(origin, [])

    def fail(self, worker_id: str, request_id: str, reason: str, detail: str = "") -> bool:
        """`worker_id` gives up on a task it holds and cannot tell the target itself (no NIXL
        channel to it): the task goes to its origin's failed list with `reason`, where the
        origin's poll finds it and prefills locally at once. False if the worker holds no
        such task (cancelled or already failed back)."""
        if not isinstance(reason, str) or not reason or len(reason) > MAX_FAIL_REASON_CHARS:
            raise ValueError(f"fail: reason must be a non-empty str of at most {MAX_FAIL_REASON_CHARS} "
                             f"chars, got {reason!r}")
        if not isinstance(detail, str):
            raise ValueError(f"fail: detail must be a str, got {type(detail).__name__}")
        taken = self._in_flight.get(worker_id, {})
        keys = [key for key in taken if key[0] == request_id]
        for key in keys:
            self._requeues.pop(key, None)
            self._fail(taken.pop(key), reason, detail[:MAX_FAIL_DETAIL_CHARS])
        if not taken:
            self._in_flight.pop(worker_id, None)
        return bool(keys)

    def hold(self, worker_id: str, tasks: list[PrefillTask]) -> int:
        """`worker_id` still holds `tasks`, taken from an earlier instance of this queue (it
        restarted while they were in flight): track them as in flight on that worker, taking a
        copy that a decode worker re-put out of the queue, so nobody else prefills them.
        Returns how many were not tracked as in flight on that worker before."""
        taken = self._in_flight.setdefault(worker_id, {})
        new = 0
        for task in tasks:
            if task.key in taken or any(task.key in t for w, t in self._in_flight.items() if w != worker_id):
                continue
            if task.key in self._queued:
                self._remove(self._queued[task.key][1])
            taken[task.key] = task
            new += 1
        if not taken:
            self._in_flight.pop(worker_id, None)
        self.counters["held_after_restart"] += new
        return new

    def untake(self, worker_id: str, tasks: list[PrefillTask]) -> int:
        """Tasks handed to `worker_id` that never reached it (its connection closed before the
        batch was sent) go back to their old place in the order; not counted as a requeue.
        Returns how many went back (those still in flight on that worker)."""
        taken = self._in_flight.get(worker_id, {})
        back = 0
        for task in tasks:
            if taken.pop(task.key, None) is not None:
                self._push(task)
                back += 1
        if not taken:
            self._in_flight.pop(worker_id, None)
        self.counters["returned_undelivered"] += back
        return back

    def gone_count(self, worker_id: str) -> int:
        """How often `worker_gone(worker_id)` was called: a long poll that started before a
        change of this value belongs to a worker the cluster has given up on."""
        return self._gone[worker_id]

    def stats(self) -> QueueStats:
        now = self._clock()
        oldest = min((entry[2] for entry in self._queued.values()), default=now)
        return QueueStats(
            depth=len(self._queued),
            queued_tokens=self._queued_tokens,
            oldest_wait_ms=max(0.0, (now - oldest) * 1000.0),
            in_flight={w: len(t) for w, t in self._in_flight.items()},
            in_flight_tokens=sum(t.num_prefill_tokens for ts in self._in_flight.values() for t in ts.values()),
            failed_pending=sum(len(f) for f in self._failed.values()),
            capacity=self.capacity,
            counters=dict(self.counters),
            instance_id=self.instance_id,
        )


@ray.remote
class PrefillQueue:
    """The named Ray actor holding the cluster's prefill queue (a QueueCore).

    Async actor: `get_batch` long-polls up to `max_wait_ms` for the first task
    without blocking puts. Errors are values: `put` returns a PutResult.
    Create or find it with `get_or_create_queue`; call it through a
    `QueueClient`, which uses the actor's wire (see `queue_wire`) when it can:
    `wire_bind` is "loopback" (127.0.0.1: clients on this Ray node), "node"
    (the node's IP: every node; multi-node clusters) or "off" (Ray calls only).
    """

    def __init__(self, capacity: int = DEFAULT_QUEUE_CAPACITY, max_requeues: int = 1,
                 wire_bind: str = "loopback", metrics_port: int | None = None):
        if wire_bind not in WIRE_BINDS:
            raise ValueError(f"wire_bind={wire_bind!r} must be one of {list(WIRE_BINDS)}")
        from .queue_metrics import QueueMetrics

        self._metrics = QueueMetrics(self)
        self._core = QueueCore(capacity, max_requeues=max_requeues, on_dispatch=self._metrics.wait.observe)
        # /metrics on loopback (port None: a free one, 0: off); its address is in stats().
        self._metrics_at = self._metrics.serve("127.0.0.1", metrics_port)
        self._arrived = asyncio.Condition()
        # A restarted queue is empty, but prefill workers may still hold tasks of the lost
        # instance: hand out nothing until they have had time to report them (`hold`).
        restarted = ray.get_runtime_context().was_current_actor_reconstructed
        self._recover_until = time.monotonic() + RECOVERY_GRACE_S if restarted else 0.0
        if restarted:
            log.warning("prefill queue restarted (instance %s): its queued tasks were lost; decode workers "
                        "re-put theirs, prefill workers report what they hold", self._core.instance_id)
        self._wire_bind = wire_bind
        self._wire: asyncio.Future | None = None  # resolves to wire_endpoint()'s answer
        from .runtime import freeze_gc_heap

        freeze_gc_heap("prefill queue actor")  # no 30 ms full-collection pauses in the hot path

    async def wire_endpoint(self) -> dict | None:
        """Where the wire listens: {"host", "port", "token", "node_id"}, started on first
        call; None when wire_bind is "off"."""
        if self._wire_bind == "off":
            return None
        if self._wire is None:
            self._wire = asyncio.ensure_future(self._start_wire())
        return await asyncio.shield(self._wire)

    async def _start_wire(self) -> dict:
        from .queue_wire import WireServer

        host = "127.0.0.1" if self._wire_bind == "loopback" else ray.util.get_node_ip_address()
        self._wire_server = WireServer(self, on_undelivered=self._undelivered)
        host, port = await self._wire_server.start(host)
        node_id = ray.get_runtime_context().get_node_id()
        log.info("prefill queue wire on %s:%d (node %s)", host, port, node_id[:12])
        return {"host": host, "port": port, "token": self._wire_server.token, "node_id": node_id}

    def _undelivered(self, worker_id: str, tasks: list[PrefillTask]) -> None:
        if self._core.untake(worker_id, tasks):
            self._arrived_notify_soon()

    def _arrived_notify_soon(self) -> None:
        async def notify():
            async with self._arrived:
                self._arrived.notify_all()
        asyncio.ensure_future(notify())

    async def put(self, task: PrefillTask) -> PutResult:
        result = self._core.put(task)
        if result.ok:
            async with self._arrived:
                self._arrived.notify()
        return result

    async def get_batch(self, worker_id: str, max_tokens: int, max_wait_ms: float = 0.0,
                        max_tasks: int | None = None, completed: list[str] | None = None) -> list[PrefillTask]:
        """A token-budgeted batch; waits up to `max_wait_ms` for the first task, else [].

        `completed` marks the worker's previous tasks done first: the usual
        loop (finish a batch, ask for the next) then costs one call, not two.
        """
        _check_poll_args(worker_id, max_tokens, max_wait_ms, max_tasks)
        if completed:
            self._core.complete(worker_id, completed)
        recovering_s = self._recover_until - time.monotonic()
        if recovering_s > 0:  # just restarted: no batch until held tasks are reported
            await asyncio.sleep(min(recovering_s, max_wait_ms / 1000.0))
            if self._recover_until > time.monotonic():
                return []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max_wait_ms / 1000.0
        # A poll outlives its caller: a worker killed while this call waits cannot receive the
        # batch. Once the worker is reported gone, a poll it started before takes nothing.
        gone = self._core.gone_count(worker_id)
        async with self._arrived:
            while True:
                if self._core.gone_count(worker_id) != gone:
                    return []
                batch = self._core.take(worker_id, max_tokens, max_tasks)
                remaining_s = deadline - loop.time()
                if batch or remaining_s <= 0:
                    self._metrics.batch(batch)
                    return batch
                try:
                    await asyncio.wait_for(self._arrived.wait(), remaining_s)
                except asyncio.TimeoutError:
                    if self._core.gone_count(worker_id) != gone:
                        return []
                    batch = self._core.take(worker_id, max_tokens, max_tasks)
                    self._metrics.batch(batch)
                    return batch

    async def complete(self, worker_id: str, request_id: str | list[str]) -> bool:
        """Stop tracking one finished task, or a whole batch (one call per batch)."""
        return self._core.complete(worker_id, request_id)

    async def cancel(self, request_id: str) -> str:
        return self._core.cancel(request_id)

    async def worker_gone(self, worker_id: str) -> dict[str, int]:
        result = self._core.worker_gone(worker_id)
        async with self._arrived:
            # Wake every waiting poll: the gone worker's own ones end empty, others may take
            # the requeued tasks.
            self._arrived.notify_all()
        return result

    async def take_failed(self, origin: str) -> list[FailedTask]:
        return self._core.take_failed(origin)

    async def fail(self, worker_id: str, request_id: str, reason: str, detail: str = "") -> bool:
        return self._core.fail(worker_id, request_id, reason, detail)

    async def hold(self, worker_id: str, tasks: list[PrefillTask]) -> int:
        new = self._core.hold(worker_id, tasks)
        if new:
            log.info("prefill worker %s holds %d task(s) of the queue's previous instance", worker_id, new)
        return new

    async def instance_id(self) -> str:
        return self._core.instance_id

    async def take_failed_and_stats(self, origin: str) -> tuple[list[FailedTask], QueueStats]:
        """`take_failed(origin)` and `stats()` in one call: a decode worker's periodic poll
        costs one actor round trip, not two."""
        return self._core.take_failed(origin), await self.stats()

    async def stats(self) -> QueueStats:
        stats = dataclasses.replace(self._core.stats(), recovering=self._recover_until > time.monotonic(),
                                    metrics=self._metrics_at or "")
        server = getattr(self, "_wire_server", None)
        if server is not None:  # wire_connections, wire_calls, wire_errors, wire_bad_hello, ...
            stats.counters.update({f"wire_{k}": v for k, v in server.counters.items()})
        return stats


def _check_poll_args(worker_id, max_tokens, max_wait_ms, max_tasks) -> None:
    """get_batch's arguments, checked: a bad one is a ValueError naming it, not a stuck poll."""
    if not isinstance(worker_id, str) or not worker_id:
        raise ValueError(f"get_batch: worker_id must be a non-empty string, got {worker_id!r}")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"get_batch: max_tokens must be an int >= 1, got {max_tokens!r}")
    if isinstance(max_wait_ms, bool) or not isinstance(max_wait_ms, (int, float)) or not 0 <= max_wait_ms <= 3_600_000:
        raise ValueError(f"get_batch: max_wait_ms must be a number in [0, 3600000], got {max_wait_ms!r}")
    if max_tasks is not None and (isinstance(max_tasks, bool) or not isinstance(max_tasks, int) or max_tasks < 1):
        raise ValueError(f"get_batch: max_tasks must be None or an int >= 1, got {max_tasks!r}")


def get_or_create_queue(name: str = DEFAULT_QUEUE_NAME, namespace: str = DEFAULT_NAMESPACE,
                        capacity: int = DEFAULT_QUEUE_CAPACITY, *, detached: bool = False,
                        max_requeues: int = 1, wire_bind: str = "loopback", metrics_port: int | None = None):
    """Handle to the named queue actor, creating it if absent (race-safe).

    An existing actor keeps the capacity and wire_bind it was created with. `detached`
    lets the queue outlive the driver that created it (the launcher's choice).
    The actor reserves no CPU: it is I/O-bound and must not take a worker's slot.
    Ray restarts it when it dies (`QUEUE_MAX_RESTARTS`); calls are not retried
    (`max_task_retries` 0): a call caught by the death fails at once, and every
    caller already treats a failed queue call as "try again or go local".
    """
    options: dict[str, Any] = dict(name=name, namespace=namespace, get_if_exists=True, num_cpus=0,
                                   max_restarts=QUEUE_MAX_RESTARTS, max_task_retries=0)
    if detached:
        options["lifetime"] = "detached"
    return PrefillQueue.options(**options).remote(capacity=capacity, max_requeues=max_requeues,
                                                  wire_bind=wire_bind, metrics_port=metrics_port)


async def _tell_gone(queue, worker_id: str) -> None:
    try:
        await queue.worker_gone(worker_id)
    except Exception as exc:  # noqa: BLE001  (another decode worker may tell it; the queue may be gone)
        log.warning("could not tell the queue that %s is gone: %r", worker_id, exc)


async def requeue_on_worker_loss(registry: "Registry", queue, *, grace_s: float = 2.0):
    """Tell `queue` (a QueueClient or the actor handle) when a worker leaves the registry;
    returns the MemberWatch.

    A worker that comes back within `grace_s` (a re-registration after an
    etcd restart re-lists everyone as gone, then back) is not reported.
    Several processes may run this: `worker_gone` is idempotent.
    """
    pending: dict[str, asyncio.TimerHandle] = {}
    loop = asyncio.get_running_loop()

    def report(worker_id: str) -> None:
        pending.pop(worker_id, None)
        if hasattr(queue.worker_gone, "remote"):  # a Ray actor handle
            queue.worker_gone.remote(worker_id)
        else:  # a QueueClient
            asyncio.ensure_future(_tell_gone(queue, worker_id))
        log.info("worker %s left the registry; queue told", worker_id)

    def on_remove(info) -> None:
        if info.worker_id not in pending:
            pending[info.worker_id] = loop.call_later(grace_s, report, info.worker_id)

    def on_add(info) -> None:
        handle = pending.pop(info.worker_id, None)
        if handle is not None:
            handle.cancel()

    return await registry.watch_members(on_add=on_add, on_remove=on_remove)
