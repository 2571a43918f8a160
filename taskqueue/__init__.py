"""The prefill queue: decode workers put `PrefillTask`s, prefill workers pull batches.

One module per concern; each imports its siblings directly, never this file:

- ``task``: `PutResult`, `FailedTask`, `QueueStats` and put()'s refusal reasons (plain
  dataclasses; no Ray). The task itself and the failure reasons are the handoff's
  (pdserve.handoff: task.py, outcomes.py).
- ``core``: `QueueCore`, the whole policy (order, budgeted batches, in-flight
  accounting, fail-back), pure and synchronous.
- ``actor``: `PrefillQueue`, the named Ray actor around the core (long poll,
  restarts), and `get_or_create_queue`.
- ``frames``: the wire format: framing and the one serialiser of tasks and results
  (msgpack, never pickle).
- ``server``: `WireServer`, the wire inside the actor (TLS: `server_tls`).
- ``client``: `QueueClient`, what workers hold (the wire when reachable, else Ray calls).
- ``signing``: `TaskSigner`, `verify_task`: a task binds to the decode worker that
  reserved its blocks (Ed25519 over its fields; no Ray, no I/O).
- ``requeue``: `requeue_on_worker_loss`, which connects the queue to the registry.

This package re-exports their public names.
"""

from .actor import QUEUE_MAX_RESTARTS, RECOVERY_GRACE_S, WIRE_BINDS, PrefillQueue, get_or_create_queue
from .client import (
    CALL_SLACK_S,
    CONNECT_TIMEOUT_S,
    TRANSPORTS,
    QueueCallError,
    QueueClient,
    QueueUnavailableError,
    client_tls,
    open_queue,
)
from .core import (
    MAX_FAIL_DETAIL_CHARS,
    MAX_FAIL_REASON_CHARS,
    MAX_FAILED_PER_ORIGIN,
    MAX_SETTLED_REMEMBERED,
    QueueCore,
)
from .frames import (
    CODECS,
    HELLO_TIMEOUT_S,
    MAX_FRAME_BYTES,
    MAX_HELLO_BYTES,
    WIRE_VERSION,
    MethodCodec,
    WireError,
    from_wire,
    pack_frame,
    read_frame,
    to_wire,
)
from .requeue import requeue_on_worker_loss
from .server import WireServer, server_tls
from .signing import (
    BAD_SIGNATURE,
    NO_DEADLINE,
    NO_KEY,
    REJECT_REASONS,
    UNSIGNED,
    TaskSigner,
    signed_message,
    verify_task,
)
from .task import (
    ALREADY_DONE,
    DEADLINE_PASSED,
    DUPLICATE,
    NOTHING_TO_PREFILL,
    QUEUE_FULL,
    FailedTask,
    PutResult,
    QueueStats,
)

__all__ = [
    # task
    "PutResult", "FailedTask", "QueueStats",
    "QUEUE_FULL", "DUPLICATE", "DEADLINE_PASSED", "NOTHING_TO_PREFILL", "ALREADY_DONE",
    # core
    "QueueCore", "MAX_FAILED_PER_ORIGIN", "MAX_FAIL_REASON_CHARS", "MAX_FAIL_DETAIL_CHARS", "MAX_SETTLED_REMEMBERED",
    # actor
    "PrefillQueue", "get_or_create_queue", "WIRE_BINDS", "RECOVERY_GRACE_S", "QUEUE_MAX_RESTARTS",
    # frames
    "WireError", "pack_frame", "read_frame", "to_wire", "from_wire", "CODECS", "MethodCodec",
    "WIRE_VERSION", "MAX_FRAME_BYTES", "MAX_HELLO_BYTES", "HELLO_TIMEOUT_S",
    # server, client, requeue
    "WireServer", "server_tls",
    "QueueClient", "QueueCallError", "QueueUnavailableError", "TRANSPORTS", "CONNECT_TIMEOUT_S", "CALL_SLACK_S",
    "client_tls", "open_queue",
    # signing
    "TaskSigner", "verify_task", "signed_message", "REJECT_REASONS", "UNSIGNED", "NO_KEY", "NO_DEADLINE",
    "BAD_SIGNATURE",
    "requeue_on_worker_loss",
]
