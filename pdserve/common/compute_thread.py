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

`ComputeProgress` is how far that thread has got: its liveness, read from the work itself and
not from the event loop beside it (a heartbeat on the loop goes on beating while the thread
is hung in a step). `ComputeExecutor` keeps one for its thread.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
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


class ComputeProgress:
    """How far one compute thread has got, for a liveness check its event loop cannot vouch for.

    The thread says when it starts a piece of work (`begin`), marks each unit of it that it
    finishes (`mark`: an engine step, a write waited for) together with how long the next one
    may take (`within_s`, its own prediction or timeout), and says when it is done (`end`).
    `snapshot` (any thread) is what a heartbeat carries: the marks so far, the age of the
    latest and that allowance, or None while the thread runs nothing. A thread hung in a step
    shows as an age that grows past its allowance while the count stands still, however alive
    the event loop that reports it is (prefill/heartbeat.py, cluster/queue/liveness.py).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()  # a snapshot reads the three fields of one moment
        self._steps = 0  # marks (units of work finished) since the thread started
        self._since: float | None = None  # when the latest mark (or begin) was made; None: idle
        self._within_s = 0.0  # how long the unit under way may take, by the thread's own account

    @staticmethod
    def _check(within_s: float) -> float:
        if isinstance(within_s, bool) or not isinstance(within_s, (int, float)) or not (
                math.isfinite(within_s) and within_s >= 0):
            raise ValueError(f"within_s must be a finite number >= 0, got {within_s!r}")
        return float(within_s)

    def begin(self, within_s: float = 0.0) -> None:
        """The thread starts a piece of work; its first unit may take `within_s` (0: no estimate)."""
        within_s = self._check(within_s)
        with self._lock:
            self._since, self._within_s = self._clock(), within_s

    def mark(self, within_s: float | None = None) -> None:
        """A unit of work is finished; the next may take `within_s` (None: the same as this one)."""
        within_s = None if within_s is None else self._check(within_s)
        with self._lock:
            self._steps += 1
            self._since = self._clock()
            if within_s is not None:
                self._within_s = within_s

    def end(self) -> None:
        """The piece of work is over: the thread is idle (nothing of it to judge)."""
        with self._lock:
            self._steps += 1
            self._since = None
            self._within_s = 0.0

    @property
    def steps(self) -> int:
        return self._steps

    def snapshot(self) -> dict | None:
        """{"steps": marks so far, "since_s": age of the latest, "within_s": the allowance of the
        unit under way}, or None while idle. Plain values: it crosses the queue's wire."""
        with self._lock:
            if self._since is None:
                return None
            return {"steps": self._steps, "since_s": max(0.0, self._clock() - self._since),
                    "within_s": self._within_s}


class ComputeExecutor:
    """One long-lived thread for a worker's torch work (loading, batches): every call runs
    there, in submission order, so the process keeps a single OpenMP team. `progress` is that
    thread's: each call begins and ends a piece of work, and a call may mark units within."""

    def __init__(self, name: str):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self.progress = ComputeProgress()

    async def run(self, fn: Callable[..., Any], *args) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._tracked, fn, args)

    def _tracked(self, fn: Callable[..., Any], args: tuple) -> Any:
        self.progress.begin()
        try:
            return fn(*args)
        finally:
            self.progress.end()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
