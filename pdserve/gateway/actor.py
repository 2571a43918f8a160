"""A gateway as a detached, restartable Ray actor: what `pdserve up` starts for the topology's
`gateway.replicas` (pdserve/launcher.py). `drain` stops it taking requests; `down` stops it
like a worker (cluster/actors.py `stop_actor`)."""

from __future__ import annotations

from .server import Gateway, GatewayConfig


class GatewayActor:
    def __init__(self, cfg: dict):
        from pdserve.cluster.netaddr import resolve_bind

        cfg = dict(cfg)
        if "bind" in cfg:  # resolved on the node the actor runs on (network.bind: node, an interface...)
            cfg["host"] = resolve_bind(cfg.pop("bind"))
        self.cfg = GatewayConfig(**cfg)
        self.gateway: Gateway | None = None

    async def start(self) -> dict:
        if self.gateway is None:
            self.gateway = Gateway(self.cfg)
            return await self.gateway.start()
        return {"gateway_id": self.gateway.gateway_id, "grpc": self.gateway.grpc_address,
                "http": self.gateway.http_address}

    async def drain(self) -> None:
        if self.gateway is not None and self.gateway.frontend is not None:
            self.gateway.frontend.draining = True
            if self.gateway.grpc is None:
                raise RuntimeError("gateway drain: its gRPC server was never started")
            await self.gateway.grpc.set_serving(False)

    async def stop(self) -> None:
        if self.gateway is not None:
            await self.gateway.stop()
            self.gateway = None


def gateway_config(topo, replica: int, model: str, etcd_endpoints: list[str]) -> dict:
    """The config of gateway ``replica`` of a topology (GatewayConfig fields)."""
    g = topo.gateway
    return {
        "etcd_endpoints": list(etcd_endpoints), "cluster": topo.cluster, "model": model,
        "bind": topo.network.bind, "grpc_port": g.grpc_port, "http_port": g.http_port,
        "gateway_id": f"gateway-{replica}", "routing": g.routing, "max_migrations": g.max_migrations,
        "race_fraction": g.race_fraction, "race_risk": g.race_risk, "forward_tenant": g.forward_tenant,
        "kv_index": g.kv_index, **chat_config(topo), **security_config(topo),
        "tracing": topo.observability.tracing(), "log_format": topo.observability.log_format,
        "access_log": topo.observability.access_log,
    }


def chat_config(topo) -> dict:
    """How a gateway reads chat output (GatewayConfig fields): as the topology's decode workers
    do (`roles.decode`: enable_auto_tool_choice, tool_call_parser, reasoning_parser), since the
    gateway serves their model and its HTTP route, not theirs, reads what they generate."""
    d = topo.roles.decode
    return {"enable_auto_tool_choice": d.enable_auto_tool_choice, "tool_call_parser": d.tool_call_parser,
            "reasoning_parser": d.reasoning_parser}


def security_config(topo, worker_api_key: bool = False) -> dict:
    """A gateway's security for a topology (GatewayConfig fields): the decode workers' own
    ingress settings (`security.tls`, `security.api_keys`: its clients use the same keys and
    certificates), how it calls the workers (their CA, under mutual TLS their certificate,
    `security.tls.server_name`, and the operator key in `gateway.worker_api_key_file`), and
    its etcd identity (a follower's: `reader`, else `operator`, else `worker`).
    ``worker_api_key``: the caller has that key from elsewhere (`pdserve gateway`'s flags)."""
    from pdserve.cluster.etcd_auth import FOLLOWER_IDENTITIES
    from pdserve.cluster.security import internal_client_tls

    g, sec = topo.gateway, topo.security
    if sec.api_keys is not None and not (g.worker_api_key_file or worker_api_key):
        raise ValueError("the decode workers check API keys (security.api_keys): give the gateway an operator key "
                         "to call them with, gateway.worker_api_key_file in the topology (or `pdserve gateway "
                         "--worker-api-key-file`)")
    tls = internal_client_tls(sec, topo.resolve)
    path = lambda p: str(topo.resolve(p)) if p else None  # noqa: E731
    tls_files = sec.tls
    etcd_tls = topo.etcd_tls(*FOLLOWER_IDENTITIES)
    return {
        "etcd_tls": None if etcd_tls is None else etcd_tls.__dict__,
        "tls_cert": path(tls_files and tls_files.cert), "tls_key": path(tls_files and tls_files.key),
        "tls_client_ca": path(tls_files and tls_files.client_ca),
        "api_keys_file": path(sec.api_keys and sec.api_keys.file),
        "open_paths": list(sec.open_paths), "open_grpc_services": list(sec.open_grpc_services),
        "worker_api_key": read_key_file(path(g.worker_api_key_file), "gateway.worker_api_key_file"),
        "worker_ca_file": tls.ca_file if tls else None, "worker_client_cert": tls.cert_file if tls else None,
        "worker_client_key": tls.key_file if tls else None, "worker_server_name": tls.server_name if tls else None,
    }


def read_key_file(path: str | None, setting: str) -> str | None:
    """The API key a file holds (its first line, stripped); None for no file."""
    if not path:
        return None
    try:
        with open(path) as f:
            key = f.readline().strip()
    except OSError as exc:
        raise ValueError(f"{setting} {path}: cannot read it ({exc.strerror})") from None
    if not key:
        raise ValueError(f"{setting} {path}: the file is empty; it should hold the operator API key (one line)")
    return key
