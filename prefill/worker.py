"""A prefill worker: pulls token-budget batches, computes KV, writes pages to decode workers.

Loop: ``PrefillQueue.get_batch`` (bounded by a token budget, long-polled) ->
prefill the batch in the engine, reusing this worker's prefix cache and
chunking long prompts -> write the KV pages of positions ``[cached_len, n)``
into the decode worker's reserved blocks with NIXL, layer by layer while the
last forward pass runs when the batch finishes in one step -> a `PrefillDone`
notification with the first sampled token rides behind the pages.

Runs as a Ray actor (``pdserve.prefill.worker:PrefillWorker`` is the
topology's default entry point) or in-process; the engine work happens in
one worker thread so the asyncio side (keep-alive, watches) stays responsive.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass, field

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.kvtransfer import KVLayout, KVTransferAgent, KVTransferError, PrefillDone, TransferError

log = logging.getLogger(__name__)

VERSION = "0.1.0"


@dataclass
class PrefillWorkerConfig:
    """Everything a prefill worker needs; defaults suit a local CPU cluster."""

    model: str
    engine_args: dict = field(default_factory=dict)
    worker_id: str | None = None
    cluster: str = "default"
    etcd_endpoints: list[str] = field(default_factory=list)
    lease_ttl_s: float = 10.0
    queue_name: str = "pdserve-prefill-queue"
    queue_namespace: str = "pdserve"
    queue_transport: str = "auto"  # "auto" (the queue's wire when reachable) | "wire" | "ray"
    freeze_gc: bool = False  # freeze the start-up heap out of the cyclic GC (the launcher sets it)
    batch_max_tokens: int | None = None  # default: the engine's max_num_batched_tokens
    poll_timeout_ms: float = 1000.0  # idle long poll of get_batch (a put wakes it at once)
    transfer_timeout_s: float = 30.0
    layerwise: bool = True  # stream each layer's pages as soon as it is computed
    ucx_env: dict = field(default_factory=lambda: {"UCX_MODULES": "^ib"})


@dataclass
class PrefillStats:
    tasks_done: int = 0
    tasks_failed: int = 0
    batches: int = 0
    tokens_computed: int = 0
    bytes_written: int = 0
    layerwise_tasks: int = 0


class PrefillWorker:
    """Owns the engine, the NIXL agent, the registration and the pull loop."""

    def __init__(self, cfg: PrefillWorkerConfig | dict):
        if isinstance(cfg, dict):
            cfg = PrefillWorkerConfig(**cfg)
        self.cfg = cfg
        self.worker_id = cfg.worker_id or f"prefill-{uuid.uuid4().hex[:8]}"
        self.stats = PrefillStats()
        self.draining = False
        self.engine: LLMEngine | None = None
        self.agent: KVTransferAgent | None = None
        self.registry = None
        self.queue = None
        self._loop_task: asyncio.Task | None = None
        self._decode_watch = None
        # Peer changes are applied by the batch thread, the only user of the NIXL agent.
        self._peers_to_remove: set[str] = set()
        self._known_peers: set[str] = set()

    # -- lifecycle -------------------------------------------------------------------
    async def start(self) -> dict:
        import ray

        from pdserve.cluster.queue import get_or_create_queue
        from pdserve.cluster.queue_wire import QueueClient
        from pdserve.cluster.records import WorkerInfo
        from pdserve.cluster.registry import Registry

        cfg = self.cfg
        self.engine = await asyncio.to_thread(LLMEngine, EngineConfig.from_kwargs(cfg.model, **cfg.engine_args))
        kv = self.engine.runner.kv_cache
        layout = KVLayout.from_tensor(kv, self.engine.model_config.model_id)
        self.agent = KVTransferAgent(self.worker_id, kv, layout, ucx_env=cfg.ucx_env)
        if not ray.is_initialized():
            raise RuntimeError("the prefill worker needs Ray (run it as a Ray actor or call ray.init first)")
        self.queue = QueueClient(get_or_create_queue(cfg.queue_name, cfg.queue_namespace), cfg.queue_transport)
        self.registry = Registry(cfg.etcd_endpoints, cfg.cluster, ttl_s=cfg.lease_ttl_s)
        info = WorkerInfo(worker_id=self.worker_id, role="prefill", model=self.engine.model_config.model_id,
                          kv_layout=self.engine.runner.layout_info(),
                          capacity={"max_num_batched_tokens": self.budget}, version=VERSION)
        await self.registry.clear_drain(self.worker_id)  # a fresh start under a drained id
        await self.registry.register(info, json.dumps(self.agent.local_info()).encode())
        self._decode_watch = await self.registry.watch_members(on_remove=self._decode_gone, role="decode")
        await self.registry.watch_drain(self.worker_id, lambda why: asyncio.ensure_future(self.drain()))
        if cfg.freeze_gc:
            from pdserve.cluster.runtime import freeze_gc_heap

            freeze_gc_heap(f"prefill worker {self.worker_id}")
        self._loop_task = asyncio.create_task(self._run())
        log.info("prefill worker %s started (pid %d)", self.worker_id, os.getpid())
        return {"worker_id": self.worker_id, "pid": os.getpid()}

    @property
    def budget(self) -> int:
        return self.cfg.batch_max_tokens or self.engine.config.max_num_batched_tokens

    def _decode_gone(self, info) -> None:
        # A vanished decode worker's pages are gone: forget its NIXL agent.
        if info.worker_id in self._known_peers:
            self._known_peers.discard(info.worker_id)
            self._peers_to_remove.add(info.worker_id)

    async def drain(self, timeout_s: float = 60.0) -> None:
        """Take no new tasks, finish in-flight ones, leave the registry (for good:
        no re-registration). Triggered by `pdserve drain` or `pdserve down`."""
        if self.draining and self._loop_task is None:
            return
        self.draining = True
        log.info("prefill worker %s draining", self.worker_id)
        if self._loop_task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._loop_task), timeout_s)
            except asyncio.TimeoutError:
                log.error("drain: in-flight batch did not finish within %.0f s", timeout_s)
        if self.registry is not None:
            await self.registry.deregister()

    async def stop(self) -> None:
        self.draining = True
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        if self.registry is not None:
            await self.registry.close()
        if self.queue is not None:
            await self.queue.close()
        if self.agent is not None:
            self.agent.close()

    def get_stats(self) -> dict:
        return {"worker_id": self.worker_id, "pid": os.getpid(), "draining": self.draining,
                **self.stats.__dict__}

    def pid(self) -> int:
        return os.getpid()

    # -- the pull loop -------------------------------------------------------------------
    async def _run(self) -> None:
        while not self.draining:
            try:
                tasks = await self.queue.get_batch(self.worker_id, self.budget, self.cfg.poll_timeout_ms)
            except Exception as exc:  # noqa: BLE001  (queue actor restarting, Ray hiccup)
                log.warning("get_batch failed: %r; retrying", exc)
                await asyncio.sleep(0.5)
                continue
            if not tasks:
                continue
            new_peers: dict[str, dict] = {}
            runnable = []
            for t in tasks:
                if await self._peer_info(t.target_worker_id, new_peers):
                    runnable.append(t)
            if runnable:
                await asyncio.to_thread(self._prefill_batch, runnable, new_peers)
            await self.queue.complete(self.worker_id, [t.request_id for t in tasks])

    async def _peer_info(self, worker_id: str, new_peers: dict) -> bool:
        """Fetch a decode worker's NIXL record from etcd the first time it is a target."""
        if worker_id in self._known_peers or worker_id in new_peers:
            return True
        raw = await self.registry.get_nixl_metadata(worker_id)
        if raw is None:
            log.warning("decode worker %s has no NIXL metadata in etcd; skipping its task", worker_id)
            self.stats.tasks_failed += 1
            return False
        new_peers[worker_id] = json.loads(raw)
        return True

    def _sync_peers(self, new_peers: dict) -> None:
        while self._peers_to_remove:
            self.agent.remove_peer(self._peers_to_remove.pop())
        for name, info in new_peers.items():
            if name in self.agent.peers:  # re-registered decode worker: new metadata
                self.agent.remove_peer(name)
            self.agent.add_peer(info)
            self._known_peers.add(name)

    # -- one batch (worker thread) ---------------------------------------------------------
    def _prefill_batch(self, tasks, new_peers: dict) -> None:
        self._sync_peers(new_peers)
        eng = self.engine
        bs = eng.config.block_size
        taken_at = time.time()
        jobs = {}
        for t in tasks:
            params = SamplingParams.from_dict({**t.sampling_params, "max_tokens": 1, "stop": [], "logprobs": 0})
            rid = f"{t.request_id}#{t.epoch}"
            req = eng.make_request(t.token_ids, params, request_id=rid, priority=t.priority)
            req.keep_kv = True
            eng.scheduler.add(req)
            jobs[rid] = {"task": t, "req": req, "stream": None}
        t0 = time.perf_counter()
        computed_before = eng.stats.num_prompt_tokens_computed
        first: dict[str, tuple[int, float | None]] = {}
        for _ in range(100_000):  # bounded: each step computes at least one token
            if len(first) == len(jobs):
                break
            hook = self._layer_hook_factory(jobs) if self.cfg.layerwise else None
            for d in eng.step(on_plan=hook):
                if d.request_id in jobs and d.new_token_ids:
                    lp = d.logprobs[0]["logprob"] if d.logprobs else None
                    first[d.request_id] = (d.new_token_ids[0], lp)
        prefill_ms = (time.perf_counter() - t0) * 1e3
        batch_tokens = eng.stats.num_prompt_tokens_computed - computed_before
        self.stats.batches += 1
        pending = []
        for rid, job in jobs.items():
            t = job["task"]
            tok, lp = first[rid]
            self.stats.tokens_computed += t.num_prefill_tokens
            done = PrefillDone(t.request_id, t.epoch, tok, lp, t.num_prefill_tokens,
                               queue_wait_ms=max(0.0, (taken_at - t.arrival_time) * 1e3),
                               prefill_ms=prefill_ms, prefill_worker=self.worker_id,
                               batch_tokens=batch_tokens).encode()
            try:
                if job.get("error") is not None:
                    raise job["error"]
                if job["stream"] is not None:
                    handles = job["stream"].finish(self.cfg.transfer_timeout_s, notify=done)
                    self.stats.layerwise_tasks += 1
                else:
                    local = eng.kv.block_ids(rid)[t.cached_len // bs:][: len(t.target_block_ids)]
                    handles = [self.agent.write_blocks(t.target_worker_id, local, t.target_block_ids, notify=done)]
                pending.append((rid, handles))
            except (KVTransferError, ValueError) as exc:
                self._give_up(rid, exc)
                eng.free_kv(rid)
                eng.release(rid)
        for rid, handles in pending:
            try:
                for h in handles:
                    self.agent.wait(h, self.cfg.transfer_timeout_s)
                    self.stats.bytes_written += h.num_bytes
                self.stats.tasks_done += 1
            except TransferError as exc:
                self._give_up(rid, exc)
            finally:
                eng.free_kv(rid)
                eng.release(rid)

    def _give_up(self, rid: str, exc: Exception) -> None:
        # The decode worker falls back to a local prefill on its deadline or
        # when the queue fails the task back; nothing to send it here.
        log.warning("KV transfer for %s failed: %s", rid, exc)
        self.stats.tasks_failed += 1

    def _layer_hook_factory(self, jobs):
        """on_plan callback: stream the pages of requests whose prefill ends in this step."""

        def on_plan(scheduled):
            bs = self.engine.config.block_size
            jobs_now = []
            for req, n in scheduled:
                job = jobs.get(req.request_id)
                if job is None or req.num_computed_tokens + n != req.num_tokens:
                    continue
                t = job["task"]
                table = self.engine.kv.block_ids(req.request_id)
                local = table[t.cached_len // bs:][: len(t.target_block_ids)]
                job["stream"] = self.agent.begin_stream(t.target_worker_id, local, t.target_block_ids, None)
                jobs_now.append(job)
            if not jobs_now:
                return None

            def after_layer(layer: int) -> None:
                for job in jobs_now:
                    if job.get("error") is None:
                        try:
                            job["stream"].write_layer(layer)
                        except KVTransferError as exc:  # this request fails; the batch goes on
                            job["error"] = exc
                            job["stream"].abort()

            return after_layer

        return on_plan
