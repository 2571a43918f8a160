"""`QueueCore`: the prefill queue's whole policy, pure and synchronous (no Ray, no I/O).

It reads top to bottom and is testable with plain values; the Ray actor
(`actor.PrefillQueue`) only adds the long poll around it.

Ordering: tasks leave in `PrefillTask.sort_key` order (priority, deadline,
arrival time; see `task`). Batching: `take` takes tasks in that order while
their prefill tokens (`len(token_ids) - cached_len`) fit `max_tokens`, and
stops at the first one that does not fit, so a long prompt is never overtaken
indefinitely by short ones. A batch always holds at least one task when any
is queued, even if that task alone exceeds `max_tokens`: otherwise a prompt
longer than the budget would starve forever. Tasks whose deadline has passed
are never handed out; they are failed back to their origin with reason
DEADLINE_EXPIRED. A task under a LoRA adapter (`PrefillTask.lora_name`) goes only to a
worker that says it runs adapters (`take(..., adapters=True)`, docs/lora.md); the others
look past it, and it keeps its place for one that does.

Replays: a task this queue has settled is refused until its deadline (its
memory is `settled.SettledTasks`). Each worker's liveness (heard from, and its
compute progressing), the stall and progress bounds and the cancels a worker's beat
tells it of are `liveness.WorkerLiveness`; what is failed back, and why, is all here.
"""

from __future__ import annotations

import heapq
import time
import uuid
from collections import Counter, deque
from typing import Callable

from pdserve.cluster.keys import DEFAULT_QUEUE_CAPACITY
from pdserve.kvtransfer.outcomes import DEADLINE_EXPIRED, NO_LIVE_WORKER, TARGET_GONE, WORKER_STALLED, WORKER_VANISHED
from pdserve.kvtransfer.task import PrefillTask

from pdserve.cluster.queue.liveness import DEFAULT_STALL_S, WorkerLiveness
from pdserve.cluster.queue.settled import SettledTasks
from pdserve.cluster.queue.answers import (
    ALREADY_DONE,
    DEADLINE_PASSED,
    DUPLICATE,
    NOTHING_TO_PREFILL,
    QUEUE_FULL,
    FailedTask,
    PutResult,
    QueueStats,
)

MAX_FAILED_PER_ORIGIN = 10_000  # failed tasks nobody collects must not grow without bound
# Prefix-aware dispatch (`take`): a task is kept for the worker whose cache holds the longest
# prefix of it when that saves at least PREFIX_MIN_TOKENS of compute more than the work that
# worker has in hand, for at most PREFIX_MAX_HOLD_S of queueing; a take looks past at most
# PREFIX_MAX_SKIPS such tasks. The decisions are kept (`prefix_decisions`) and counted.
PREFIX_MIN_TOKENS = 16
PREFIX_MAX_HOLD_S = 0.5
PREFIX_MAX_SKIPS = 64
PREFIX_DECISIONS_KEPT = 200
MAX_FAIL_REASON_CHARS = 64
MAX_FAIL_DETAIL_CHARS = 300


class QueueCore(WorkerLiveness, SettledTasks):
    """Ordering, budgeted batching, in-flight accounting and fail-back; no I/O.

    Owns the heap of queued tasks (lazy deletion on cancel), the tasks each
    worker has taken, how often each task was requeued, and the failed tasks
    waiting for their origin.
    """

    def __init__(self, capacity: int = DEFAULT_QUEUE_CAPACITY, *, max_requeues: int = 1,
                 clock: Callable[[], float] = time.time, on_dispatch: Callable[[float], None] | None = None,
                 stall_s: float = DEFAULT_STALL_S):
        if capacity < 1:
            raise ValueError(f"capacity={capacity} must be >= 1")
        self._init_liveness(stall_s)  # stall bound, when each worker last called, cancels to tell
        self.instance_id = uuid.uuid4().hex[:12]
        self.capacity = capacity
        self.max_requeues = max_requeues
        self._clock = clock
        self._heap: list[tuple[tuple, int, tuple[str, int]]] = []
        self._seq = 0
        self._queued: dict[tuple[str, int], tuple[int, PrefillTask, float]] = {}  # key -> (seq, task, enqueued_at)
        self._queued_tokens = 0
        self._in_flight: dict[str, dict[tuple[str, int], PrefillTask]] = {}
        self._requeues: Counter = Counter()
        self._failed: dict[str, list[FailedTask]] = {}
        self._init_settled()
        self.counters: Counter = Counter()
        self.on_dispatch = on_dispatch  # called with each dispatched task's queue wait (s)
        self.prefix_min_tokens, self.prefix_max_hold_s = PREFIX_MIN_TOKENS, PREFIX_MAX_HOLD_S
        self.prefix_decisions: deque[dict] = deque(maxlen=PREFIX_DECISIONS_KEPT)
        self.stalled_why: dict[str, str] = {}  # worker id -> why `fail_stalled` last failed its tasks back

    def __len__(self) -> int:
        return len(self._queued)

    @property
    def queued_tokens(self) -> int:
        """Prefill tokens of the queued tasks (what `stats` reports, without its O(n) scan)."""
        return self._queued_tokens

    def put(self, task: PrefillTask) -> PutResult:
        reason = None
        if task.num_prefill_tokens <= 0:
            reason = NOTHING_TO_PREFILL
        elif task.key in self._queued or any(task.key in tasks for tasks in self._in_flight.values()):
            reason = DUPLICATE
        elif task.deadline is not None and task.deadline <= self._clock():
            reason = DEADLINE_PASSED
        elif self._was_settled(task.key):
            reason = ALREADY_DONE
        elif len(self._queued) >= self.capacity:
            reason = QUEUE_FULL
        if reason is not None:
            self.counters[f"rejected_{reason}"] += 1
            return PutResult(False, reason, len(self._queued))
        self._push(task)
        self.counters["put"] += 1
        return PutResult(True, None, len(self._queued))

    def _push(self, task: PrefillTask) -> None:
        self._seq += 1
        self._queued[task.key] = (self._seq, task, self._clock())
        self._queued_tokens += task.num_prefill_tokens
        heapq.heappush(self._heap, (task.sort_key(), self._seq, task.key))

    def _pop_head(self) -> PrefillTask | None:
        """The most urgent live task without removing it (drops stale heap entries)."""
        while self._heap:
            _, seq, key = self._heap[0]
            entry = self._queued.get(key)
            if entry is not None and entry[0] == seq:
                return entry[1]
            heapq.heappop(self._heap)  # cancelled or superseded
        return None

    def _remove(self, task: PrefillTask) -> None:
        del self._queued[task.key]
        self._queued_tokens -= task.num_prefill_tokens

    def take(self, worker_id: str, max_tokens: int, max_tasks: int | None = None,
             adapters: bool = False) -> list[PrefillTask]:
        """The next batch for `worker_id` (see the module docstring); [] if none queued.
        ``adapters``: the worker runs LoRA adapters (else it is handed no task that names one)."""
        now = self._clock()
        self._seen[worker_id] = now
        self._idle(worker_id)  # it pulls: its previous batch is over
        batch: list[PrefillTask] = []
        tokens = 0
        kept: list[tuple] = []  # heap entries of tasks kept for another worker's cached prefix
        while (task := self._pop_head()) is not None:
            if task.deadline is not None and task.deadline <= now:
                self._remove(task)
                self._fail(task, *self._never_taken_or(task, DEADLINE_EXPIRED,
                                                       "deadline passed before any worker took it"))
                continue
            if batch and (tokens + task.num_prefill_tokens > max_tokens
                          or (max_tasks is not None and len(batch) >= max_tasks)):
                break
            if task.lora_name and not adapters:  # (kept for a worker that runs adapters)
                kept.append(heapq.heappop(self._heap))
                continue
            if task.prefix_hint and len(kept) < PREFIX_MAX_SKIPS and self._keep_for_prefix(task, worker_id, now):
                kept.append(heapq.heappop(self._heap))  # the head: `_pop_head` dropped stale entries
                continue
            if self.on_dispatch is not None:
                self.on_dispatch(max(0.0, now - self._queued[task.key][2]))
            self._remove(task)
            batch.append(task)
            tokens += task.num_prefill_tokens
        for entry in kept:
            heapq.heappush(self._heap, entry)
        if batch:
            taken = self._in_flight.setdefault(worker_id, {})
            for task in batch:
                taken[task.key] = task
            self.counters["dispatched"] += len(batch)
        return batch

    def _keep_for_prefix(self, task: PrefillTask, worker_id: str, now: float) -> bool:
        """Keep `task` out of `worker_id`'s batch for the live worker holding the longest cached
        prefix of it? Yes when what that worker's cache saves over this one's (in tokens of
        compute) exceeds the prefill tokens it has in hand (the wait before it pulls again),
        by at least `prefix_min_tokens`, and the task has waited less than `prefix_max_hold_s`.
        Each decision that names another worker is recorded with its figures."""
        hint = task.prefix_hint
        best = max(hint, key=lambda w: (hint[w], w))
        mine = hint.get(worker_id, 0)
        if best == worker_id or hint[best] <= mine:
            if mine:
                self.counters["prefix_routed"] += 1  # it goes where its prefix is
            return False
        gap = hint[best] - mine
        backlog = sum(t.num_prefill_tokens for t in self._in_flight.get(best, {}).values())
        waited = now - self._queued[task.key][2]
        live = self._is_live(best, now)
        keep = live and gap - backlog >= self.prefix_min_tokens and waited < self.prefix_max_hold_s
        why = ("kept for the worker with the prefix" if keep else
               f"{best} is not live" if not live else
               f"held {waited:.2f} s, the most a prefix may hold it" if waited >= self.prefix_max_hold_s else
               f"{best}'s {backlog} tokens in hand cost more than the {gap} its prefix saves")
        self.counters["prefix_kept" if keep else "prefix_overridden"] += 1
        self.prefix_decisions.append({
            "request_id": task.request_id, "epoch": task.epoch, "puller": worker_id, "best": best,
            "best_cached_tokens": hint[best], "puller_cached_tokens": mine, "best_backlog_tokens": backlog,
            "waited_s": round(waited, 4), "kept": keep, "why": why, "at": now})
        return keep

    def complete(self, worker_id: str, request_id: str | list[str]) -> bool:
        """The worker finished (or gave up on) a task, or a list of them: stop
        tracking them. True if any was in flight on that worker."""
        self.alive(worker_id)
        self._idle(worker_id)  # a worker completes its batch once it is over
        wanted = {request_id} if isinstance(request_id, str) else set(request_id)
        taken = self._in_flight.get(worker_id, {})
        keys = [key for key in taken if key[0] in wanted]
        for key in keys:
            self._settle(taken.pop(key))
            self._requeues.pop(key, None)
        if not taken:
            self._in_flight.pop(worker_id, None)
        self._forget_cancelled(worker_id, wanted)
        self.counters["completed"] += len(keys)
        return bool(keys)

    def cancel(self, request_id: str) -> str:
        """"queued" if removed before any worker took it, "in_flight" if a worker
        already has it (it will not be requeued; the worker learns of the cancel from
        its next `beat` and stops computing it), "unknown" otherwise. Covers every
        epoch of the request."""
        queued = [entry[1] for key, entry in self._queued.items() if key[0] == request_id]
        for task in queued:
            self._remove(task)
            self._settle(task)
        in_flight = False
        for worker_id in list(self._in_flight):
            taken = self._in_flight[worker_id]
            for key in [k for k in taken if k[0] == request_id]:
                task = taken.pop(key)
                self._settle(task)
                self._requeues.pop(key, None)
                self._cancelled.setdefault(worker_id, {})[key] = task
                self._untold.setdefault(worker_id, []).append(key)
                in_flight = True
            if not taken:
                del self._in_flight[worker_id]
        if queued or in_flight:
            self.counters["cancelled"] += 1
        return "queued" if queued else "in_flight" if in_flight else "unknown"

    def worker_gone(self, worker_id: str) -> dict[str, int]:
        """A worker left the registry. Tasks it had taken are requeued (at their
        original place in the order) up to `max_requeues` times, then failed
        back to their origin. Queued tasks whose KV target it was are dropped
        (failed back if their origin is another worker), and failed tasks
        waiting for it are discarded. Idempotent."""
        requeued = failed = 0
        for key, task in self._in_flight.pop(worker_id, {}).items():
            if self._requeues[key] < self.max_requeues:
                self._requeues[key] += 1
                self._push(task)  # bypasses capacity: it was admitted once already
                requeued += 1
            else:
                self._requeues.pop(key, None)
                self._fail(task, WORKER_VANISHED,
                           f"prefill worker {worker_id} vanished holding it after {self.max_requeues} requeue(s)")
                failed += 1
        orphans = [entry[1] for entry in self._queued.values() if entry[1].target_worker_id == worker_id]
        for task in orphans:
            self._remove(task)
            if task.origin != worker_id:
                self._fail(task, TARGET_GONE, f"decode worker {worker_id} that was to receive its KV is gone")
        dropped_failed = len(self._failed.pop(worker_id, []))
        self._forget_cancelled(worker_id)  # (it may still write them: their blocks stay quarantined)
        self._gone[worker_id] += 1
        self._seen.pop(worker_id, None)
        self._progress.pop(worker_id, None)
        self.counters["requeued"] += requeued
        self.counters["dropped_target_gone"] += len(orphans)
        return {"requeued": requeued, "failed": failed, "dropped_queued": len(orphans),
                "dropped_failed": dropped_failed}

    def _fail(self, task: PrefillTask, reason: str, detail: str) -> None:
        self._settle(task)
        pending = self._failed.setdefault(task.origin, [])
        pending.append(FailedTask(task, reason, detail, self._clock()))
        del pending[:-MAX_FAILED_PER_ORIGIN]
        self.counters[f"failed_{reason}"] += 1

    def take_failed(self, origin: str) -> list[FailedTask]:
        return self._failed.pop(origin, [])

    def fail(self, worker_id: str, request_id: str, reason: str, detail: str = "") -> bool:
        """`worker_id` gives up on a task it holds and cannot tell the target itself (no NIXL
        channel to it): the task goes to its origin's failed list with `reason`, where the
        origin's poll finds it and prefills locally at once. The same for a task cancelled
        while it held it (it stopped computing it and no write of it can land: the origin
        frees the blocks it had quarantined). False if the worker holds no such task (already
        failed back, or never its own)."""
        if not isinstance(reason, str) or not reason or len(reason) > MAX_FAIL_REASON_CHARS:
            raise ValueError(f"fail: reason must be a non-empty str of at most {MAX_FAIL_REASON_CHARS} "
                             f"chars, got {reason!r}")
        if not isinstance(detail, str):
            raise ValueError(f"fail: detail must be a str, got {type(detail).__name__}")
        self.alive(worker_id)
        taken = self._in_flight.get(worker_id, {})
        keys = [key for key in taken if key[0] == request_id]
        for key in keys:
            self._requeues.pop(key, None)
            self._fail(taken.pop(key), reason, detail[:MAX_FAIL_DETAIL_CHARS])
        if not taken:
            self._in_flight.pop(worker_id, None)
        cancelled = [task for key, task in self._cancelled.get(worker_id, {}).items() if key[0] == request_id]
        self._forget_cancelled(worker_id, {request_id})
        for task in cancelled:
            self._fail(task, reason, detail[:MAX_FAIL_DETAIL_CHARS])
        return bool(keys or cancelled)

    def hold(self, worker_id: str, tasks: list[PrefillTask]) -> int:
        """`worker_id` still holds `tasks`, taken from an earlier instance of this queue (it
        restarted while they were in flight): track them as in flight on that worker, taking a
        copy that a decode worker re-put out of the queue, so nobody else prefills them.
        Returns how many were not tracked as in flight on that worker before."""
        self.alive(worker_id)
        taken = self._in_flight.setdefault(worker_id, {})
        new = 0
        for task in tasks:
            if task.key in taken or any(task.key in t for w, t in self._in_flight.items() if w != worker_id):
                continue
            if self._was_settled(task.key):  # finished here already: not a task anybody still holds
                continue
            if task.key in self._queued:
                self._remove(self._queued[task.key][1])
            taken[task.key] = task
            new += 1
        if not taken:
            self._in_flight.pop(worker_id, None)
        self.counters["held_after_restart"] += new
        return new

    def untake(self, worker_id: str, tasks: list[PrefillTask]) -> int:
        """Tasks handed to `worker_id` that never reached it (its connection closed before the
        batch was sent) go back to their old place in the order; not counted as a requeue.
        Returns how many went back (those still in flight on that worker)."""
        taken = self._in_flight.get(worker_id, {})
        back = 0
        for task in tasks:
            if taken.pop(task.key, None) is not None:
                self._push(task)
                back += 1
        if not taken:
            self._in_flight.pop(worker_id, None)
        self.counters["returned_undelivered"] += back
        return back

    def fail_stalled(self) -> dict[str, int]:
        """Liveness beyond the lease: a worker holding tasks that has not called for `stall_s`
        (hung, SIGSTOPped, wedged; its etcd lease may well still be kept alive), or that beats
        but whose compute has stood still past its progress bound (a compute thread hung in a
        step while its event loop beats on; liveness.py), gets its tasks failed back to their
        origins now (WORKER_STALLED: not settled, as it may resume and write), so decode
        workers fall back within this bound instead of their deadline. The two are counted
        apart (counters `stalled_silent`, `stalled_compute`: tasks) and told apart in the
        task's detail and in `stalled_why`. Returns {worker id: tasks failed back}."""
        now = self._clock()
        out: dict[str, int] = {}
        self.stalled_why = {}
        for worker_id in list(self._in_flight):
            silent = now - self._seen.get(worker_id, now)
            if silent > self.stall_s:
                kind, why = "stalled_silent", (f"prefill worker {worker_id} holds it but has not been heard from "
                                               f"for {silent:.1f} s (stall bound {self.stall_s:g} s)")
            elif (still := self.compute_stalled(worker_id, now)) is not None:
                p = self._progress[worker_id]
                kind, why = "stalled_compute", (
                    f"prefill worker {worker_id} holds it and still beats, but its compute has made no progress "
                    f"for {still:.1f} s (progress bound {self.progress_bound(p.within_s):g} s: the larger of the "
                    f"stall bound and its own allowance of {p.within_s:.3g} s; {p.steps} progress marks)")
            else:
                continue
            tasks = self._in_flight.pop(worker_id)
            for key, task in tasks.items():
                self._requeues.pop(key, None)
                self._fail(task, WORKER_STALLED, why)
            self.counters[kind] += len(tasks)
            self.stalled_why[worker_id] = why
            out[worker_id] = len(tasks)
        if self.live_workers() == 0:  # nobody can take what waits: fail it back (nobody took it)
            stale = [entry[1] for entry in self._queued.values() if now - entry[2] > self.stall_s]
            for task in stale:
                self._remove(task)
                self._fail(task, *self._never_taken_or(
                    task, NO_LIVE_WORKER, f"queued {self.stall_s:g} s with no live prefill worker (none heard "
                    "from, or each one's compute stalled)"))
            if stale:
                out[""] = len(stale)
        return out

    def _never_taken_or(self, task: PrefillTask, reason: str, detail: str) -> tuple[str, str]:
        """The reason to fail a queued task back with. `reason` says nobody took it (its decode
        worker frees the blocks at once), which is false for a task requeued after its worker
        left the registry: a partitioned or stopped worker may still hold it and write, so
        that one goes back as WORKER_VANISHED (its blocks are quarantined)."""
        if self._requeues.pop(task.key, 0):  # (it leaves the queue for good either way)
            return WORKER_VANISHED, f"{detail}; requeued after its prefill worker vanished holding it"
        return reason, detail

    def stats(self) -> QueueStats:
        now = self._clock()
        oldest = min((entry[2] for entry in self._queued.values()), default=now)
        return QueueStats(
            depth=len(self._queued),
            queued_tokens=self._queued_tokens,
            oldest_wait_ms=max(0.0, (now - oldest) * 1000.0),
            in_flight={w: len(t) for w, t in self._in_flight.items()},
            in_flight_tokens=sum(t.num_prefill_tokens for ts in self._in_flight.values() for t in ts.values()),
            failed_pending=sum(len(f) for f in self._failed.values()),
            capacity=self.capacity,
            counters=dict(self.counters),
            instance_id=self.instance_id,
            live_workers=self.live_workers(),
        )
