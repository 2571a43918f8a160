"""What the queue knows of its prefill workers besides their tasks: liveness and cancels.

`WorkerLiveness` holds the `QueueCore` bookkeeping of each worker: when it last
called (its heartbeat `alive`/`beat`, and every take, complete, fail or hold; one
silent for longer than the stall bound `stall_s` is not live, and
`QueueCore.fail_stalled` fails back what it holds), how far its compute has got (below),
the tasks cancelled while it held them, which its next `beat` tells it of, and how often
the cluster declared it gone (`gone_count`). Pure and synchronous like the core, which
provides `_clock` and `instance_id`.

Compute progress. A prefill worker's heartbeat runs on its event loop and its compute on
another thread: a thread hung in an engine step leaves the loop beating. So each `beat`
made while the compute thread works carries that thread's progress
(common/compute_thread.py `ComputeProgress.snapshot`: `steps`, the marks so far; `since_s`,
the age of the latest; `within_s`, how long the unit under way may take by the worker's own
account: a multiple of its predicted step, or a wait's timeout; prefill/progress.py). The
queue keeps, per worker, when its progress last advanced (its clock, less `since_s`) and that
allowance; a worker whose progress has stood still for longer than

    progress bound = max(stall_s, within_s)

is compute-stalled, however often it beats: not live, and what it holds is failed back
(`fail_stalled`, counted apart from silence). `stall_s` is the floor: no worker is judged
hung faster than a silent one would be. A beat without progress (the thread runs nothing
for the batch yet; a worker of an earlier version) and a worker's next `take` or `complete`
(its batch is over) clear the record: only the silence bound applies then.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Callable, NamedTuple

from pdserve.kvtransfer.task import PrefillTask

# A worker holding tasks must be heard from this often (it calls `beat` every 0.25 s while it
# serves a batch, its compute running in a thread): past it, its tasks are failed back.
DEFAULT_STALL_S = 3.0


class Progress(NamedTuple):
    """A worker's compute progress as the queue keeps it (see the module docstring)."""

    advanced_at: float  # when its progress last advanced (the queue's clock)
    within_s: float  # how long the unit under way may take, by the worker's account
    steps: int  # its progress marks so far


def check_progress(progress) -> tuple[int, float, float]:
    """A beat's progress map, checked: (steps, since_s, within_s); ValueError naming the field."""
    if not isinstance(progress, dict) or set(progress) != {"steps", "since_s", "within_s"}:
        raise ValueError(f"beat: progress must be a map of steps, since_s and within_s, got {progress!r}")
    steps, since_s, within_s = progress["steps"], progress["since_s"], progress["within_s"]
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"beat: progress.steps must be an int >= 0, got {steps!r}")
    for name, v in (("since_s", since_s), ("within_s", within_s)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v >= 0):
            raise ValueError(f"beat: progress.{name} must be a finite number >= 0, got {v!r}")
    return steps, float(since_s), float(within_s)


class WorkerLiveness:
    """The liveness half of `QueueCore` (see the module docstring)."""

    # QueueCore's (declared here for the checker; no value is set)
    _clock: Callable[[], float]
    instance_id: str

    def _init_liveness(self, stall_s: float) -> None:
        if not stall_s > 0:
            raise ValueError(f"stall_s={stall_s} must be > 0")
        self.stall_s = stall_s
        self._seen: dict[str, float] = {}  # worker id -> when it last called (clock)
        self._progress: dict[str, Progress] = {}  # worker id -> its compute progress, while it works
        # Tasks cancelled while a worker held them: told to that worker by its next `beat`, so it
        # stops computing them (prefill/batch.py); kept until it `fail`s them (its writes are
        # over: the origin frees their blocks) or completes its batch.
        self._cancelled: dict[str, dict[tuple[str, int], PrefillTask]] = {}
        self._untold: dict[str, list[tuple[str, int]]] = {}  # of those, the ones not yet told
        self._gone: Counter = Counter()  # worker_id -> how often worker_gone was called for it

    def _forget_cancelled(self, worker_id: str, request_ids: set[str] | None = None) -> None:
        """The cancelled tasks of `worker_id` (those of `request_ids`, or all) are over there."""
        held = self._cancelled.pop(worker_id, {})
        untold = self._untold.pop(worker_id, [])
        if request_ids is not None:
            held = {k: t for k, t in held.items() if k[0] not in request_ids}
            untold = [k for k in untold if k[0] not in request_ids]
            if held:
                self._cancelled[worker_id] = held
            if untold:
                self._untold[worker_id] = untold

    def alive(self, worker_id: str) -> str:
        """`worker_id` is making progress (its heartbeat while it serves a batch); returns this
        queue's instance id, so the same call tells the worker whether the queue restarted."""
        self._seen[worker_id] = self._clock()
        return self.instance_id

    def beat(self, worker_id: str, progress: dict | None = None) -> dict:
        """`alive`, with the compute `progress` of `worker_id` (None: its compute thread runs
        nothing of the batch; see the module docstring), and the tasks cancelled since the
        last beat while it held them: {"instance": instance id, "cancelled": [[request_id,
        epoch], ...]} (each told once). A malformed progress is a ValueError, and the beat
        does not count."""
        checked = None if progress is None else check_progress(progress)
        instance = self.alive(worker_id)
        if checked is None:
            self._progress.pop(worker_id, None)
        else:
            steps, since_s, within_s = checked
            self._progress[worker_id] = Progress(self._clock() - since_s, within_s, steps)
        cancelled = self._untold.pop(worker_id, [])
        return {"instance": instance, "cancelled": [list(key) for key in cancelled]}

    def _idle(self, worker_id: str) -> None:
        """`worker_id`'s batch is over (it takes or completes): no compute of it to judge."""
        self._progress.pop(worker_id, None)

    def progress_bound(self, within_s: float) -> float:
        """How long a worker's compute may stand still on a unit it allows `within_s` for."""
        return max(self.stall_s, within_s)

    def compute_stalled(self, worker_id: str, now: float) -> float | None:
        """How long `worker_id`'s compute has stood still, when that is past its progress bound
        (it beats, but its compute thread is hung); None otherwise."""
        p = self._progress.get(worker_id)
        if p is None:
            return None
        still = now - p.advanced_at
        return still if still > self.progress_bound(p.within_s) else None

    def _is_live(self, worker_id: str, now: float) -> bool:
        """Heard from within the stall bound, and its compute (if it works) not stalled."""
        return (now - self._seen.get(worker_id, -math.inf) <= self.stall_s
                and self.compute_stalled(worker_id, now) is None)

    def live_workers(self) -> int:
        """Prefill workers heard from within the stall bound whose compute is not stalled."""
        now = self._clock()
        return sum(1 for w in self._seen if self._is_live(w, now))

    def gone_count(self, worker_id: str) -> int:
        """How often `worker_gone(worker_id)` was called: a long poll that started before a
        change of this value belongs to a worker the cluster has given up on."""
        return self._gone[worker_id]
