"""The engine thread's entry points, contained by whose failure it is (decode/async_engine.py):
a failure of one request's abort or of indexing its blocks fails that request alone; a
failure of the scheduler stops the engine visibly (on_death, every stream told); work that
cannot be scheduled waits instead of spinning."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.decode.async_engine import AsyncEngine
from pdserve.engine import LLM, EngineStateError, SamplingParams
from pdserve.engine.scheduler import SchedulerOutput


@pytest.fixture
def llm(llama_dir):
    return LLM(llama_dir, max_model_len=256)


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


async def drain(q: asyncio.Queue, timeout_s: float = 60.0) -> list:
    """Every item of one stream up to its last (a finished delta or an exception)."""
    items = []
    while True:
        item, _ = await asyncio.wait_for(q.get(), timeout_s)
        items.append(item)
        if isinstance(item, BaseException) or item.finished:
            return items


def run(llm, body, **kwargs):
    async def main():
        ae = AsyncEngine(llm.engine, **kwargs)
        ae.start()
        try:
            return await body(ae)
        finally:
            ae.stop()
    return asyncio.run(main())


def tokens(items) -> list[int]:
    return [t for d in items for t in d.new_token_ids]


def assert_no_leak(llm):
    eng = llm.engine
    assert not eng.requests and eng.kv.num_free_blocks == eng.kv.pool.num_blocks


def test_an_abort_that_raises_fails_that_request_alone(llm, monkeypatch):
    ref = llm.generate([[5, 6, 7, 8]], params(8))[0].token_ids
    real = llm.engine.abort_request

    def abort(rid):
        if rid == "victim":
            raise RuntimeError("injected abort failure")
        return real(rid)

    monkeypatch.setattr(llm.engine, "abort_request", abort)

    async def body(ae):
        victim = ae.submit("victim", [9, 10, 11], params(200), 0)
        other = ae.submit("other", [5, 6, 7, 8], params(8), 0)
        first = await victim.get()
        ae.abort("victim")
        return [first[0]] + await drain(victim), await drain(other), ae.alive

    got_victim, got_other, alive = run(llm, body)
    assert got_victim[-1].finish_reason == "error" and "injected abort failure" in got_victim[-1].error
    assert tokens(got_other) == ref and got_other[-1].finish_reason == "length"
    assert alive
    assert_no_leak(llm)


def test_a_block_indexing_failure_fails_that_request_alone(llm, monkeypatch):
    prompt = list(range(3, 43))  # 40 tokens: its prefill fills two blocks
    ref = llm.generate([prompt], params(6))[0].token_ids
    real = llm.engine.kv.cache_full_blocks

    def index(rid, *args):
        if rid == "victim":
            raise RuntimeError("injected prefix-cache failure")
        return real(rid, *args)

    monkeypatch.setattr(llm.engine.kv, "cache_full_blocks", index)

    async def body(ae):
        victim = ae.submit("victim", list(range(50, 90)), params(6), 0)
        other = ae.submit("other", prompt, params(6), 0)
        return await drain(victim), await drain(other), ae.alive

    got_victim, got_other, alive = run(llm, body)
    assert got_victim[-1].finish_reason == "error" and "injected prefix-cache failure" in got_victim[-1].error
    assert tokens(got_other) == ref
    assert alive
    assert_no_leak(llm)


def test_a_scheduler_failure_stops_the_engine_visibly(llm, monkeypatch):
    def broken():
        raise RuntimeError("injected scheduler bug")

    monkeypatch.setattr(llm.engine.scheduler, "schedule", broken)
    deaths = []

    async def body(ae):
        q = ae.submit("r", [5, 6, 7], params(4), 0)
        items = await drain(q)
        for _ in range(100):  # on_death is called on the event loop
            if deaths:
                break
            await asyncio.sleep(0.01)
        return items, ae.alive

    items, alive = run(llm, body, on_death=deaths.append)
    assert isinstance(items[-1], EngineStateError) and "injected scheduler bug" in str(items[-1])
    assert not alive and len(deaths) == 1 and isinstance(deaths[0], EngineStateError)


def test_work_that_cannot_be_scheduled_waits_instead_of_spinning(llm, monkeypatch):
    """The waiting head cannot get blocks and nothing runs: schedule() plans nothing while
    has_work() stays true. Each loop turn then waits for a command or a poller (at most one
    step per idle wait); a spinning loop would step thousands of times without waiting."""
    monkeypatch.setattr(llm.engine.scheduler, "schedule", lambda: SchedulerOutput())
    counts = {"steps": 0, "waits": 0}
    real_step = llm.engine.step

    def step(*args, **kwargs):
        counts["steps"] += 1
        return real_step(*args, **kwargs)

    monkeypatch.setattr(llm.engine, "step", step)

    async def body(ae):
        wait = ae._wake.wait

        def counted_wait(timeout=None):
            counts["waits"] += 1
            return wait(timeout)

        ae._wake.wait = counted_wait
        ae.idle_wait_s = 0.05
        ae.submit("stuck", [5, 6, 7], params(4), 0)
        await asyncio.sleep(0.5)
        return dict(counts)

    seen = run(llm, body)
    assert seen["steps"] >= 1 and seen["steps"] <= seen["waits"] + 2, seen


def test_a_request_held_for_a_prefix_loan_is_added_later_or_ends_on_abort(llm):
    """add_later / add_held (decode/borrow.py): the stream is attached first, the request joins
    the engine when its loan ends; an abort meanwhile ends the stream, and the later add is
    skipped (nothing runs for a client that left)."""
    ref = llm.generate([[5, 6, 7, 8]], params(4))[0].token_ids

    async def body(ae):
        kept, left = ae.attach("kept"), ae.attach("left")
        ae.call(lambda eng: (ae.add_later("kept"), ae.add_later("left")))
        ae.abort("left")
        aborted = await drain(left)
        assert [d.finish_reason for d in aborted] == ["abort"]
        ae.call(lambda eng: ae.add_held("left", [5, 6, 7, 8], params(4), 0, None))  # skipped: aborted
        ae.call(lambda eng: ae.add_held("kept", [5, 6, 7, 8], params(4), 0, None))
        return await drain(kept)

    items = run(llm, body)
    assert tokens(items) == ref and items[-1].finish_reason == "length"
    assert_no_leak(llm)


def test_the_step_under_way_is_published_while_it_runs_and_cleared_after(llm, monkeypatch):
    """What the router prices as the step under way (AsyncEngine.in_flight): during the forward
    pass, its start and shape (a 4-token prompt, nothing decoding); None between steps."""
    seen = []
    runner = llm.engine.runner
    real = runner.execute

    def execute(*args, **kwargs):
        seen.append(ae_ref[0].in_flight)
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "execute", execute)
    ae_ref = []

    async def body(ae):
        ae_ref.append(ae)
        items = await drain(ae.submit("r", [5, 6, 7, 8], params(3), 0))
        return items

    assert tokens(run(llm, body)) and ae_ref[0].in_flight is None
    assert seen[0] is not None and seen[0][1:3] == (0, 4)  # no stream decoding, 4 prompt tokens
    assert all(s is not None and s[0] > 0 for s in seen) and seen[1][1:3] == (1, 0)  # then one decode
