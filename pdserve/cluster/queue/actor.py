"""`PrefillQueue`: the named Ray actor holding the cluster's prefill queue.

The policy is `core.QueueCore`; the actor serves the queue's operations
(`operations.OPERATIONS`) around it, adding the long poll of `get_batch`, serves
the queue's wire (`server.WireServer`) and its Prometheus metrics, and recovers
from its own restarts.

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
import inspect
import logging
import time
from typing import Any, Awaitable, Callable, TypeVar

import ray

from pdserve.cluster.keys import DEFAULT_NAMESPACE, DEFAULT_QUEUE_CAPACITY, DEFAULT_QUEUE_NAME
from pdserve.cluster.runtime import freeze_gc_heap
from pdserve.kvtransfer.task import PrefillTask

from pdserve.cluster.queue.core import QueueCore
from pdserve.cluster.queue.liveness import DEFAULT_STALL_S
from pdserve.cluster.queue.metrics import QueueMetrics
from pdserve.cluster.queue.operations import OPERATIONS, perform_coded
from pdserve.cluster.queue.server import WireServer, server_tls
from pdserve.cluster.queue.answers import FailedTask, PutResult, QueueStats

log = logging.getLogger(__name__)

WIRE_BINDS = ("loopback", "node", "off")
# After a restart, how long the queue hands out nothing: prefill workers check the queue's
# instance every HOLD_CHECK_S while they hold a batch and report it (`hold`) well within it.
RECOVERY_GRACE_S = 2.0
QUEUE_MAX_RESTARTS = -1  # Ray restarts the queue actor without limit (it holds no state worth a crash loop)
_Actor = TypeVar("_Actor", bound=type)


def _core_method(name: str) -> Callable[..., Awaitable[Any]]:
    """The actor's method for an operation its core serves as is: `QueueCore.<name>` on the
    actor's core, with that method's signature (Ray checks a call's arguments against it when
    the call is made, as with a method written out) and its docstring. A copy of the
    signature, not `functools.wraps`: Ray adds its tracing argument to the signature of the
    function a method wraps, which would be the core's."""
    impl = getattr(QueueCore, name)

    async def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._core, name)(*args, **kwargs)
    setattr(method, "__signature__", inspect.signature(impl))  # what inspect.signature (Ray's check) reads
    method.__name__, method.__doc__, method.__module__ = name, impl.__doc__, __name__
    method.__qualname__ = f"PrefillQueue.{name}"
    return method


def _serves_operations(cls: _Actor) -> _Actor:
    """Give the actor class a method for each operation `operations.OPERATIONS` says its
    core serves (``by="core"``); each ``by="actor"`` one it must define itself. A mismatch
    fails at import, not on the first call."""
    for op in OPERATIONS.values():
        defined = op.name in vars(cls)
        if op.by == "actor" and not defined:
            raise TypeError(f"{cls.__name__} must define {op.name}: operations.py says the actor serves it")
        if op.by == "core":
            if defined:
                raise TypeError(f"{cls.__name__} defines {op.name}, which operations.py says the core serves as is")
            setattr(cls, op.name, _core_method(op.name))
    return cls


@ray.remote
@_serves_operations
class PrefillQueue:
    """The named Ray actor holding the cluster's prefill queue (a QueueCore).

    Async actor: `get_batch` long-polls up to `max_wait_ms` for the first task
    without blocking puts. Errors are values: `put` returns a PutResult.
    Create or find it with `get_or_create_queue`; call it through a
    `QueueClient`, which uses the actor's wire (see `server`) when it can:
    `wire_bind` is "loopback" (127.0.0.1: clients on this Ray node), "node"
    (the node's IP: every node; multi-node clusters) or "off" (Ray calls only).
    `wire_tls` ({"cert", "key", "client_ca"}: PEM paths on the queue's node, the
    topology's `queue.tls`) makes the wire TLS only (`server.server_tls`).
    Its methods are the queue's operations (`operations.OPERATIONS`): the ones its core
    serves as is are made from the core's (`_serves_operations`), those written here add
    to the core.
    """

    def __init__(self, capacity: int = DEFAULT_QUEUE_CAPACITY, max_requeues: int = 1,
                 wire_bind: str = "loopback", metrics_port: int | None = None, wire_tls: dict | None = None,
                 stall_s: float = DEFAULT_STALL_S):
        if wire_bind not in WIRE_BINDS:
            raise ValueError(f"wire_bind={wire_bind!r} must be one of {list(WIRE_BINDS)}")
        self._wire_tls = wire_tls
        self._metrics = QueueMetrics(self)
        self._core = QueueCore(capacity, max_requeues=max_requeues, on_dispatch=self._metrics.wait.observe,
                               stall_s=stall_s)
        # /metrics (port None: a free one, 0: off) where the wire would listen: loopback, or the
        # node's address when other hosts are served; its address is in stats().
        host = "127.0.0.1" if wire_bind == "loopback" else ray.util.get_node_ip_address()
        self._metrics_at = self._metrics.serve(host, metrics_port)
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
        self._wire_server: WireServer | None = None
        freeze_gc_heap("prefill queue actor")  # no 30 ms full-collection pauses in the hot path

    async def call_coded(self, payload: bytes) -> bytes:
        """One queue call over Ray when the wire is not used (``queue.transport: ray``, or
        ``auto`` where the wire is unreachable): the request is `operations.pack_call`'s
        msgpack body, the answer the wire's response body, both encoded by the operation's
        codecs (`operations.perform_coded`). So Ray carries bytes only: no task, result or
        exception object is pickled across nodes."""
        return await perform_coded(self, payload)

    async def wire_endpoint(self) -> dict | None:
        """Where the wire listens: {"host", "port", "token", "node_id", "tls"}, started on first
        call; None when wire_bind is "off". A `wire_tls` file that does not load raises here,
        naming its `queue.tls` key."""
        if self._wire_bind == "off":
            return None
        if self._wire is None:
            self._wire = asyncio.ensure_future(self._start_wire())
        return await asyncio.shield(self._wire)

    async def _start_wire(self) -> dict:
        host = "127.0.0.1" if self._wire_bind == "loopback" else ray.util.get_node_ip_address()
        tls = server_tls(**self._wire_tls) if self._wire_tls else None
        self._wire_server = WireServer(self, on_undelivered=self._undelivered, tls=tls)
        host, port = await self._wire_server.start(host)
        node_id = ray.get_runtime_context().get_node_id()
        log.info("prefill queue wire on %s:%d (node %s, %s)", host, port, node_id[:12],
                 "TLS" + (", client certificates required" if (self._wire_tls or {}).get("client_ca") else "")
                 if tls else "plaintext")
        if tls is None and self._wire_bind == "node":
            log.warning("the prefill queue wire serves %s:%d without TLS: its token and the tasks cross the network "
                        "in clear text; set queue.tls in the topology (docs/security.md)", host, port)
        return {"host": host, "port": port, "token": self._wire_server.token, "node_id": node_id,
                "tls": tls is not None}

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
                if task.prefix_hint or task.lora_name:  # every poller: the one it is (or may be) kept for must look
                    self._arrived.notify_all()
                else:
                    self._arrived.notify()
        return result

    async def get_batch(self, worker_id: str, max_tokens: int, max_wait_ms: float = 0.0,
                        max_tasks: int | None = None, completed: list[str] | None = None,
                        adapters: bool = False) -> list[PrefillTask]:
        """A token-budgeted batch; waits up to `max_wait_ms` for the first task, else [].

        `completed` marks the worker's previous tasks done first: the usual
        loop (finish a batch, ask for the next) then costs one call, not two.
        `adapters`: the worker runs LoRA adapters (only such a worker takes a task naming one).
        """
        _check_poll_args(worker_id, max_tokens, max_wait_ms, max_tasks)
        self._core.alive(worker_id)  # polling is progress, also while the queue recovers
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
                batch = self._core.take(worker_id, max_tokens, max_tasks, adapters is True)
                remaining_s = deadline - loop.time()
                if batch or remaining_s <= 0:
                    self._metrics.batch(batch)
                    return batch
                try:
                    await asyncio.wait_for(self._arrived.wait(), remaining_s)
                except asyncio.TimeoutError:
                    if self._core.gone_count(worker_id) != gone:
                        return []
                    batch = self._core.take(worker_id, max_tokens, max_tasks, adapters is True)
                    self._metrics.batch(batch)
                    return batch

    async def worker_gone(self, worker_id: str) -> dict[str, int]:
        result = self._core.worker_gone(worker_id)
        async with self._arrived:
            # Wake every waiting poll: the gone worker's own ones end empty, others may take
            # the requeued tasks.
            self._arrived.notify_all()
        return result

    async def take_failed(self, origin: str) -> list[FailedTask]:
        self._fail_stalled()
        return self._core.take_failed(origin)

    def _fail_stalled(self) -> None:
        """Checked whenever a decode worker collects its failed tasks (every 0.25 s each)."""
        for worker_id, n in self._core.fail_stalled().items():
            if not worker_id:
                log.warning("%d queued task(s) failed back: no live prefill worker for %.1f s", n,
                            self._core.stall_s)
                continue
            log.warning("%d task(s) failed back to their decode workers: %s", n, self._core.stalled_why[worker_id])

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
        self._fail_stalled()
        return self._core.take_failed(origin), await self.stats()

    async def prefix_decisions(self, limit: int = 50) -> list[dict]:
        """The last prefix-aware dispatch decisions that named another worker than the puller
        (cluster/queue/core.py `_keep_for_prefix`): who pulled, who holds the longest prefix, its
        backlog, how long the task had waited, kept or not and why. Newest last."""
        return list(self._core.prefix_decisions)[-max(0, int(limit)):]

    async def stats(self) -> QueueStats:
        stats = dataclasses.replace(self._core.stats(), recovering=self._recover_until > time.monotonic(),
                                    metrics=self._metrics_at or "")
        server = self._wire_server
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
                        max_requeues: int = 1, wire_bind: str = "loopback", metrics_port: int | None = None,
                        on_head: bool = False, wire_tls: dict | None = None, stall_s: float = DEFAULT_STALL_S):
    """Handle to the named queue actor, creating it if absent (race-safe).

    An existing actor keeps the capacity, wire_bind and wire_tls it was created with. `detached`
    lets the queue outlive the driver that created it (the launcher's choice).
    The actor reserves no CPU: it is I/O-bound and must not take a worker's slot.
    Ray restarts it when it dies (`QUEUE_MAX_RESTARTS`); calls are not retried
    (`max_task_retries` 0): a call caught by the death fails at once, and every
    caller already treats a failed queue call as "try again or go local". `on_head`
    places it on the Ray head node (Ray's `node:__internal_head__` resource): an actor
    that reserves nothing may otherwise land on any node, and a worker node scaled
    away (a pod, a `ray up` worker) would take the queue with it.
    """
    options: dict[str, Any] = dict(name=name, namespace=namespace, get_if_exists=True, num_cpus=0,
                                   max_restarts=QUEUE_MAX_RESTARTS, max_task_retries=0)
    if on_head:
        options["resources"] = {"node:__internal_head__": 0.001}
    if detached:
        options["lifetime"] = "detached"
    actor_cls: Any = PrefillQueue  # @ray.remote made the class a Ray ActorClass (ray is read as Any)
    return actor_cls.options(**options).remote(capacity=capacity, max_requeues=max_requeues,
                                               wire_bind=wire_bind, metrics_port=metrics_port,
                                               wire_tls=wire_tls, stall_s=stall_s)
