"""The queue's messages: `PrefillTask` and the queue's answers, as plain dataclasses.

No Ray and no I/O here: these are the values that travel between decode
workers, the queue actor and prefill workers. Over the queue's wire they are
encoded by `frames` (the one serialiser: msgpack maps of their fields).

Ordering: tasks leave the queue in (priority, deadline, arrival_time) order.
`priority` is a `pdserve.common.Priority` (HIGH=0, NORMAL=1, LOW=2; lower =
more urgent); a name ("high", any case) or an int is parsed into one. A task
without a deadline sorts after every task with one at the same priority.
Deadlines and arrival times are absolute unix seconds from the producer's
clock (hosts are assumed NTP-synchronised).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from pdserve.common.priority import Priority

# Why put() refused a task (PutResult.reason). ALREADY_DONE: this queue already settled that
# (request_id, epoch) and its deadline has not passed (a replayed copy; core.QueueCore).
QUEUE_FULL, DUPLICATE, DEADLINE_PASSED, NOTHING_TO_PREFILL, ALREADY_DONE = (
    "queue_full", "duplicate", "deadline_passed", "nothing_to_prefill", "already_done")

# Why the queue itself failed a task back to its origin (FailedTask.reason); a prefill
# worker's `fail` gives its own kind instead (kvtransfer.messages.FAILURE_KINDS).
DEADLINE_EXPIRED, WORKER_VANISHED, TARGET_GONE = "deadline_expired", "worker_vanished", "target_gone"
# A prefill worker that holds tasks but has not been heard from within the queue's stall bound
# (alive, get_batch, complete, fail or hold): its tasks are failed back; it may resume and write.
WORKER_STALLED = "worker_stalled"
# Queued past the stall bound while no prefill worker was heard from: nobody took it.
NO_LIVE_WORKER = "no_live_worker"


@dataclass
class PrefillTask:
    """One remote-prefill request, from a decode worker to the prefill pool.

    The prefill worker computes KV for positions [cached_len, len(token_ids))
    and writes it into `target_block_ids` of `target_worker_id`; the
    completion it sends carries (request_id, epoch), so the decode worker can
    ignore late results of an abandoned attempt. `origin` (default: the
    target) is where failed tasks are returned, via `take_failed(origin)`.
    `signature`: the target decode worker's Ed25519 signature over the task
    (`signing`); a prefill worker refuses a task without a valid one.
    """

    request_id: str
    epoch: int
    token_ids: list[int]
    cached_len: int
    target_worker_id: str
    target_block_ids: list[int]
    sampling_params: dict[str, Any] = field(default_factory=dict)
    priority: Priority = Priority.NORMAL  # a name ("high") or an int (0) is parsed
    deadline: float | None = None  # absolute unix time; None = no deadline
    arrival_time: float = field(default_factory=time.time)
    origin: str = ""
    signature: bytes = b""

    def __post_init__(self) -> None:
        self.priority = Priority.parse(self.priority)  # ValueError naming the choices
        if not isinstance(self.signature, bytes):
            raise ValueError(f"signature must be bytes, got {type(self.signature).__name__}")
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
    # DEADLINE_EXPIRED | WORKER_VANISHED | TARGET_GONE, or the failure kind a prefill
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
    # Prefill workers heard from within the stall bound (polling, or serving with heartbeats):
    # liveness from progress, which an etcd lease kept alive by someone else cannot fake.
    live_workers: int = 0
