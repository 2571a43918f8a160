"""pdserve.kvtransfer: the prefill/decode handoff, in one place: its protocol here, the NIXL
transport beneath it in ``nixl/``.

One remote prefill, as the two workers see it:

    decode worker                                           prefill worker
    reserve blocks  -> Handoff RESERVED   (decode_side)
    put PrefillTask -> QUEUED             (task: the message and its wire codec)
                                            take the task -> PrefillJob ADMITTED (prefill_side)
                                            compute, post the pages     -> STREAMING/COMPUTED/POSTED
            <- pages, then PrefillDone    (notices)                      -> DONE
    Handoff READY: run from the first token
                     or
            <- PrefillFailed / the queue's failed task                   -> FAILED
    FALLEN_BACK (blocks freed) or QUARANTINED (a write may still land: outcomes)

Modules (each imports only its siblings and pdserve.common):

- ``task``: `PrefillTask`, what the decode worker asks, and `task_to_wire` /
  `task_from_wire` (the queue's wire carries it so).
- ``notices``: `PrefillDone`, `PrefillFailed` and their codec (inside a transport
  notification; never pickle).
- ``outcomes``: every failure reason, who raises it and whether the reserved
  blocks are free at once (settled) or quarantined: one table.
- ``decode_side``: `Handoffs`, the decode worker's table of attempts (the one owner
  of "awaiting remote KV") and the effects it asks of the engine.
- ``prefill_side``: `PrefillJob`, the prefill worker's state of one task.
- ``transport``: `KVSender` / `KVReceiver`, what both sides need from the data
  plane, and its errors; pdserve.kvtransfer.nixl (NIXL) implements it.

The walk of one request through the files is in docs/architecture.md.
"""

from pdserve.kvtransfer.decode_side import Effect, Handoff, Handoffs, HandoffState, Step
from pdserve.kvtransfer.notices import MalformedNoticeError, PrefillDone, PrefillFailed, decode_notification
from pdserve.kvtransfer.outcomes import (
                       BAD_TASK,
                       BATCH_FAILED,
                       CANCELLED,
                       FAILURES,
                       PEER_MISSING,
                       REQUEST_FAILED,
                       TRANSFER_ERROR,
                       fallback_reason,
                       is_settled,
)
from pdserve.kvtransfer.prefill_side import JobState, PrefillJob
from pdserve.kvtransfer.task import PrefillTask
from pdserve.kvtransfer.transport import KVReceiver, KVSender, TransportError, WriteFailed, WriteTimedOut

__all__ = [
    "BAD_TASK", "BATCH_FAILED", "CANCELLED", "PEER_MISSING", "REQUEST_FAILED", "TRANSFER_ERROR", "FAILURES",
    "Effect", "Handoff", "HandoffState", "Handoffs", "JobState", "KVReceiver", "KVSender", "MalformedNoticeError",
    "PrefillDone", "PrefillFailed", "PrefillJob", "PrefillTask", "Step", "TransportError", "WriteFailed",
    "WriteTimedOut", "decode_notification", "fallback_reason", "is_settled",
]
