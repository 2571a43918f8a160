"""A decode worker: the cluster's ingress.

Composes the engine (continuous batching in its own thread), the router
policy (file + etcd, hot-reloaded), the gRPC and HTTP servers, metrics, and
its etcd registration. The remote-prefill path attaches to the frontend.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn

from pdserve.api.adapters import Adapters, LoRAModule, parse_lora_modules
from pdserve.api.grpc_service import GrpcServer
from pdserve.api.http_app import forget_http_endpoints
from pdserve.api.http_app import H11Protocol, build_app
from pdserve.api.ingress import RequestError
from pdserve.api.security import ServerSecurity
from pdserve.api.tool_calls import ChatOptions
from pdserve.cluster.join import join_cluster, leave_cluster, publish_load
from pdserve.cluster.keys import VERSION
from pdserve.cluster.kvindex.publisher import KVEventPublisher, record_endpoints, start_event_publisher
from pdserve.cluster.kvindex.service import KVIndexFollower
from pdserve.cluster.load import BusyMeter, LatencyWindow, counter_value, gpu_load, histogram_buckets
from pdserve.cluster.queue import QueueClient, open_queue, requeue_on_worker_loss
from pdserve.cluster.records import WorkerInfo
from pdserve.cluster.registry import Registry
from pdserve.cluster.runtime import cpu_list, freeze_gc_heap
from pdserve.cluster.security import DEFAULT_OPEN_GRPC_SERVICES, DEFAULT_OPEN_PATHS
from pdserve.cluster.worker_config import WorkerConfig
from pdserve.common import jsonlog, tracing
from pdserve.common.compute_thread import run_in_own_thread
from pdserve.engine import EngineConfig, LLMEngine, LoRARequest
from pdserve.engine.lora import check_request, load_adapter
from pdserve.engine.calibrate import measure_steps
from pdserve.engine.step_plan import StepPlanFeed
from pdserve.kvtransfer.lend import LENDS_CAPACITY_KEY
from pdserve.kvtransfer.lending import Lending
from pdserve.kvtransfer.nixl.tp_receiver import TPReceiver
from pdserve.kvtransfer.nixl.tp_transport import open_worker_transport, with_rank_transport
from pdserve.router import parse_policy

from .async_engine import AsyncEngine, StepInfo
from .borrow import PeerPrefixes
from .core_client import CoreEngineView, EngineCoreClient
from .frontend import Frontend, ServingLimits
from .metrics import WorkerMetrics
from .policy_state import PolicyState
from .remote import RemoteConfig, RemotePrefill

log = logging.getLogger(__name__)


@dataclass
class DecodeWorkerConfig(WorkerConfig):
    """Everything a decode worker needs to start (the shared fields: cluster.worker_config)."""

    host: str | None = None  # None: the address `bind` resolves to on this host
    grpc_port: int = 0  # 0: pick a free port
    http_port: int = 0
    router_policy: str | None = None  # YAML file; None: the built-in default policy
    served_model_name: str | None = None  # default: the model directory's name
    policy_poll_s: float = 1.0
    load_report_s: float = 2.0
    # Remote prefill (needs etcd_endpoints and Ray): register the KV pool with
    # NIXL and send REMOTE decisions to the prefill queue.
    remote_prefill: bool = False
    remote_timeout_s: float = 30.0
    remote_quarantine_s: float = 60.0  # abandoned blocks a late write could still reach stay unused
    # Prompt tokens one engine step may take (engine/step_plan.py); None: planned every
    # step from the measured step cost curve and the policy's qos.tpot_slo_ms / ttft_slo_ms.
    local_prefill_budget_tokens: int | None = None
    # Time a few engine steps before serving (engine/calibrate.py) so that routing, admission
    # and the step plan start from this machine's costs, not the policy's seeds (~0.5 s).
    calibrate: bool = True
    # The engine loop in a process of its own (decode/core_process.py), fed over a Unix socket:
    # HTTP, streaming, tokenizing and routing stay in this one. Colocated serving only for now.
    engine_core_process: bool = False
    limits: dict = field(default_factory=dict)  # ServingLimits fields (request sizes, body bytes)
    # When the engine dies: leave etcd, report NOT_SERVING, then exit the process so its
    # supervisor (Ray max_restarts, Kubernetes) starts a fresh one. The launcher sets it;
    # a worker embedded in another program only reports.
    exit_on_engine_death: bool = False
    # Security (api/security.py, docs/security.md): TLS for gRPC and HTTP (client_ca: mutual
    # TLS), a file of hashed API keys, and what stays reachable without a key.
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    api_keys_file: str | None = None
    open_paths: list[str] = field(default_factory=lambda: list(DEFAULT_OPEN_PATHS))
    open_grpc_services: list[str] = field(default_factory=lambda: list(DEFAULT_OPEN_GRPC_SERVICES))
    # How chat output is read (api/tool_calls.py; vLLM's flags of the same names): tool_choice auto
    # needs enable_auto_tool_choice and a tool_call_parser (hermes, llama3_json, mistral);
    # reasoning_parser (deepseek_r1, qwen3) splits <think>...</think> into reasoning_content.
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    # LoRA adapters served from the start (api/adapters.py: "name=path" or {name, path,
    # base_model_name}); needs the engine argument enable_lora. docs/lora.md, "The API".
    lora_modules: list = field(default_factory=list)

    def chat_options(self) -> ChatOptions:
        """ValueError naming the setting for an unknown parser."""
        return ChatOptions(self.enable_auto_tool_choice, self.tool_call_parser, self.reasoning_parser)


def refuse_with_core_process(cfg: DecodeWorkerConfig, engine: LLMEngine | None) -> None:
    """ValueError naming what the engine core in its own process does not run with (yet)."""
    if engine is not None:
        raise ValueError("engine_core_process: a worker changing role in place keeps its engine in its process")
    if cfg.remote_prefill:
        raise ValueError("engine_core_process: remote_prefill needs the KV arrival beside the engine in one "
                         "process; turn one of them off")


class DecodeWorker:
    """Owns every task, server and the engine thread of one decode worker.

    `start` assembles it from its parts, in order, each built from those before it (the
    engine, its thread, the remote path, the frontend, the servers, the registration);
    `stop` ends whatever it got to."""

    # The parts every started worker has (set by `start`, in this order).
    security: ServerSecurity
    chat: ChatOptions
    engine: LLMEngine | CoreEngineView
    metrics: WorkerMetrics
    async_engine: AsyncEngine | EngineCoreClient
    step_plan: StepPlanFeed
    frontend: Frontend
    grpc: GrpcServer

    def __init__(self, cfg: DecodeWorkerConfig | dict):
        self.cfg = cfg = DecodeWorkerConfig.of(cfg)
        self.worker_id = cfg.worker_id_for("decode")
        self.cpus: list[int] | None = None  # the cores this process owns (topology roles.*.cpus)
        self.registry: Registry | None = None
        self.policy_watch: Any = None
        self.prefill_watch: Any = None
        self.remote: RemotePrefill | None = None
        self.queue: QueueClient | None = None  # with remote prefill
        self.agent: TPReceiver | None = None
        self.kv_publisher: KVEventPublisher | None = None  # when the engine records KV events
        self.transport_record: dict | None = None  # this worker's ranks' NIXL records (published in etcd)
        self._requeue_watch: Any = None
        self._http: uvicorn.Server | None = None
        self._http_sock: socket.socket | None = None
        self._tasks: list[asyncio.Task] = []  # background loops, cancelled on stop
        self._http_task: asyncio.Task | None = None
        self.grpc_address = ""
        self.http_address = ""
        self.host = ""  # the address it serves on (cfg.host or what cfg.bind resolves to)
        # What its etcd record's `load` reports (cluster/load.py): the planner reads it.
        self.busy = BusyMeter()
        self.decode_steps = self.decode_seqs = 0
        self.decode_ms = 0.0
        self._drained: asyncio.Future | None = None

    async def start(self, engine: LLMEngine | None = None) -> dict:
        """Load the engine (or take `engine`, already loaded: a worker changing role keeps its
        weights and KV pool), start serving and register; returns the endpoints."""
        cfg = self.cfg
        if cfg.log_format != "text":
            jsonlog.setup(cfg.log_format)
        tracing.configure("decode", cfg.tracing)  # off without an endpoint (common/tracing.py)
        self.host = cfg.host or cfg.address()
        self.security = ServerSecurity.from_config(cfg)  # bad files fail before the engine loads
        self.chat = cfg.chat_options()  # so does an unknown parser
        lora_modules = parse_lora_modules(cfg.lora_modules)  # and a malformed adapter entry
        if lora_modules and not cfg.engine_args.get("enable_lora"):
            raise ValueError("lora_modules: serving LoRA adapters needs the engine argument enable_lora: true")
        self.security.warn_if_plaintext(self.host, self.worker_id)
        # Own its cores before any engine thread exists (threads inherit the mask; topology cpus).
        self.cpus = cfg.pin_cpus(f"decode worker {self.worker_id}")
        if cfg.engine_core_process:
            refuse_with_core_process(cfg, engine)
            client = await EngineCoreClient.launch(cfg.model, with_rank_transport(cfg.engine_args),
                                                   on_step=self._on_step, on_death=self._on_engine_death,
                                                   host=cfg.address(),
                                                   log_format=cfg.log_format, calibrate=cfg.calibrate,
                                                   freeze_gc=cfg.freeze_gc)
            self.async_engine = client  # (first: a worker that fails from here on stops its core)
            self.engine = CoreEngineView(client)
        else:
            self.engine = engine or await run_in_own_thread(
                LLMEngine, EngineConfig.from_kwargs(cfg.model, **with_rank_transport(cfg.engine_args)))
            self.async_engine = AsyncEngine(self.engine, on_step=self._on_step, on_death=self._on_engine_death)
        policy = PolicyState(self.engine.connector.kv_bytes_per_token, path=cfg.router_policy)
        served = cfg.served_model_name or os.path.basename(os.path.normpath(cfg.model))
        self.metrics = WorkerMetrics("decode", self.worker_id)
        if isinstance(self.async_engine, EngineCoreClient):  # its threads beside this process's
            self.metrics.watch_core_threads(self.async_engine.thread_cpu)
        self.metrics.watch_grammars(self.engine.grammar_stats)  # structured outputs' compiler
        self.metrics.watch_step_plan(lambda: self.engine.stats)  # the step plan's rules (engine/step_budget.py)
        if self.engine.spec is not None:  # speculative decoding's counters (decode/spec_metrics.py)
            self.metrics.watch_spec_decode(lambda: self.engine.stats)
        self._ttft_window, self._itl_window = LatencyWindow(self.metrics.ttft), LatencyWindow(self.metrics.itl)
        self._policy = policy
        if cfg.calibrate:
            await self._calibrate(policy)
        self.step_plan = StepPlanFeed(self._apply_step_plan, self._apply_fixed_budget,
                                      fixed=cfg.local_prefill_budget_tokens)
        self._update_step_plan()  # before the first step
        if cfg.remote_prefill:
            if not cfg.etcd_endpoints:
                raise ValueError("remote_prefill needs etcd_endpoints (prefill workers find this worker there)")
            self.remote = self._remote_path(policy)
        if self.remote is not None:
            self.async_engine.start(pollers=self.remote.pollers, after_schedule=self.remote.after_schedule)
        else:
            self.async_engine.start()
        if self.remote is not None:
            self.remote.start()
        # The router predicts a local prefill as the chunks the engine's step plan would cut it into.
        self.frontend = Frontend(self.async_engine, policy, self.metrics, self.worker_id, served,
                                 ServingLimits.from_dict(cfg.limits), remote=self.remote, plan_local_prefill=True)
        if self.engine.config.enable_lora:
            self._serve_adapters(served, lora_modules)
        self.metrics.engine_alive.set(1)
        self.grpc = GrpcServer(self.frontend, self.host, cfg.grpc_port, self.security)
        await self.grpc.start()
        self.grpc_address = self.grpc.address
        await self._start_http()
        if cfg.router_policy:
            self._tasks.append(asyncio.create_task(policy.watch_file(cfg.policy_poll_s)))
        # The engine's KV events (engine arg kv_events), for the cluster's KV index (cluster/kvindex/).
        self.kv_publisher = start_event_publisher(self.engine, cfg.address())
        if cfg.etcd_endpoints:
            await self._join_cluster()
        if cfg.freeze_gc:
            freeze_gc_heap(f"decode worker {self.worker_id}")
        log.info("decode worker %s serving gRPC %s, HTTP %s", self.worker_id, self.grpc_address, self.http_address)
        return {"worker_id": self.worker_id, "grpc": self.grpc_address, "http": self.http_address, "pid": os.getpid()}

    def _serve_adapters(self, served: str, modules: list[LoRAModule]) -> None:
        """The frontend serves LoRA adapters by name, starting with ``modules`` (each read and
        checked now: a bad one stops the start, naming its field)."""
        eng = self.engine  # (with the engine core in its own process: its view's model config and rank)

        def check(lora: LoRARequest) -> None:  # reads files only: safe off the engine thread
            load_adapter(check_request(lora, True), eng.model_config, eng.config.max_lora_rank)

        adapters = Adapters(served, check)
        for i, mod in enumerate(modules):
            try:
                adapters.load(mod.name, mod.path, mod.base_model_name)
            except RequestError as exc:
                raise ValueError(f"lora_modules[{i}] ({mod.name}): {exc}") from None
        self.frontend.serve_adapters(adapters)
        self.frontend.on_adapters_changed = self._publish_adapters

    async def _publish_adapters(self) -> None:
        """An adapter was loaded or unloaded: the record's ``load["lora_adapters"]`` says so now
        (gateways route by it), not at the next load report. A failed write is kept and retried
        by the registration (cluster/registration.py `update`), and the next report carries it."""
        if self.registry is None or self.registry.info is None:
            return
        self.registry.info.load = self._load()
        try:
            await asyncio.wait_for(self.registry.update(self.registry.info), 5.0)
        except Exception as exc:  # noqa: BLE001  (the load is served; the record catches up)
            log.warning("%s: publishing its LoRA adapters failed: %s", self.worker_id, exc)

    async def _start_http(self) -> None:
        cfg = self.cfg
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, cfg.http_port))
        self._http_sock = sock
        self.http_address = f"{self.host}:{sock.getsockname()[1]}"
        config = jsonlog.uvicorn_config(build_app(self.frontend, self.security, self.chat), cfg.log_format,
                                        cfg.access_log, lifespan="off", timeout_graceful_shutdown=2, http=H11Protocol,
                                        **self.security.uvicorn_ssl())
        self._http = uvicorn.Server(config)
        self._http.install_signal_handlers = lambda: None  # the process owner handles signals
        self._http_task = asyncio.create_task(self._http.serve(sockets=[sock]))
        for _ in range(200):  # up to 10 s
            if self._http.started:
                return
            await asyncio.sleep(0.05)
        raise RuntimeError(f"HTTP server did not start on {self.http_address}")

    def _remote_path(self, policy: PolicyState) -> RemotePrefill:
        """The remote-prefill path, assembled from its parts: the queue, this worker's NIXL
        transport, prefix loans when this pool takes part, the prefill workers' cached prefixes."""
        cfg, engine, async_engine = self.cfg, self.engine, self.async_engine
        if not isinstance(engine, LLMEngine) or not isinstance(async_engine, AsyncEngine):
            raise ValueError("engine_core_process: remote_prefill needs the engine in the worker's process")
        self.queue = open_queue(cfg, "remote_prefill")
        # One agent per tensor-parallel rank; the receiver gathers every rank's notices (kvtransfer/nixl/tp_transport.py).
        # No posting threads: a decode worker receives pages; it posts only notices.
        transport = open_worker_transport(self.worker_id, engine, cfg.agent_ucx_env(self.host))
        self.transport_record = transport.record
        self.agent = transport.receiver()
        peers = None
        if cfg.lending and engine.config.enable_prefix_caching:
            # Prefix loans (decode/borrow.py): borrow what prefill workers hold for local
            # prefills, lend what this pool holds. The loans' peers are met on every rank, and
            # reads go rank by rank (kvtransfer/nixl/tp_transport.py TPSender.read_blocks).
            loans = transport.sender()
            lending = Lending(engine.connector, loans, verify=cfg.lend_verify)
            peers = PeerPrefixes(async_engine, lending, loans, self._nixl_record_of)
        # The prefill workers' KV events (those that publish them, followed from their etcd
        # records): each remote task carries their cached prefixes, so the queue can hand it to
        # the one holding it (cluster/queue/core.py).
        return RemotePrefill(self.worker_id, async_engine, self.agent, self.queue, self.metrics,
                             RemoteConfig(timeout_s=cfg.remote_timeout_s, quarantine_s=cfg.remote_quarantine_s),
                             costs=policy.costs, peers=peers, prefix_view=KVIndexFollower().start())

    async def _nixl_record_of(self, worker_id: str) -> bytes | None:
        return await self.registry.get_nixl_metadata(worker_id) if self.registry is not None else None

    async def _join_cluster(self) -> None:
        cfg = self.cfg
        nixl = json.dumps(self.transport_record).encode() if self.agent is not None else None
        self.registry = registry = await join_cluster(cfg, self._record(), nixl, on_drain=self.drain)
        self.metrics.watch_registration(registry)
        policy = self.frontend.policy
        self.policy_watch = await registry.watch_policy(
            "router", validate=lambda text: parse_policy(text, source=f"etcd:/pdserve/{cfg.cluster}/config/router"),
            on_change=lambda p: policy.set(p, "etcd"), on_reject=lambda r: policy.reject(str(r)))
        follower = self.remote.prefix_view if self.remote is not None else None
        peers = self.remote.peers if self.remote is not None else None

        def seen(info):
            self._count_prefill()
            if follower is not None:
                follower.member(info)
            if peers is not None:
                peers.member(info)

        def gone(info):
            self._count_prefill()
            if follower is not None:
                follower.gone(info)
            if peers is not None:
                peers.gone(info)

        self.prefill_watch = await registry.watch_members(on_add=seen, on_update=seen, on_remove=gone,
                                                          role="prefill")
        if self.queue is not None:
            self._requeue_watch = await requeue_on_worker_loss(registry, self.queue)
        self._tasks.append(asyncio.create_task(publish_load(registry, self._load, cfg.load_report_s)))

    def _count_prefill(self) -> None:
        n = len(self.prefill_watch.members) if self.prefill_watch else 0
        if self.remote is not None:
            self.remote.set_pool_size(n)
            # which of them run LoRA adapters, and which adapters they hold (docs/lora.md)
            self.remote.view.count_adapters(self.prefill_watch.members.values() if self.prefill_watch else ())

    def _record(self) -> WorkerInfo:
        eng = self.engine
        return WorkerInfo(
            worker_id=self.worker_id, role="decode",
            endpoints={"grpc": self.grpc_address, "http": self.http_address,
                       **(eng.kv_event_endpoints if isinstance(eng, CoreEngineView) else record_endpoints(self.kv_publisher))},
            model=self.frontend.served_model, kv_layout=eng.connector.layout_info(),
            capacity={"num_blocks": eng.load().num_blocks, "max_num_seqs": eng.config.max_num_seqs,
                      "max_model_len": eng.max_model_len,
                      **({LENDS_CAPACITY_KEY: True} if self.remote is not None and self.remote.peers else {})},
            version=VERSION, load=self._load(), hostname=socket.gethostname(), address=self.host,
            task_key=self.remote.signer.public_key if self.remote is not None else "",
        )

    def _load(self) -> dict:
        load, m = self.engine.load(), self.metrics
        return {"running": load.running, "waiting": load.waiting, "kv_usage": round(load.kv_usage, 4),
                **({"cpus": cpu_list(self.cpus)} if self.cpus else {}),
                "inflight": len(self.frontend.inflight), **self.busy.snapshot(),
                **({"draining": True} if self.frontend.draining else {}),
                # The LoRA adapters it serves by name (docs/lora.md, "Through the gateway")
                **({"lora_adapters": sorted(a.served)} if (a := self.frontend.adapters) is not None else {}),
                **gpu_load(self.engine.connector.kv_tensor.device),
                "requests": int(histogram_buckets(m.ttft)[-1][1]),
                "prompt_tokens": int(counter_value(m.prompt_tokens)),
                "output_tokens": int(counter_value(m.generation_tokens)),
                "decode_steps": self.decode_steps, "decode_ms": round(self.decode_ms, 2),
                "decode_seqs": self.decode_seqs,
                **self._ttft_window.percentiles_ms("ttft"), **self._itl_window.percentiles_ms("itl")}

    def _on_step(self, info: StepInfo) -> None:
        costs = self.frontend.policy.costs
        if info.ms <= 0:
            return
        self.busy.add(info.ms / 1e3)
        # Proposals verified (speculative decoding) are decode work, not prompt tokens: a verifying
        # step is a decode step, and the TPOT its streams saw is its time over the tokens each got.
        prefill_tokens = info.prefill_tokens
        if prefill_tokens == 0:
            self.decode_steps += 1
            self.decode_ms += info.ms
            self.decode_seqs += info.num_seqs
        self.metrics.step(info.ms / 1e3, prefill_tokens)
        costs.observe_step(info.ms, info.num_decode_seqs, prefill_tokens, info.prefill_pairs)
        costs.observe_drain(info.end_s, info.ms, prefill_tokens, self.frontend.local_backlog())
        if prefill_tokens == 0 and info.num_decode_seqs:
            costs.observe_decode_step(info.ms, info.num_seqs, info.emitted_per_stream)
        budget = self.engine.prefill_token_budget
        if budget is not None:
            self.metrics.local_prefill_budget.set(budget)
        self._update_step_plan()

    async def _calibrate(self, policy) -> None:
        """Replace the policy's seed costs with this machine's (engine/calibrate.py)."""
        t0 = time.monotonic()
        eng = self.engine
        if isinstance(eng, CoreEngineView):
            steps = eng.calibration  # timed by the core before it served
        else:
            steps = await run_in_own_thread(measure_steps, eng, name="pdserve-calibrate")
        policy.costs.calibrate(steps)
        est, seeds = policy.costs.snapshot(), policy.policy.router.cost_model
        log.info("decode worker %s: calibrated in %.2f s from %d steps: a step costs %.1f ms + %.2f ms per "
                 "stream + %.3f ms per prompt token + %.3f ms per 1000 attention pairs (policy seeds: "
                 "%.1f + %.2f + %.3f + %.3f)", self.worker_id, time.monotonic() - t0, len(steps), est.step_fixed_ms,
                 est.step_decode_ms_per_seq, est.prefill_local_ms_per_token, est.prefill_attention_ms_per_kpair,
                 seeds.step_fixed_ms, seeds.step_decode_ms_per_seq, seeds.prefill_local_ms_per_token,
                 seeds.prefill_attention_ms_per_kpair)

    def _update_step_plan(self) -> None:
        qos = self._policy.policy.qos
        self.step_plan.update(self._policy.costs.snapshot(), qos.tpot_slo_ms, qos.ttft_slo_ms)

    def _apply_step_plan(self, cost, targets) -> None:
        self.async_engine.set_step_targets(cost, targets)

    def _apply_fixed_budget(self, tokens: int) -> None:
        self.metrics.local_prefill_budget.set(tokens)
        self.async_engine.set_prefill_token_budget(tokens)

    def _on_engine_death(self, exc: BaseException) -> None:
        """The engine thread died (event loop): make it visible everywhere at once."""
        log.critical("decode worker %s: engine dead (%s); NOT_SERVING, leaving the registry", self.worker_id, exc)
        self.metrics.engine_alive.set(0)
        self._tasks.append(asyncio.ensure_future(self._leave_after_death()))

    async def _leave_after_death(self) -> None:
        await self.grpc.set_serving(False)
        await leave_cluster(self.registry, f"decode worker {self.worker_id}",
                            exit_process=self.cfg.exit_on_engine_death,
                            flush_s=0.5)  # the error responses already queued reach their clients

    async def drain(self, timeout_s: float = 30.0) -> None:
        """Stop taking new requests (health NOT_SERVING, 503), let in-flight ones
        finish (up to ``timeout_s``), and leave the registry. Triggered by
        `pdserve drain` (its drain key in etcd) or `pdserve down`."""
        if self._drained is not None:  # a second call (a restarted planner, `down`) waits for the first
            await asyncio.shield(self._drained)
            return
        self._drained = asyncio.get_running_loop().create_future()
        try:
            self.frontend.draining = True
            await self.grpc.set_serving(False)
            if self.registry is not None and self.registry.info is not None:  # gateways stop picking it now
                self.registry.info.load = self._load()
                try:
                    await self.registry.update(self.registry.info)
                except Exception as exc:  # noqa: BLE001  (the next load report carries it)
                    log.warning("drain of %s: publishing the draining state failed: %s", self.worker_id, exc)
            deadline = asyncio.get_running_loop().time() + timeout_s
            while self.frontend.inflight and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
            if self.frontend.inflight:  # the deadline came first: hand them back (a gateway moves them)
                n = self.frontend.hand_back()
                log.warning("drain of %s: deadline reached with %d stream(s) running; handed back to their "
                            "clients to continue elsewhere", self.worker_id, n)
                wait = asyncio.get_running_loop().time() + 5.0
                while self.frontend.inflight and asyncio.get_running_loop().time() < wait:
                    await asyncio.sleep(0.02)
            if self.registry is not None:
                await self.registry.deregister()
        finally:
            self._drained.set_result(None)

    def stats(self) -> dict:
        eng, load = self.engine, self.engine.load()
        out = {"worker_id": self.worker_id, "inflight": len(self.frontend.inflight), **eng.stats.__dict__,
               "kv_usage": load.kv_usage, "num_blocks": load.num_blocks,
               "num_free_blocks": load.num_free_blocks, "policy_version": self.frontend.policy.version,
               "engine_alive": self.async_engine.alive, **{f"engine_{k}": v for k, v in self.async_engine.counters.items()}}
        if self.remote is not None:
            out["remote"] = dict(self.remote.counters)
            if self.remote.peers is not None:  # prefix loans (decode/borrow.py)
                out["borrowing"] = dict(self.remote.peers.counters)
                out["lending"] = self.remote.peers.lending.stats()
        out.update(eng.tier_stats())
        out["grammars"] = eng.grammar_stats()  # structured outputs' compiler (engine/structured.py)
        return out

    async def stop(self, close_engine: bool = True) -> None:
        """Stop serving and release what the worker holds. `close_engine=False`: the engine lives
        on (a worker changing role in place hands it to its next role, pdserve/role_flip.py)."""
        if self._http is not None:
            self._http.should_exit = True  # uvicorn finishes its serve task by itself
        for t in self._tasks:
            t.cancel()
        started = vars(self)  # a start that failed part way has only its first parts
        if "grpc" in started:
            await self.grpc.stop(1.0)
        if self.remote is not None:
            await self.remote.stop()
        if self.registry is not None:
            await self.registry.close()
        if self.queue is not None:
            await self.queue.close()  # the wire connection, if one is open
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._http_task is not None:
            try:
                await asyncio.wait_for(self._http_task, 5.0)
            except (asyncio.TimeoutError, Exception) as exc:  # noqa: BLE001
                log.warning("HTTP server stop: %r", exc)
        if "async_engine" in started:
            self.async_engine.stop()
            # The engine's other tensor-parallel ranks and its tier's copy thread end now, not
            # when the engine is garbage-collected (a process that outlives the worker, e.g. a
            # test run, kept rank processes for minutes). Not while its thread still steps.
            if close_engine and not self.async_engine.thread_running:
                self.engine.close()
        if "frontend" in started:
            self.frontend.close()
        tracing.flush("decode")  # its last spans leave before it does
        if self.agent is not None:
            self.agent.close()
        if self.kv_publisher is not None:
            self.kv_publisher.close()
        if self._http_sock is not None:
            self._http_sock.close()
        if self._http is not None:
            forget_http_endpoints()

    async def __aenter__(self) -> "DecodeWorker":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()
