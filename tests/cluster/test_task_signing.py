"""Task signatures (cluster/queue/signing.py) and the queue's refusal of replayed copies: what
binds a prefill task to the decode worker that reserved its blocks. Pure: no Ray, no I/O."""

from __future__ import annotations

import asyncio
import dataclasses
import math

import msgpack
import pytest

from pdserve.kvtransfer import PrefillTask
from pdserve.cluster.queue import BAD_SIGNATURE, NO_KEY, TaskSigner, verify_task
from pdserve.cluster.queue.core import QueueCore
from pdserve.cluster.queue.frames import from_wire, pack_frame, read_frame, to_wire
from pdserve.cluster.queue.signing import NO_DEADLINE, UNSIGNED
from pdserve.cluster.queue.answers import ALREADY_DONE, DEADLINE_PASSED

NOW = 1_000.0


def signed(signer: TaskSigner, **changes) -> PrefillTask:
    fields = dict(request_id="r1", epoch=2, token_ids=list(range(40)), cached_len=16, target_worker_id="decode-0",
                  target_block_ids=[7, 8, 9], sampling_params={"temperature": 0.5, "stop": ["x"], "logprobs": 2},
                  priority="high", deadline=NOW + 30, arrival_time=NOW, origin="decode-0")
    return signer.sign(PrefillTask(**{**fields, **changes}))


def test_a_task_signed_by_its_target_verifies_and_survives_the_wire():
    signer = TaskSigner()
    t = signed(signer)
    assert len(t.signature) == 64 and verify_task(t, signer.public_key) is None

    async def through_a_frame():
        reader = asyncio.StreamReader()
        reader.feed_data(pack_frame(to_wire(t)))
        reader.feed_eof()
        return from_wire(PrefillTask, await read_frame(reader), "task")

    back = asyncio.run(through_a_frame())
    assert back == t and verify_task(back, signer.public_key) is None
    # The order of a map's keys is not part of what is signed (msgpack keeps the sender's order).
    back.sampling_params = dict(reversed(list(back.sampling_params.items())))
    assert verify_task(back, signer.public_key) is None
    # The arrival time is a statistic, not signed: the queue may stamp it.
    assert verify_task(dataclasses.replace(t, arrival_time=NOW + 1), signer.public_key) is None


@pytest.mark.parametrize("change", [
    {"target_block_ids": [7, 8, 10]},  # the attack: someone else's blocks
    {"target_worker_id": "decode-1"}, {"request_id": "r2"}, {"epoch": 3}, {"cached_len": 0},
    {"token_ids": list(range(1, 41))}, {"token_ids": list(range(41))},
    {"sampling_params": {"temperature": 0.6, "stop": ["x"], "logprobs": 2}}, {"priority": "low"},
    {"deadline": NOW + 3600}, {"origin": "decode-1"},
])
def test_any_field_a_prefill_worker_acts_on_breaks_the_signature(change):
    signer = TaskSigner()
    t = dataclasses.replace(signed(signer), **change)
    assert verify_task(t, signer.public_key) == BAD_SIGNATURE


def test_unsigned_foreign_keyless_and_malformed_tasks_are_refused():
    signer, forger = TaskSigner(), TaskSigner()
    t = signed(signer)
    assert verify_task(dataclasses.replace(t, signature=b""), signer.public_key) == UNSIGNED
    assert verify_task(signed(forger), signer.public_key) == BAD_SIGNATURE  # signed, by somebody else
    assert verify_task(t, None) == NO_KEY and verify_task(t, "") == NO_KEY
    assert verify_task(t, "not base64!") == NO_KEY
    assert verify_task(dataclasses.replace(t, deadline=None), signer.public_key) == NO_DEADLINE
    assert verify_task(dataclasses.replace(t, token_ids=[math.nan] * 40), signer.public_key) == BAD_SIGNATURE
    with pytest.raises(ValueError, match="needs a deadline"):
        signer.sign(dataclasses.replace(t, deadline=None))
    with pytest.raises(ValueError, match="signature must be bytes"):
        dataclasses.replace(t, signature="text")
    body = msgpack.unpackb(pack_frame(to_wire(t))[4:], raw=False)
    assert isinstance(body["signature"], bytes)  # msgpack bin, never pickle


def test_the_queue_refuses_a_copy_of_a_settled_task_until_its_deadline():
    now = [NOW]
    core = QueueCore(capacity=8, clock=lambda: now[0])
    signer = TaskSigner()
    done, failed, cancelled = (signed(signer, request_id=r) for r in ("done", "failed", "cancelled"))
    for t in (done, failed, cancelled):
        assert core.put(t).ok
    assert len(core.take("p0", max_tokens=1000)) == 3
    core.complete("p0", "done")
    core.fail("p0", "failed", "bad_task")
    core.cancel("cancelled")
    for t in (done, failed, cancelled):  # a replayed copy would write blocks given to another request since
        assert core.put(dataclasses.replace(t)).reason == ALREADY_DONE
    assert core.hold("p-fake", [dataclasses.replace(done)]) == 0  # nor smuggled in as "held after a restart"
    assert core.stats().counters["rejected_already_done"] == 3
    assert core.put(signed(signer, request_id="done", epoch=3)).ok  # a new attempt is another task
    now[0] = NOW + 31
    assert core.put(dataclasses.replace(done)).reason == DEADLINE_PASSED
    assert core.put(signed(signer, request_id="later", deadline=NOW + 60)).ok
    assert core._settled == {}  # forgotten once their deadlines passed: the memory stays bounded
