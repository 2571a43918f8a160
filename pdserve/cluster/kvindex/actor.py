"""The KV index as a detached, restartable Ray actor: what `pdserve up` starts when the
topology says ``kv_index: {enabled: true}`` (pdserve/launcher.py). It holds nothing of its own
(a restarted one rebuilds from the workers' snapshots); `down` stops it like a worker
(cluster/actors.py `stop_actor`)."""

from __future__ import annotations

from pdserve.cluster.kvindex.service import KVIndexService


class KVIndexActor:
    def __init__(self, cfg: dict):
        self.cfg = dict(cfg)
        self.service: KVIndexService | None = None

    async def start(self) -> dict:
        if self.service is None:
            from pdserve.cluster.etcd_auth import EtcdTLS
            from pdserve.cluster.netaddr import resolve_bind

            c = self.cfg
            host = resolve_bind(c["bind"])  # on the node the actor runs on (network.bind)
            self.service = await KVIndexService(c["etcd_endpoints"], c["cluster"], host, c["port"],
                                                tls=EtcdTLS.of(c.get("etcd_tls"))).start()
        return {"url": self.service.url}

    async def drain(self) -> None:  # it takes no requests that a drain would hand elsewhere
        return None

    async def stop(self) -> None:
        if self.service is not None:
            await self.service.stop()
            self.service = None


def kv_index_config(topo, etcd_endpoints: list[str]) -> dict:
    """The actor's config for a topology (plain data: it crosses to the Ray node)."""
    from pdserve.cluster.etcd_auth import FOLLOWER_IDENTITIES

    etcd_tls = topo.etcd_tls(*FOLLOWER_IDENTITIES)
    return {"etcd_endpoints": list(etcd_endpoints), "cluster": topo.cluster, "bind": topo.network.bind,
            "port": topo.kv_index.port, "etcd_tls": None if etcd_tls is None else etcd_tls.to_dict()}
