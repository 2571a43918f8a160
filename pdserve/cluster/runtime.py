"""Process-level settings shared by the long-running processes (queue actor, workers).

A worker's way into and out of the cluster (leave, exit for a restart) is in join.py."""

from __future__ import annotations

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


def available_cpu_count() -> int:
    """CPUs this process may run on (its affinity mask, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def worker_cpus(cpus: list[int] | str | None, slot: int, slots: int) -> list[int] | None:
    """The cores a worker owns: an explicit list as given; "auto": the cores this process may
    use, split evenly between ``slots`` workers, this one being number ``slot`` (wrapping
    around when there are more workers than cores); None: no pinning."""
    if cpus is None or isinstance(cpus, list):
        return cpus
    if cpus != "auto":
        raise ValueError(f"cpus={cpus!r}: a list of CPU ids, 'auto' or None")
    avail = sorted(os.sched_getaffinity(0))
    per = max(1, len(avail) // max(1, slots))
    start = (slot * per) % len(avail)
    return [avail[(start + j) % len(avail)] for j in range(per)]


def pin_process(cpus: list[int], what: str) -> list[int]:
    """Pin every thread of this process to ``cpus`` (threads started later inherit it) and size
    torch's intra-op pool to them; returns the cores now owned. A CPU id this host lacks is an
    error naming the setting."""
    allowed = set(os.sched_getaffinity(0)) | set(range(os.cpu_count() or 1))
    missing = sorted(set(cpus) - allowed)
    if missing:
        raise ValueError(f"roles.*.cpus: CPU ids {missing} do not exist on this host "
                         f"({os.cpu_count()} CPUs: 0-{(os.cpu_count() or 1) - 1})")
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, PermissionError):  # a thread that just ended
            pass
    import torch

    torch.set_num_threads(len(cpus))
    log.info("%s: pinned to CPUs %s, %d torch threads", what, cpu_list(cpus), len(cpus))
    return sorted(cpus)


def cpu_list(cpus) -> str:
    """``[0, 1, 2, 5]`` as ``0-2,5`` (the form `taskset` and /proc use)."""
    out: list[str] = []
    run: list[int] = []
    for c in sorted(cpus):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


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

