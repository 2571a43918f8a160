"""Process-level settings shared by the long-running processes (queue actor, workers).

A worker's way into and out of the cluster (leave, exit for a restart) is in join.py."""

from __future__ import annotations

import gc
import logging

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

