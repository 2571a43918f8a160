"""Decode side of disaggregation: reserve blocks, enqueue, receive pages, or fall back.

**Who owns a remote request's state:** its `RemoteRequest`, one per request this worker
routes remote, in `RemotePrefill.owners`: the current attempt (the handoff state machine
of kvtransfer/decode_side.py, with its epoch), the reserved blocks, the deadline, what the
queue was told, and the breakdown its last chunk carries. The frontend, the engine thread
(`KVArrival`, decode/kv_arrival.py) and the queue watch ask it; the engine only parks the
request with its blocks (engine/kv_connector.py).

- the event loop reserves (through the engine thread), puts the task, arms
  the deadline, cancels, and reacts to the queue (`QueueWatch`: failed
  tasks, a restart, a loss);
- the engine thread receives NIXL notifications (`PrefillDone`,
  `PrefillFailed`) and applies every effect to the engine through its KV
  connector, so engine state only ever changes in that thread.

Failures reach this side at once: a `PrefillFailed` notice on the NIXL
channel, or the queue's failed-task list; the fallback reason is the failure
kind. If the queue restarts, each task still awaited is put again as a new attempt
(the next epoch) into fresh blocks, its old blocks quarantined until the old attempt's
notice or `quarantine_s`: a prefill worker that still holds the lost queue's copy writes
only the old blocks, and its notice never runs the request. If the queue stays
unreachable for `queue_lost_s`, they fall back. Every await here is bounded,
so a remote request ends by its deadline whatever dies on the way.

Every task is signed (`TaskSigner`, cluster/queue/signing.py) with the key
this worker publishes in its etcd record: prefill workers write only into
blocks this worker reserved and signed for, whatever else reaches the queue.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdserve.cluster.queue import TaskSigner
from pdserve.engine import LoRARequest, Reservation
from pdserve.kvtransfer import Handoff, Handoffs, KVReceiver, PrefillTask

from .async_engine import AsyncEngine, EngineDeadError
from .final_info import FinalInfo
from .ingress import Prepared
from .kv_arrival import KVArrival
from .metrics import WorkerMetrics
from .prefill_pool import PrefillView, QueueWatch

if TYPE_CHECKING:
    from .borrow import PeerPrefixes

log = logging.getLogger(__name__)


def adapter_fields(lora: LoRARequest | None) -> dict[str, Any]:
    """A task's LoRA fields (kvtransfer/task.py) for adapter ``lora`` (none for the base model)."""
    if lora is None:
        return {}
    return {"lora_name": lora.lora_name, "lora_int_id": lora.lora_int_id, "lora_path": lora.lora_path}


@dataclass
class RemoteConfig:
    timeout_s: float = 30.0  # remote TTFT deadline before falling back locally
    quarantine_s: float = 60.0  # how long abandoned blocks wait for a late write
    # How often to collect tasks the queue failed back and refresh the queue depth the router
    # sees (one actor call; this worker's own puts are counted without waiting for it).
    queue_poll_s: float = 0.25
    queue_call_s: float = 2.0  # bound on a cancel or a put: a wedged queue must not hold a request
    queue_lost_s: float = 5.0  # queue unreachable this long (no restart came): awaited requests go local


@dataclass(eq=False)
class RemoteRequest:
    """Everything about one request routed remote, in one place (see the module docstring).

    The engine thread writes ``attempt``, ``reservation`` and ``breakdown`` (before it hands
    the request's next item to the stream); the event loop writes the rest."""

    prep: Prepared
    tokens: int  # uncached prompt tokens: pending remote work until its first token
    attempt: Handoff | None = None  # the current attempt (state, epoch, task); None before blocks
    reservation: Reservation | None = None  # the current attempt's target blocks
    deadline: asyncio.TimerHandle | None = None  # its fallback timer (one for all its attempts)
    deadline_at: float = 0.0  # wall clock: the tasks' deadline (a re-put keeps it)
    put_issued: bool = False  # a put went out: an abort must ask the queue
    withdrawn: bool = False  # aborted before its put: no put follows
    streaming: bool = True  # its stream() still runs
    pending: bool = True  # counted in the pending remote work (until its first token or its end)
    reserved: asyncio.Future | None = None  # set (event loop) once the engine reserved its blocks or had no room
    breakdown: dict[str, Any] = field(default_factory=lambda: {"route": "remote", "attempts": 1})

    @property
    def request_id(self) -> str:
        return self.prep.request_id


class RemotePrefill:
    """The remote path a decode worker's frontend plugs in (see frontend.RemotePath)."""

    def __init__(self, worker_id: str, engine: AsyncEngine, agent: KVReceiver, queue: Any,
                 metrics: WorkerMetrics, cfg: RemoteConfig | None = None, costs: Any = None,
                 peers: PeerPrefixes | None = None, prefix_view: Any = None):
        self.worker_id = worker_id
        self.engine = engine
        self.queue = queue
        self.cfg = cfg or RemoteConfig()
        self.signer = TaskSigner()  # its public key goes into this worker's etcd record (task_key)
        self.view = PrefillView()
        # Prefill workers' cached prefixes (their KV events, cluster/kvindex/service.py KVIndexFollower):
        # each task carries them as its prefix_hint; None when none is followed.
        self.prefix_view = prefix_view
        self.peers = peers  # prefix loans (decode/borrow.py PeerPrefixes), when this pool can take part
        self.owners: dict[str, RemoteRequest] = {}  # the owners (request id -> its RemoteRequest)
        self.pending_requests = 0  # routed remote, first token not yet back (the router's view)
        self.pending_tokens = 0
        self.handoffs = Handoffs(self.cfg.quarantine_s)
        self.arrival = KVArrival(engine, agent, self.handoffs, self.owners, metrics, costs, peers)
        self.counters = self.arrival.counters
        self.counters.update(queue_restarts=0, reput=0, queue_lost=0, withdrawn_queued=0, withdrawn_held=0)
        self.fallback_causes = self.arrival.fallback_causes
        self._watch = QueueWatch(queue, worker_id, self.view, poll_s=self.cfg.queue_poll_s,
                                 call_s=self.cfg.queue_call_s, lost_s=self.cfg.queue_lost_s,
                                 on_failed=self._queue_failed, on_restart=self._queue_restarted,
                                 on_lost=self._queue_lost, has_waiters=lambda: self.handoffs.num_awaiting > 0)
        self._tasks: list[asyncio.Task] = []

    @property
    def pollers(self) -> list:
        """What the engine thread polls for this path (`AsyncEngine.start`)."""
        return [self.arrival.poll]

    @property
    def after_schedule(self) -> list:
        """What the engine thread runs once a step's plan is made (`AsyncEngine.start`): the
        blocks it reserved become attempts, and their tasks go out while the step computes."""
        return [self.arrival.take_reservations]

    # -- lifecycle ------------------------------------------------------------------
    def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._watch.run()))
        if self.peers is not None:
            self.peers.start()

    async def stop(self) -> None:
        if self.peers is not None:
            await self.peers.stop()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.prefix_view is not None:
            self.prefix_view.close()

    def available(self) -> bool:
        """A registered prefill worker that the queue also hears from (progress, not only a lease)."""
        return self.view.pool_size > 0 and (self.view.live_workers is None or self.view.live_workers > 0)

    def owns(self, request_id: str) -> bool:
        """Whether ``request_id`` is a request this path owns (routed remote, not yet over)."""
        return request_id in self.owners

    def set_pool_size(self, n: int) -> None:
        was, self.view.pool_size = self.view.pool_size, n
        if n == 0 and was > 0:
            asyncio.ensure_future(self._pool_empty())

    async def _pool_empty(self) -> None:
        """No prefill worker is registered. Each waiting request's task is cancelled (a worker
        that joins later must not take it) and the request falls back now. A lost lease does
        not mean a dead process: a partitioned prefill worker may still have page writes in
        its TCP send buffer that land when the link returns (measured: a write that timed out
        on a throttled link was delivered after the throttle lifted). So only a task that was
        still queued frees its blocks; the others are quarantined until their attempt's own
        notification arrives or `quarantine_s` passes."""
        await asyncio.gather(*(self._cancel_and_fallback(h.request_id, h.epoch, "prefill pool empty")
                               for h in self.handoffs.awaiting()))

    # -- the owners' bookkeeping (event loop) -----------------------------------------------
    def _open(self, prep: Prepared) -> RemoteRequest:
        owner = RemoteRequest(prep, max(0, len(prep.prompt_ids) - prep.cached_len))
        self.owners[owner.request_id] = owner
        self.pending_requests += 1
        self.pending_tokens += owner.tokens
        return owner

    def _prefill_over(self, owner: RemoteRequest) -> None:
        """Its first token is out (or it ended before one): no longer pending remote work."""
        if owner.pending:
            owner.pending = False
            self.pending_requests -= 1
            self.pending_tokens -= owner.tokens
        if owner.deadline is not None:
            owner.deadline.cancel()
            owner.deadline = None

    def _close(self, owner: RemoteRequest) -> None:
        self._prefill_over(owner)
        if self.owners.get(owner.request_id) is owner:
            del self.owners[owner.request_id]

    # -- the asyncio side -------------------------------------------------------------
    async def stream(self, prep: Prepared) -> AsyncIterator[tuple[object, FinalInfo | None, dict]]:
        """Yield (delta, final, breakdown) for one request routed remote."""
        loop = asyncio.get_running_loop()
        owner = self._open(prep)
        owner.reserved = loop.create_future()
        ended = False  # a last delta was yielded: no abort follows, so the owner ends here
        try:
            # The engine's scheduler reserves its blocks in the step that admits it (engine/
            # remote_kv.py); the engine thread's poller hands the Reservation over (KVArrival).
            q = self.engine.submit(prep.request_id, prep.prompt_ids, prep.params, prep.priority, prep.tenant,
                                   remote_kv=True, lora_request=prep.lora)  # (its prompt's KV: under its adapter)
            first = await self._reservation(owner, q)
            if first is not None:  # the request ended before any reservation (it was refused)
                pass
            elif owner.withdrawn:  # aborted while reserving: the abort frees the blocks, no put
                pass
            elif owner.reservation is None:
                owner.breakdown.update(route="local", fell_back_to_local=True,
                                       reason="fallback: no KV space for a reservation")
                self.arrival.count_fallback("no_kv_space")
            else:
                # The deadline covers the put too: a put stuck on a restarting queue ends with it.
                owner.deadline = loop.call_later(self.cfg.timeout_s, self._on_deadline, owner)
                owner.deadline_at = time.time() + self.cfg.timeout_s
                await self._put(owner)
            while True:
                item, final = first if first is not None else await q.get()
                first = None
                if owner.pending and not isinstance(item, BaseException):
                    self._prefill_over(owner)
                ended = isinstance(item, BaseException) or getattr(item, "finished", False)
                yield item, final, owner.breakdown
                if ended:
                    return
        finally:
            owner.streaming = False
            owner.withdrawn = False  # the stream is over: no put can follow
            if ended:  # else the frontend's abort reads (and ends) whether a put was issued
                self._close(owner)

    async def _reservation(self, owner: RemoteRequest, q: asyncio.Queue):
        """Wait until the engine reserved the request's blocks (or had no room: it prefills
        locally). None then; the request's first stream item instead when it ended before any
        reservation (an add the engine refused). EngineDeadError when the engine dies first
        (a dead engine never answers: waiting on it alone would hang the request)."""
        fut = owner.reserved
        assert fut is not None
        getter: asyncio.Future | None = None
        try:
            while not fut.done():
                if getter is None:
                    getter = asyncio.ensure_future(q.get())
                done, _ = await asyncio.wait({fut, getter}, timeout=0.5, return_when=asyncio.FIRST_COMPLETED)
                if getter in done:
                    return getter.result()
                if not done and not self.engine.alive:
                    raise EngineDeadError(f"engine is not running: {self.engine.error!r}")
        finally:
            if getter is not None and not getter.done():
                getter.cancel()
        return None

    async def _engine_answer(self, fut: asyncio.Future):
        """The engine thread's answer to a posted call; EngineDeadError if the engine dies first
        (a dead engine never runs the call: waiting on it alone would hang the request)."""
        while True:
            done, _ = await asyncio.wait({fut}, timeout=0.5)
            if done:
                return fut.result()
            if not self.engine.alive:
                raise EngineDeadError(f"engine is not running: {self.engine.error!r}")

    async def _put(self, owner: RemoteRequest) -> bool:
        """Put the current attempt's task; on failure the attempt falls back (a put that timed
        out may still reach the queue: then a prefill worker may write the blocks, so they wait
        in quarantine and the task is cancelled). Whether it is on the queue."""
        h = owner.attempt
        assert h is not None and owner.reservation is not None  # reserved first (stream, _queue_restarted)
        ok, why, maybe_queued = await self._enqueue(owner, h, owner.reservation)
        if not ok:
            self._fallback(owner.request_id, h.epoch, why, release_now=not maybe_queued)
            if maybe_queued:
                asyncio.ensure_future(self._cancel_quietly(owner.request_id))
        return ok

    async def _enqueue(self, owner: RemoteRequest, h: Handoff, res: Reservation) -> tuple[bool, str, bool]:
        """Put the task: (ok, why not, whether a failed put may still have reached the queue)."""
        prep = owner.prep
        task = PrefillTask(
            request_id=prep.request_id, epoch=h.epoch, token_ids=prep.prompt_ids, cached_len=res.cached_len,
            target_worker_id=self.worker_id, target_block_ids=res.block_ids,
            sampling_params=prep.params.to_dict(), priority=prep.priority,
            deadline=owner.deadline_at,
            prefix_hint=prep.prefix_hint,  # computed once at admission (decode/frontend.py)
            traceparent=prep.traceparent or "",  # the prefill worker's spans join the request's trace
            **adapter_fields(prep.lora),  # the LoRA adapter the prefill worker computes under (signed)
            draft_block_ids=list(res.draft_block_ids),  # the draft model's KV, where wanted (signed)
        )
        self.signer.sign(task)  # binds the blocks to this worker: the prefill worker checks it
        h.task = task
        owner.put_issued = True  # from here an abort must ask the queue
        try:
            put = await asyncio.wait_for(self.queue.put(task), self.cfg.queue_call_s)
        except asyncio.TimeoutError:
            return False, "queue_unreachable: put timed out", True
        except Exception as exc:  # noqa: BLE001  (queue actor gone or restarting)
            return False, f"queue_unreachable: {exc.__class__.__name__}", False
        if not put.ok:
            return False, f"queue refused ({put.reason})", False
        self.handoffs.queued(prep.request_id, h.epoch, task)
        return True, "", False

    def _on_deadline(self, owner: RemoteRequest) -> None:
        owner.deadline = None
        if owner.attempt is not None:
            asyncio.ensure_future(self._cancel_and_fallback(owner.request_id, owner.attempt.epoch, "deadline passed"))

    async def _cancel_and_fallback(self, rid: str, epoch: int, why: str) -> None:
        """Cancel the queued task, then fall back. The blocks are freed at once only when the
        task was still queued (nobody took it); else they are quarantined."""
        self._fallback(rid, epoch, why, release_now=await self._withdrawn_unseen(rid))

    async def _withdrawn_unseen(self, rid: str) -> bool:
        """Cancel `rid`'s task on the queue: True only if no prefill worker can hold the current
        attempt's copy (the queue removed it before anyone took it). An earlier attempt's copy
        that a worker may hold writes only its own, quarantined, blocks."""
        try:
            status = await asyncio.wait_for(self.queue.cancel(rid), self.cfg.queue_call_s)
        except Exception:  # noqa: BLE001  (unreachable or wedged queue: someone may hold the task)
            status = "unknown"
        return status == "queued"

    def abort(self, rid: str) -> None:
        """Client gone or Abort RPC: drop the request. Its task is withdrawn first: blocks
        are freed at once when no write can land (no put was issued, or the queue still held
        the task: nobody took it), and quarantined only when a prefill worker holds the task
        or a put's answer never came."""
        owner = self.owners.get(rid)
        if owner is not None:
            if owner.streaming:  # a put not yet issued for it never will be (see stream)
                owner.withdrawn = True
            else:  # its stream is over: this abort ends it
                self._close(owner)
        if owner is None or not owner.put_issued:
            self.engine.call(lambda eng: self.arrival.abort(rid, False))
            return
        owner.put_issued = False
        asyncio.ensure_future(self._withdraw(rid))

    async def _withdraw(self, rid: str) -> None:
        unseen = await self._withdrawn_unseen(rid)
        self.counters["withdrawn_queued" if unseen else "withdrawn_held"] += 1
        self.engine.call(lambda eng: self.arrival.abort(rid, not unseen))

    async def _cancel_quietly(self, rid: str) -> None:
        try:
            await asyncio.wait_for(self.queue.cancel(rid), self.cfg.queue_call_s)
        except Exception:  # noqa: BLE001  (best effort: the queue drops expired tasks itself)
            pass

    def _fallback(self, rid: str, epoch: int, why: str, release_now: bool) -> None:
        self.engine.call(lambda eng: self.arrival.apply(self.handoffs.give_up(rid, epoch, release_now, why)))

    # -- what the queue tells us (QueueWatch callbacks, event loop) --------------------------
    def _queue_failed(self, task: PrefillTask, why: str, settled: bool) -> None:
        """A task the queue failed back (expired, its worker vanished, or failed by a prefill
        worker that could not tell us over NIXL): prefill locally now; its blocks are freed
        only when no write can still land (the failure table, kvtransfer/outcomes.py). A failed
        task of an attempt already superseded only ends that attempt's quarantine (settled)."""
        self._fallback(task.request_id, task.epoch, why, release_now=settled)

    async def _queue_restarted(self, instance: str) -> None:
        """The queue came back empty: each awaited task is put again as the next attempt (a new
        epoch) into fresh blocks; the old attempt's blocks wait in quarantine, so a prefill
        worker still holding the lost queue's copy writes only those, and its notice (an old
        epoch) frees them without running the request. A request the pool has no room for
        now, or whose new put is refused, prefills locally."""
        self.counters["queue_restarts"] += 1
        owners = [self.owners[h.request_id] for h in self.handoffs.awaiting()
                  if isinstance(h.task, PrefillTask) and h.request_id in self.owners]
        log.warning("prefill queue restarted (instance %s): putting %d awaited task(s) again as new attempts",
                    instance, len(owners))
        loop = asyncio.get_running_loop()

        async def again(owner: RemoteRequest) -> None:
            old = owner.attempt
            assert old is not None  # an awaited handoff's owner has it
            fut = loop.create_future()
            self.engine.call(lambda eng: self._engine_answer_of(fut, self.arrival.supersede, owner, old))
            try:
                res = await self._engine_answer(fut)
            except EngineDeadError:
                return
            if isinstance(res, BaseException) or res is None:  # it went local, or its attempt ended meanwhile
                return
            if await self._put(owner):
                self.counters["reput"] += 1

        await asyncio.gather(*(again(o) for o in owners))

    def _queue_lost(self) -> None:
        awaiting = self.handoffs.awaiting()
        self.counters["queue_lost"] += 1
        log.error("prefill queue unreachable for %.1f s: %d awaited request(s) prefill locally",
                  self.cfg.queue_lost_s, len(awaiting))
        for h in awaiting:
            self._fallback(h.request_id, h.epoch, "queue_lost: the prefill queue is unreachable", release_now=False)

    # -- the engine thread ----------------------------------------------------------------
    def _engine_answer_of(self, fut: asyncio.Future, fn, *args) -> None:
        """Engine thread: run ``fn(*args)`` and hand its result (or its error) to ``fut``."""
        answer: object
        try:
            answer = fn(*args)
        except Exception as exc:  # noqa: BLE001  (delivered to the caller)
            answer = exc
        self.engine.to_loop(fut.set_result, answer)
