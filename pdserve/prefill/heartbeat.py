"""A prefill worker's heartbeat to the queue while it serves a batch.

The compute runs in a thread; the heartbeat on the event loop. It tells the queue the worker
is alive every HOLD_CHECK_S, or the queue fails the batch back as stalled (cluster/queue/core.py
`fail_stalled`), and how far the compute thread has got (`ComputeProgress.snapshot`: this loop
beats on while that thread is hung, so the queue judges the thread by its progress against its
own allowance, not by the beat; prefill/progress.py). The queue answers with the tasks
cancelled meanwhile (their decode worker aborted them), which the batch stops computing, and
its instance id: when the queue restarted, the worker reports the tasks it holds so the new
instance neither hands them out again nor loses them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

from pdserve.cluster.queue import QueueClient
from pdserve.common.compute_thread import ComputeProgress
from pdserve.kvtransfer.task import PrefillTask

log = logging.getLogger(__name__)

# While a batch is served: heartbeat to the queue, which answers whether it restarted and which
# held tasks were cancelled since (so a cancel stops the compute within about this long).
HOLD_CHECK_S = 0.25


class Heartbeat:
    """One worker's beats to its queue. ``instance``: the queue's instance id as the worker last
    knew it (None: not known); ``cancel`` stops computing held tasks, (request_id, epoch) keys
    (the batch's `PrefillBatch.cancel`)."""

    def __init__(self, worker_id: str, queue: QueueClient, progress: ComputeProgress,
                 cancel: Callable[[Iterable[tuple[str, int]]], None], instance: str | None = None):
        self.worker_id = worker_id
        self.queue = queue
        self.progress = progress
        self.cancel = cancel
        self.instance = instance
        self._with_progress = True  # False once a queue of an earlier version refused it (`beat`)

    async def run(self, tasks: list[PrefillTask]) -> None:
        """Beat while `tasks` are served, until cancelled (see the module docstring)."""
        while True:
            await asyncio.sleep(HOLD_CHECK_S)
            try:
                beat = await asyncio.wait_for(self.beat(), HOLD_CHECK_S * 8)
                instance, cancelled = beat["instance"], beat["cancelled"]
                if cancelled:
                    self.cancel((str(rid), int(epoch)) for rid, epoch in cancelled)
                if instance != self.instance:
                    n = await asyncio.wait_for(self.queue.hold(self.worker_id, tasks), HOLD_CHECK_S * 8)
                    self.instance = instance
                    if n:
                        log.warning("queue restarted (instance %s); reported %d held task(s)", instance, n)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001  (the queue is still restarting: check again)
                log.debug("queue heartbeat failed: %r", exc)

    async def beat(self) -> dict:
        """One heartbeat with the compute thread's progress. A queue of an earlier version takes
        the worker id alone (a TypeError for the second argument): beat it so from then on, as
        before, rather than fall silent and have every batch failed back as stalled."""
        progress = self.progress.snapshot() if self._with_progress else None
        try:
            return await self.queue.beat(self.worker_id, progress)
        except Exception as exc:  # noqa: BLE001  (QueueCallError "TypeError" over the wire, TypeError over Ray)
            if progress is None or not (isinstance(exc, TypeError) or getattr(exc, "type", None) == "TypeError"):
                raise
            log.warning("the queue does not take the compute progress with the heartbeat (%s): an earlier "
                        "version; beating without it, so a hung compute thread is not detected", exc)
            self._with_progress = False
            return await self.queue.beat(self.worker_id)
