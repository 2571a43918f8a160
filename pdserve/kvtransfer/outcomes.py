"""Why a remote attempt failed, and what each reason means for the reserved blocks: one table.

A failed attempt reaches its decode worker in one of two ways: a prefill
worker's `PrefillFailed` notice over the transport (its ``kind``), or the
queue's failed-task list (a prefill worker's ``fail`` carries the same kind;
the queue adds its own reasons). The decode worker then prefills locally.
What it may do with the blocks it reserved depends on the reason:

- **settled**: no page write of the attempt can still land (nobody took the
  task, or the prefill worker failed it before posting a write, or waited
  for every posted write). The blocks go back to the pool at once.
- **not settled**: a write may still arrive (a worker that vanished or
  stalled while holding the task may be partitioned, not dead; a transfer
  error may leave a write in flight). The blocks are quarantined until the
  attempt's own notice arrives or the quarantine ends (decode_side.py).

A `PrefillFailed` says itself whether its writes are settled
(``writes_settled``); the column here is what the queue path, which carries
only the reason, must assume. A reason this build does not know (a newer
peer) is treated as not settled: quarantining is always safe.
"""

from __future__ import annotations

from dataclasses import dataclass

PREFILL, QUEUE = "prefill", "queue"


@dataclass(frozen=True)
class FailureKind:
    name: str
    raised_by: str  # PREFILL: a prefill worker (PrefillFailed, fail); QUEUE: the queue itself
    settled: bool  # over the queue path: no write of the attempt can still land
    meaning: str


# A prefill worker's kinds (PrefillFailed.kind, and the reason it gives the queue's `fail`).
TRANSFER_ERROR = "transfer_error"
PEER_MISSING = "peer_missing"
BAD_TASK = "bad_task"
REQUEST_FAILED = "request_failed"
BATCH_FAILED = "batch_failed"
CANCELLED = "cancelled"
# The queue's own reasons (FailedTask.reason).
DEADLINE_EXPIRED = "deadline_expired"
WORKER_VANISHED = "worker_vanished"
TARGET_GONE = "target_gone"
WORKER_STALLED = "worker_stalled"
NO_LIVE_WORKER = "no_live_worker"

FAILURES: dict[str, FailureKind] = {k.name: k for k in (
    FailureKind(TRANSFER_ERROR, PREFILL, False, "a page write failed or timed out"),
    FailureKind(PEER_MISSING, PREFILL, True,
                "no usable transport record of the decode worker (etcd metadata absent or rejected)"),
    FailureKind(BAD_TASK, PREFILL, True, "the task itself is invalid (sampling params, token ids, blocks)"),
    FailureKind(REQUEST_FAILED, PREFILL, True, "the engine failed this one request (sampling raised)"),
    FailureKind(BATCH_FAILED, PREFILL, True, "the forward pass of the task's batch raised (OOM, device error)"),
    FailureKind(CANCELLED, PREFILL, True, "its decode worker aborted the request while the task was computed"),
    FailureKind(DEADLINE_EXPIRED, QUEUE, True, "queued past its deadline: nobody took it"),
    FailureKind(NO_LIVE_WORKER, QUEUE, True, "queued past the stall bound while no prefill worker was heard from"),
    FailureKind(WORKER_VANISHED, QUEUE, False,
                "the prefill worker holding it left the registry (it may be partitioned, not dead)"),
    FailureKind(WORKER_STALLED, QUEUE, False,
                "the prefill worker holding it was not heard from within the stall bound; it may resume"),
    FailureKind(TARGET_GONE, QUEUE, False, "its decode worker left the registry"),
)}

# The kinds a prefill worker may put in a PrefillFailed (the notice's codec checks them).
PREFILL_FAILURE_KINDS = tuple(k.name for k in FAILURES.values() if k.raised_by == PREFILL)


def is_settled(reason: str) -> bool:
    """Whether a failed task handed back by the queue with this reason leaves no write in flight
    (unknown reasons: not settled)."""
    kind = FAILURES.get(reason)
    return kind is not None and kind.settled


def fallback_reason(reason: str, detail: str) -> str:
    """The decode worker's fallback reason for a task the queue handed back (a metric label is
    its first word): a prefill worker's kind is the cause as it is, and so is a stalled prefill
    worker (an operator looks for it by name); the queue's other reasons read ``queue: reason``."""
    kind = FAILURES.get(reason)
    named = kind is not None and (kind.raised_by == PREFILL or reason == WORKER_STALLED)
    return f"{reason}: {detail}" if named else f"queue: {reason}"
