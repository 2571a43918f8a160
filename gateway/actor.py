"""A gateway as a detached, restartable Ray actor: what `pdserve up` starts for the topology's
`gateway.replicas` (pdserve/launcher.py). `drain` stops it taking requests; `down` stops it
like a worker (control/actors.py `stop_actor`)."""

from __future__ import annotations

from .server import Gateway, GatewayConfig


class GatewayActor:
    def __init__(self, cfg: dict):
        from pdserve.control.netaddr import resolve_bind

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
            await self.gateway.grpc.set_serving(False)

    async def stop(self) -> None:
        if self.gateway is not None:
            await self.gateway.stop()
            self.gateway = None


def gateway_config(topo, replica: int, model: str, etcd_endpoints: list[str]) -> dict:
    """The config of gateway ``replica`` of a topology (GatewayConfig fields)."""
    from pdserve.control.security import internal_client_tls

    g, sec = topo.gateway, topo.security
    if sec.api_keys is not None and not g.worker_api_key_file:
        raise ValueError("gateway.replicas with security.api_keys: set gateway.worker_api_key_file (a file holding "
                         "an operator API key the gateway calls the decode workers with)")
    tls = internal_client_tls(sec, topo.resolve)
    path = lambda p: str(topo.resolve(p)) if p else None  # noqa: E731
    tls_files = sec.tls
    etcd_tls = topo.etcd_tls("operator", "worker")
    return {
        "etcd_endpoints": list(etcd_endpoints), "cluster": topo.cluster, "model": model,
        "bind": topo.network.bind, "grpc_port": g.grpc_port, "http_port": g.http_port,
        "gateway_id": f"gateway-{replica}", "routing": g.routing, "max_migrations": g.max_migrations,
        "race_fraction": g.race_fraction, "race_risk": g.race_risk, "forward_tenant": g.forward_tenant,
        "kv_index": g.kv_index, "etcd_tls": None if etcd_tls is None else etcd_tls.__dict__,
        "tls_cert": path(tls_files and tls_files.cert), "tls_key": path(tls_files and tls_files.key),
        "tls_client_ca": path(tls_files and tls_files.client_ca),
        "api_keys_file": path(sec.api_keys and sec.api_keys.file),
        "open_paths": list(sec.open_paths), "open_grpc_services": list(sec.open_grpc_services),
        "worker_api_key": (open(topo.resolve(g.worker_api_key_file)).read().strip()
                           if g.worker_api_key_file else None),
        "worker_ca_file": tls.ca_file if tls else None, "worker_client_cert": tls.cert_file if tls else None,
        "worker_client_key": tls.key_file if tls else None,
    }
