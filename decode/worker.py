"""A decode worker: the cluster's ingress.

Composes the engine (continuous batching in its own thread), the router
policy (file + etcd, hot-reloaded), the gRPC and HTTP servers, metrics, and
its etcd registration. The remote-prefill path attaches to the frontend.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid
from dataclasses import dataclass, field

import uvicorn

from pdserve.engine import EngineConfig, LLMEngine
from pdserve.router import parse_policy

from .async_engine import AsyncEngine, StepInfo
from .frontend import Frontend
from .grpc_service import GrpcServer
from .http_app import build_app
from .metrics import WorkerMetrics
from .policy_state import PolicyState

log = logging.getLogger(__name__)

VERSION = "0.1.0"


@dataclass
class DecodeWorkerConfig:
    """Everything a decode worker needs to start; defaults suit one local worker."""

    model: str
    engine_args: dict = field(default_factory=dict)
    host: str = "127.0.0.1"
    grpc_port: int = 0  # 0: pick a free port
    http_port: int = 0
    router_policy: str | None = None  # YAML file; None: the built-in default policy
    worker_id: str | None = None
    served_model_name: str | None = None  # default: the model directory's name
    cluster: str = "default"
    etcd_endpoints: list[str] | None = None  # None: run without registration
    lease_ttl_s: float = 10.0
    policy_poll_s: float = 1.0
    load_report_s: float = 2.0


class DecodeWorker:
    """Owns every task, server and the engine thread of one decode worker."""

    def __init__(self, cfg: DecodeWorkerConfig):
        self.cfg = cfg
        self.worker_id = cfg.worker_id or f"decode-{uuid.uuid4().hex[:8]}"
        self.engine: LLMEngine | None = None
        self.async_engine: AsyncEngine | None = None
        self.frontend: Frontend | None = None
        self.grpc: GrpcServer | None = None
        self.registry = None
        self.policy_watch = None
        self.prefill_watch = None
        self._http: uvicorn.Server | None = None
        self._http_sock: socket.socket | None = None
        self._tasks: list[asyncio.Task] = []  # background loops, cancelled on stop
        self._http_task: asyncio.Task | None = None
        self.grpc_address = ""
        self.http_address = ""

    async def start(self) -> None:
        cfg = self.cfg
        self.engine = await asyncio.to_thread(LLMEngine, EngineConfig.from_kwargs(cfg.model, **cfg.engine_args))
        m = self.engine.model_config
        kv_bytes_per_token = 2 * m.num_layers * m.num_kv_heads * m.head_dim * self.engine.runner.dtype.itemsize
        policy = PolicyState(kv_bytes_per_token, path=cfg.router_policy)
        served = cfg.served_model_name or os.path.basename(os.path.normpath(cfg.model))
        self.metrics = WorkerMetrics("decode", self.worker_id)
        self.async_engine = AsyncEngine(self.engine, on_step=self._on_step)
        self.async_engine.start()
        self.frontend = Frontend(self.async_engine, policy, self.metrics, self.worker_id, served)
        self.grpc = GrpcServer(self.frontend, cfg.host, cfg.grpc_port)
        await self.grpc.start()
        self.grpc_address = self.grpc.address
        await self._start_http()
        if cfg.router_policy:
            self._tasks.append(asyncio.create_task(policy.watch_file(cfg.policy_poll_s)))
        if cfg.etcd_endpoints:
            await self._join_cluster()
        log.info("decode worker %s serving gRPC %s, HTTP %s", self.worker_id, self.grpc_address, self.http_address)

    async def _start_http(self) -> None:
        cfg = self.cfg
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((cfg.host, cfg.http_port))
        self._http_sock = sock
        self.http_address = f"{cfg.host}:{sock.getsockname()[1]}"
        config = uvicorn.Config(build_app(self.frontend), log_level="warning", lifespan="off",
                                timeout_graceful_shutdown=2)
        self._http = uvicorn.Server(config)
        self._http.install_signal_handlers = lambda: None  # the process owner handles signals
        self._http_task = asyncio.create_task(self._http.serve(sockets=[sock]))
        for _ in range(200):  # up to 10 s
            if self._http.started:
                return
            await asyncio.sleep(0.05)
        raise RuntimeError(f"HTTP server did not start on {self.http_address}")

    async def _join_cluster(self) -> None:
        from pdserve.cluster.registry import Registry

        cfg = self.cfg
        self.registry = Registry(cfg.etcd_endpoints, cfg.cluster, ttl_s=cfg.lease_ttl_s)
        await self.registry.register(self._record())
        policy = self.frontend.policy
        self.policy_watch = await self.registry.watch_policy(
            "router", validate=lambda text: parse_policy(text, source=f"etcd:/pdserve/{cfg.cluster}/config/router"),
            on_change=lambda p: policy.set(p, "etcd"), on_reject=lambda r: policy.reject(str(r)))
        self.prefill_watch = await self.registry.watch_members(
            on_add=lambda _: self._count_prefill(), on_remove=lambda _: self._count_prefill(), role="prefill")
        self._tasks.append(asyncio.create_task(self._report_load()))

    def _count_prefill(self) -> None:
        self.frontend.cluster["prefill_pool_size"] = len(self.prefill_watch.members) if self.prefill_watch else 0

    def _record(self):
        from pdserve.cluster.records import WorkerInfo

        eng = self.engine
        return WorkerInfo(
            worker_id=self.worker_id, role="decode",
            endpoints={"grpc": self.grpc_address, "http": self.http_address},
            model=self.frontend.served_model, kv_layout=eng.runner.layout_info(),
            capacity={"num_blocks": eng.runner.num_blocks, "max_num_seqs": eng.config.max_num_seqs,
                      "max_model_len": eng.max_model_len},
            version=VERSION, load=self._load(),
        )

    def _load(self) -> dict:
        sched = self.engine.scheduler
        return {"running": len(sched.running), "waiting": len(sched.waiting), "kv_usage": round(self.engine.kv.usage, 4),
                "inflight": len(self.frontend.inflight)}

    async def _report_load(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.load_report_s)
            info = self.registry.info
            if info is not None:
                info.load = self._load()
                await self.registry.update(info)

    def _on_step(self, info: StepInfo) -> None:
        if info.num_decode_seqs and info.num_decode_seqs == info.num_seqs and info.ms > 0:
            self.frontend.policy.costs.observe_decode_step(info.ms, info.num_seqs)

    async def drain(self) -> None:
        """Stop taking new requests (health NOT_SERVING, 503) and leave the registry."""
        self.frontend.draining = True
        await self.grpc.set_serving(False)
        if self.registry is not None:
            await self.registry.deregister()

    async def stop(self) -> None:
        if self._http is not None:
            self._http.should_exit = True  # uvicorn finishes its serve task by itself
        for t in self._tasks:
            t.cancel()
        if self.grpc is not None:
            await self.grpc.stop(1.0)
        if self.registry is not None:
            await self.registry.close()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._http_task is not None:
            try:
                await asyncio.wait_for(self._http_task, 5.0)
            except (asyncio.TimeoutError, Exception) as exc:  # noqa: BLE001
                log.warning("HTTP server stop: %r", exc)
        if self.async_engine is not None:
            self.async_engine.stop()
        if self._http_sock is not None:
            self._http_sock.close()

    async def __aenter__(self) -> "DecodeWorker":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()
