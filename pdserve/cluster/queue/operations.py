"""The queue's operations, declared once: `OPERATIONS`.

Each `Operation` names a method of the queue, says how its arguments and its answer
cross the wire (the `frames` value codecs) and who serves it. Everything else follows
from this table:

- the actor (`actor.PrefillQueue`): an operation ``by="core"`` is `QueueCore`'s method
  of its name served as is (the actor's Ray method for it is made from the core's,
  its signature included); one ``by="actor"`` is the actor's own method, which adds
  to the core (the long poll, waking polls, logs);
- the dispatch of a coded call, the same on both transports (`decode_call`, `perform`):
  the wire server (`server.WireServer`) and the Ray fallback (`perform_coded`, the
  actor's `call_coded`);
- the client (`client.QueueClient.call`: its typed methods are one line each) and the
  Ray fallback's request body (`pack_call`).

Adding an operation is one entry here and its core method (or the actor's, ``by="actor"``);
a one-line method on `QueueClient` gives callers its types.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Literal, Sequence

import msgpack

from pdserve.cluster.queue.frames import (
    FAILED_AND_STATS,
    FAILED_TASKS,
    PLAIN,
    PUT_RESULT,
    STATS,
    TASK,
    TASKS,
    Value,
    WireError,
    unpack_body,
)


@dataclass(frozen=True)
class Operation:
    """One queue operation: its method's name and how its values cross the wire.

    `args`: the arguments' codecs, (name, `Value`) each, for an operation whose arguments
    are not all plain (their number is then checked on both sides); None: plain values,
    as many as the method takes (the method's signature checks them). `answer`: its
    result's codec. `by`: "core" (QueueCore's method, served as is) or "actor"
    (PrefillQueue's own). `wait_ms_arg`: where its argument bounding how long it waits
    (in ms) sits: a call's timeout grows by that wait. `hands_out`: its answer is tasks
    taken for the worker named by its first argument, which go back to the queue if they
    cannot be delivered.
    """

    name: str
    args: tuple[tuple[str, Value], ...] | None = None
    answer: Value = PLAIN
    by: Literal["core", "actor"] = "core"
    wait_ms_arg: int | None = None
    hands_out: bool = False

    def _arity(self, n: int) -> str | None:
        """Why `n` arguments are wrong for this operation (None: they may be right)."""
        if self.args is None or n == len(self.args):
            return None
        names = ", ".join(name for name, _ in self.args)
        return f"{self.name} takes {len(self.args)} argument(s) ({names}), got {n}"

    def encode_args(self, args: Sequence[Any]) -> list:
        """On the calling side: the arguments as the wire carries them."""
        if self.args is None:
            return list(args)
        wrong = self._arity(len(args))
        if wrong is not None:
            raise TypeError(wrong)
        return [value.encode(arg) for (_, value), arg in zip(self.args, args)]

    def decode_args(self, args: list) -> list:
        """On the serving side: the arguments back from the wire (WireError if malformed)."""
        if self.args is None:
            return args
        wrong = self._arity(len(args))
        if wrong is not None:
            raise WireError(wrong)
        return [value.decode(arg, f"{self.name}.{name}") for (name, value), arg in zip(self.args, args)]

    def encode_answer(self, result: Any) -> Any:
        return self.answer.encode(result)

    def decode_answer(self, body: Any) -> Any:
        return self.answer.decode(body, f"{self.name} result")

    def wait_s(self, args: Sequence[Any]) -> float:
        """How long a call with `args` may wait in the queue before it answers (s)."""
        if self.wait_ms_arg is None or len(args) <= self.wait_ms_arg:
            return 0.0
        return float(args[self.wait_ms_arg]) / 1000.0


OPERATIONS: dict[str, Operation] = {op.name: op for op in (
    Operation("put", args=(("task", TASK),), answer=PUT_RESULT, by="actor"),
    Operation("get_batch", answer=TASKS, by="actor", wait_ms_arg=2, hands_out=True),
    Operation("complete"),
    Operation("cancel"),
    Operation("worker_gone", by="actor"),
    Operation("take_failed", answer=FAILED_TASKS, by="actor"),
    Operation("fail"),
    Operation("hold", args=(("worker_id", PLAIN), ("tasks", TASKS)), by="actor"),
    Operation("instance_id", by="actor"),
    Operation("alive"),
    Operation("beat"),
    Operation("take_failed_and_stats", answer=FAILED_AND_STATS, by="actor"),
    Operation("stats", answer=STATS, by="actor"),
)}


def operation(name: Any) -> Operation:
    """The operation called `name`; WireError if the queue serves none of that name."""
    op = OPERATIONS.get(name) if isinstance(name, str) else None
    if op is None:
        raise WireError(f"unknown method {name!r}; the queue serves {sorted(OPERATIONS)}")
    return op


def decode_call(method: Any, args: Any) -> tuple[Operation, list]:
    """A request's operation and its decoded arguments (WireError if either is malformed)."""
    op = operation(method)
    if not isinstance(args, list):
        raise WireError(f"{op.name}: 'a' must be a list of arguments")
    return op, op.decode_args(args)


async def perform(target: Any, op: Operation, args: list) -> Any:
    """`op` on `target`, the queue actor (or, in tests, anything with its methods): its
    method of the operation's name, awaited when it is a coroutine."""
    result = getattr(target, op.name)(*args)
    return await result if inspect.isawaitable(result) else result


def pack_call(method: str, args: Sequence[Any]) -> bytes:
    """A call as the Ray fallback carries it (`perform_coded`): the operation's arguments
    encoded by its codecs, in one msgpack body, so Ray moves bytes and never pickles a task
    or any other queue value across nodes."""
    return msgpack.packb({"m": method, "a": operation(method).encode_args(args)}, use_bin_type=True)


async def perform_coded(target: Any, payload: bytes) -> bytes:
    """One coded call over Ray (`pack_call`'s body) on `target`, answered with the wire's
    response body (``{"ok": true, "r": ...}`` or ``{"ok": false, "error": {"type",
    "message"}}``) as msgpack bytes: no task, result or exception object is pickled."""
    try:
        body = unpack_body(payload, "call_coded")
        method, args = (body.get("m"), body.get("a")) if isinstance(body, dict) else (None, None)
        op, args = decode_call(method, args)
        answer: dict[str, Any] = {"ok": True, "r": op.encode_answer(await perform(target, op, args))}
    except Exception as exc:  # noqa: BLE001  (every error goes back to the caller, typed)
        answer = {"ok": False, "error": {"type": type(exc).__name__, "message": str(exc)}}
    return msgpack.packb(answer, use_bin_type=True)
