"""Prefix-aware dispatch in the prefill queue (cluster/queue/core.py `QueueCore.take`): a task is
kept for the live worker whose cache holds the longest prefix of it while that saves more
compute than the work that worker has in hand, for a bounded time; every decision that
names another worker is recorded with its figures."""

from __future__ import annotations

import pytest

from pdserve.kvtransfer import PrefillTask
from pdserve.kvtransfer.task import task_from_wire, task_to_wire
from pdserve.cluster.queue.core import QueueCore


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def task(rid: str, n: int = 100, hint: dict | None = None) -> PrefillTask:
    return PrefillTask(request_id=rid, epoch=1, token_ids=list(range(n)), cached_len=0, target_worker_id="d0",
                       target_block_ids=[0], prefix_hint=hint or {})


@pytest.fixture
def q():
    clock = Clock()
    core = QueueCore(clock=clock)
    core.clock = clock
    for w in ("p0", "p1"):
        core.beat(w)
    return core


def rids(batch):
    return [t.request_id for t in batch]


def test_a_task_waits_for_the_worker_holding_its_prefix_and_the_next_one_is_not_held_up(q):
    q.put(task("a", hint={"p1": 64}))
    q.put(task("b"))
    assert rids(q.take("p0", 1000)) == ["b"]  # "a" is kept for p1; "b" behind it is not held up
    (d,) = q.prefix_decisions
    assert d["request_id"] == "a" and d["puller"] == "p0" and d["best"] == "p1" and d["kept"]
    assert d["best_cached_tokens"] == 64 and d["best_backlog_tokens"] == 0
    assert rids(q.take("p1", 1000)) == ["a"]
    assert q.counters["prefix_kept"] == 1 and q.counters["prefix_routed"] == 1


def test_the_holder_s_backlog_the_hold_limit_and_its_liveness_release_the_task(q):
    # p1 holds 50 tokens of work: the 64 its prefix saves exceed it by less than 16.
    q.put(task("busy", n=50))
    assert rids(q.take("p1", 1000)) == ["busy"]
    q.put(task("a", hint={"p1": 64}))
    assert rids(q.take("p0", 1000)) == ["a"]
    assert "tokens in hand cost more" in q.prefix_decisions[-1]["why"]
    # Kept at first, then released once it has waited the hold limit.
    q.complete("p1", "busy")
    q.put(task("b", hint={"p1": 64}))
    assert q.take("p0", 1000) == []
    q.clock.t += q.prefix_max_hold_s
    q.beat("p1")
    assert rids(q.take("p0", 1000)) == ["b"] and "the most a prefix may hold it" in q.prefix_decisions[-1]["why"]
    # A holder that stopped calling is not waited for.
    q.put(task("c", hint={"p1": 64}))
    q.clock.t += q.stall_s + 1
    q.beat("p0")
    assert rids(q.take("p0", 1000)) == ["c"] and "not live" in q.prefix_decisions[-1]["why"]
    assert q.counters["prefix_overridden"] == 3


def test_a_worker_that_holds_as_much_as_any_takes_it_and_small_gains_are_ignored(q):
    q.put(task("a", hint={"p0": 32, "p1": 32}))
    assert rids(q.take("p0", 1000)) == ["a"] and not q.prefix_decisions
    q.put(task("b", hint={"p1": 8}))  # 8 tokens saved: under prefix_min_tokens, not worth a wait
    assert rids(q.take("p0", 1000)) == ["b"] and not q.prefix_decisions[-1]["kept"]


def test_the_hint_travels_on_the_wire_and_a_malformed_one_is_refused():
    t = task("a", hint={"p1": 64})
    assert task_from_wire(task_to_wire(t)).prefix_hint == {"p1": 64}
    for bad in ({"p1": -1}, {"p1": "64"}, {1: 64}, ["p1"]):
        with pytest.raises(ValueError, match="prefix_hint"):
            task("x", hint=bad) if isinstance(bad, dict) else PrefillTask(
                request_id="x", epoch=1, token_ids=[1], cached_len=0, target_worker_id="d0", target_block_ids=[0],
                prefix_hint=bad)
