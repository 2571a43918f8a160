"""common/compute_thread.py: a worker's torch work runs on a thread that ends (loading) or on
one long-lived thread (batches), never on pooled threads that keep OpenMP teams alive."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pdserve.common.compute_thread import ComputeExecutor, run_in_own_thread


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
