"""The queue's memory of settled tasks, which refuses their replays until their deadline.

A task whose (request_id, epoch) the queue has settled (completed, failed back or
cancelled) is refused (ALREADY_DONE) until its deadline; after that, put() refuses it
as DEADLINE_PASSED anyway. A copy of a signed task (`signing`) therefore cannot be put
again to write blocks its decode worker has since given to another request.
`SettledTasks` holds that memory for `QueueCore` (which provides `_clock`), bounded
both ways: a key is forgotten at its deadline, and the oldest go first beyond
`MAX_SETTLED_REMEMBERED`.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from pdserve.kvtransfer.task import PrefillTask

MAX_SETTLED_REMEMBERED = 200_000  # settled keys kept until their deadline (the oldest go first beyond this)


class SettledTasks:
    """The replay memory of `QueueCore` (see the module docstring)."""

    _clock: Callable[[], float]  # QueueCore's (declared here for the checker; no value is set)

    def _init_settled(self) -> None:
        self._settled: dict[tuple[str, int], float] = {}  # key -> deadline: refused by put/hold until then
        self._settled_heap: list[tuple[float, tuple[str, int]]] = []

    def _settle(self, task: PrefillTask) -> None:
        """`task` left the queue for good: refuse it again until its deadline (see the docstring)."""
        if task.deadline is None or task.deadline <= self._clock():
            return
        if task.key not in self._settled:
            heapq.heappush(self._settled_heap, (task.deadline, task.key))
        self._settled[task.key] = task.deadline
        while len(self._settled) > MAX_SETTLED_REMEMBERED:
            self._settled.pop(heapq.heappop(self._settled_heap)[1], None)

    def _was_settled(self, key: tuple[str, int]) -> bool:
        now = self._clock()
        while self._settled_heap and self._settled_heap[0][0] <= now:
            self._settled.pop(heapq.heappop(self._settled_heap)[1], None)
        return key in self._settled
