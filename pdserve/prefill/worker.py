"""A prefill worker: pulls token-budget batches, computes KV, writes pages to decode workers.

Loop: ``PrefillQueue.get_batch`` (bounded by a token budget, long-polled) ->
prefill the batch in the engine, reusing this worker's prefix cache and
chunking long prompts -> write the KV pages of positions ``[cached_len, n)``
into the decode worker's reserved blocks with NIXL, layer by layer during the
forward pass that finishes each prompt -> a `PrefillDone` notification with the
first sampled token rides behind the pages, sent after that step (the batch's
other prompts go on computing). A task that
cannot be delivered ends with a `PrefillFailed` notice instead (prefill/batch.py),
so its decode worker prefills locally at once; no task ends the pull loop.

Before anything is computed or written, every task must carry a valid signature
of the decode worker it targets (the key in that worker's etcd record;
cluster/queue/signing.py): a task that names blocks its decode worker did not
reserve and sign is dropped and counted (`pdserve_prefill_tasks_rejected`).

Runs as a Ray actor (``pdserve.prefill.worker:PrefillWorker`` is the
topology's default entry point) or in-process; the engine work happens in
one worker thread so the asyncio side (keep-alive, watches) stays responsive.
That is also why the heartbeat that keeps its tasks is not proof of life on its own: it
carries the compute thread's progress, and the queue fails back the tasks of a worker whose
compute stood still past a bound drawn from its predicted step time (prefill/progress.py),
however well its event loop beats.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass

from pdserve.common import failpoints
from pdserve.common.compute_thread import ComputeExecutor
from pdserve.cluster.join import join_cluster, leave_cluster, publish_load
from pdserve.cluster.keys import VERSION
from pdserve.cluster.load import BusyMeter, gpu_load
from pdserve.cluster.records import WorkerInfo
from pdserve.cluster.runtime import cpu_list, freeze_gc_heap
from pdserve.cluster.worker_config import WorkerConfig
from pdserve.engine import EngineConfig, LLMEngine
from pdserve.engine.tp_group import TPGroupBroken
from pdserve.kvtransfer.lend import AGENT_INCARNATION_KEY, LENDS_CAPACITY_KEY, lends
from pdserve.cluster.kvindex.publisher import record_endpoints, start_event_publisher
from pdserve.kvtransfer.lending import Lending, LendingAgent
from pdserve.kvtransfer.nixl.tp_transport import TPSender, open_worker_transport, with_rank_transport
from pdserve.router.costs import CostModel
from pdserve.router.policy import CostModelParams
from pdserve.cluster.queue import BAD_SIGNATURE, NO_KEY, open_queue, verify_task

from .batch import PrefillBatch, PrefillStats
from .metrics import PrefillMetrics
from .progress import WAIT_SLACK_S

log = logging.getLogger(__name__)

# While a batch is served: heartbeat to the queue, which answers whether it restarted and which
# held tasks were cancelled since (so a cancel stops the compute within about this long).
HOLD_CHECK_S = 0.25
PEER_LOOKUP_TIMEOUT_S = 5.0
LEND_POLL_S = 0.005  # between batches, how often loan requests are answered
MIN_BORROW_BLOCKS = 2  # a shorter prefix held elsewhere is computed: one block is not worth a round trip


@dataclass
class PrefillWorkerConfig(WorkerConfig):
    """Everything a prefill worker needs (the shared fields: cluster.worker_config); it needs
    `etcd_endpoints` and Ray. Defaults suit a local CPU cluster."""

    batch_max_tokens: int | None = None  # default: the engine's max_num_batched_tokens
    poll_timeout_ms: float = 1000.0  # idle long poll of get_batch (a put wakes it at once)
    transfer_timeout_s: float = 30.0
    layerwise: bool = True  # stream each layer's pages as soon as it is computed
    # When the pull loop dies anyway (a bug): leave etcd, then exit the process so that its
    # supervisor (Ray max_restarts) starts a fresh one. The launcher sets it; a worker embedded
    # in another program (tests) only leaves the registry.
    exit_on_loop_death: bool = False
    metrics_port: int | None = None  # Prometheus /metrics: None = a free loopback port, 0 = off
    metrics_host: str | None = None  # None: the address `bind` resolves to on this host
    load_report_s: float = 2.0  # how often the record's `load` is refreshed (cluster/load.py)


class PrefillWorker:
    """Owns the engine, the NIXL agent, the registration and the pull loop."""

    def __init__(self, cfg: PrefillWorkerConfig | dict):
        self.cfg = cfg = PrefillWorkerConfig.of(cfg)
        self.worker_id = cfg.worker_id_for("prefill")
        self.stats = PrefillStats()
        self.draining = False
        self.engine: LLMEngine | None = None
        self.cpus: list[int] | None = None  # the cores this process owns (topology roles.*.cpus)
        self.agent: TPSender | None = None
        self.registry = None
        self.queue = None
        self._loop_task: asyncio.Task | None = None
        self._decode_watch = None
        # Peer changes are applied by the batch thread, the only user of the NIXL agent.
        self._peers_to_remove: set[str] = set()
        self._known_peers: set[str] = set()
        # NIXL records read ahead of need (workers met as they joined, borrowers met mid-batch),
        # for the batch thread to register: at a batch's start or between its steps.
        self._pending_peers: dict[str, dict] = {}
        self._prefill_watch = None
        self._task_keys: dict[str, str] = {}  # decode worker id -> its published task key, as last read
        self._lenders: dict[str, bool] = {}  # worker id -> its record says it lends prefixes (as last read)
        self._batch: PrefillBatch | None = None
        self._queue_instance: str | None = None
        self.loop_error: str | None = None
        self.metrics = PrefillMetrics(self.worker_id, self.stats)
        self.busy = BusyMeter()  # time spent serving batches (compute and transfers)
        self.holding = 0  # tasks of the batch being served
        self._load_task: asyncio.Task | None = None
        self.kv_publisher = None  # cluster/kvindex/publisher.py, when the engine records KV events
        self.lending: Lending | None = None  # prefix loans to other workers (kvtransfer/lending.py)
        self._lend_task: asyncio.Task | None = None
        # Held by whoever drives the engine and the agent: a batch (its thread), or between
        # batches the loan answers (`_lend_loop`, on the event loop).
        self._engine_lock = threading.Lock()
        # Its torch work (loading, batches, loan answers) on one thread (common/compute_thread.py).
        self._compute = ComputeExecutor(f"pdserve-prefill-{self.worker_id}")
        self._beat_progress = True  # False once a queue of an earlier version refused it (`_beat`)

    # -- lifecycle -------------------------------------------------------------------
    async def start(self, engine: LLMEngine | None = None) -> dict:
        """Load the engine (or take `engine`, already loaded: a worker changing role keeps its
        weights and KV pool), join the cluster and start pulling; returns its id and pid."""
        cfg = self.cfg
        # Own its cores before any engine thread exists (threads inherit the mask; topology cpus).
        self.cpus = cfg.pin_cpus(f"prefill worker {self.worker_id}")
        self.engine = engine or await self._compute.run(
            LLMEngine, EngineConfig.from_kwargs(cfg.model, **with_rank_transport(cfg.engine_args)))
        self.host = cfg.metrics_host or cfg.address()
        # One agent per tensor-parallel rank; the sender writes by the head plan (kvtransfer/nixl/tp_transport.py).
        transport = await self._compute.run(
            open_worker_transport, self.worker_id, self.engine, cfg.agent_ucx_env(self.host),
            cfg.agent_threads(self.engine.connector.tensor_parallel_size))
        self.agent = transport.sender()
        if cfg.lending and self.engine.config.enable_prefix_caching:
            # Lend this pool's cached prefixes to other workers' reads (kvtransfer/lending.py):
            # every poll of the agent answers them, between batches too (`_lend_loop`). The
            # sender meets peers on every rank and reads rank by rank (TPSender.read_blocks).
            self.lending = Lending(self.engine.connector, self.agent, verify=cfg.lend_verify)
            self.agent = LendingAgent(self.agent, self.lending)
        self.queue = open_queue(cfg, "the prefill worker")
        # What a borrow costs against computing the same tokens here, learned from this worker's
        # own steps and reads (router/costs.py: the decode side's model, seeded by the default
        # policy): a prefix is borrowed only when reading it is predicted cheaper.
        self.borrow_costs = (CostModel(CostModelParams(), self.engine.connector.kv_bytes_per_token)
                             if self.lending is not None else None)
        self._batch = PrefillBatch(self.worker_id, self.engine, self.agent, self.stats,
                                   transfer_timeout_s=cfg.transfer_timeout_s, layerwise=cfg.layerwise,
                                   progress=self._compute.progress, costs=self.borrow_costs)
        if self.lending is not None:
            self._batch.between_steps = self._answer_loans
        # A fresh start under this id (a Ray restart after a crash): whatever an earlier
        # incarnation held is gone. Requeue it now, not when (or if) its lease expires.
        try:
            await self.queue.worker_gone(self.worker_id)
            self._queue_instance = await self.queue.instance_id()
        except Exception as exc:  # noqa: BLE001  (the queue restarting: its restart lost them anyway)
            log.warning("could not reach the queue at start: %r", exc)
        metrics_at = self.metrics.serve(self.host, cfg.metrics_port)
        # The engine's KV events (engine arg kv_events), for the cluster's KV index (cluster/kvindex/).
        self.kv_publisher = start_event_publisher(self.engine, cfg.address())
        info = WorkerInfo(worker_id=self.worker_id, role="prefill", model=self.engine.model_config.model_id,
                          kv_layout=self.engine.connector.layout_info(),
                          capacity={"max_num_batched_tokens": self.budget,
                                    **({LENDS_CAPACITY_KEY: True, AGENT_INCARNATION_KEY: uuid.uuid4().hex[:16]}
                                       if self.lending is not None else {})},
                          version=VERSION,
                          endpoints={**({"metrics": metrics_at} if metrics_at else {}),
                                     **record_endpoints(self.kv_publisher),
                                     # the UCX listeners of the agent's posting threads
                                     **{f"ucx_{i}": f"{cfg.address()}:{port}"
                                        for i, port in enumerate(transport.agent.listen_ports)}},
                          hostname=socket.gethostname(), address=self.host)
        self.registry = await join_cluster(cfg, info, json.dumps(transport.record).encode(),
                                           on_drain=self.drain)
        # Meet the workers as they join (their NIXL records loaded before the first task or loan
        # needs them: a first contact inside a loan's wait costs the borrower its deadline).
        self._decode_watch = await self.registry.watch_members(on_add=self._met, on_update=self._met,
                                                               on_remove=self._peer_gone, role="decode")
        if self.lending is not None:
            self._prefill_watch = await self.registry.watch_members(on_add=self._met, on_update=self._met,
                                                                    on_remove=self._peer_gone, role="prefill")
        if cfg.freeze_gc:
            freeze_gc_heap(f"prefill worker {self.worker_id}")
        self._loop_task = asyncio.create_task(self._run())
        if self.lending is not None:
            self._lend_task = asyncio.create_task(self._lend_loop())
        self._load_task = asyncio.create_task(publish_load(self.registry, self._load, cfg.load_report_s))
        log.info("prefill worker %s started (pid %d)", self.worker_id, os.getpid())
        return {"worker_id": self.worker_id, "pid": os.getpid()}

    @property
    def budget(self) -> int:
        return self.cfg.batch_max_tokens or self.engine.config.max_num_batched_tokens

    def _load(self) -> dict:
        return {**self.busy.snapshot(), **gpu_load(self.engine.connector.kv_tensor.device),
                **({"cpus": cpu_list(self.cpus)} if self.cpus else {}),
                "kv_usage": round(self.engine.load().kv_usage, 4), "inflight": self.holding,
                "tokens": self.stats.tokens_computed, "tasks": self.stats.tasks_done}

    def _peer_gone(self, info) -> None:
        # A vanished worker's pages are gone: forget its NIXL agent.
        self._task_keys.pop(info.worker_id, None)
        self._pending_peers.pop(info.worker_id, None)
        if info.role == "prefill":
            self._lenders.pop(info.worker_id, None)
        if info.worker_id in self._known_peers:
            self._known_peers.discard(info.worker_id)
            self._peers_to_remove.add(info.worker_id)

    async def _met(self, info) -> None:
        """A decode worker's record, or a lending prefill worker's: read its NIXL record now, for
        the batch thread to register before a task or a loan needs it."""
        name = info.worker_id
        if name == self.worker_id:
            return
        if info.role == "prefill":
            self._lenders[name] = lends(info.capacity)
            if not self._lenders[name]:
                return
        if name in self._known_peers or name in self._pending_peers:
            return
        problem = await self._peer_info(name, self._pending_peers)
        if problem is not None:
            log.debug("%s not met yet: %s", name, problem)

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
        if self._load_task is not None:
            self._load_task.cancel()
        if self._lend_task is not None:
            self._lend_task.cancel()
            await asyncio.gather(self._lend_task, return_exceptions=True)
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        if self.registry is not None:
            await self.registry.close()
        if self.queue is not None:
            await self.queue.close()
        if self.agent is not None:
            self.agent.close()
        if self.kv_publisher is not None:
            self.kv_publisher.close()
        self.metrics.close()
        self._compute.shutdown()  # its thread ends after a batch still running (and its OpenMP team)

    def get_stats(self) -> dict:
        return {"worker_id": self.worker_id, "pid": os.getpid(), "draining": self.draining,
                "loop_alive": self._loop_task is not None and not self._loop_task.done(),
                "loop_error": self.loop_error, "metrics": self.metrics.address,
                # what the heartbeat tells the queue of the compute thread (None: it runs nothing)
                "compute_progress": self._compute.progress.snapshot(),
                "tp_ranks": self.tp_rank_pids(),
                "lending": self.lending.stats() if self.lending is not None else None,
                "peers": sorted(self._known_peers),  # the workers whose NIXL records this agent loaded
                "prompt_tokens_cached": self.engine.stats.num_prompt_tokens_cached if self.engine else 0,
                **(self.engine.tier_stats() if self.engine is not None else {}),
                **{k: dict(v) if isinstance(v, dict) else v for k, v in self.stats.__dict__.items()}}

    def pid(self) -> int:
        return os.getpid()

    async def hang_compute(self, seconds: float) -> str:
        """Failpoint ``prefill.hang_compute`` (common/failpoints.py; chaos runs only): block the
        compute thread for `seconds` while this loop and its heartbeat go on, as a hung step
        would. Refused unless the worker's environment turned the failpoint on."""
        if not failpoints.enabled("prefill.hang_compute"):
            raise PermissionError(f"failpoint prefill.hang_compute is off (set {failpoints.ENV} in the worker's "
                                  "environment: chaos runs only)")
        self._hang = asyncio.ensure_future(self._compute.run(time.sleep, float(seconds)))
        return f"compute thread of {self.worker_id} blocked for {seconds:g} s (its event loop beats on)"

    def tp_rank_pids(self) -> list[int]:
        """Pids of this worker's tensor-parallel ranks 1..N-1 (none at TP=1)."""
        return self.engine.connector.tp_rank_pids() if self.engine is not None else []

    # -- the pull loop -------------------------------------------------------------------
    async def _run(self) -> None:
        """Pull and serve batches until drained. No task can end this loop (a batch reports
        its failures); should it end anyway (a bug), the worker leaves the registry and, when
        `exit_on_loop_death`, exits so that Ray restarts it."""
        try:
            while not self.draining:
                tasks = await self._next_batch()
                if tasks:
                    t0, self.holding = time.monotonic(), len(tasks)
                    try:
                        await self._serve(tasks)
                    finally:
                        self.busy.add(time.monotonic() - t0)
                        self.holding = 0
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001  (a bug: make it loud and recoverable)
            await self._loop_died(exc)

    async def _next_batch(self) -> list:
        try:
            return await self.queue.get_batch(self.worker_id, self.budget, self.cfg.poll_timeout_ms)
        except Exception as exc:  # noqa: BLE001  (queue actor restarting, Ray hiccup)
            log.warning("get_batch failed: %r; retrying", exc)
            await asyncio.sleep(0.5)
            return []

    async def _serve(self, tasks: list) -> None:
        beat = asyncio.ensure_future(self._heartbeat(tasks))
        try:
            accepted = await self._authenticate(tasks)
            if accepted:
                await self._prefill(accepted)
        finally:
            beat.cancel()
        await self._queue_call("complete", self.worker_id, [t.request_id for t in tasks])

    async def _authenticate(self, tasks: list) -> list:
        """The tasks their target decode worker signed. The others are dropped here, before any
        compute, NIXL peer or write, and counted; nobody is told (a PrefillFailed, or a `fail`
        through the queue, for a forged task would let its forger end the attempt it names of
        some other request). The queue forgets them when the batch completes."""
        accepted, refreshed = [], set()
        for t in tasks:
            target = t.target_worker_id
            reason = verify_task(t, await self._task_key(target))
            if reason in (BAD_SIGNATURE, NO_KEY) and target not in refreshed:
                refreshed.add(target)  # its key may be new (it restarted): read the record again, once a batch
                reason = verify_task(t, await self._task_key(target, refresh=True))
            if reason is None:
                accepted.append(t)
                continue
            self.stats.tasks_rejected += 1
            self.stats.rejected_by_reason[reason] += 1
            log.warning("task %s (epoch %s) for %s, blocks %s, refused before any work: %s", t.request_id, t.epoch,
                        target, t.target_block_ids[:8], reason)
        return accepted

    async def _task_key(self, worker_id: str, refresh: bool = False) -> str | None:
        """The task key decode worker `worker_id` publishes in its etcd record (None: none)."""
        if not refresh and worker_id in self._task_keys:
            return self._task_keys[worker_id]
        try:
            info = await asyncio.wait_for(self.registry.member("decode", worker_id), PEER_LOOKUP_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001  (etcd down or slow, a malformed record: no key to trust)
            log.warning("could not read the task key of decode worker %s: %r", worker_id, exc)
            return None
        key = info.task_key if info is not None and info.task_key else None
        self._lenders[worker_id] = info is not None and lends(info.capacity)
        if key is None:
            self._task_keys.pop(worker_id, None)
        else:
            self._task_keys[worker_id] = key
        return key

    async def _prefill(self, tasks: list) -> None:
        new_peers: dict[str, dict] = {}
        unusable: dict[str, str] = {}
        for target in dict.fromkeys(t.target_worker_id for t in tasks):
            problem = await self._peer_info(target, new_peers)
            if problem is not None:
                unusable[target] = problem
        if self.lending is not None:  # the holders of prefixes worth borrowing (other prefill workers)
            for holder in dict.fromkeys(h for t in tasks for h in t.prefix_hint if h != self.worker_id):
                if holder not in self._lenders:  # its record says whether it lends (read once)
                    try:
                        info = await asyncio.wait_for(self.registry.member("prefill", holder), PEER_LOOKUP_TIMEOUT_S)
                    except Exception:  # noqa: BLE001  (etcd slow: no loan from it this batch)
                        info = None
                    self._lenders[holder] = info is not None and lends(info.capacity)
                if self._lenders[holder] and await self._peer_info(holder, new_peers) is not None:
                    self._lenders[holder] = False
        batch = asyncio.ensure_future(self._compute.run(self._run_batch, tasks, new_peers, unusable))
        result = await batch
        self.metrics.observe_batch(result)
        for f in result.failures:
            # Through the queue too: the origin's failed-task poll (0.25 s) reaches it where NIXL
            # could not (no channel, a broken connection, a notice this idle worker no longer
            # drives out). Not when a write may still land: the
            # queue path frees the blocks at once; the decode worker's deadline quarantines them.
            if f.writes_settled:
                await self._queue_call("fail", self.worker_id, f.task.request_id, f.kind, f.detail)
        broken = self.engine.connector.tp_broken()
        if broken:
            # A rank exited: this engine cannot step again. The loop dies, the worker leaves the
            # registry and exits; Ray restarts it whole (its tasks were failed above, so their
            # decode workers prefill them locally).
            raise TPGroupBroken(f"tensor-parallel group broken: {broken}")

    def _run_batch(self, tasks, new_peers: dict, unusable: dict):
        with self._engine_lock:
            if self._sync_peers(new_peers, unusable) and self.lending is not None:
                self.lending.lender.retry()  # borrowers met meanwhile
            if self.lending is not None:
                self._borrow_prefixes([t for t in tasks if t.target_worker_id not in unusable], unusable)
            return self._batch.run(tasks, unusable)

    def _borrow_prefixes(self, tasks: list, unusable: dict) -> None:
        """Before a batch is computed (batch thread): for each task, the longest prefix of its
        prompt another worker holds, past what this pool holds, when it is at least
        MIN_BORROW_BLOCKS more: borrowed and read (kvtransfer/lending.py), so the batch
        computes only the rest. The sources: the task's target decode worker, which holds its
        first ``cached_len`` tokens, and the prefill workers its hint names. Bounded by the
        loans' deadline; whatever is not read in time is computed as usual."""
        conn, bs = self.engine.connector, self.engine.config.block_size
        borrower = self.lending.borrower
        started = 0
        for t in tasks:
            sources = {h: n for h, n in t.prefix_hint.items() if h != self.worker_id and self._lenders.get(h)}
            if self._lenders.get(t.target_worker_id):
                sources[t.target_worker_id] = max(sources.get(t.target_worker_id, 0), t.cached_len)
            if not sources:
                continue
            holder, tokens = max(sources.items(), key=lambda kv: (kv[1], kv[0]))
            tokens = min(tokens, ((len(t.token_ids) - 1) // bs) * bs)
            have = conn.cached_prefix_len(t.token_ids)
            if tokens - have < MIN_BORROW_BLOCKS * bs or holder not in self._known_peers:
                continue
            cheaper, read_ms, compute_ms = self.borrow_costs.snapshot().borrow_cheaper(tokens - have, have)
            if not cheaper:  # reading is no cheaper: compute (counted, explained at debug)
                self.stats.borrows["not_cheaper"] += 1
                log.debug("task %s: %d tokens of %s not borrowed: read %.1f ms >= compute %.1f ms", t.request_id,
                          tokens - have, holder, read_ms, compute_ms)
                continue
            if borrower.start(t.token_ids, holder, tokens // bs, tag=t.request_id) is not None:
                started += 1
        if not started:
            return
        deadline = time.monotonic() + borrower.lease_ms / 2e3 + 0.5
        self._compute.progress.mark(deadline - time.monotonic() + WAIT_SLACK_S)  # the loans' wait, bounded
        while borrower.tickets and time.monotonic() < deadline:
            self.agent.poll()  # (LendingAgent: grants, reads and their ends)
            time.sleep(0.0005)
        for r in borrower.take_results():
            self.stats.borrows[r.outcome] += 1
            self.stats.borrowed_tokens += r.read_tokens
            if r.outcome == "read" and r.read_tokens and r.elapsed_s > 0:  # the whole loan: ask, grant, read
                self.borrow_costs.observe_transfer(r.read_tokens * conn.kv_bytes_per_token, r.elapsed_s * 1e3)

    async def _lend_loop(self) -> None:
        """Between batches, answer other workers' loan requests (a batch's own polls answer
        them while it runs): poll the agent every LEND_POLL_S while no batch holds the engine;
        a borrower met for the first time is looked up in etcd, then answered."""
        lender = self.lending.lender
        while True:
            await asyncio.sleep(LEND_POLL_S)
            if not self._engine_lock.locked():
                # On the compute thread, not this loop: an answer may load a chain back from the
                # tier or, at TP>1, wait for the other ranks' copies (engine/kv_connector.py).
                await self._compute.run(self._lend_poll)
            for name in lender.waiting_for_peers():
                problem = await self._peer_info(name, self._pending_peers)
                if problem is not None:
                    log.info("loan request from %s not answerable: %s", name, problem)
            if (self._pending_peers or lender.waiting) and not self._engine_lock.locked():
                # No batch under way: register them now (a batch would, between its steps).
                await self._compute.run(self._answer_waiting_borrowers)

    def _lend_poll(self) -> None:
        """Between batches (compute thread): poll the agent, which answers the loan requests."""
        if self._engine_lock.acquire(blocking=False):
            try:
                self.agent.poll()
            except Exception as exc:  # noqa: BLE001  (the transport's trouble shows in the batches too)
                log.debug("lend poll failed: %r", exc)
            finally:
                self._engine_lock.release()

    def _answer_loans(self) -> None:
        """Between a batch's steps (batch thread): the loan requests that arrived meanwhile,
        and those of borrowers met meanwhile."""
        try:
            if self._pending_peers and self._sync_peers({}, {}, mid_batch=True):
                self.lending.lender.retry()
            self.agent.poll()
        except Exception as exc:  # noqa: BLE001  (the transport's trouble shows in the batch's own writes)
            log.debug("lend poll failed: %r", exc)

    def _answer_waiting_borrowers(self) -> None:
        with self._engine_lock:  # (after the batch that may have started meanwhile)
            self._sync_peers({}, {})
            self.lending.lender.retry()

    async def _heartbeat(self, tasks: list) -> None:
        """While this worker serves a batch (the compute runs in a thread): tell the queue it is
        alive every HOLD_CHECK_S, or it fails the batch back as stalled (cluster/queue/core.py
        `fail_stalled`), and how far the compute thread has got (`ComputeProgress.snapshot`:
        this loop beats on while that thread is hung, so the queue judges the thread by its
        progress against its own allowance, not by the beat); hand the batch the tasks
        cancelled meanwhile (their decode worker aborted them), which it stops computing; and
        if the queue restarted (a new instance id), report the tasks held so the new instance
        neither hands them out again nor loses them."""
        while True:
            await asyncio.sleep(HOLD_CHECK_S)
            try:
                beat = await asyncio.wait_for(self._beat(), HOLD_CHECK_S * 8)
                instance, cancelled = beat["instance"], beat["cancelled"]
                if cancelled:
                    self._batch.cancel((str(rid), int(epoch)) for rid, epoch in cancelled)
                if instance != self._queue_instance:
                    n = await asyncio.wait_for(self.queue.hold(self.worker_id, tasks), HOLD_CHECK_S * 8)
                    self._queue_instance = instance
                    if n:
                        log.warning("queue restarted (instance %s); reported %d held task(s)", instance, n)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001  (the queue is still restarting: check again)
                log.debug("queue heartbeat failed: %r", exc)

    async def _beat(self) -> dict:
        """One heartbeat with the compute thread's progress. A queue of an earlier version takes
        the worker id alone (a TypeError for the second argument): beat it so from then on, as
        before, rather than fall silent and have every batch failed back as stalled."""
        progress = self._compute.progress.snapshot() if self._beat_progress else None
        try:
            return await self.queue.beat(self.worker_id, progress)
        except Exception as exc:  # noqa: BLE001  (QueueCallError "TypeError" over the wire, TypeError over Ray)
            if progress is None or not (isinstance(exc, TypeError) or getattr(exc, "type", None) == "TypeError"):
                raise
            log.warning("the queue does not take the compute progress with the heartbeat (%s): an earlier "
                        "version; beating without it, so a hung compute thread is not detected", exc)
            self._beat_progress = False
            return await self.queue.beat(self.worker_id)

    async def _queue_call(self, method: str, *args) -> None:
        try:
            await getattr(self.queue, method)(*args)
        except Exception as exc:  # noqa: BLE001  (a queue hiccup must not end the loop)
            log.warning("queue %s failed: %r", method, exc)

    async def _loop_died(self, exc: BaseException) -> None:
        self.loop_error = f"{exc.__class__.__name__}: {exc}"
        log.error("prefill worker %s: pull loop died (%s); leaving the registry%s", self.worker_id, self.loop_error,
                  " and exiting so that Ray restarts it" if self.cfg.exit_on_loop_death else "", exc_info=exc)
        await leave_cluster(self.registry, f"prefill worker {self.worker_id}", exit_process=self.cfg.exit_on_loop_death)

    async def _peer_info(self, worker_id: str, new_peers: dict) -> str | None:
        """Fetch a worker's NIXL record from etcd (a decode worker, the first time it is a
        target or as it joins; a lending prefill worker or a borrower) into ``new_peers``; why it
        cannot be used, or None."""
        if worker_id in self._known_peers or worker_id in new_peers:
            return None
        try:
            raw = await asyncio.wait_for(self.registry.get_nixl_metadata(worker_id), PEER_LOOKUP_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001  (etcd down or slow)
            return f"could not read its NIXL metadata from etcd: {exc!r}"
        if raw is None:
            return f"worker {worker_id} has no NIXL metadata in etcd (not registered, or its lease expired)"
        try:
            new_peers[worker_id] = json.loads(raw)
        except ValueError as exc:
            return f"worker {worker_id}'s NIXL record is not JSON: {exc}"
        return None

    def _sync_peers(self, new_peers: dict, unusable: dict, mid_batch: bool = False) -> bool:
        """Apply peer changes (under the engine lock: the agent's only user): ``new_peers`` and
        those read ahead (``_pending_peers``). A record NIXL or the layout check refuses makes
        that peer unusable for this batch, not the batch fail. Whether any peer was added.
        ``mid_batch`` (between a batch's steps): only new peers are added; removals and
        re-registrations wait for the next batch's start, since the batch may be writing to them."""
        while self._peers_to_remove and not mid_batch:
            self.agent.remove_peer(self._peers_to_remove.pop())
        while self._pending_peers:  # (filled on the event loop; popitem is atomic)
            name, info = self._pending_peers.popitem()
            new_peers.setdefault(name, info)
        added = False
        for name, info in new_peers.items():
            if name in self._known_peers:
                continue  # met already (ahead of need, and then named by this batch too)
            if mid_batch and name in self.agent.peers:
                self._pending_peers.setdefault(name, info)  # a re-registration: at the next batch's start
                continue
            try:
                if name in self.agent.peers:  # re-registered decode worker: new metadata
                    self.agent.remove_peer(name)
                self.agent.add_peer(info)
                self._known_peers.add(name)
                added = True
            except Exception as exc:  # noqa: BLE001  (LayoutMismatchError, MalformedMessageError, TransferError)
                unusable[name] = f"its NIXL record was refused: {exc.__class__.__name__}: {exc}"
        return added
