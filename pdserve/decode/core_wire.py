"""The wire between a decode worker's API process and its engine-core process
(decode/core_client.py, decode/core_process.py): length-prefixed msgpack frames over a
Unix socket pair, never pickle. Each message is a map with a ``t`` (its kind); the values
the engine hands its callers travel as the maps of their dataclasses' fields.

Two socket pairs: the stream (requests and commands one way; each step's deltas, emitted
items and the engine's death the other) and the reads (one request, one reply, for the
figures the router reads at admission: a blocking round trip from the API process, answered
by a thread of the core process beside its engine thread).
"""

from __future__ import annotations

import asyncio
import socket
import struct
from dataclasses import asdict, fields
from typing import Any

import msgpack

from pdserve.engine import EngineLoad, LoRARequest, RequestDelta, SamplingParams
from pdserve.engine.driver import StepInfo
from pdserve.engine.request import InvalidRequestError
from pdserve.engine.step_budget import StepCost, StepTargets

from .final_info import FinalInfo

_LEN = struct.Struct("!I")
MAX_FRAME = 256 << 20  # a step's deltas with prompt logprobs stay far below this


class WireError(RuntimeError):
    """The other process broke the wire (closed it, or sent what is not a frame)."""


def pack(msg: dict) -> bytes:
    body = msgpack.packb(msg, use_bin_type=True)
    return _LEN.pack(len(body)) + body


def unpack(body: bytes) -> dict:
    msg = msgpack.unpackb(body, raw=False, strict_map_key=False)
    if not isinstance(msg, dict) or "t" not in msg:
        raise WireError(f"not a message: {type(msg).__name__}")
    return msg


def send(sock: socket.socket, msg: dict) -> None:
    """Blocking send of one frame."""
    sock.sendall(pack(msg))


def recv(sock: socket.socket) -> dict:
    """Blocking read of one frame (the socket's timeout applies); WireError at EOF."""
    (n,) = _LEN.unpack(_recv_exactly(sock, _LEN.size))
    if n > MAX_FRAME:
        raise WireError(f"frame of {n} bytes (at most {MAX_FRAME})")
    return unpack(_recv_exactly(sock, n))


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise WireError("the other process closed the wire")
        buf += part
    return bytes(buf)


async def read(reader: asyncio.StreamReader) -> dict:
    """One frame from an asyncio stream; WireError at EOF."""
    try:
        (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
        if n > MAX_FRAME:
            raise WireError(f"frame of {n} bytes (at most {MAX_FRAME})")
        return unpack(await reader.readexactly(n))
    except asyncio.IncompleteReadError:
        raise WireError("the other process closed the wire") from None


# -- the engine's values as maps -------------------------------------------------------------
def _of(cls, d: dict | None):
    if d is None:
        return None
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in d.items() if k in names})


def params_out(p: SamplingParams) -> dict:
    return asdict(p)


def params_in(d: dict) -> SamplingParams:
    return _of(SamplingParams, d)


def delta_out(d: RequestDelta) -> dict:
    return asdict(d)


def delta_in(d: dict) -> RequestDelta:
    return _of(RequestDelta, d)


def final_out(f: FinalInfo | None) -> dict | None:
    return None if f is None else asdict(f)


def final_in(d: dict | None) -> FinalInfo | None:
    f = _of(FinalInfo, d)
    if f is not None and f.spec_tokens is not None:
        f.spec_tokens = (int(f.spec_tokens[0]), int(f.spec_tokens[1]))
    return f


def info_out(i: StepInfo) -> dict:
    return asdict(i)


def info_in(d: dict) -> StepInfo:
    return _of(StepInfo, d)


def load_out(load: EngineLoad) -> dict:
    return asdict(load)


def load_in(d: dict) -> EngineLoad:
    return _of(EngineLoad, d)


def lora_out(lora: LoRARequest | None) -> dict | None:
    return None if lora is None else asdict(lora)


def lora_in(d: dict | None) -> LoRARequest | None:
    return _of(LoRARequest, d)


def plan_out(cost: StepCost | None, targets: StepTargets | None) -> dict:
    return {"cost": None if cost is None else asdict(cost), "targets": None if targets is None else asdict(targets)}


def plan_in(d: dict) -> tuple[StepCost | None, StepTargets | None]:
    return _of(StepCost, d["cost"]), _of(StepTargets, d["targets"])


def error_out(exc: BaseException) -> dict:
    """An error a request's stream ends with: its kind, message and (a request's) field."""
    out: dict[str, Any] = {"kind": exc.__class__.__name__, "message": str(exc)}
    if isinstance(exc, InvalidRequestError):
        out["field"] = exc.field
        out["message"] = str(exc).removeprefix(f"{exc.field}: ")
    return out


def error_in(d: dict) -> BaseException:
    """The error as the API side raises it: a request's (InvalidRequestError, naming its field)
    or the engine's (RuntimeError with the core's class name in front)."""
    if d.get("field") is not None:
        return InvalidRequestError(d["field"], d["message"])
    return RuntimeError(f"{d['kind']}: {d['message']}")
