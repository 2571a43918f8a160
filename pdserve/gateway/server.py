"""One gateway process: follows the decode workers in etcd, serves the decode worker's gRPC
`Inference` API and OpenAI HTTP surface (the same implementation: api/grpc_service.py,
api/http_app.py over a gateway's `Surface`), plus ``POST /gateway/explain`` (the scores
behind a pick). Stateless: any number of replicas; a restart loses only its own connections."""

from __future__ import annotations

import asyncio
import logging
import socket
import uuid
from dataclasses import dataclass, field
from typing import Any

import grpc
import uvicorn
from fastapi import Request
from fastapi.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from pdserve.api.grpc_service import GrpcServer
from pdserve.api.http_app import build_app, forget_http_endpoints
from pdserve.api.ingress import ServingLimits
from pdserve.api.security import ServerSecurity
from pdserve.api.tool_calls import ChatOptions
from pdserve.api.v1 import inference_pb2 as pb
from pdserve.cluster.etcd_auth import EtcdTLS
from pdserve.cluster.registry import Registry
from pdserve.cluster.security import DEFAULT_OPEN_GRPC_SERVICES, DEFAULT_OPEN_PATHS
from pdserve.common import jsonlog, tracing
from pdserve.engine.prompts import PromptChecker
from pdserve.engine.tokenizer import Tokenizer

from .backends import Backends, WorkerCredentials
from .frontend import GatewayFrontend
from .metrics import GatewayMetrics

log = logging.getLogger(__name__)

MAX_EXPLAIN_TOKENS = 1 << 20


@dataclass
class GatewayConfig:
    etcd_endpoints: list[str]
    cluster: str = "default"
    model: str = ""  # the model directory: its tokenizer (the gateway loads no weights)
    host: str = "127.0.0.1"
    grpc_port: int = 0
    http_port: int = 0
    gateway_id: str | None = None
    etcd_tls: EtcdTLS | dict[str, Any] | None = None  # cluster/etcd_auth.py EtcdTLS, or its dict; None: plaintext
    max_migrations: int = 3
    kv_index: bool = True  # follow the decode workers' KV events (those that publish them)
    wait_for_workers_s: float = 60.0
    limits: dict = field(default_factory=dict)
    # Its own ingress (api/security.py): TLS and API keys, as a decode worker's
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    api_keys_file: str | None = None
    open_paths: list[str] = field(default_factory=lambda: list(DEFAULT_OPEN_PATHS))
    open_grpc_services: list[str] = field(default_factory=lambda: list(DEFAULT_OPEN_GRPC_SERVICES))
    # How it calls the decode workers (gateway/backends.py WorkerCredentials)
    worker_api_key: str | None = None
    worker_ca_file: str | None = None
    worker_client_cert: str | None = None
    worker_client_key: str | None = None
    worker_server_name: str | None = None  # the name their certificates carry, when not their address
    # Send each client's key identity to the workers (``x-pdserve-tenant``; api/security.py),
    # so that their per-key fairness and sequence shares see the clients, not the gateway's one
    # key. Needs an operator worker key when the workers check keys.
    forward_tenant: bool = True
    seed: int | None = None  # the tie-breaking draws (tests)
    routing: str = "ttft"  # gateway/pick.py ROUTINGS: "random" is the baseline benchmarks compare with
    # Racing (gateway/frontend.py `_race_partner`): at most this fraction of the requests is raced
    # on a second worker (0: never); a request is raced when it names ttft_slo_ms and its best
    # predicted TTFT is at least race_risk x that target.
    race_fraction: float = 0.0
    race_risk: float = 0.5
    # How its HTTP chat route reads the model's output (api/tool_calls.py; the decode worker's and
    # vLLM's settings of the same names): tool_choice "auto" needs enable_auto_tool_choice and a
    # tool_call_parser; reasoning_parser splits <think>...</think> into reasoning_content. A chat
    # request's tool grammar (tool_choice required or named) is made here and sent to the worker.
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    # Traces (common/tracing.py TracingConfig fields; None: off), the log lines' format and
    # uvicorn's access lines (the topology's observability section; `pdserve gateway` flags).
    tracing: dict | None = None
    log_format: str = "text"
    access_log: bool = True

    def chat_options(self) -> ChatOptions:
        """ValueError naming the setting for an unknown parser, or auto without one."""
        return ChatOptions(self.enable_auto_tool_choice, self.tool_call_parser, self.reasoning_parser)


class Gateway:
    def __init__(self, cfg: GatewayConfig):
        self.cfg = cfg
        self.gateway_id = cfg.gateway_id or f"gateway-{uuid.uuid4().hex[:8]}"
        self.security = ServerSecurity.from_config(cfg)
        self.chat = cfg.chat_options()
        self.registry: Registry | None = None
        self.backends: Backends | None = None
        self.frontend: GatewayFrontend | None = None
        self.grpc: GrpcServer | None = None
        self._http: uvicorn.Server | None = None
        self.grpc_address = self.http_address = ""

    async def start(self) -> dict:
        cfg = self.cfg
        if not cfg.model:
            raise ValueError("model: the gateway needs the model directory for its tokenizer (--model)")
        tracing.configure("gateway", cfg.tracing)  # off without an endpoint (common/tracing.py)
        if cfg.log_format != "text":
            jsonlog.setup(cfg.log_format)
        self.registry = Registry(cfg.etcd_endpoints, cfg.cluster, tls=EtcdTLS.of(cfg.etcd_tls))
        creds = WorkerCredentials(cfg.worker_api_key, cfg.worker_ca_file, cfg.worker_client_cert,
                                  cfg.worker_client_key, server_name=cfg.worker_server_name)
        self.backends = backends = await Backends(self.registry, creds, kv_index=cfg.kv_index, seed=cfg.seed,
                                                  routing=cfg.routing).start()
        card = await self._model_card(backends)
        checker = PromptChecker(Tokenizer(cfg.model), card.max_model_len, card.vocab_size)
        metrics = GatewayMetrics(self.gateway_id)
        self.frontend = frontend = GatewayFrontend(
            backends, checker, metrics, self.gateway_id, card.id, card.dtype, ServingLimits.from_dict(cfg.limits),
            cfg.max_migrations, cfg.race_fraction, cfg.race_risk, cfg.forward_tenant)
        self.grpc = GrpcServer(frontend, cfg.host, cfg.grpc_port, self.security)
        await self.grpc.start()
        self.grpc_address = self.grpc.address
        await self._start_http(frontend, backends)
        log.info("gateway %s serving gRPC %s, HTTP %s for %d decode worker(s) of %r", self.gateway_id,
                 self.grpc_address, self.http_address, len(backends.workers), card.id)
        return {"gateway_id": self.gateway_id, "grpc": self.grpc_address, "http": self.http_address}

    async def _model_card(self, backends: Backends) -> pb.ModelCard:
        """The served model, as a decode worker describes it (waits for the first one)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.wait_for_workers_s
        last = "none registered yet"
        while loop.time() < deadline:
            for wid in list(backends.workers):
                stub, md = backends.stub(wid)
                try:
                    reply = await stub.ListModels(pb.ListModelsRequest(), metadata=md, timeout=5)
                    return reply.models[0]
                except Exception as exc:  # noqa: BLE001  (next worker, or wait)
                    detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
                    last = f"{wid}: {exc.__class__.__name__}: {detail}"
            await asyncio.sleep(0.2)
        raise TimeoutError(f"no decode worker of cluster {self.cfg.cluster!r} answered ListModels within "
                           f"{self.cfg.wait_for_workers_s:.0f} s ({last}); start one, or check --etcd/--cluster")

    async def _start_http(self, frontend: GatewayFrontend, backends: Backends) -> None:
        app = build_app(frontend, self.security, chat=self.chat)
        checker = frontend.checker

        @app.post("/gateway/explain", include_in_schema=False)
        async def explain(request: Request):
            """The pick this gateway would make now for a prompt: every worker's score and terms;
            with ``model`` naming a LoRA adapter, among the workers that serve it."""
            body = await request.json()
            prompt = body.get("prompt") if isinstance(body, dict) else None
            model = body.get("model") if isinstance(body, dict) else None
            if model is not None and not isinstance(model, str):
                return JSONResponse({"error": {"message": "model: must be a string", "param": "model"}},
                                    status_code=400)
            try:
                ids = checker.tokenize_prompt(prompt)
            except ValueError as exc:
                return JSONResponse({"error": {"message": str(exc), "param": "prompt"}}, status_code=400)
            adapter = model if model and model != frontend.served_model else None
            pick = backends.pick(ids, adapter=adapter)
            cached = backends.cached(ids) if adapter is None else {}
            return {"prompt_tokens": len(ids), "cached": cached, **pick.as_dict()}

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.cfg.host, self.cfg.http_port))
        self.http_address = f"{self.cfg.host}:{sock.getsockname()[1]}"
        config = jsonlog.uvicorn_config(app, self.cfg.log_format, self.cfg.access_log, lifespan="off",
                                        timeout_graceful_shutdown=2, http=H11Protocol, **self.security.uvicorn_ssl())
        self._http = uvicorn.Server(config)
        self._http.install_signal_handlers = lambda: None
        self._http_task = asyncio.create_task(self._http.serve(sockets=[sock]))
        for _ in range(200):
            if self._http.started:
                return
            await asyncio.sleep(0.05)
        raise RuntimeError(f"HTTP server did not start on {self.http_address}")

    async def stop(self) -> None:
        if self._http is not None:
            self._http.should_exit = True
        if self.grpc is not None:
            await self.grpc.stop(1.0)
        if self.backends is not None:
            await self.backends.close()
        if self.frontend is not None:
            self.frontend.close()
        tracing.flush("gateway")  # its last spans leave before it does
        forget_http_endpoints()  # (FastAPI's caches would keep its frontend: api/http_app.py)
        if self.registry is not None:
            await self.registry.close(deregister=False)
