"""common/compute_thread.py: a worker's torch work runs on a thread that ends (loading) or on
one long-lived thread (batches), never on pooled threads that keep OpenMP teams alive."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pdserve.common.compute_thread import ComputeExecutor, ComputeProgress, run_in_own_thread


async def test_run_in_own_thread_returns_on_a_thread_that_has_ended():
    seen = {}

    def work(a, b):
        seen["thread"] = threading.current_thread()
        return a + b

    assert await run_in_own_thread(work, 2, 3, name="loader") == 5
    thread = seen["thread"]
    assert thread is not threading.main_thread() and thread.name == "loader"
    thread.join(timeout=10)  # the result is handed over just before it returns
    assert not thread.is_alive()


async def test_run_in_own_thread_raises_the_functions_error():
    def bad():
        raise ValueError("model dir has no config.json")

    with pytest.raises(ValueError, match="config.json"):
        await run_in_own_thread(bad)


async def test_run_in_own_thread_survives_its_awaiting_task_being_cancelled():
    release = threading.Event()
    task = asyncio.ensure_future(run_in_own_thread(lambda: release.wait(10)))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    release.set()  # the thread finishes later; settling a cancelled future must not raise
    await asyncio.sleep(0.05)


async def test_compute_executor_runs_every_call_on_one_thread_in_order():
    ex = ComputeExecutor("pdserve-test")
    order, threads = [], set()

    def work(i):
        threads.add(threading.get_ident())
        order.append(i)
        return i * i

    try:
        results = await asyncio.gather(*(ex.run(work, i) for i in range(8)))
    finally:
        ex.shutdown()
    assert results == [i * i for i in range(8)]
    assert order == list(range(8)) and len(threads) == 1


def test_compute_progress_reports_marks_their_age_and_the_allowance_while_busy():
    """What a heartbeat carries: nothing while idle; while busy, the marks so far, the age of
    the latest (which grows while the thread is stuck) and how long the unit under way may
    take; a mark without an allowance keeps the last one."""
    now = [100.0]
    p = ComputeProgress(clock=lambda: now[0])
    assert p.snapshot() is None
    p.begin()
    now[0] += 0.5
    assert p.snapshot() == {"steps": 0, "since_s": 0.5, "within_s": 0.0}
    p.mark(2.0)
    now[0] += 1.5
    assert p.snapshot() == {"steps": 1, "since_s": 1.5, "within_s": 2.0}
    p.mark()
    assert p.snapshot() == {"steps": 2, "since_s": 0.0, "within_s": 2.0}
    p.end()
    assert p.snapshot() is None and p.steps == 3
    for bad in (-1.0, float("nan"), float("inf"), True, "1"):
        with pytest.raises(ValueError, match="within_s"):
            p.mark(bad)


async def test_compute_executor_tracks_each_call_as_progress_of_its_thread():
    """A call in progress shows (and its marks), and the thread is idle once it returns; a
    call that raises ends its piece of work too."""
    ex = ComputeExecutor("pdserve-test")
    inside, release = threading.Event(), threading.Event()

    def work():
        ex.progress.mark(5.0)
        inside.set()
        release.wait(10)

    def bad():
        raise RuntimeError("boom")

    try:
        assert ex.progress.snapshot() is None
        running = asyncio.ensure_future(ex.run(work))
        assert await asyncio.to_thread(inside.wait, 10)
        snap = ex.progress.snapshot()
        assert snap["steps"] == 1 and snap["within_s"] == 5.0
        release.set()
        await asyncio.wait_for(running, 10)
        assert ex.progress.snapshot() is None
        with pytest.raises(RuntimeError, match="boom"):
            await ex.run(bad)
        assert ex.progress.snapshot() is None
    finally:
        release.set()
        ex.shutdown()
