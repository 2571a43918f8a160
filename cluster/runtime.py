"""Process-level settings shared by the long-running processes (queue actor, workers)."""

from __future__ import annotations

import asyncio
import gc
import logging
import os

log = logging.getLogger(__name__)


def freeze_gc_heap(what: str) -> int:
    """Move every object alive now (imports, the model, the engine's tables) out of the
    garbage collector's reach; returns how many were frozen.

    Call once, after start-up. A full (generation 2) collection traverses every tracked
    object: ~30 ms for the ~66k objects of a bare Ray worker on the 2-core CI box, more
    with a model loaded, and it runs every few hundred requests, a pause that lands in
    some request's latency. Frozen objects are never traversed; objects created later
    are collected as usual. vLLM and SGLang freeze their start-up heap for the same reason.
    """
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("%s: froze %d start-up objects out of the cyclic GC", what, frozen)
    return frozen


class MetricsEndpoint:
    """A Prometheus `/metrics` endpoint for one `CollectorRegistry`, for processes that
    serve no HTTP of their own (prefill workers, the queue actor).

    `port` None (or 0) binds a free port; the address is what the process advertises (its etcd
    record, `stats()`). The server thread belongs to this object: `close()` stops it.
    """

    def __init__(self, registry, host: str = "127.0.0.1", port: int | None = None):
        from prometheus_client import start_http_server

        self._server, self._thread = start_http_server(port or 0, addr=host, registry=registry)
        self.address = f"{host}:{self._server.server_port}"
        log.info("metrics at http://%s/metrics", self.address)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5.0)


EXIT_FOR_RESTART = 70  # EX_SOFTWARE: a Ray actor whose process exits this way is restarted (max_restarts)


async def leave_and_maybe_exit(registry, what: str, exit_process: bool, flush_s: float = 0.0) -> None:
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

