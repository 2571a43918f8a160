"""The queue's wire format: framing, and THE serialiser of the queue's values.

Frame: ``u32 big-endian length | msgpack body`` (never pickle), at most
`MAX_FRAME_BYTES`. The first frame on a connection is the hello
``{"hello": token, "v": WIRE_VERSION}``, the token being the one the actor
hands out through its `wire_endpoint()` Ray method; it may be at most
`MAX_HELLO_BYTES`, and the server checks that from the length prefix alone,
so a peer without the token never makes it read or allocate a large body.
Then:

    request   {"id": n, "m": method, "a": [args]}
    response  {"id": n, "ok": true, "r": result}
              {"id": n, "ok": false, "error": {"type": ..., "message": ...}}

Values are plain msgpack: results travel as maps of their fields (`to_wire` /
`from_wire`), a task as the handoff's codec makes it (kvtransfer/task.py). `CODECS` says, for
every method the wire serves, how its arguments and its result are encoded
and decoded on each side; the server and the client both use it, and nothing
else serialises a task.
"""

from __future__ import annotations

import asyncio
from dataclasses import fields
from typing import Any, Callable, NamedTuple

import msgpack

from pdserve.kvtransfer.task import PrefillTask, TaskFormatError, task_from_wire, task_to_wire

from pdserve.cluster.queue.answers import FailedTask, PutResult, QueueStats

WIRE_VERSION = 1
MAX_FRAME_BYTES = 64 << 20
# The hello is ~60 bytes; anything larger before a valid hello closes the connection
# unread (a peer without the token gets no more than this much of the server's memory).
MAX_HELLO_BYTES = 1024
HELLO_TIMEOUT_S = 10.0


class WireError(Exception):
    """A malformed frame or a protocol violation."""


# -- framing ----------------------------------------------------------------------------
def pack_frame(body: Any) -> bytes:
    payload = msgpack.packb(body, use_bin_type=True)
    if len(payload) > MAX_FRAME_BYTES:
        raise WireError(f"frame of {len(payload)} bytes exceeds MAX_FRAME_BYTES={MAX_FRAME_BYTES}")
    return len(payload).to_bytes(4, "big") + payload


async def read_frame(reader: asyncio.StreamReader, max_bytes: int = MAX_FRAME_BYTES,
                     what: str = "MAX_FRAME_BYTES", why: str = "") -> Any:
    """The next frame's body; IncompleteReadError at end of stream, WireError if malformed.
    A length over `max_bytes` (named `what` in the error, then `why`) is refused before any
    of the body is read."""
    size = int.from_bytes(await reader.readexactly(4), "big")
    if size > max_bytes:
        raise WireError(f"frame of {size} bytes exceeds {what}={max_bytes}{why}")
    payload = await reader.readexactly(size)
    try:
        return msgpack.unpackb(payload, raw=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise WireError(f"undecodable frame: {exc}") from None


def error_body(call_id: int, type_name: str, message: str) -> dict[str, Any]:
    """A failed call's response."""
    return {"id": call_id, "ok": False, "error": {"type": type_name, "message": message}}


def pack_call(method: str, args: list) -> bytes:
    """A call as the Ray fallback carries it (`PrefillQueue.call_coded`): the method's
    arguments encoded by its codec, in one msgpack body, so Ray moves bytes and never pickles
    a task or any other queue value across nodes."""
    return msgpack.packb({"m": method, "a": CODECS[method].encode_args(list(args))}, use_bin_type=True)


def unpack_body(payload: bytes, what: str) -> Any:
    """A msgpack body from the Ray fallback; WireError if it is not one."""
    if not isinstance(payload, (bytes, bytearray)) or len(payload) > MAX_FRAME_BYTES:
        raise WireError(f"{what}: expected at most {MAX_FRAME_BYTES} bytes of msgpack")
    try:
        return msgpack.unpackb(payload, raw=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise WireError(f"{what}: undecodable body: {exc}") from None


# -- values -----------------------------------------------------------------------------
def to_wire(obj: Any) -> dict[str, Any]:
    """A queue value (PrefillTask, PutResult, QueueStats, FailedTask) as a map of its fields
    (shallow: see `task_to_wire`)."""
    if isinstance(obj, PrefillTask):
        return task_to_wire(obj)
    out = {f.name: getattr(obj, f.name) for f in fields(obj)}
    if "task" in out:  # FailedTask
        out["task"] = task_to_wire(out["task"])
    return out


def from_wire(cls: type, body: Any, what: str) -> Any:
    """Rebuild `cls` from its map; a clear WireError (naming the field) instead of a TypeError.
    A bad value is the class's own ValueError (a PrefillTask's cached_len, priority, ...)."""
    if cls is PrefillTask:
        try:
            return task_from_wire(body, what)
        except TaskFormatError as exc:
            raise WireError(str(exc)) from None
    if not isinstance(body, dict):
        raise WireError(f"{what}: expected a map, got {type(body).__name__}")
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(body) - names)
    if unknown:
        raise WireError(f"{what}: unknown field(s) {unknown}")
    if cls is FailedTask:
        body = {**body, "task": from_wire(PrefillTask, body.get("task"), f"{what}.task")}
    try:
        return cls(**body)
    except TypeError as exc:
        raise WireError(f"{what}: {exc}") from None


# -- the methods the wire serves -----------------------------------------------------------
class MethodCodec(NamedTuple):
    """How one method's values cross the wire: arguments (client -> server), result (back)."""

    encode_args: Callable[[list], list]  # on the client
    decode_args: Callable[[list], list]  # on the server
    encode_result: Callable[[Any], Any]  # on the server
    decode_result: Callable[[Any], Any]  # on the client


def _same(value: Any) -> Any:
    return value


def _put_args_in(args: list) -> list:
    if len(args) != 1:
        raise WireError(f"put takes 1 argument (the task), got {len(args)}")
    return [from_wire(PrefillTask, args[0], "put.task")]


def _hold_args_in(args: list) -> list:
    if len(args) != 2 or not isinstance(args[1], list):
        raise WireError("hold takes 2 arguments (worker_id, [tasks])")
    return [args[0], [from_wire(PrefillTask, t, "hold.task") for t in args[1]]]


def _list_in(cls: type, what: str) -> Callable[[Any], list]:
    def decode(body: Any) -> list:
        if not isinstance(body, list):
            raise WireError(f"{what}: expected a list, got {type(body).__name__}")
        return [from_wire(cls, item, what) for item in body]
    return decode


def _list_out(items: list) -> list:
    return [to_wire(item) for item in items]


def _pair_out(pair: tuple) -> list:
    return [_list_out(pair[0]), to_wire(pair[1])]


def _pair_in(body: Any) -> tuple:
    return _list_in(FailedTask, "failed task")(body[0]), from_wire(QueueStats, body[1], "stats")


_PLAIN = MethodCodec(list, _same, _same, _same)  # arguments and result are plain values

CODECS: dict[str, MethodCodec] = {
    "put": MethodCodec(lambda a: [to_wire(a[0])], _put_args_in, to_wire,
                       lambda b: from_wire(PutResult, b, "put result")),
    "get_batch": MethodCodec(list, _same, _list_out, _list_in(PrefillTask, "get_batch result")),
    "complete": _PLAIN,
    "cancel": _PLAIN,
    "worker_gone": _PLAIN,
    "take_failed": MethodCodec(list, _same, _list_out, _list_in(FailedTask, "failed task")),
    "fail": _PLAIN,
    "hold": MethodCodec(lambda a: [a[0], _list_out(list(a[1]))], _hold_args_in, _same, _same),
    "instance_id": _PLAIN,
    "alive": _PLAIN,
    "beat": _PLAIN,
    "take_failed_and_stats": MethodCodec(list, _same, _pair_out, _pair_in),
    "stats": MethodCodec(list, _same, to_wire, lambda b: from_wire(QueueStats, b, "stats")),
}
