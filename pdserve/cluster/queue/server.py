"""The queue's wire server: queue calls over one TCP connection per process, beside Ray.

Ray runs the queue actor (placement, naming, lifetime) and finds it for every
process; the calls themselves go over a plain socket that the actor serves
from its own event loop. A Ray actor call costs two core-worker hops, a task
submission and pickling on each side (~3 ms p50, a tail of 10-40 ms on a
loaded 2-core box); a frame on an open connection costs one socket write and
one event-loop wake-up on each side. `bench/queue_latency.py` measures both
transports side by side. The frames and the values in them: `frames`.

Only processes that can reach the actor through Ray can use the socket: the
first frame must carry the token the actor hands out via `wire_endpoint()`.
That frame may be at most `MAX_HELLO_BYTES`: a larger length prefix (or any
malformed first frame) closes the connection before its body is read, so a
peer without the token costs the server a 4-byte read, not a 64 MiB buffer.
With `queue.tls` in the topology the socket speaks TLS only (`server_tls`;
`client_ca` set: mutual TLS), so the token and the tasks never cross the
network in clear text; a plaintext peer fails the handshake and is dropped.
Calls on one connection run concurrently (a long-polling `get_batch` does not
hold up a `put`); responses come back in completion order, matched by id.

A connection that closes while its `get_batch` waits ends that poll without
taking anything; a batch taken for a connection that closed before it could
be sent goes back to the queue at its old place (`on_undelivered`), so a
killed prefill worker never strands tasks. Ray calls cannot offer this: a
poll outlives its killed caller (see `PrefillQueue.get_batch`).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import ssl
from typing import Any, Callable

from pdserve.cluster.queue.frames import (
    HELLO_TIMEOUT_S,
    MAX_HELLO_BYTES,
    WIRE_VERSION,
    WireError,
    error_body,
    pack_frame,
    read_frame,
)
from pdserve.cluster.queue.operations import Operation, decode_call, perform

log = logging.getLogger(__name__)


def server_tls(cert: str, key: str, client_ca: str | None = None) -> ssl.SSLContext:
    """The wire's TLS context (TLS 1.2 or later): `cert`/`key` are the queue's certificate
    chain and key (PEM; the certificate must name the address the wire advertises), and
    `client_ca`, when set, makes it mutual TLS. A file that does not load is a ValueError
    naming its `queue.tls` key."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"queue.tls.cert/queue.tls.key: cannot load {cert} with {key}: {exc}") from None
    if client_ca:
        try:
            ctx.load_verify_locations(cafile=client_ca)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"queue.tls.client_ca: cannot load {client_ca}: {exc}") from None
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


class WireServer:
    """Serves the queue's operations (`operations.OPERATIONS`) on a TCP socket from the running
    event loop, each by `target`'s method of its name (the queue actor's; a coroutine or not).

    `on_undelivered(worker_id, tasks)` is called with the tasks an operation handed out
    (`Operation.hands_out`: get_batch) that could not be sent (its connection closed first). `tls`: serve TLS only (`server_tls`).
    """

    def __init__(self, target: Any, on_undelivered: Callable[[str, list], None] | None = None,
                 tls: ssl.SSLContext | None = None):
        self.target = target
        self.on_undelivered = on_undelivered
        self.tls = tls
        self.token = secrets.token_hex(16)
        self.counters = {"connections": 0, "calls": 0, "errors": 0, "bad_hello": 0, "undelivered": 0}
        self._server: asyncio.base_events.Server | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> tuple[str, int]:
        tls: dict[str, Any] = ({"ssl": self.tls, "ssl_handshake_timeout": HELLO_TIMEOUT_S}
                               if self.tls is not None else {})
        self._server = await asyncio.start_server(self._serve, host, port, limit=1 << 20, **tls)
        sock_host, sock_port = self._server.sockets[0].getsockname()[:2]
        return sock_host, sock_port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        calls: set[asyncio.Task] = set()
        peer = writer.get_extra_info("peername")
        authenticated = False
        try:
            # The hello's size is checked from its length prefix: nothing larger is read.
            hello = await asyncio.wait_for(
                read_frame(reader, MAX_HELLO_BYTES, "MAX_HELLO_BYTES", ": the first frame must be the hello"),
                HELLO_TIMEOUT_S)
            if not (isinstance(hello, dict) and isinstance(hello.get("hello"), str)
                    and hmac.compare_digest(hello["hello"].encode(), self.token.encode())):
                self.counters["bad_hello"] += 1
                writer.write(pack_frame(error_body(
                    0, "PermissionError", "bad hello: the token from wire_endpoint() is required")))
                return
            if hello.get("v") != WIRE_VERSION:
                writer.write(pack_frame(error_body(0, "WireError", f"wire version {hello.get('v')!r} unsupported; "
                                                                   f"this queue speaks {WIRE_VERSION}")))
                return
            writer.write(pack_frame({"id": 0, "ok": True, "r": {"v": WIRE_VERSION}}))
            authenticated = True
            self.counters["connections"] += 1
            while True:
                request = await read_frame(reader)
                task = asyncio.create_task(self._call(writer, request))
                calls.add(task)
                task.add_done_callback(calls.discard)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError, ssl.SSLError):
            pass  # peer closed, broke the TLS session, or never said hello
        except WireError as exc:
            if not authenticated:
                self.counters["bad_hello"] += 1
            log.warning("queue wire: dropping connection from %s: %s", peer, exc)
            if not writer.is_closing():
                writer.write(pack_frame(error_body(0, "WireError", str(exc))))
        finally:
            for task in calls:  # a waiting get_batch ends without taking anything
                task.cancel()
            writer.close()

    async def _call(self, writer: asyncio.StreamWriter, request: Any) -> None:
        call_id: Any = request.get("id") if isinstance(request, dict) else None  # as the client sent it
        op: Operation | None = None
        args: list = []
        result, error = None, None
        try:
            if not isinstance(call_id, int) or call_id <= 0:
                raise WireError("request without a positive integer 'id'")
            op, args = decode_call(request.get("m"), request.get("a", []))
            result = await perform(self.target, op, args)
            body = {"id": call_id, "ok": True, "r": op.encode_answer(result)}
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001  (every error goes back to the caller, typed)
            self.counters["errors"] += 1
            error = exc
            body = error_body(call_id or 0, type(exc).__name__, str(exc))
        self.counters["calls"] += 1
        # tasks taken for the caller (get_batch), which go back to the queue if they cannot reach it
        handed_out: list = result if op is not None and op.hands_out and isinstance(result, list) else []
        give_back = self.on_undelivered if handed_out else None
        if writer.is_closing():
            if give_back is not None and error is None:
                self.counters["undelivered"] += len(handed_out)
                give_back(args[0], handed_out)
            return
        try:
            writer.write(pack_frame(body))
        except WireError as exc:  # the result itself is too large
            writer.write(pack_frame(error_body(call_id, "WireError", str(exc))))
            if give_back is not None:
                give_back(args[0], handed_out)
