"""The queue's operations, declared once (cluster/queue/operations.py `OPERATIONS`): the actor
serves each (the core's method where the table says so, with its signature, which Ray checks
at the call), the codecs code each value the way wire version 1 does, and a malformed call is
a typed error on both transports. The operations' behaviour is test_queue.py's."""

from __future__ import annotations

import inspect
import uuid

import msgpack
import pytest
import ray

from pdserve.kvtransfer import PrefillTask
from pdserve.cluster.queue import get_or_create_queue
from pdserve.cluster.queue.actor import PrefillQueue, _serves_operations
from pdserve.cluster.queue.answers import FailedTask, PutResult
from pdserve.cluster.queue.core import QueueCore
from pdserve.cluster.queue.frames import WIRE_VERSION, WireError, to_wire
from pdserve.cluster.queue.operations import OPERATIONS, decode_call, pack_call, perform_coded

pytestmark = pytest.mark.timeout(120)


def task(request_id: str) -> PrefillTask:
    return PrefillTask(request_id=request_id, epoch=0, token_ids=list(range(8)), cached_len=0,
                       target_worker_id="d0", target_block_ids=[0], deadline=2e9)


def test_the_actor_serves_every_operation_with_the_signature_of_what_serves_it():
    actor = PrefillQueue.__ray_metadata__.modified_class  # the class under @ray.remote
    signatures = PrefillQueue.__ray_metadata__.method_meta.signatures  # what Ray checks calls against
    for op in OPERATIONS.values():
        assert inspect.iscoroutinefunction(getattr(actor, op.name)), op.name
        if op.by == "core":
            core = list(inspect.signature(getattr(QueueCore, op.name)).parameters.values())[1:]  # less self
            assert [p for p in signatures[op.name] if p.name != "_ray_trace_ctx"] == core, op.name


def test_an_actor_that_disagrees_with_the_table_fails_at_import():
    with pytest.raises(TypeError, match="must define put"):
        _serves_operations(type("Queue", (), {}))
    own = {op.name: (lambda self: None) for op in OPERATIONS.values() if op.by == "actor"}
    with pytest.raises(TypeError, match="defines complete, which operations.py says the core serves"):
        _serves_operations(type("Queue", (), {**own, "complete": lambda self: None}))


def test_ray_checks_a_core_served_calls_arguments_when_it_is_made(ray_local):
    h = get_or_create_queue(f"o-{uuid.uuid4().hex[:8]}", "pdserve-tests", capacity=4)
    try:
        with pytest.raises(TypeError):
            h.alive.remote("p0", "too", "many")
        assert isinstance(ray.get(h.alive.remote("p0"), timeout=30), str)
    finally:
        ray.kill(h)


def test_values_are_coded_as_wire_version_1_codes_them():
    assert WIRE_VERSION == 1
    t, failed = task("a"), FailedTask(task("b"), "worker_stalled", "why", 1.0)
    assert OPERATIONS["put"].encode_args([t]) == [to_wire(t)]
    assert OPERATIONS["hold"].encode_args(["p0", [t]]) == ["p0", [to_wire(t)]]
    assert OPERATIONS["get_batch"].encode_args(["p0", 100, 5.0, None, ["x"]]) == ["p0", 100, 5.0, None, ["x"]]
    assert OPERATIONS["put"].encode_answer(PutResult(True, None, 1)) == {"ok": True, "reason": None, "depth": 1}
    assert OPERATIONS["get_batch"].encode_answer([t]) == [to_wire(t)]
    assert OPERATIONS["take_failed"].encode_answer([failed]) == [dict(to_wire(failed), task=to_wire(failed.task))]
    stats = QueueCore(4).stats()
    pair = OPERATIONS["take_failed_and_stats"].encode_answer(([failed], stats))
    assert pair == [[to_wire(failed)], to_wire(stats)]
    for name, answer in [("put", PutResult(False, "queue_full", 4)), ("get_batch", [t]), ("take_failed", [failed]),
                         ("take_failed_and_stats", ([failed], stats)), ("stats", stats), ("beat", {"cancelled": []})]:
        op = OPERATIONS[name]  # through msgpack and back, as on the wire
        assert op.decode_answer(msgpack.unpackb(msgpack.packb(op.encode_answer(answer)))) == answer, name
    assert decode_call("hold", msgpack.unpackb(msgpack.packb(["p0", [to_wire(t)]])))[1] == ["p0", [t]]


def test_a_malformed_call_is_a_typed_error():
    with pytest.raises(WireError, match=r"put takes 1 argument\(s\) \(task\), got 2"):
        decode_call("put", [to_wire(task("a")), 1])
    with pytest.raises(WireError, match="hold.tasks: expected a list"):
        decode_call("hold", ["p0", 3])
    with pytest.raises(WireError, match="unknown method 'drop'"):
        decode_call("drop", [])
    with pytest.raises(WireError, match="'a' must be a list"):
        decode_call("stats", None)
    with pytest.raises(TypeError, match="hold takes 2"):  # the caller's mistake, caught before anything is sent
        pack_call("hold", ["p0"])
    with pytest.raises(WireError, match="take_failed_and_stats result: expected a list of 2"):
        OPERATIONS["take_failed_and_stats"].decode_answer([[]])


async def test_a_coded_call_is_served_by_the_method_the_table_names():
    class Queue:  # the actor's methods, as the Ray fallback calls them
        def __init__(self):
            self.core = QueueCore(4)

        async def put(self, t):
            return self.core.put(t)

        def cancel(self, request_id):  # not a coroutine: served all the same
            return self.core.cancel(request_id)

    queue = Queue()
    put = msgpack.unpackb(await perform_coded(queue, pack_call("put", [task("a")])))
    assert put == {"ok": True, "r": {"ok": True, "reason": None, "depth": 1}}
    assert msgpack.unpackb(await perform_coded(queue, pack_call("cancel", ["a"]))) == {"ok": True, "r": "queued"}
    wrong = msgpack.unpackb(await perform_coded(queue, pack_call("cancel", ["a", "b"])))
    assert wrong["ok"] is False and wrong["error"]["type"] == "TypeError"
    missing = msgpack.unpackb(await perform_coded(queue, pack_call("stats", [])))
    assert missing["ok"] is False and missing["error"]["type"] == "AttributeError"
