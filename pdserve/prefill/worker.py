"""A prefill worker: pulls token-budget batches, computes KV, writes pages to decode workers.

Loop: ``PrefillQueue.get_batch`` (bounded by a token budget, long-polled) -> prefill the batch
in the engine, reusing this worker's prefix cache, chunking long prompts, each under its task's
LoRA adapter if any (prefill/admit.py) -> write the KV of positions ``[cached_len, n)`` into the
decode worker's reserved blocks with NIXL, layer by layer during the forward pass that finishes
each prompt -> a `PrefillDone` with the first sampled token rides behind the pages, sent after
that step (the batch's other prompts go on computing). A task that cannot be delivered ends with
a `PrefillFailed` notice instead (prefill/batch.py): its decode worker prefills locally at once.

Before anything is computed or written, every task must carry a valid signature
of the decode worker it targets (prefill/auth.py): a task that names blocks its
decode worker did not reserve and sign is dropped and counted.

Runs as a Ray actor (``pdserve.prefill.worker:PrefillWorker`` is the
topology's default entry point) or in-process; the engine work happens in
one worker thread so the asyncio side (keep-alive, watches) stays responsive.
That is also why the heartbeat that keeps its tasks (prefill/heartbeat.py) is not proof of
life on its own: it carries the compute thread's progress, and the queue fails back the tasks
of a worker whose compute stood still past a bound drawn from its predicted step time
(prefill/progress.py), however well its event loop beats.

Its parts: the other workers as its sender knows them (prefill/peers.py), the task gate
(prefill/auth.py), its prefix loans when its pool lends (prefill/loans.py), one batch at a
time (prefill/batch.py) and the heartbeat while it runs (prefill/heartbeat.py).
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

from pdserve.cluster.join import join_cluster, leave_cluster, publish_load
from pdserve.cluster.keys import VERSION
from pdserve.cluster.kvindex.publisher import KVEventPublisher, record_endpoints, start_event_publisher
from pdserve.cluster.load import BusyMeter, gpu_load
from pdserve.cluster.queue import QueueClient, open_queue
from pdserve.cluster.records import WorkerInfo
from pdserve.cluster.registry import Registry
from pdserve.cluster.runtime import cpu_list, freeze_gc_heap
from pdserve.cluster.watch import MemberWatch
from pdserve.cluster.worker_config import WorkerConfig
from pdserve.common import failpoints, jsonlog, tracing
from pdserve.common.compute_thread import ComputeExecutor
from pdserve.engine import EngineConfig, LLMEngine
from pdserve.engine.tp_group import TPGroupBroken
from pdserve.kvtransfer.lend import AGENT_INCARNATION_KEY, LENDS_CAPACITY_KEY
from pdserve.kvtransfer.lending import Lending
from pdserve.kvtransfer.nixl.tp_sender import TPSender
from pdserve.kvtransfer.nixl.tp_transport import WorkerTransport, open_worker_transport, with_rank_transport
from pdserve.kvtransfer.task import PrefillTask
from pdserve.router.costs import CostModel
from pdserve.router.policy import CostModelParams

from .admit import lora_capacity
from .auth import TaskGate
from .batch import PrefillBatch
from .heartbeat import Heartbeat
from .loans import PrefixLoans
from .metrics import PrefillMetrics
from .peers import Peers
from .tracing import trace_batch
from .values import PrefillStats

log = logging.getLogger(__name__)


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
    """Owns the engine, the NIXL sender, the registration and the pull loop.

    `start` assembles it from its parts, in order, each built from those before it (the
    engine, its sender, the queue, the registration, the peers, the task gate, the prefix
    loans when this pool lends, the batch and its heartbeat); `stop` ends whatever it got to."""

    # The parts every started worker has (set by `start`, in this order).
    engine: LLMEngine
    host: str
    agent: TPSender
    queue: QueueClient
    registry: Registry
    peers: Peers
    gate: TaskGate
    batch: PrefillBatch
    heartbeat: Heartbeat

    def __init__(self, cfg: PrefillWorkerConfig | dict):
        self.cfg = cfg = PrefillWorkerConfig.of(cfg)
        self.worker_id = cfg.worker_id_for("prefill")
        self.stats = PrefillStats()
        self.draining = False
        self.cpus: list[int] | None = None  # the cores this process owns (topology roles.*.cpus)
        # Prefix loans to and from other workers (kvtransfer/lending.py), when this pool lends.
        self.lending: Lending | None = None
        self.loans: PrefixLoans | None = None
        self.kv_publisher: KVEventPublisher | None = None  # when the engine records KV events
        self.loop_error: str | None = None
        self.metrics = PrefillMetrics(self.worker_id, self.stats)
        self.busy = BusyMeter()  # time spent serving batches (compute and transfers)
        self.holding = 0  # tasks of the batch being served
        self._decode_watch: MemberWatch | None = None
        self._prefill_watch: MemberWatch | None = None  # lending prefill workers (when this one lends)
        self._loop_task: asyncio.Task | None = None
        self._lend_task: asyncio.Task | None = None
        self._load_task: asyncio.Task | None = None
        self._hang: asyncio.Future | None = None  # failpoint prefill.hang_compute
        # Held by whoever drives the engine and the sender: a batch (its thread), or between
        # batches the loan answers (prefill/loans.py `PrefixLoans.run`, on the compute thread).
        self._engine_lock = threading.Lock()
        # Its torch work (loading, batches, loan answers) on one thread (common/compute_thread.py).
        self._compute = ComputeExecutor(f"pdserve-prefill-{self.worker_id}")

    # -- lifecycle -------------------------------------------------------------------
    async def start(self, engine: LLMEngine | None = None) -> dict:
        """Load the engine (or take `engine`, already loaded: a worker changing role keeps its
        weights and KV pool), join the cluster and start pulling; returns its id and pid."""
        cfg = self.cfg
        if cfg.log_format != "text":
            jsonlog.setup(cfg.log_format)
        tracing.configure("prefill", cfg.tracing)  # off without an endpoint (common/tracing.py)
        # Own its cores before any engine thread exists (threads inherit the mask; topology cpus).
        self.cpus = cfg.pin_cpus(f"prefill worker {self.worker_id}")
        self.engine = engine or await self._compute.run(
            LLMEngine, EngineConfig.from_kwargs(cfg.model, **with_rank_transport(cfg.engine_args)))
        self.metrics.watch_grammars(self.engine.grammar_stats)  # structured outputs' compiler
        self.host = cfg.metrics_host or cfg.address()
        # One agent per tensor-parallel rank; the sender writes by the head plan (kvtransfer/nixl/tp_transport.py).
        transport: WorkerTransport = await self._compute.run(
            open_worker_transport, self.worker_id, self.engine, cfg.agent_ucx_env(self.host),
            cfg.agent_threads(self.engine.connector.tensor_parallel_size))
        self.agent = transport.sender()
        if cfg.lending and self.engine.config.enable_prefix_caching:
            # Lend this pool's cached prefixes to other workers' reads, and borrow theirs
            # (prefill/loans.py). The sender meets peers on every rank and reads rank by rank
            # (TPSender.read_blocks).
            self.lending = Lending(self.engine.connector, self.agent, verify=cfg.lend_verify)
        self.queue = open_queue(cfg, "the prefill worker")
        instance = await self._requeue_earlier_incarnation()
        metrics_at = self.metrics.serve(self.host, cfg.metrics_port)
        # The engine's KV events (engine arg kv_events), for the cluster's KV index (cluster/kvindex/).
        self.kv_publisher = start_event_publisher(self.engine, cfg.address())
        self.registry = await join_cluster(cfg, self._record(transport, metrics_at),
                                           json.dumps(transport.record).encode(), on_drain=self.drain)
        self.metrics.watch_registration(self.registry)
        self.peers = Peers(self.worker_id, self.registry, self.agent)
        self.gate = TaskGate(self.peers, self.stats)
        self.loans = self._prefix_loans(self.lending)
        self.batch = PrefillBatch(self.worker_id, self.engine, self.agent, self.stats,
                                  transfer_timeout_s=cfg.transfer_timeout_s, layerwise=cfg.layerwise,
                                  progress=self._compute.progress,
                                  costs=self.loans.costs if self.loans is not None else None,
                                  poll=self.loans.poll if self.loans is not None else None,
                                  between_steps=self.loans.between_steps if self.loans is not None else None)
        self.heartbeat = Heartbeat(self.worker_id, self.queue, self._compute.progress, self.batch.cancel, instance)
        # Meet the workers as they join (their NIXL records loaded before the first task or loan
        # needs them: a first contact inside a loan's wait costs the borrower its deadline).
        self._decode_watch = await self.registry.watch_members(
            on_add=self.peers.met, on_update=self.peers.met, on_remove=self._peer_gone, role="decode")
        if self.loans is not None:
            self._prefill_watch = await self.registry.watch_members(
                on_add=self.peers.met, on_update=self.peers.met, on_remove=self._peer_gone, role="prefill")
        if cfg.freeze_gc:
            freeze_gc_heap(f"prefill worker {self.worker_id}")
        self._loop_task = asyncio.create_task(self._run())
        if self.loans is not None:
            self._lend_task = asyncio.create_task(self.loans.run())
        self._load_task = asyncio.create_task(publish_load(self.registry, self._load, cfg.load_report_s))
        log.info("prefill worker %s started (pid %d)", self.worker_id, os.getpid())
        return {"worker_id": self.worker_id, "pid": os.getpid()}

    async def _requeue_earlier_incarnation(self) -> str | None:
        """A fresh start under this id (a Ray restart after a crash): whatever an earlier
        incarnation held is gone. Requeue it now, not when (or if) its lease expires. The
        queue's instance id (None: the queue could not be reached)."""
        try:
            await self.queue.worker_gone(self.worker_id)
            return await self.queue.instance_id()
        except Exception as exc:  # noqa: BLE001  (the queue restarting: its restart lost them anyway)
            log.warning("could not reach the queue at start: %r", exc)
            return None

    def _prefix_loans(self, lending: Lending | None) -> PrefixLoans | None:
        """This worker's prefix loans over `lending` (None: its pool lends nothing). What a borrow
        costs against computing the same tokens here is learned from this worker's own steps and
        reads (router/costs.py: the decode side's model, seeded by the default policy): a prefix
        is borrowed only when reading it is predicted cheaper."""
        if lending is None:
            return None
        costs = CostModel(CostModelParams(), self.engine.connector.kv_bytes_per_token)
        return PrefixLoans(self.worker_id, self.engine, self.agent, lending, self.peers, costs, self.stats,
                           self._compute, self._engine_lock)

    def _record(self, transport: WorkerTransport, metrics_at: str | None) -> WorkerInfo:
        cfg = self.cfg
        lends = {LENDS_CAPACITY_KEY: True, AGENT_INCARNATION_KEY: uuid.uuid4().hex[:16]} if self.lending else {}
        return WorkerInfo(worker_id=self.worker_id, role="prefill", model=self.engine.model_config.model_id,
                          kv_layout=self.engine.connector.layout_info(),
                          capacity={"max_num_batched_tokens": self.budget, **lends, **lora_capacity(self.engine)},
                          version=VERSION,
                          endpoints={**({"metrics": metrics_at} if metrics_at else {}),
                                     **record_endpoints(self.kv_publisher),
                                     # the UCX listeners of the agent's posting threads
                                     **{f"ucx_{i}": f"{cfg.address()}:{port}"
                                        for i, port in enumerate(transport.agent.listen_ports)}},
                          hostname=socket.gethostname(), address=self.host)

    @property
    def budget(self) -> int:
        return self.cfg.batch_max_tokens or self.engine.config.max_num_batched_tokens

    def _load(self) -> dict:
        return {**self.busy.snapshot(), **gpu_load(self.engine.connector.kv_tensor.device),
                **({"cpus": cpu_list(self.cpus)} if self.cpus else {}),
                "kv_usage": round(self.engine.load().kv_usage, 4), "inflight": self.holding,
                "tokens": self.stats.tokens_computed, "tasks": self.stats.tasks_done, **self.batch.admission.load()}

    def _peer_gone(self, info: WorkerInfo) -> None:
        """A worker left: forget its task key and its NIXL agent."""
        self.gate.forget(info.worker_id)
        self.peers.gone(info)

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
        if "registry" in vars(self):
            await self.registry.deregister()

    async def stop(self) -> None:
        self.draining = True
        if self._load_task is not None:
            self._load_task.cancel()
        for task in (self._lend_task, self._loop_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        started = vars(self)  # a start that failed part way has only its first parts
        if "registry" in started:
            await self.registry.close()
        if "queue" in started:
            await self.queue.close()
        if "agent" in started:
            self.agent.close()
        if self.kv_publisher is not None:
            self.kv_publisher.close()
        self.metrics.close()
        tracing.flush("prefill")  # its last spans leave before it does
        self._compute.shutdown()  # its thread ends after a batch still running (and its OpenMP team)

    def get_stats(self) -> dict:
        started = vars(self)
        engine = self.engine if "engine" in started else None
        return {"worker_id": self.worker_id, "pid": os.getpid(), "draining": self.draining,
                "loop_alive": self._loop_task is not None and not self._loop_task.done(),
                "loop_error": self.loop_error, "metrics": self.metrics.address,
                # what the heartbeat tells the queue of the compute thread (None: it runs nothing)
                "compute_progress": self._compute.progress.snapshot(),
                "tp_ranks": self.tp_rank_pids(),
                "lending": self.lending.stats() if self.lending is not None else None,
                # the workers whose NIXL records this agent loaded
                "peers": sorted(self.peers.known) if "peers" in started else [],
                "prompt_tokens_cached": engine.stats.num_prompt_tokens_cached if engine is not None else 0,
                **(engine.tier_stats() if engine is not None else {}),
                "grammars": engine.grammar_stats() if engine is not None else None,  # engine/structured.py
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
        return self.engine.connector.tp_rank_pids() if "engine" in vars(self) else []

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

    async def _next_batch(self) -> list[PrefillTask]:
        try:
            return await self.queue.get_batch(self.worker_id, self.budget, self.cfg.poll_timeout_ms,
                                              adapters=self.batch.admission.enabled)  # (LoRA tasks only then)
        except Exception as exc:  # noqa: BLE001  (queue actor restarting, Ray hiccup)
            log.warning("get_batch failed: %r; retrying", exc)
            await asyncio.sleep(0.5)
            return []

    async def _serve(self, tasks: list[PrefillTask]) -> None:
        beat = asyncio.ensure_future(self.heartbeat.run(tasks))
        try:
            accepted = await self.gate.admit(tasks)
            if accepted:
                await self._prefill(accepted)
        finally:
            beat.cancel()
        await self._queue_call("complete", self.worker_id, [t.request_id for t in tasks])

    async def _prefill(self, tasks: list[PrefillTask]) -> None:
        new_peers: dict[str, dict] = {}
        unusable: dict[str, str] = {}
        for target in dict.fromkeys(t.target_worker_id for t in tasks):
            problem = await self.peers.fetch(target, new_peers)
            if problem is not None:
                unusable[target] = problem
        if self.loans is not None:  # the holders of prefixes worth borrowing (other prefill workers)
            await self.peers.meet_lenders((h for t in tasks for h in t.prefix_hint), new_peers)
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

    def _run_batch(self, tasks: list[PrefillTask], new_peers: dict[str, dict], unusable: dict[str, str]):
        """The batch thread: register the peers met, borrow the prefixes worth it, run the batch."""
        with self._engine_lock:
            added = self.peers.sync(new_peers, unusable)
            if self.loans is not None:
                self.loans.before_batch([t for t in tasks if t.target_worker_id not in unusable], added)
            # its tasks' spans, when this worker traces (prefill/tracing.py)
            return trace_batch(self.batch.run(tasks, unusable), self.worker_id)

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
