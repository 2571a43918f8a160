"""How a worker joins the cluster and leaves it: the steps both roles share.

    queue = open_queue(cfg, "the prefill worker")          # pdserve.cluster.queue: the prefill queue, through Ray
    registry = await join_cluster(cfg, info, nixl_metadata, on_drain=worker.drain)
    ...
    await registry.deregister()                              # drained: leave for good
    await leave_cluster(registry, "prefill worker p0", exit_process=True)  # broken: leave, exit

`join_cluster` clears a drain request left under this worker's id (a fresh start
under a drained id), registers the record and the NIXL metadata under a lease
(taking over the record of its own earlier process when the config says so),
and calls `on_drain()` when an operator asks this worker to drain. The NIXL
metadata arrives as bytes: the control plane never imports kvtransfer.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, Awaitable, Callable

from pdserve.cluster.records import WorkerInfo
from pdserve.cluster.registry import Registry
from pdserve.cluster.worker_config import WorkerConfig

log = logging.getLogger(__name__)

EXIT_FOR_RESTART = 70  # EX_SOFTWARE: a Ray actor whose process exits this way is restarted (max_restarts)


async def join_cluster(cfg: WorkerConfig, info: WorkerInfo, nixl_metadata: bytes | None = None, *,
                       on_drain: Callable[[], Awaitable[Any]]) -> Registry:
    """Register `info` (+ NIXL metadata) in the cluster `cfg` names and follow this worker's
    drain key; returns the Registry, which the worker owns from then on (`close()` it)."""
    if not cfg.etcd_endpoints:
        raise ValueError(f"{info.role} worker {info.worker_id}: joining the cluster needs etcd_endpoints")
    registry = Registry(cfg.etcd_endpoints, cfg.cluster, ttl_s=cfg.lease_ttl_s, tls=cfg.etcd_tls_for(info.worker_id))
    try:
        # A fresh start under a drained id: forget that drain (or, when etcd RBAC keeps a worker
        # from deleting drain keys, ignore the one left there; a later drain still counts).
        stale_drain = await registry.clear_drain(info.worker_id)
        await registry.register(info, nixl_metadata, replace_stale=cfg.replace_stale_registration)
        await registry.watch_drain(info.worker_id, lambda why: asyncio.ensure_future(on_drain()),
                                   ignore_through_revision=stale_drain)
    except BaseException:
        await registry.close()
        raise
    return registry


async def publish_load(registry: Registry, load: Callable[[], dict], every_s: float) -> None:
    """Refresh the `load` field of this worker's record every `every_s` (runs until cancelled)."""
    while True:
        await asyncio.sleep(every_s)
        info = registry.info
        if info is not None:
            info.load = load()
            await registry.update(info)


async def leave_cluster(registry: Registry | None, what: str, *, exit_process: bool = False,
                        flush_s: float = 0.0) -> None:
    """A worker that can no longer work: leave the registry now (so nothing is routed to it),
    then, with ``exit_process``, exit so that its supervisor starts a fresh process.
    ``flush_s`` lets replies already queued reach their clients first."""
    if registry is not None:
        try:
            await asyncio.wait_for(registry.deregister(), 10.0)
        except Exception as exc:  # noqa: BLE001  (the lease expires anyway)
            log.error("%s: could not leave the registry: %r", what, exc)
    if exit_process:
        await asyncio.sleep(flush_s)
        log.critical("%s exits (code %d) so that its supervisor restarts it", what, EXIT_FOR_RESTART)
        os._exit(EXIT_FOR_RESTART)
