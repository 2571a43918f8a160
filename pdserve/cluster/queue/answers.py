"""The queue's answers, as plain dataclasses (the task itself is the handoff's: kvtransfer/task.py).

No Ray and no I/O here: these are the values that travel between decode
workers, the queue actor and prefill workers. Over the queue's wire they are
encoded by `frames` (msgpack maps of their fields; a task by its own codec).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.kvtransfer.task import PrefillTask

# Why put() refused a task (PutResult.reason). ALREADY_DONE: this queue already settled that
# (request_id, epoch) and its deadline has not passed (a replayed copy; core.QueueCore).
QUEUE_FULL, DUPLICATE, DEADLINE_PASSED, NOTHING_TO_PREFILL, ALREADY_DONE = (
    "queue_full", "duplicate", "deadline_passed", "nothing_to_prefill", "already_done")


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
    # one of the failure table's reasons (kvtransfer/outcomes.py): the queue's own, or the kind
    # a prefill worker gave with `fail`
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
