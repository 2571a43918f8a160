"""The prefill queue: decode workers put `PrefillTask`s, prefill workers pull batches.

One module per concern; each imports its siblings directly, never this file:

- ``answers``: `PutResult`, `FailedTask`, `QueueStats` and put()'s refusal reasons (plain
  dataclasses; no Ray). The task itself and the failure reasons are the handoff's
  (pdserve.kvtransfer: task.py, outcomes.py).
- ``core``: `QueueCore`, the whole policy (order, budgeted batches, in-flight
  accounting, fail-back), pure and synchronous.
- ``liveness``: `WorkerLiveness`, the core's view of each worker: when it last called
  (the stall bound, `DEFAULT_STALL_S`), the cancels its next beat tells it of.
- ``settled``: `SettledTasks`, the core's memory of settled tasks (replays refused
  until their deadline).
- ``actor``: `PrefillQueue`, the named Ray actor around the core (long poll,
  restarts), and `get_or_create_queue`.
- ``operations``: `OPERATIONS`, the queue's operations declared once (codecs, who serves
  each); the actor's methods, both transports' dispatch and the client's calls follow.
- ``frames``: the wire format: framing and the one serialiser of tasks and results
  (msgpack, never pickle).
- ``server``: `WireServer`, the wire inside the actor (TLS: `server_tls`).
- ``client``: `QueueClient`, what workers hold (the wire when reachable, else Ray calls).
- ``signing``: `TaskSigner`, `verify_task`: a task binds to the decode worker that
  reserved its blocks (Ed25519 over its fields; no Ray, no I/O).
- ``requeue``: `requeue_on_worker_loss`, which connects the queue to the registry.

This package re-exports what the workers and the launcher use; import anything else
from its module.
"""

from pdserve.cluster.queue.actor import get_or_create_queue
from pdserve.cluster.queue.client import QueueClient, open_queue
from pdserve.cluster.queue.requeue import requeue_on_worker_loss
from pdserve.cluster.queue.signing import BAD_SIGNATURE, NO_KEY, TaskSigner, verify_task

__all__ = ["BAD_SIGNATURE", "NO_KEY", "QueueClient", "TaskSigner", "get_or_create_queue", "open_queue",
           "requeue_on_worker_loss", "verify_task"]
