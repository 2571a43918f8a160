"""Where a worker runs torch's CPU work: one thread at a time, never a pooled one.

torch's CPU build parallelises with libgomp. Each thread that starts a parallel region gets
its own team of OpenMP worker threads, and the team lives as long as that thread does.
libgomp counts every thread of every team; once there are more than the process's cores, it
stops spin-waiting between regions (a "throttled" spin of 100 iterations, env.c) and each
region pays a futex wake-up per worker instead. An engine step runs a few hundred regions.

Measured on the 2-core dev box (`python bench/engine_threads.py`): a 1-stream decode step
took 15-17 ms when the engine had been built on another live thread (the event loop's, or a
`asyncio.to_thread` pool thread, which lives on), against 9-11 ms when every region ran on
the one thread that steps. A decode worker paid that on every step of every request.

So the rule: the weights are loaded, warmed and calibrated on a thread that ends when it is
done (`run_in_own_thread`; its team goes with it), and afterwards only the engine's own
thread (decode/async_engine.py) or one long-lived executor thread (`ComputeExecutor`, the
prefill worker's batches) runs torch.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable


async def run_in_own_thread(fn: Callable[..., Any], *args, name: str = "pdserve-load") -> Any:
    """``fn(*args)`` on a fresh thread that exits afterwards (so the OpenMP team it made goes
    with it); its result or exception is the await's. Unlike `asyncio.to_thread`, no pooled
    thread is left holding a team beside the engine's."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()

    def settle(ok: bool, value) -> None:
        if fut.done():  # the awaiting task was cancelled meanwhile
            return
        fut.set_result(value) if ok else fut.set_exception(value)

    def body() -> None:
        try:
            result = fn(*args)
        except BaseException as exc:  # noqa: BLE001  (handed to the awaiting task)
            if not loop.is_closed():
                loop.call_soon_threadsafe(settle, False, exc)
            return
        if not loop.is_closed():
            loop.call_soon_threadsafe(settle, True, result)

    thread = threading.Thread(target=body, name=name, daemon=True)
    thread.start()
    return await fut


class ComputeExecutor:
    """One long-lived thread for a worker's torch work (loading, batches): every call runs
    there, in submission order, so the process keeps a single OpenMP team."""

    def __init__(self, name: str):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, fn: Callable[..., Any], *args) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
