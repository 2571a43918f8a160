"""What the queue knows of its prefill workers besides their tasks: liveness and cancels.

`WorkerLiveness` holds the `QueueCore` bookkeeping of each worker: when it last
called (its heartbeat `alive`/`beat`, and every take, complete, fail or hold; one
silent for longer than the stall bound `stall_s` is not live, and
`QueueCore.fail_stalled` fails back what it holds), the tasks cancelled while it held
them, which its next `beat` tells it of, and how often the cluster declared it gone
(`gone_count`). Pure and synchronous like the core, which provides `_clock` and
`instance_id`.
"""

from __future__ import annotations

from collections import Counter

from pdserve.handoff.task import PrefillTask

# A worker holding tasks must be heard from this often (it calls `beat` every 0.25 s while it
# serves a batch, its compute running in a thread): past it, its tasks are failed back.
DEFAULT_STALL_S = 3.0


class WorkerLiveness:
    """The liveness half of `QueueCore` (see the module docstring)."""

    def _init_liveness(self, stall_s: float) -> None:
        if not stall_s > 0:
            raise ValueError(f"stall_s={stall_s} must be > 0")
        self.stall_s = stall_s
        self._seen: dict[str, float] = {}  # worker id -> when it last called (clock)
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

    def beat(self, worker_id: str) -> dict:
        """`alive`, and the tasks cancelled since the last beat while `worker_id` held them:
        {"instance": instance id, "cancelled": [[request_id, epoch], ...]} (each told once)."""
        instance = self.alive(worker_id)
        cancelled = self._untold.pop(worker_id, [])
        return {"instance": instance, "cancelled": [list(key) for key in cancelled]}

    def live_workers(self) -> int:
        """Prefill workers heard from within the stall bound."""
        now = self._clock()
        return sum(1 for t in self._seen.values() if now - t <= self.stall_s)

    def gone_count(self, worker_id: str) -> int:
        """How often `worker_gone(worker_id)` was called: a long poll that started before a
        change of this value belongs to a worker the cluster has given up on."""
        return self._gone[worker_id]
