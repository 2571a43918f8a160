"""The client side of the queue: what decode and prefill workers hold.

`QueueClient` offers the queue's operations (`operations.OPERATIONS`) as
coroutines (`call`, and a one-line typed method for each), over the queue's
wire (`server`, `frames`) when the actor serves one this process can reach,
else over Ray calls. A lost connection fails the calls in flight on it
at once (`QueueUnavailableError`, no hang) and is reopened on the next call;
an error the actor raised comes back as `QueueCallError` with its type name.

TLS: the actor's `wire_endpoint()` says whether its wire speaks TLS. A client
made with `tls` (the topology's `queue.tls`: the CA, and under mutual TLS a
client certificate) verifies the queue's certificate against the address it
connects to; a client without it refuses a TLS wire, and a client with it
refuses a plaintext one (it would send its token in clear text), each with an
error naming the setting to change, never a silent fallback.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import ssl
from typing import Any, Iterable

from pdserve.cluster.security import ClientTLS
from pdserve.kvtransfer.task import PrefillTask

from pdserve.cluster.queue.answers import FailedTask, PutResult, QueueStats
from pdserve.cluster.queue.frames import HELLO_TIMEOUT_S, WIRE_VERSION, WireError, pack_frame, read_frame, unpack_body
from pdserve.cluster.queue.operations import Operation, operation, pack_call

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0
CALL_SLACK_S = 30.0  # a call's reply may take this long beyond its own wait (a wedged actor)
WRITE_BUFFER_HIGH = 1 << 20  # a client waits for its socket to drain beyond this many unsent bytes
TRANSPORTS = ("auto", "wire", "ray")


class QueueUnavailableError(ConnectionError):
    """The connection to the queue actor is gone (the actor died or restarted)."""


class QueueCallError(RuntimeError):
    """The queue actor raised while serving a call; `type` is the exception's class name."""

    def __init__(self, type_name: str, message: str):
        super().__init__(f"{type_name}: {message}")
        self.type = type_name


def client_tls(tls: ClientTLS) -> ssl.SSLContext:
    """A TLS 1.2+ client context that verifies the queue with `tls.ca_file` (None: the system's
    trust store) and checks its certificate names the address dialled; with `tls.cert_file`,
    presents that certificate (mutual TLS). A file that does not load: ValueError naming it."""
    try:
        ctx = ssl.create_default_context(cafile=tls.ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"queue.tls.ca: cannot load {tls.ca_file}: {exc}") from None
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if tls.cert_file:
        try:
            ctx.load_cert_chain(tls.cert_file, tls.key_file)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"queue.tls.client_cert/queue.tls.client_key: cannot load {tls.cert_file} "
                             f"with {tls.key_file}: {exc}") from None
    return ctx


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer
        self.pending: dict[int, asyncio.Future] = {}
        self.next_id = 0
        self.closed: BaseException | None = None
        self.read_task = asyncio.create_task(self._read_loop())

    async def _read_loop(self) -> None:
        try:
            while True:
                body = await read_frame(self.reader)
                reply_id = body.get("id") if isinstance(body, dict) else None
                fut = self.pending.pop(reply_id, None) if reply_id is not None else None
                if fut is None:
                    if isinstance(body, dict) and body.get("id") == 0 and not body.get("ok", True):
                        raise QueueUnavailableError(f"queue closed the connection: {body.get('error')}")
                    log.warning("queue wire: reply for an unknown call (timed out?) dropped")
                    continue
                if not fut.done():
                    fut.set_result(body)
        except asyncio.CancelledError:
            self.fail(QueueUnavailableError("queue connection closed"))
            raise
        except (asyncio.IncompleteReadError, ConnectionError, WireError, OSError) as exc:
            self.fail(exc if isinstance(exc, QueueUnavailableError)
                      else QueueUnavailableError(f"queue connection lost: {exc!r}"))

    def fail(self, exc: BaseException) -> None:
        self.closed = exc
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(exc)
        self.pending.clear()
        self.writer.close()

    async def call(self, method: str, args: list, timeout_s: float) -> Any:
        if self.closed is not None:
            raise self.closed
        self.next_id += 1
        call_id = self.next_id
        frame = pack_frame({"id": call_id, "m": method, "a": args})  # WireError if too large: nothing sent
        fut = asyncio.get_running_loop().create_future()
        self.pending[call_id] = fut
        self.writer.write(frame)
        try:
            if self.writer.transport.get_write_buffer_size() > WRITE_BUFFER_HIGH:
                await asyncio.wait_for(self.writer.drain(), timeout_s)  # the queue reads slower than we put
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self.pending.pop(call_id, None)

    async def close(self) -> None:
        self.read_task.cancel()
        await asyncio.gather(self.read_task, return_exceptions=True)


class QueueClient:
    """The queue's operations as coroutines, over the wire or over Ray calls.

    transport "auto" (default): the wire when the actor serves one this process
    can reach (same Ray node for a loopback socket), else Ray calls; "wire":
    the wire or an error; "ray": always Ray calls. One client per event loop
    (the connection belongs to the loop that opened it); a lost connection is
    reopened on the next call, an unreachable actor raises Ray's error.
    """

    def __init__(self, handle: Any, transport: str = "auto", tls: ClientTLS | None = None):
        if transport not in TRANSPORTS:
            raise ValueError(f"queue transport {transport!r} must be one of {list(TRANSPORTS)}")
        self.handle = handle
        self.transport = transport
        self.tls = tls
        self._tls_context: ssl.SSLContext | None = None
        self.in_use: str | None = None  # "wire" | "ray" once resolved
        self._conn: _Connection | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._connecting: asyncio.Lock | None = None

    # The queue's operations (operations.OPERATIONS), typed ------------------------------
    async def put(self, task: PrefillTask) -> PutResult:
        return await self.call("put", task)

    async def get_batch(self, worker_id: str, max_tokens: int, max_wait_ms: float = 0.0,
                        max_tasks: int | None = None, completed: list[str] | None = None,
                        adapters: bool = False) -> list[PrefillTask]:
        """``adapters``: this worker runs LoRA adapters (sent only then: a queue of an earlier
        version reads the call of a worker without them as before)."""
        if adapters:
            return await self.call("get_batch", worker_id, max_tokens, max_wait_ms, max_tasks, completed, True)
        return await self.call("get_batch", worker_id, max_tokens, max_wait_ms, max_tasks, completed)

    async def complete(self, worker_id: str, request_id: str | list[str]) -> bool:
        return await self.call("complete", worker_id, request_id)

    async def cancel(self, request_id: str) -> str:
        return await self.call("cancel", request_id)

    async def worker_gone(self, worker_id: str) -> dict[str, int]:
        return await self.call("worker_gone", worker_id)

    async def take_failed(self, origin: str) -> list[FailedTask]:
        return await self.call("take_failed", origin)

    async def fail(self, worker_id: str, request_id: str, reason: str, detail: str = "") -> bool:
        return await self.call("fail", worker_id, request_id, reason, detail)

    async def hold(self, worker_id: str, tasks: Iterable[PrefillTask]) -> int:
        return await self.call("hold", worker_id, list(tasks))

    async def instance_id(self) -> str:
        return await self.call("instance_id")

    async def alive(self, worker_id: str) -> str:
        """Heartbeat of a prefill worker serving a batch; the queue's instance id."""
        return await self.call("alive", worker_id)

    async def beat(self, worker_id: str, progress: dict | None = None) -> dict:
        """Heartbeat of a prefill worker serving a batch: the instance id and its cancelled tasks.
        `progress`: its compute thread's (`ComputeProgress.snapshot`); without it, the call is
        the one every version of the queue takes."""
        if progress is None:
            return await self.call("beat", worker_id)
        return await self.call("beat", worker_id, progress)

    async def take_failed_and_stats(self, origin: str) -> tuple[list[FailedTask], QueueStats]:
        return await self.call("take_failed_and_stats", origin)

    async def stats(self) -> QueueStats:
        return await self.call("stats")

    async def close(self) -> None:
        if self._conn is not None:
            await self._conn.close()
            self._conn = None

    # Plumbing ----------------------------------------------------------------------------
    async def call(self, method: str, *args: Any) -> Any:
        """Operation `method` (operations.OPERATIONS) with `args`, over the wire or over Ray;
        what the typed methods above call. Its timeout: the operation's own wait + CALL_SLACK_S."""
        op = operation(method)
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop, self._connecting = loop, asyncio.Lock()
        elif self._loop is not loop:
            raise RuntimeError("QueueClient is bound to the event loop it first ran in; "
                               "make one client per event loop")
        timeout_s = op.wait_s(args) + CALL_SLACK_S
        if self.transport == "ray" or self.in_use == "ray":
            self.in_use = "ray"
            return await self._ray_call(method, args, timeout_s)
        conn = self._conn
        if conn is None or conn.closed is not None:
            conn = await self._connect()
            if conn is None:  # auto: the wire is not reachable from here
                return await self._ray_call(method, args, timeout_s)
        body = await conn.call(method, op.encode_args(args), timeout_s)
        return self._result(op, body)

    async def _ray_call(self, method: str, args: tuple, timeout_s: float) -> Any:
        """The same call over Ray, coded as the wire codes it (`PrefillQueue.call_coded`):
        Ray carries msgpack bytes, never a pickled task or result."""
        return await ray_call(self.handle, method, *args, timeout_s=timeout_s)

    @staticmethod
    def _result(op: Operation, body: dict) -> Any:
        if not body.get("ok"):
            err = body.get("error") or {}
            raise QueueCallError(str(err.get("type", "Error")), str(err.get("message", "")))
        return op.decode_answer(body.get("r"))

    async def _connect(self) -> _Connection | None:
        if self._connecting is None:  # `call` binds the lock with the loop before it connects
            raise RuntimeError("QueueClient._connect before `call` bound it to an event loop")
        async with self._connecting:
            if self._conn is not None and self._conn.closed is None:
                return self._conn
            endpoint = await asyncio.wait_for(self.handle.wire_endpoint.remote(), CALL_SLACK_S)
            reason = self._unreachable(endpoint)
            if reason is not None:
                if self.transport == "wire":
                    raise QueueUnavailableError(f"queue wire unusable: {reason}")
                log.info("queue: using Ray calls (%s)", reason)
                self.in_use = "ray"
                return None
            host, port = endpoint["host"], endpoint["port"]
            tls = self._tls_for(endpoint)
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_connection(
                    host, port, limit=1 << 20, **tls), CONNECT_TIMEOUT_S)
                writer.write(pack_frame({"hello": endpoint["token"], "v": WIRE_VERSION}))
                reply = await asyncio.wait_for(read_frame(reader), HELLO_TIMEOUT_S)
            except ssl.SSLError as exc:  # never a silent fallback: the setting is wrong, or someone is in between
                raise QueueUnavailableError(
                    f"TLS with the queue wire at {host}:{port} failed: {exc}. Check queue.tls.ca (it must have "
                    f"signed the queue's certificate), that queue.tls.cert names "
                    f"{(self.tls and self.tls.server_name) or host}, and under mutual TLS "
                    "queue.tls.client_cert") from None
            except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, WireError) as exc:
                if self.transport == "wire":
                    raise QueueUnavailableError(f"queue wire at {endpoint['host']}:{endpoint['port']}: {exc!r}") from exc
                log.warning("queue: wire at %s:%s unreachable (%r); using Ray calls",
                            endpoint["host"], endpoint["port"], exc)
                self.in_use = "ray"
                return None
            if not (isinstance(reply, dict) and reply.get("ok")):
                writer.close()
                raise QueueUnavailableError(f"queue refused the connection: {reply!r}")
            self._conn = _Connection(reader, writer)
            self.in_use = "wire"
            return self._conn

    def _tls_for(self, endpoint: dict) -> dict:
        """open_connection's TLS arguments for `endpoint`; QueueUnavailableError when this client's
        TLS settings and the wire's disagree."""
        where = f"{endpoint['host']}:{endpoint['port']}"
        if not endpoint.get("tls"):
            if self.tls is not None:
                raise QueueUnavailableError(
                    f"the queue wire at {where} is plaintext but this client expects TLS (queue.tls is set): "
                    "refusing to send its token in clear text. The queue actor was started without queue.tls; "
                    "restart the cluster with the same topology")
            return {}
        if self.tls is None:
            raise QueueUnavailableError(
                f"the queue wire at {where} requires TLS but this client has no queue TLS settings: set queue.tls "
                "in the topology (worker config queue_tls)")
        if self._tls_context is None:
            self._tls_context = client_tls(self.tls)
        return {"ssl": self._tls_context, "server_hostname": self.tls.server_name or endpoint["host"],
                "ssl_handshake_timeout": CONNECT_TIMEOUT_S}

    @staticmethod
    def _unreachable(endpoint: dict | None) -> str | None:
        if endpoint is None:
            return "the queue serves no wire (queue.transport: ray)"
        if _is_loopback(endpoint["host"]):
            import ray

            here = ray.get_runtime_context().get_node_id()
            if endpoint.get("node_id") and endpoint["node_id"] != here:
                return (f"its wire listens on loopback of another Ray node ({endpoint['node_id'][:12]}); "
                        f"set queue.wire_bind: node in the topology for multi-node clusters")
        return None


async def ray_call(handle, method: str, *args, timeout_s: float = CALL_SLACK_S) -> Any:
    """One queue call on an actor handle over Ray, coded as the wire codes it: for callers
    that hold a handle but no client (the planner, `pdserve status`). Ray carries bytes only."""
    raw = await asyncio.wait_for(handle.call_coded.remote(pack_call(method, list(args))), timeout_s)
    return _answer(method, raw)


def ray_call_sync(handle, method: str, *args, timeout_s: float = CALL_SLACK_S) -> Any:
    """`ray_call` from synchronous code (no event loop running in this thread)."""
    import ray

    return _answer(method, ray.get(handle.call_coded.remote(pack_call(method, list(args))), timeout=timeout_s))


def _answer(method: str, raw: bytes) -> Any:
    """The result of a coded call's answer (`PrefillQueue.call_coded`), or its typed error."""
    body = unpack_body(raw, f"{method} over Ray")
    if not isinstance(body, dict):
        raise WireError(f"{method} over Ray: the answer is not a response body")
    return QueueClient._result(operation(method), body)


def open_queue(cfg, who: str) -> QueueClient:
    """A `QueueClient` on the cluster's prefill queue (created if absent) as a worker's config
    (`pdserve.cluster.worker_config.WorkerConfig`) names it; `who` needs Ray."""
    import ray

    from pdserve.cluster.queue.actor import get_or_create_queue

    if not ray.is_initialized():
        raise RuntimeError(f"{who} needs Ray: run it as a Ray actor or call ray.init first")
    tls = ClientTLS(**cfg.queue_tls) if cfg.queue_tls is not None else None
    return QueueClient(get_or_create_queue(cfg.queue_name, cfg.queue_namespace), cfg.queue_transport, tls=tls)
