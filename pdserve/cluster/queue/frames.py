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
`from_wire`), a task as the handoff's codec makes it (kvtransfer/task.py). Each kind of
value an operation carries has its `Value` codec here (`TASK`, `TASKS`, `PUT_RESULT`,
`STATS`, `FAILED_TASKS`, `FAILED_AND_STATS`, `PLAIN`); which operation carries which is
declared once, in `operations.OPERATIONS`. Nothing else serialises a task.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, fields
from typing import Any, Callable

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


# -- the values operations carry -----------------------------------------------------------
@dataclass(frozen=True)
class Value:
    """How one kind of value crosses the wire: `encode` on the side that sends it, `decode`
    (the body, and what it is for the error) on the side that receives it: a WireError, or the
    value's own ValueError, when the body is malformed."""

    encode: Callable[[Any], Any]
    decode: Callable[[Any, str], Any]


def _same(value: Any, what: str = "") -> Any:
    return value


def fields_of(cls: type) -> Value:
    """A queue value as the map of its fields (`to_wire`, `from_wire`)."""
    return Value(to_wire, lambda body, what: from_wire(cls, body, what))


def list_of(item: Value) -> Value:
    """A list of values of one kind."""
    def decode(body: Any, what: str) -> list:
        if not isinstance(body, list):
            raise WireError(f"{what}: expected a list, got {type(body).__name__}")
        return [item.decode(each, what) for each in body]
    return Value(lambda items: [item.encode(each) for each in items], decode)


def pair_of(first: Value, second: Value) -> Value:
    """A pair of values, as a list of two."""
    def decode(body: Any, what: str) -> tuple:
        if not isinstance(body, list) or len(body) != 2:
            raise WireError(f"{what}: expected a list of 2, got {type(body).__name__}")
        return first.decode(body[0], what), second.decode(body[1], what)
    return Value(lambda pair: [first.encode(pair[0]), second.encode(pair[1])], decode)


PLAIN = Value(_same, _same)  # plain msgpack values (str, int, float, None, lists and maps of them)
TASK = fields_of(PrefillTask)
TASKS = list_of(TASK)
PUT_RESULT = fields_of(PutResult)
STATS = fields_of(QueueStats)
FAILED_TASKS = list_of(fields_of(FailedTask))
FAILED_AND_STATS = pair_of(FAILED_TASKS, STATS)
