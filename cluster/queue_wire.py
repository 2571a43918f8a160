"""The queue's wire: queue calls over one TCP connection per process, beside Ray.

Ray runs the queue actor (placement, naming, lifetime) and finds it for every
process; the calls themselves go over a plain socket that the actor serves
from its own event loop. A Ray actor call costs two core-worker hops, a task
submission and pickling on each side (~3 ms p50, a tail of 10-40 ms on a
loaded 2-core box); a frame on an open connection costs one socket write and
one event-loop wake-up on each side. `bench/queue_latency.py` measures both
transports side by side.

Frame: ``u32 big-endian length | msgpack body`` (never pickle), at most
`MAX_FRAME_BYTES`. The first frame on a connection is the hello
``{"hello": token, "v": WIRE_VERSION}``, the token being the one the actor
hands out through its `wire_endpoint()` Ray method (so only processes that
can reach the actor through Ray can use the socket). Then:

    request   {"id": n, "m": method, "a": [args]}
    response  {"id": n, "ok": true, "r": result}
              {"id": n, "ok": false, "error": {"type": ..., "message": ...}}

Calls on one connection run concurrently (a long-polling `get_batch` does not
hold up a `put`); responses come back in completion order, matched by id.
Values are plain msgpack: tasks and results travel as maps of their fields.

A connection that closes while its `get_batch` waits ends that poll without
taking anything; a batch taken for a connection that closed before it could
be sent goes back to the queue at its old place (`on_undelivered`), so a
killed prefill worker never strands tasks. Ray calls cannot offer this: a
poll outlives its killed caller (see `PrefillQueue.get_batch`).

`QueueClient` is what workers hold: the actor's methods as coroutines, over
the wire when the actor is reachable, else over Ray calls.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import secrets
from dataclasses import fields
from typing import Any, Callable

import msgpack

log = logging.getLogger(__name__)

WIRE_VERSION = 1
MAX_FRAME_BYTES = 64 << 20
HELLO_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 10.0
CALL_SLACK_S = 30.0  # a call's reply may take this long beyond its own wait (a wedged actor)
WRITE_BUFFER_HIGH = 1 << 20  # a client waits for its socket to drain beyond this many unsent bytes
TRANSPORTS = ("auto", "wire", "ray")


class WireError(Exception):
    """A malformed frame or a protocol violation."""


class QueueUnavailableError(ConnectionError):
    """The connection to the queue actor is gone (the actor died or restarted)."""


class QueueCallError(RuntimeError):
    """The queue actor raised while serving a call; `type` is the exception's class name."""

    def __init__(self, type_name: str, message: str):
        super().__init__(f"{type_name}: {message}")
        self.type = type_name


# -- framing ----------------------------------------------------------------------------
def pack_frame(body: Any) -> bytes:
    payload = msgpack.packb(body, use_bin_type=True)
    if len(payload) > MAX_FRAME_BYTES:
        raise WireError(f"frame of {len(payload)} bytes exceeds MAX_FRAME_BYTES={MAX_FRAME_BYTES}")
    return len(payload).to_bytes(4, "big") + payload


async def read_frame(reader: asyncio.StreamReader) -> Any:
    """The next frame's body; IncompleteReadError at end of stream, WireError if malformed."""
    size = int.from_bytes(await reader.readexactly(4), "big")
    if size > MAX_FRAME_BYTES:
        raise WireError(f"frame of {size} bytes exceeds MAX_FRAME_BYTES={MAX_FRAME_BYTES}")
    payload = await reader.readexactly(size)
    try:
        return msgpack.unpackb(payload, raw=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise WireError(f"undecodable frame: {exc}") from None


# -- values -----------------------------------------------------------------------------
def to_wire(obj: Any) -> dict[str, Any]:
    """A queue dataclass (PrefillTask, PutResult, QueueStats, FailedTask) as a map of its
    fields. Shallow on purpose: `dataclasses.asdict` deep-copies every token id (~0.8 ms
    for a 512-token task)."""
    out = {f.name: getattr(obj, f.name) for f in fields(obj)}
    if "task" in out:  # FailedTask
        out["task"] = to_wire(out["task"])
    return out


def from_wire(cls: type, body: Any, what: str) -> Any:
    """Rebuild `cls` from its map; a clear WireError (naming the field) instead of a TypeError."""
    if not isinstance(body, dict):
        raise WireError(f"{what}: expected a map, got {type(body).__name__}")
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(body) - names)
    if unknown:
        raise WireError(f"{what}: unknown field(s) {unknown}")
    try:
        return cls(**body)
    except TypeError as exc:
        raise WireError(f"{what}: {exc}") from None


# The methods the wire serves: how to decode the arguments on the server (None = as sent)
# and how to encode / decode the result. Imported lazily to keep queue.py importable first.
def _codecs():
    from .queue import FailedTask, PrefillTask, PutResult, QueueStats

    def task_arg(args):
        if len(args) != 1:
            raise WireError(f"put takes 1 argument (the task), got {len(args)}")
        return [from_wire(PrefillTask, args[0], "put.task")]

    def tasks_out(batch):
        return [to_wire(t) for t in batch]

    def tasks_in(body):
        return [from_wire(PrefillTask, t, "get_batch result") for t in body]

    def hold_args(args):
        if len(args) != 2 or not isinstance(args[1], list):
            raise WireError("hold takes 2 arguments (worker_id, [tasks])")
        return [args[0], [from_wire(PrefillTask, t, "hold.task") for t in args[1]]]

    def failed_in(body):
        return [FailedTask(**{**f, "task": from_wire(PrefillTask, f["task"], "failed task")}) for f in body]

    def pair_out(pair):
        return [[to_wire(f) for f in pair[0]], to_wire(pair[1])]

    def pair_in(body):
        return failed_in(body[0]), from_wire(QueueStats, body[1], "stats")

    same = (lambda v: v)
    return {
        # method: (decode args on the server, encode result, decode result on the client)
        "put": (task_arg, to_wire, lambda b: from_wire(PutResult, b, "put result")),
        "get_batch": (None, tasks_out, tasks_in),
        "complete": (None, same, same),
        "cancel": (None, same, same),
        "worker_gone": (None, same, same),
        "take_failed": (None, lambda fs: [to_wire(f) for f in fs], failed_in),
        "fail": (None, same, same),
        "hold": (hold_args, same, same),
        "instance_id": (None, same, same),
        "take_failed_and_stats": (None, pair_out, pair_in),
        "stats": (None, to_wire, lambda b: from_wire(QueueStats, b, "stats")),
    }


_CODECS: dict | None = None


def codecs() -> dict:
    global _CODECS
    if _CODECS is None:
        _CODECS = _codecs()
    return _CODECS


# -- server (inside the queue actor) -----------------------------------------------------
class WireServer:
    """Serves `target`'s queue methods on a TCP socket from the running event loop.

    `on_undelivered(worker_id, tasks)` is called with a get_batch result that
    could not be sent (its connection closed first).
    """

    def __init__(self, target: Any, on_undelivered: Callable[[str, list], None] | None = None):
        self.target = target
        self.on_undelivered = on_undelivered
        self.token = secrets.token_hex(16)
        self.counters = {"connections": 0, "calls": 0, "errors": 0, "bad_hello": 0, "undelivered": 0}
        self._server: asyncio.base_events.Server | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> tuple[str, int]:
        self._server = await asyncio.start_server(self._serve, host, port, limit=1 << 20)
        sock_host, sock_port = self._server.sockets[0].getsockname()[:2]
        return sock_host, sock_port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        calls: set[asyncio.Task] = set()
        peer = writer.get_extra_info("peername")
        try:
            hello = await asyncio.wait_for(read_frame(reader), HELLO_TIMEOUT_S)
            if not (isinstance(hello, dict) and isinstance(hello.get("hello"), str)
                    and hmac.compare_digest(hello["hello"], self.token)):
                self.counters["bad_hello"] += 1
                writer.write(pack_frame({"id": 0, "ok": False, "error": {
                    "type": "PermissionError", "message": "bad hello: the token from wire_endpoint() is required"}}))
                return
            if hello.get("v") != WIRE_VERSION:
                writer.write(pack_frame({"id": 0, "ok": False, "error": {
                    "type": "WireError", "message": f"wire version {hello.get('v')!r} unsupported; "
                                                    f"this queue speaks {WIRE_VERSION}"}}))
                return
            writer.write(pack_frame({"id": 0, "ok": True, "r": {"v": WIRE_VERSION}}))
            self.counters["connections"] += 1
            while True:
                request = await read_frame(reader)
                task = asyncio.create_task(self._call(writer, request))
                calls.add(task)
                task.add_done_callback(calls.discard)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError):
            pass  # peer closed or never said hello
        except WireError as exc:
            log.warning("queue wire: dropping connection from %s: %s", peer, exc)
            if not writer.is_closing():
                writer.write(pack_frame({"id": 0, "ok": False, "error": {"type": "WireError", "message": str(exc)}}))
        finally:
            for task in calls:  # a waiting get_batch ends without taking anything
                task.cancel()
            writer.close()

    async def _call(self, writer: asyncio.StreamWriter, request: Any) -> None:
        call_id = request.get("id") if isinstance(request, dict) else None
        method, result, error = None, None, None
        try:
            if not isinstance(call_id, int) or call_id <= 0:
                raise WireError("request without a positive integer 'id'")
            method, args = request.get("m"), request.get("a", [])
            if method not in codecs():
                raise WireError(f"unknown method {method!r}; the queue serves {sorted(codecs())}")
            if not isinstance(args, list):
                raise WireError(f"{method}: 'a' must be a list of arguments")
            decode_args, encode_result, _ = codecs()[method]
            if decode_args is not None:
                args = decode_args(args)
            result = await getattr(self.target, method)(*args)
            body = {"id": call_id, "ok": True, "r": encode_result(result)}
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001  (every error goes back to the caller, typed)
            self.counters["errors"] += 1
            error = exc
            body = {"id": call_id or 0, "ok": False, "error": {"type": type(exc).__name__, "message": str(exc)}}
        self.counters["calls"] += 1
        if writer.is_closing():
            if method == "get_batch" and error is None and result and self.on_undelivered is not None:
                self.counters["undelivered"] += len(result)
                self.on_undelivered(args[0], result)
            return
        try:
            writer.write(pack_frame(body))
        except WireError as exc:  # the result itself is too large
            writer.write(pack_frame({"id": call_id, "ok": False, "error": {"type": "WireError", "message": str(exc)}}))
            if method == "get_batch" and result and self.on_undelivered is not None:
                self.on_undelivered(args[0], result)


# -- client -------------------------------------------------------------------------------
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
                fut = self.pending.pop(body.get("id"), None) if isinstance(body, dict) else None
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
    """The queue actor's methods as coroutines, over the wire or over Ray calls.

    transport "auto" (default): the wire when the actor serves one this process
    can reach (same Ray node for a loopback socket), else Ray calls; "wire":
    the wire or an error; "ray": always Ray calls. One client per event loop
    (the connection belongs to the loop that opened it); a lost connection is
    reopened on the next call, an unreachable actor raises Ray's error.
    """

    def __init__(self, handle: Any, transport: str = "auto"):
        if transport not in TRANSPORTS:
            raise ValueError(f"queue transport {transport!r} must be one of {list(TRANSPORTS)}")
        self.handle = handle
        self.transport = transport
        self.in_use: str | None = None  # "wire" | "ray" once resolved
        self._conn: _Connection | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._connecting: asyncio.Lock | None = None

    # The actor's API -----------------------------------------------------------------
    async def put(self, task):
        return await self._call("put", task)

    async def get_batch(self, worker_id: str, max_tokens: int, max_wait_ms: float = 0.0,
                        max_tasks: int | None = None, completed: list[str] | None = None):
        return await self._call("get_batch", worker_id, max_tokens, max_wait_ms, max_tasks, completed,
                                wait_s=max_wait_ms / 1000.0)

    async def complete(self, worker_id: str, request_id: str | list[str]) -> bool:
        return await self._call("complete", worker_id, request_id)

    async def cancel(self, request_id: str) -> str:
        return await self._call("cancel", request_id)

    async def worker_gone(self, worker_id: str) -> dict[str, int]:
        return await self._call("worker_gone", worker_id)

    async def take_failed(self, origin: str):
        return await self._call("take_failed", origin)

    async def fail(self, worker_id: str, request_id: str, reason: str, detail: str = "") -> bool:
        return await self._call("fail", worker_id, request_id, reason, detail)

    async def hold(self, worker_id: str, tasks) -> int:
        return await self._call("hold", worker_id, list(tasks))

    async def instance_id(self) -> str:
        return await self._call("instance_id")

    async def take_failed_and_stats(self, origin: str):
        return await self._call("take_failed_and_stats", origin)

    async def stats(self):
        return await self._call("stats")

    async def close(self) -> None:
        if self._conn is not None:
            await self._conn.close()
            self._conn = None

    # Plumbing ----------------------------------------------------------------------------
    async def _call(self, method: str, *args, wait_s: float = 0.0):
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop, self._connecting = loop, asyncio.Lock()
        elif self._loop is not loop:
            raise RuntimeError("QueueClient is bound to the event loop it first ran in; "
                               "make one client per event loop")
        timeout_s = wait_s + CALL_SLACK_S
        if self.transport == "ray" or self.in_use == "ray":
            self.in_use = "ray"
            return await asyncio.wait_for(getattr(self.handle, method).remote(*args), timeout_s)
        conn = self._conn
        if conn is None or conn.closed is not None:
            conn = await self._connect()
            if conn is None:  # auto: the wire is not reachable from here
                return await asyncio.wait_for(getattr(self.handle, method).remote(*args), timeout_s)
        if method == "put":
            wire_args = [to_wire(args[0])]
        elif method == "hold":
            wire_args = [args[0], [to_wire(t) for t in args[1]]]
        else:
            wire_args = list(args)
        body = await conn.call(method, wire_args, timeout_s)
        if not body.get("ok"):
            err = body.get("error") or {}
            raise QueueCallError(str(err.get("type", "Error")), str(err.get("message", "")))
        return codecs()[method][2](body.get("r"))

    async def _connect(self) -> _Connection | None:
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
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(endpoint["host"], endpoint["port"], limit=1 << 20), CONNECT_TIMEOUT_S)
                writer.write(pack_frame({"hello": endpoint["token"], "v": WIRE_VERSION}))
                reply = await asyncio.wait_for(read_frame(reader), HELLO_TIMEOUT_S)
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
