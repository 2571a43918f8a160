"""What a decode worker knows of the prefill side, and how it learns it.

`PrefillView` is the one record of it that the router's snapshot reads:
live prefill workers (from the registry watch), the queue's depth and
queued tokens (polled). `QueueWatch` is the poll loop: every `poll_s` it
collects the tasks the queue failed back to this worker, refreshes the view,
notices a queue restart (a new `instance_id`) and a queue that stays
unreachable; it reports each through callbacks, so the remote path decides
what they mean for its handoffs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Iterable

from pdserve.cluster.records import WorkerInfo
from pdserve.kvtransfer.outcomes import fallback_reason, is_settled
from pdserve.kvtransfer.task import PrefillTask

# The keys of a prefill worker's record that say it runs LoRA adapters (capacity) and which it
# holds (load): prefill/admit.py writes them (decode never imports prefill: they meet in etcd).
LORA_CAPACITY_KEY = "enable_lora"
LORA_ADAPTERS_KEY = "lora_adapters"

log = logging.getLogger(__name__)


@dataclass
class PrefillView:
    """The prefill side as this worker sees it (read by the router's cluster snapshot)."""

    pool_size: int = 0  # live prefill workers in the registry
    queue_depth: int = 0  # tasks waiting on the queue (all decode workers)
    queue_tokens: int = 0  # prompt tokens those tasks will prefill
    # prefill workers the queue heard from lately (None: not polled yet): a registered worker
    # that makes no progress (hung, its lease kept alive) is not counted
    live_workers: int | None = None
    # LoRA adapters (docs/lora.md, "Across prefill and decode"): the registered prefill workers
    # that run adapters (their record's capacity["enable_lora"]), and the adapters any of them
    # holds (the union of their load["lora_adapters"])
    lora_workers: int = 0
    lora_adapters: frozenset[str] = frozenset()

    def count_adapters(self, members: Iterable[WorkerInfo]) -> None:
        """Read the prefill workers' records (the registry watch's members) for their adapters."""
        runs = [m for m in members if m.capacity.get(LORA_CAPACITY_KEY)]
        held = (m.load.get(LORA_ADAPTERS_KEY) for m in runs)
        self.lora_workers = len(runs)
        self.lora_adapters = frozenset(n for names in held if isinstance(names, list) for n in names
                                       if isinstance(n, str))


class QueueWatch:
    """The decode side's poll of the prefill queue (see the module docstring)."""

    def __init__(self, queue, worker_id: str, view: PrefillView, *, poll_s: float, call_s: float, lost_s: float,
                 on_failed: Callable[[PrefillTask, str, bool], None],
                 on_restart: Callable[[str], Awaitable[None]],
                 on_lost: Callable[[], None],
                 has_waiters: Callable[[], bool]):
        self.queue = queue
        self.worker_id = worker_id
        self.view = view
        self.poll_s, self.call_s, self.lost_s = poll_s, call_s, lost_s
        self._on_failed, self._on_restart, self._on_lost = on_failed, on_restart, on_lost
        self._has_waiters = has_waiters
        self.instance: str | None = None

    async def run(self) -> None:
        """Poll until cancelled; a failed poll is retried (queue or Ray hiccups), and a queue
        unreachable for `lost_s` while requests wait is reported once per outage."""
        last_ok = time.monotonic()
        lost = False
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                failed, st = await asyncio.wait_for(self.queue.take_failed_and_stats(self.worker_id), self.call_s)
            except Exception as exc:  # noqa: BLE001
                log.debug("queue poll failed: %r", exc)
                if not lost and time.monotonic() - last_ok > self.lost_s and self._has_waiters():
                    lost = True
                    self._on_lost()
                continue
            last_ok, lost = time.monotonic(), False
            for f in failed:
                # whether its blocks are free at once: the failure table (kvtransfer/outcomes.py)
                self._on_failed(f.task, fallback_reason(f.reason, f.detail), is_settled(f.reason))
            self.view.queue_depth, self.view.queue_tokens = st.depth, st.queued_tokens
            self.view.live_workers = st.live_workers
            if st.instance_id and st.instance_id != self.instance:
                if self.instance is not None:
                    await self._on_restart(st.instance_id)
                self.instance = st.instance_id
