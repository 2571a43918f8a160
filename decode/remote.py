"""Decode side of disaggregation: reserve blocks, enqueue, receive pages, or fall back.

Per remote request, the states are: RESERVED (blocks for the uncached
positions, cached ones pinned) -> QUEUED (a `PrefillTask` on the Ray queue)
-> READY (the `PrefillDone` notification arrived: the request joins the
running batch with its first token) or FALLBACK (prefill locally under a new
epoch). Every transition of engine state happens in the engine thread, so a
notification and a fallback for the same request can never interleave.

Blocks of an abandoned attempt are freed at once when no prefill worker can
still write them (the task was still queued, the prefill pool is empty, or
the prefill worker said so in its `PrefillFailed`); otherwise they are
quarantined until that attempt's notification arrives (its write is over) or
`quarantine_s` passes, so a late write never lands in blocks another request
owns.

Failures reach this side at once: a `PrefillFailed` notice on the NIXL
channel, or the queue's failed-task list (polled every `queue_poll_s`); the
fallback reason is the failure kind. If the queue actor restarts (a new
`instance_id` in its stats), the tasks still awaited are put again under the
same epoch (their blocks are still reserved for them); if the queue stays
unreachable for `queue_lost_s`, they fall back. Every await here is bounded,
so a remote request ends by its deadline whatever dies on the way.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from pdserve.kvtransfer import KVTransferAgent, MalformedMessageError
from pdserve.kvtransfer.messages import FAILURE_KINDS, TRANSFER_ERROR, PrefillFailed, decode_notification

from .async_engine import AsyncEngine, EngineDeadError
from .metrics import WorkerMetrics

log = logging.getLogger(__name__)

PRIORITY_NAMES = {-1: "high", 0: "normal", 1: "low"}


@dataclass
class RemoteConfig:
    timeout_s: float = 30.0  # remote TTFT deadline before falling back locally
    quarantine_s: float = 60.0  # how long abandoned blocks wait for a late write
    # How often to collect tasks the queue failed back and refresh the queue depth the router
    # sees (one actor call; this worker's own puts are counted without waiting for it).
    queue_poll_s: float = 0.25
    queue_call_s: float = 2.0  # bound on a cancel or a put: a wedged queue must not hold a request
    queue_lost_s: float = 5.0  # queue unreachable this long (no restart came): awaited requests go local


@dataclass
class _Pending:
    epoch: int
    enqueued: float  # monotonic
    num_blocks: int  # reserved target blocks the prefill worker writes


class RemotePrefill:
    """The remote path a decode worker's frontend plugs in (see frontend.RemotePath)."""

    def __init__(self, worker_id: str, engine: AsyncEngine, agent: KVTransferAgent, queue,
                 metrics: WorkerMetrics, cluster: dict, cfg: RemoteConfig | None = None):
        self.worker_id = worker_id
        self.engine = engine
        self.agent = agent
        self.queue = queue
        self.metrics = metrics
        self.cfg = cfg or RemoteConfig()
        self.pool_size = 0
        self.cluster = cluster  # the frontend's view: queue depth/tokens, pool size
        self.costs = None  # the router's CostModel, fed with measured prefill/transfer costs
        self.counters = {"notifications": 0, "stale": 0, "malformed": 0, "ready": 0, "fallbacks": 0,
                         "bytes_received": 0, "prefill_failed": 0, "queue_restarts": 0, "reput": 0,
                         "queue_lost": 0}
        self.fallback_causes: dict[str, int] = {}  # fallback reason -> count (the metric's label)
        # Engine-thread state.
        self._pending: dict[str, _Pending] = {}
        self._quarantine: dict[tuple[str, int], tuple[str, float]] = {}
        self._info: dict[str, dict] = {}
        self._awaiting: dict[str, int] = {}  # event-loop side: request -> epoch awaiting its pages
        self._sent: dict[str, object] = {}  # event-loop side: request -> its PrefillTask (for a re-put)
        self._reput: set[str] = set()  # requests put again after a queue restart
        self._queue_instance: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task] = []
        engine.pollers.append(self._poll)

    # -- lifecycle ------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._tasks.append(asyncio.create_task(self._collect_failed()))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def available(self) -> bool:
        return self.pool_size > 0

    def set_pool_size(self, n: int) -> None:
        was, self.pool_size = self.pool_size, n
        self.cluster["prefill_pool_size"] = n
        if n == 0 and was > 0:
            asyncio.ensure_future(self._pool_empty())

    async def _pool_empty(self) -> None:
        """No prefill worker is alive, so nobody is writing. Each waiting
        request's task is cancelled first (a dead worker's tasks are requeued
        by the queue, and a worker that joins later must not take them), then
        it falls back and its blocks are freed; quarantines are freed too."""
        await asyncio.gather(*(self._cancel_and_fallback(rid, epoch, "prefill pool empty", release_anyway=True)
                               for rid, epoch in list(self._awaiting.items())))
        self.engine.call(self._free_quarantines)

    # -- the asyncio side -------------------------------------------------------------
    async def stream(self, prep):
        """Yield (delta, final, info) for one request routed remote."""
        loop = asyncio.get_running_loop()
        rid = prep.request_id
        q = self.engine.attach(rid)
        fut = loop.create_future()
        self.engine.call(lambda eng: self._reserve(eng, prep, fut))
        try:
            res = await self._engine_answer(fut)
        except BaseException:
            self.engine.detach(rid)
            raise
        info = {"route": "remote", "attempts": 1}
        timer = None
        if isinstance(res, BaseException):
            self.engine.detach(rid)
            raise res
        if res is None:
            info.update(route="local", fell_back_to_local=True, reason="fallback: no KV space for a reservation")
            self._count_fallback("no_kv_space")
        else:
            cached_len, targets = res
            # The deadline covers the put too: a put stuck on a restarting queue ends with it.
            self._awaiting[rid] = 1
            timer = loop.call_later(self.cfg.timeout_s, self._on_deadline, rid, 1)
            ok, why, maybe_queued = await self._enqueue(prep, cached_len, targets)
            if not ok:
                timer.cancel()
                timer = None
                self._awaiting.pop(rid, None)
                info.update(route="local", fell_back_to_local=True, reason=f"fallback: {why}")
                # A put that timed out may still reach the queue: then a prefill worker may
                # write the blocks, so they wait in quarantine (and the task is cancelled).
                self._fallback(rid, 1, why, release_now=not maybe_queued)
                if maybe_queued:
                    asyncio.ensure_future(self._cancel_quietly(rid))
        try:
            first = True
            while True:
                item, final = await q.get()
                if first and not isinstance(item, BaseException):
                    first = False
                    self._awaiting.pop(rid, None)
                    self._sent.pop(rid, None)
                    info.update(self._info.pop(rid, {}))
                    if timer is not None:
                        timer.cancel()
                    if rid in self._reput:  # a copy put after a queue restart may still be queued
                        self._reput.discard(rid)
                        asyncio.ensure_future(self._cancel_quietly(rid))
                yield item, final, info
                if isinstance(item, BaseException) or item.finished:
                    return
        finally:
            if timer is not None:
                timer.cancel()
            self._info.pop(rid, None)
            self._awaiting.pop(rid, None)
            self._sent.pop(rid, None)
            self._reput.discard(rid)

    async def _engine_answer(self, fut: asyncio.Future):
        """The engine thread's answer to a posted call; EngineDeadError if the engine dies first
        (a dead engine never runs the call: waiting on it alone would hang the request)."""
        while True:
            done, _ = await asyncio.wait({fut}, timeout=0.5)
            if done:
                return fut.result()
            if not self.engine.alive:
                raise EngineDeadError(f"engine is not running: {self.engine.error!r}")

    async def _enqueue(self, prep, cached_len: int, targets: list[int]) -> tuple[bool, str, bool]:
        """Put the task: (ok, why not, whether a failed put may still have reached the queue)."""
        from pdserve.cluster.queue import PrefillTask

        task = PrefillTask(
            request_id=prep.request_id, epoch=1, token_ids=prep.prompt_ids, cached_len=cached_len,
            target_worker_id=self.worker_id, target_block_ids=targets,
            sampling_params=prep.params.to_dict(), priority=PRIORITY_NAMES.get(prep.priority, "normal"),
            deadline=time.time() + self.cfg.timeout_s,
        )
        self._sent[prep.request_id] = task
        try:
            put = await asyncio.wait_for(self.queue.put(task), self.cfg.queue_call_s)
        except asyncio.TimeoutError:
            return False, "queue_unreachable: put timed out", True
        except Exception as exc:  # noqa: BLE001  (queue actor gone or restarting)
            return False, f"queue_unreachable: {exc.__class__.__name__}", False
        if not put.ok:
            return False, f"queue refused ({put.reason})", False
        return True, "", False

    def _on_deadline(self, rid: str, epoch: int) -> None:
        asyncio.ensure_future(self._cancel_and_fallback(rid, epoch, "deadline passed"))

    async def _cancel_and_fallback(self, rid: str, epoch: int, why: str, release_anyway: bool = False) -> None:
        """Cancel the queued task, then fall back. The blocks are freed at once
        when nobody can write them any more: the task was still queued, or
        (``release_anyway``) no prefill worker is alive; else quarantined."""
        try:
            status = await asyncio.wait_for(self.queue.cancel(rid), self.cfg.queue_call_s)
        except Exception:  # noqa: BLE001  (unreachable or wedged queue: someone may hold the task)
            status = "unknown"
        self._fallback(rid, epoch, why, release_now=release_anyway or status == "queued")

    def abort(self, rid: str) -> None:
        """Client gone or Abort RPC: drop the request; a reservation a prefill
        worker may still write is quarantined, not freed."""
        self.engine.call(lambda eng: self._abort_in_engine(eng, rid))
        asyncio.ensure_future(self._cancel_quietly(rid))

    async def _cancel_quietly(self, rid: str) -> None:
        try:
            await asyncio.wait_for(self.queue.cancel(rid), self.cfg.queue_call_s)
        except Exception:  # noqa: BLE001  (best effort: the queue drops expired tasks itself)
            pass

    def _fallback(self, rid: str, epoch: int, why: str, release_now: bool) -> None:
        self.engine.call(lambda eng: self._fallback_in_engine(eng, rid, epoch, why, release_now))

    async def _collect_failed(self) -> None:
        """Tasks the queue failed back (expired, worker vanished twice, or failed by a prefill
        worker that could not tell us over NIXL) go local; a restarted queue gets our awaited
        tasks again; a queue gone for `queue_lost_s` sends them local."""
        last_ok = time.monotonic()
        lost = False
        while True:
            await asyncio.sleep(self.cfg.queue_poll_s)
            try:
                failed, st = await asyncio.wait_for(self.queue.take_failed_and_stats(self.worker_id),
                                                    self.cfg.queue_call_s)
            except Exception as exc:  # noqa: BLE001  (keep collecting through queue/Ray hiccups)
                log.debug("queue poll failed: %r", exc)
                if not lost and time.monotonic() - last_ok > self.cfg.queue_lost_s and self._awaiting:
                    lost = True
                    self._queue_lost()
                continue
            last_ok, lost = time.monotonic(), False
            for f in failed:
                if f.reason in FAILURE_KINDS:  # a prefill worker's failure: its kind is the cause
                    why = f"{f.reason}: {f.detail}"
                else:
                    why = f"queue: {f.reason}"
                self._fallback(f.task.request_id, f.task.epoch, why, release_now=True)
            self.cluster["prefill_queue_depth"] = st.depth
            self.cluster["prefill_queue_tokens"] = st.queued_tokens
            if st.instance_id and st.instance_id != self._queue_instance:
                if self._queue_instance is not None:
                    await self._queue_restarted(st.instance_id)
                self._queue_instance = st.instance_id

    async def _queue_restarted(self, instance: str) -> None:
        """The queue came back empty: put again every task still awaited, same epoch (its
        blocks are still reserved for it). A prefill worker that holds one reports it to the
        new queue (`hold`), which then refuses our copy as a duplicate; a copy that got in
        first is taken out by that report. A task the queue refuses now goes local."""
        self.counters["queue_restarts"] += 1
        awaiting = [(rid, epoch, self._sent.get(rid)) for rid, epoch in self._awaiting.items()]
        log.warning("prefill queue restarted (instance %s): putting %d awaited task(s) again", instance,
                    len(awaiting))

        async def reput(rid, epoch, task):
            if task is None:
                return
            try:
                put = await asyncio.wait_for(self.queue.put(task), self.cfg.queue_call_s)
                ok, why = put.ok or put.reason == "duplicate", put.reason
            except Exception as exc:  # noqa: BLE001
                ok, why = False, exc.__class__.__name__
            if ok:
                self.counters["reput"] += 1
                self._reput.add(rid)
            elif self._awaiting.get(rid) == epoch:
                # A prefill worker may still hold it from the lost queue: quarantine, not free.
                self._fallback(rid, epoch, f"queue_lost: re-put after a queue restart refused ({why})",
                               release_now=False)

        await asyncio.gather(*(reput(*a) for a in awaiting))

    def _queue_lost(self) -> None:
        self.counters["queue_lost"] += 1
        log.error("prefill queue unreachable for %.1f s: %d awaited request(s) prefill locally",
                  self.cfg.queue_lost_s, len(self._awaiting))
        for rid, epoch in list(self._awaiting.items()):
            self._fallback(rid, epoch, "queue_lost: the prefill queue is unreachable", release_now=False)

    # -- the engine thread ----------------------------------------------------------------
    def _reserve(self, eng, prep, fut) -> None:
        try:
            req = eng.make_request(prep.prompt_ids, prep.params, request_id=prep.request_id,
                                   priority=prep.priority)
            res = eng.add_remote_request(req)
            if res is None:
                eng.scheduler.add(req)  # no room to reserve: prefill locally now
            else:
                self._pending[req.request_id] = _Pending(epoch=1, enqueued=time.monotonic(), num_blocks=len(res[1]))
        except Exception as exc:  # noqa: BLE001  (delivered to the caller)
            res = exc
        self._loop.call_soon_threadsafe(fut.set_result, res)

    def _fallback_in_engine(self, eng, rid: str, epoch: int, why: str, release_now: bool) -> None:
        p = self._pending.get(rid)
        if p is None or p.epoch != epoch or rid not in eng.scheduler.remote:
            return  # already ready, finished or fallen back
        del self._pending[rid]
        if release_now:
            eng.remote_kv_failed(rid)
        else:
            key = f"{rid}#quarantine{epoch}"
            eng.remote_kv_failed(rid, quarantine_as=key)
            self._quarantine[(rid, epoch)] = (key, time.monotonic() + self.cfg.quarantine_s)
        self.counters["fallbacks"] += 1
        self._count_fallback(why.split(" ")[0].strip(":"))
        if why.startswith(TRANSFER_ERROR):  # told by NIXL or by the queue: counted once, here
            self.metrics.transfer_failures.inc()
        self._info[rid] = {"route": "local", "fell_back_to_local": True, "attempts": epoch,
                           "reason": f"fallback after remote attempt {epoch}: {why}"}
        log.info("request %s: remote prefill attempt %d abandoned (%s); prefilling locally", rid, epoch, why)

    def _count_fallback(self, cause: str) -> None:
        self.fallback_causes[cause] = self.fallback_causes.get(cause, 0) + 1
        self.metrics.fallback(cause)

    def _observe(self, msg, kv_bytes: int, transfer_ms: float) -> None:
        """Feed the router's cost model (on the event loop, which owns it)."""
        if self.costs is None or self._loop is None:
            return

        def feed():
            if msg.batch_tokens > 0 and msg.prefill_ms > 0:
                self.costs.observe_prefill(msg.batch_tokens, msg.prefill_ms, "remote")
            if transfer_ms > 0:
                self.costs.observe_transfer(kv_bytes, transfer_ms)

        self._loop.call_soon_threadsafe(feed)

    def _abort_in_engine(self, eng, rid: str) -> None:
        p = self._pending.pop(rid, None)
        if p is not None and rid in eng.scheduler.remote and self.pool_size > 0:
            key = f"{rid}#quarantine{p.epoch}"
            eng.kv.rename(rid, key)
            self._quarantine[(rid, p.epoch)] = (key, time.monotonic() + self.cfg.quarantine_s)
        if eng.abort_request(rid):
            self.engine.deliver_abort(rid)

    def _free_quarantines(self, eng) -> None:
        for key, (qkey, _) in list(self._quarantine.items()):
            eng.free_kv(qkey)
            del self._quarantine[key]

    def _on_failed(self, eng, msg: PrefillFailed) -> None:
        """A prefill worker will not write this attempt: prefill locally now (engine thread)."""
        self.counters["prefill_failed"] += 1
        quarantined = self._quarantine.get((msg.request_id, msg.epoch))
        if quarantined is not None:
            if msg.writes_settled:  # an abandoned attempt that is now over: its blocks are free
                del self._quarantine[(msg.request_id, msg.epoch)]
                eng.free_kv(quarantined[0])
            return
        p = self._pending.get(msg.request_id)
        if p is None or p.epoch != msg.epoch:
            self.counters["stale"] += 1
            return
        worker = f" on {msg.prefill_worker}" if msg.prefill_worker else ""
        self._fallback_in_engine(eng, msg.request_id, msg.epoch, f"{msg.kind}{worker}: {msg.detail}",
                                 release_now=msg.writes_settled)

    def _poll(self) -> bool:
        """Engine-thread poller: NIXL progress, notifications, quarantine expiry."""
        eng = self.engine.engine
        res = self.agent.poll()
        did = False
        for note in res.notifications:
            did = True
            self.counters["notifications"] += 1
            try:
                msg = decode_notification(note.payload)
            except MalformedMessageError as exc:
                self.counters["malformed"] += 1
                log.warning("malformed notification from %s ignored: %s", note.sender, exc)
                continue
            if isinstance(msg, PrefillFailed):
                self._on_failed(eng, msg)
                continue
            quarantined = self._quarantine.pop((msg.request_id, msg.epoch), None)
            if quarantined is not None:  # the late write is over: its blocks are safe to reuse
                eng.free_kv(quarantined[0])
                self.counters["stale"] += 1
                continue
            p = self._pending.get(msg.request_id)
            if p is None or p.epoch != msg.epoch or msg.request_id not in eng.scheduler.remote:
                self.counters["stale"] += 1
                continue
            del self._pending[msg.request_id]
            now = time.monotonic()
            total_ms = (now - p.enqueued) * 1e3
            # Whole pages land (the last one partly filled): count them as written.
            kv_bytes = p.num_blocks * eng.runner.block_bytes * eng.model_config.num_layers
            self._info[msg.request_id] = {
                "route": "remote", "prefill_worker": msg.prefill_worker, "attempts": msg.epoch,
                "queue_wait_ms": msg.queue_wait_ms, "prefill_ms": msg.prefill_ms,
                # Transfer as the decode side sees it: what the enqueue->notification
                # time leaves after queue wait and prefill compute (pages + notification).
                "transfer_ms": max(0.0, total_ms - msg.queue_wait_ms - msg.prefill_ms),
                "transfer_bytes": kv_bytes,
            }
            self.counters["ready"] += 1
            self.counters["bytes_received"] += kv_bytes
            self.metrics.transfer_bytes.observe(kv_bytes)
            self._observe(msg, kv_bytes, self._info[msg.request_id]["transfer_ms"])
            self.metrics.transfer_seconds.observe(self._info[msg.request_id]["transfer_ms"] / 1e3)
            self.engine.deliver(eng.remote_kv_ready(msg.request_id, msg.first_token_id, msg.first_token_logprob))
        if self._quarantine:
            now = time.monotonic()
            for key, (qkey, until) in list(self._quarantine.items()):
                if now > until:
                    eng.free_kv(qkey)
                    del self._quarantine[key]
        # While pages are awaited, keep the loop polling briskly.
        self.engine.idle_wait_s = 0.001 if self._pending else 0.05
        return did
