"""Decode side of disaggregation: reserve blocks, enqueue, receive pages, or fall back.

Each remote attempt is a `Handoff` in this worker's `Handoffs` table
(kvtransfer/decode_side.py: the states, the transitions and why blocks are freed
or quarantined). This module feeds it events and applies what it decides:

- the event loop reserves (through the engine thread), puts the task, arms
  the deadline, cancels, and reacts to the queue (`QueueWatch`: failed
  tasks, a restart, a loss);
- the engine thread receives NIXL notifications (`PrefillDone`,
  `PrefillFailed`) and applies every effect to the engine through its KV
  connector, so engine state only ever changes in that thread.

Failures reach this side at once: a `PrefillFailed` notice on the NIXL
channel, or the queue's failed-task list; the fallback reason is the failure
kind. If the queue restarts, the tasks still awaited are put again under the
same epoch (their blocks are still reserved for them); if it stays
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
from dataclasses import dataclass

from pdserve.engine import Reservation
from pdserve.kvtransfer import Handoff, Handoffs, KVReceiver, PrefillTask
from pdserve.cluster.queue import TaskSigner

from .async_engine import AsyncEngine, EngineDeadError
from .kv_arrival import KVArrival
from .metrics import WorkerMetrics
from .prefill_pool import PrefillView, QueueWatch

log = logging.getLogger(__name__)


@dataclass
class RemoteConfig:
    timeout_s: float = 30.0  # remote TTFT deadline before falling back locally
    quarantine_s: float = 60.0  # how long abandoned blocks wait for a late write
    # How often to collect tasks the queue failed back and refresh the queue depth the router
    # sees (one actor call; this worker's own puts are counted without waiting for it).
    queue_poll_s: float = 0.25
    queue_call_s: float = 2.0  # bound on a cancel or a put: a wedged queue must not hold a request
    queue_lost_s: float = 5.0  # queue unreachable this long (no restart came): awaited requests go local


class RemotePrefill:
    """The remote path a decode worker's frontend plugs in (see frontend.RemotePath)."""

    def __init__(self, worker_id: str, engine: AsyncEngine, agent: KVReceiver, queue,
                 metrics: WorkerMetrics, cfg: RemoteConfig | None = None, costs=None):
        self.worker_id = worker_id
        self.engine = engine
        self.queue = queue
        self.cfg = cfg or RemoteConfig()
        self.signer = TaskSigner()  # its public key goes into this worker's etcd record (task_key)
        self.view = PrefillView()
        self.handoffs = Handoffs(self.cfg.quarantine_s)
        self.arrival = KVArrival(engine, agent, self.handoffs, metrics, costs)  # the engine-thread half
        self.arrival.on_ready_reput = lambda rid: asyncio.ensure_future(self._cancel_quietly(rid))
        self.counters = self.arrival.counters
        self.counters.update(queue_restarts=0, reput=0, queue_lost=0, withdrawn_queued=0, withdrawn_held=0)
        # Prefill workers' cached prefixes (their KV events, cluster/kvindex/service.py KVIndexFollower):
        # each task carries them as its prefix_hint; None when none is followed.
        self.prefix_view = None
        self.peers = None  # prefix loans (decode/borrow.py PeerPrefixes), when this pool can take part
        # Event-loop bookkeeping of aborts: requests whose task put was issued, and requests
        # aborted (a put not yet issued for them is skipped). Both end with the stream.
        self._put_issued: set[str] = set()
        self._withdrawn: set[str] = set()
        self._streaming: set[str] = set()  # requests whose stream() is still running
        self.fallback_causes = self.arrival.fallback_causes
        self._info = self.arrival.info
        self._watch = QueueWatch(queue, worker_id, self.view, poll_s=self.cfg.queue_poll_s,
                                 call_s=self.cfg.queue_call_s, lost_s=self.cfg.queue_lost_s,
                                 on_failed=self._queue_failed, on_restart=self._queue_restarted,
                                 on_lost=self._queue_lost, has_waiters=lambda: self.handoffs.num_awaiting > 0)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task] = []
        engine.pollers.append(self.arrival.poll)

    # -- lifecycle ------------------------------------------------------------------
    def start(self) -> None:
        self._loop = self.arrival.loop = asyncio.get_running_loop()
        self._tasks.append(asyncio.create_task(self._watch.run()))
        if self.peers is not None:
            self.peers.start()

    async def stop(self) -> None:
        if self.peers is not None:
            await self.peers.stop()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def available(self) -> bool:
        """A registered prefill worker that the queue also hears from (progress, not only a lease)."""
        return self.view.pool_size > 0 and (self.view.live_workers is None or self.view.live_workers > 0)

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

    # -- the asyncio side -------------------------------------------------------------
    async def stream(self, prep):
        """Yield (delta, final, info) for one request routed remote."""
        loop = asyncio.get_running_loop()
        rid = prep.request_id
        q = self.engine.attach(rid)
        fut = loop.create_future()
        self.engine.call(lambda eng: self._reserve(prep, fut))
        self._streaming.add(rid)
        try:
            res = await self._engine_answer(fut)
        except BaseException:
            self._streaming.discard(rid)
            self.engine.detach(rid)
            raise
        if isinstance(res, BaseException):
            self._streaming.discard(rid)
            self.engine.detach(rid)
            raise res
        info = {"route": "remote", "attempts": 1}
        timer = None
        ended = False  # a last delta was yielded: no abort follows, so the bookkeeping ends here
        try:
            if rid in self._withdrawn:  # aborted while reserving: the abort frees the blocks, no put
                pass
            elif res is None:
                info.update(route="local", fell_back_to_local=True,
                            reason="fallback: no KV space for a reservation")
                self.arrival.count_fallback("no_kv_space")
            else:
                h, reservation = res
                # The deadline covers the put too: a put stuck on a restarting queue ends with it.
                timer = loop.call_later(self.cfg.timeout_s, self._on_deadline, rid, h.epoch)
                ok, why, maybe_queued = await self._enqueue(prep, h, reservation)
                if not ok:
                    # A put that timed out may still reach the queue: then a prefill worker may
                    # write the blocks, so they wait in quarantine (and the task is cancelled).
                    self._fallback(rid, h.epoch, why, release_now=not maybe_queued)
                    if maybe_queued:
                        asyncio.ensure_future(self._cancel_quietly(rid))
            first = True
            while True:
                item, final = await q.get()
                if first and not isinstance(item, BaseException):
                    first = False
                    info.update(self._info.pop(rid, {}))
                    if timer is not None:
                        timer.cancel()
                ended = isinstance(item, BaseException) or item.finished
                yield item, final, info
                if ended:
                    return
        finally:
            if timer is not None:
                timer.cancel()
            self._info.pop(rid, None)
            self._streaming.discard(rid)
            self._withdrawn.discard(rid)  # the stream is over: no put can follow
            if ended:  # else the frontend's abort reads (and clears) whether a put was issued
                self._put_issued.discard(rid)

    async def _engine_answer(self, fut: asyncio.Future):
        """The engine thread's answer to a posted call; EngineDeadError if the engine dies first
        (a dead engine never runs the call: waiting on it alone would hang the request)."""
        while True:
            done, _ = await asyncio.wait({fut}, timeout=0.5)
            if done:
                return fut.result()
            if not self.engine.alive:
                raise EngineDeadError(f"engine is not running: {self.engine.error!r}")

    async def _enqueue(self, prep, h: Handoff, res: Reservation) -> tuple[bool, str, bool]:
        """Put the task: (ok, why not, whether a failed put may still have reached the queue)."""
        task = PrefillTask(
            request_id=prep.request_id, epoch=h.epoch, token_ids=prep.prompt_ids, cached_len=res.cached_len,
            target_worker_id=self.worker_id, target_block_ids=res.block_ids,
            sampling_params=prep.params.to_dict(), priority=prep.priority,
            deadline=time.time() + self.cfg.timeout_s,
            prefix_hint=prep.prefix_hint,  # computed once at admission (decode/frontend.py)
        )
        self.signer.sign(task)  # binds the blocks to this worker: the prefill worker checks it
        h.task = task
        self._put_issued.add(prep.request_id)  # from here an abort must ask the queue
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

    def _on_deadline(self, rid: str, epoch: int) -> None:
        asyncio.ensure_future(self._cancel_and_fallback(rid, epoch, "deadline passed"))

    async def _cancel_and_fallback(self, rid: str, epoch: int, why: str) -> None:
        """Cancel the queued task, then fall back. The blocks are freed at once only when the
        task was still queued (nobody took it); else they are quarantined."""
        self._fallback(rid, epoch, why, release_now=await self._withdrawn_unseen(rid))

    async def _withdrawn_unseen(self, rid: str) -> bool:
        """Cancel `rid`'s task on the queue: True only if no prefill worker can hold it (the
        queue removed it before anyone took it, and it was never put again after a queue
        restart: a worker may still hold the copy of the lost queue, reported only later)."""
        h = self.handoffs.awaited(rid)
        reput = h is not None and h.reput
        try:
            status = await asyncio.wait_for(self.queue.cancel(rid), self.cfg.queue_call_s)
        except Exception:  # noqa: BLE001  (unreachable or wedged queue: someone may hold the task)
            status = "unknown"
        return status == "queued" and not reput

    def abort(self, rid: str) -> None:
        """Client gone or Abort RPC: drop the request. Its task is withdrawn first: blocks
        are freed at once when no write can land (no put was issued, or the queue still held
        the task: nobody took it), and quarantined only when a prefill worker holds the task
        or a put's answer never came."""
        if rid in self._streaming:  # a put not yet issued for it never will be (see stream)
            self._withdrawn.add(rid)
        if rid not in self._put_issued:
            self.engine.call(lambda eng: self.arrival.abort(rid, False))
            return
        self._put_issued.discard(rid)
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
    def _queue_failed(self, task, why: str, settled: bool) -> None:
        """A task the queue failed back (expired, its worker vanished, or failed by a prefill
        worker that could not tell us over NIXL): prefill locally now; its blocks are freed
        only when no write can still land (the failure table, kvtransfer/outcomes.py), and never for a task
        put again after a queue restart: whatever the new queue says of its copy, a prefill
        worker may still hold the old queue's and write it (freed blocks would then be
        overwritten, possibly while they serve another request or sit in the prefix cache)."""
        h = self.handoffs.awaited(task.request_id)
        reput = h is not None and h.epoch == task.epoch and h.reput
        self._fallback(task.request_id, task.epoch, why, release_now=settled and not reput)

    async def _queue_restarted(self, instance: str) -> None:
        """The queue came back empty: put every awaited task again, same epoch (its blocks
        are still reserved for it). A prefill worker that holds one reports it to the new
        queue (`hold`), which then refuses our copy as a duplicate; a copy that got in first
        is taken out by that report. A task the queue refuses now goes local."""
        self.counters["queue_restarts"] += 1
        awaiting = [h for h in self.handoffs.awaiting() if isinstance(h.task, PrefillTask)]
        log.warning("prefill queue restarted (instance %s): putting %d awaited task(s) again", instance,
                    len(awaiting))

        async def reput(h: Handoff):
            try:
                put = await asyncio.wait_for(self.queue.put(h.task), self.cfg.queue_call_s)
                ok, why = put.ok or put.reason == "duplicate", put.reason
            except Exception as exc:  # noqa: BLE001
                ok, why = False, exc.__class__.__name__
            if ok:
                self.counters["reput"] += 1
                h.reput = True
            else:  # a prefill worker may still hold it from the lost queue: quarantine, not free
                self._fallback(h.request_id, h.epoch,
                               f"queue_lost: re-put after a queue restart refused ({why})", release_now=False)

        await asyncio.gather(*(reput(h) for h in awaiting))

    def _queue_lost(self) -> None:
        awaiting = self.handoffs.awaiting()
        self.counters["queue_lost"] += 1
        log.error("prefill queue unreachable for %.1f s: %d awaited request(s) prefill locally",
                  self.cfg.queue_lost_s, len(awaiting))
        for h in awaiting:
            self._fallback(h.request_id, h.epoch, "queue_lost: the prefill queue is unreachable", release_now=False)

    # -- the engine thread ----------------------------------------------------------------
    def _reserve(self, prep, fut) -> None:
        """Reserve blocks: the answer is (the new Handoff, its Reservation), None (no room:
        the request was queued for a local prefill) or an error."""
        answer: object = None
        try:
            req = self.engine.engine.make_request(prep.prompt_ids, prep.params, request_id=prep.request_id,
                                                  priority=prep.priority, tenant=prep.tenant)
            res = self.arrival.connector.reserve(req)
            if res is not None:
                answer = (self.handoffs.reserve(req.request_id, 1, len(res.block_ids)), res)
        except Exception as exc:  # noqa: BLE001  (delivered to the caller)
            answer = exc
        if self._loop is None:
            raise RuntimeError("the remote prefill path reserved blocks before start() bound its event loop")
        self._loop.call_soon_threadsafe(fut.set_result, answer)
