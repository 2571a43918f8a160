"""Decode side of disaggregation: reserve blocks, enqueue, receive pages, or fall back.

Per remote request, the states are: RESERVED (blocks for the uncached
positions, cached ones pinned) -> QUEUED (a `PrefillTask` on the Ray queue)
-> READY (the `PrefillDone` notification arrived: the request joins the
running batch with its first token) or FALLBACK (prefill locally under a new
epoch). Every transition of engine state happens in the engine thread, so a
notification and a fallback for the same request can never interleave.

Blocks of an abandoned attempt are freed at once when no prefill worker can
still write them (the task was still queued, or the prefill pool is empty);
otherwise they are quarantined until that attempt's notification arrives
(its write is over) or `quarantine_s` passes, so a late write never lands in
blocks another request owns.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from pdserve.kvtransfer import KVTransferAgent, MalformedMessageError
from pdserve.kvtransfer.messages import decode_prefill_done

from .async_engine import AsyncEngine
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
                         "bytes_received": 0}
        # Engine-thread state.
        self._pending: dict[str, _Pending] = {}
        self._quarantine: dict[tuple[str, int], tuple[str, float]] = {}
        self._info: dict[str, dict] = {}
        self._awaiting: dict[str, int] = {}  # event-loop side: request -> epoch awaiting its pages
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
        for rid, epoch in list(self._awaiting.items()):
            await self._cancel_and_fallback(rid, epoch, "prefill pool empty", release_anyway=True)
        self.engine.call(self._free_quarantines)

    # -- the asyncio side -------------------------------------------------------------
    async def stream(self, prep):
        """Yield (delta, final, info) for one request routed remote."""
        loop = asyncio.get_running_loop()
        rid = prep.request_id
        q = self.engine.attach(rid)
        fut = loop.create_future()
        self.engine.call(lambda eng: self._reserve(eng, prep, fut))
        res = await fut
        info = {"route": "remote", "attempts": 1}
        timer = None
        if isinstance(res, BaseException):
            self.engine.detach(rid)
            raise res
        if res is None:
            info.update(route="local", fell_back_to_local=True, reason="fallback: no KV space for a reservation")
            self.metrics.fallback("no_kv_space")
        else:
            cached_len, targets = res
            ok, why = await self._enqueue(prep, cached_len, targets)
            if not ok:
                info.update(route="local", fell_back_to_local=True, reason=f"fallback: {why}")
                self._fallback(rid, 1, why, release_now=True)
            else:
                self._awaiting[rid] = 1
                timer = loop.call_later(self.cfg.timeout_s, self._on_deadline, rid, 1)
        try:
            first = True
            while True:
                item, final = await q.get()
                if first and not isinstance(item, BaseException):
                    first = False
                    self._awaiting.pop(rid, None)
                    info.update(self._info.pop(rid, {}))
                    if timer is not None:
                        timer.cancel()
                yield item, final, info
                if isinstance(item, BaseException) or item.finished:
                    return
        finally:
            self._info.pop(rid, None)
            self._awaiting.pop(rid, None)

    async def _enqueue(self, prep, cached_len: int, targets: list[int]) -> tuple[bool, str]:
        from pdserve.cluster.queue import PrefillTask

        task = PrefillTask(
            request_id=prep.request_id, epoch=1, token_ids=prep.prompt_ids, cached_len=cached_len,
            target_worker_id=self.worker_id, target_block_ids=targets,
            sampling_params=prep.params.to_dict(), priority=PRIORITY_NAMES.get(prep.priority, "normal"),
            deadline=time.time() + self.cfg.timeout_s,
        )
        try:
            put = await self.queue.put(task)
        except Exception as exc:  # noqa: BLE001  (queue actor gone)
            return False, f"queue unreachable ({exc.__class__.__name__})"
        if not put.ok:
            return False, f"queue refused ({put.reason})"
        return True, ""

    def _on_deadline(self, rid: str, epoch: int) -> None:
        asyncio.ensure_future(self._cancel_and_fallback(rid, epoch, "deadline passed"))

    async def _cancel_and_fallback(self, rid: str, epoch: int, why: str, release_anyway: bool = False) -> None:
        """Cancel the queued task, then fall back. The blocks are freed at once
        when nobody can write them any more: the task was still queued, or
        (``release_anyway``) no prefill worker is alive; else quarantined."""
        try:
            status = await self.queue.cancel(rid)
        except Exception:  # noqa: BLE001
            status = "unknown"
        self._fallback(rid, epoch, why, release_now=release_anyway or status == "queued")

    def abort(self, rid: str) -> None:
        """Client gone or Abort RPC: drop the request; a reservation a prefill
        worker may still write is quarantined, not freed."""
        self.engine.call(lambda eng: self._abort_in_engine(eng, rid))
        asyncio.ensure_future(self._cancel_quietly(rid))

    async def _cancel_quietly(self, rid: str) -> None:
        try:
            await self.queue.cancel(rid)
        except Exception:  # noqa: BLE001
            pass

    def _fallback(self, rid: str, epoch: int, why: str, release_now: bool) -> None:
        self.engine.call(lambda eng: self._fallback_in_engine(eng, rid, epoch, why, release_now))

    async def _collect_failed(self) -> None:
        """Tasks the queue failed back (expired, worker vanished twice) go local."""
        while True:
            await asyncio.sleep(self.cfg.queue_poll_s)
            try:
                failed, st = await self.queue.take_failed_and_stats(self.worker_id)
                for f in failed:
                    self._fallback(f.task.request_id, f.task.epoch, f"queue: {f.reason}", release_now=True)
                self.cluster["prefill_queue_depth"] = st.depth
                self.cluster["prefill_queue_tokens"] = st.queued_tokens
            except Exception as exc:  # noqa: BLE001  (keep collecting through queue/Ray hiccups)
                log.debug("queue poll failed: %r", exc)

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
        self.metrics.fallback(why.split(" ")[0].strip(":"))
        self._info[rid] = {"route": "local", "fell_back_to_local": True, "attempts": epoch,
                           "reason": f"fallback after remote attempt {epoch}: {why}"}
        log.info("request %s: remote prefill attempt %d abandoned (%s); prefilling locally", rid, epoch, why)

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

    def _poll(self) -> bool:
        """Engine-thread poller: NIXL progress, notifications, quarantine expiry."""
        eng = self.engine.engine
        res = self.agent.poll()
        did = False
        for note in res.notifications:
            did = True
            self.counters["notifications"] += 1
            try:
                msg = decode_prefill_done(note.payload)
            except MalformedMessageError as exc:
                self.counters["malformed"] += 1
                log.warning("malformed notification from %s ignored: %s", note.sender, exc)
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
