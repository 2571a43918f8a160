"""Test harness shared by the decode and end-to-end suites."""

from __future__ import annotations

import asyncio
import threading
import time

from pdserve.decode.worker import DecodeWorker, DecodeWorkerConfig

# A router policy under which QoS admits everything (the QoS tests have their own).
PERMISSIVE_POLICY = """
router:
  mode: conditional
  policy: cost_model
qos:
  enable_early_rejection: false
"""


class WorkerThread:
    """Starts a DecodeWorker on a private event loop; `call(coro_fn)` runs code on it."""

    def __init__(self, cfg: DecodeWorkerConfig):
        self.worker = DecodeWorker(cfg)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="decode-worker-loop", daemon=True)

    def start(self, timeout_s: float = 120.0) -> "WorkerThread":
        self._thread.start()
        self.call(self.worker.start, timeout_s)
        return self

    def call(self, fn, timeout_s: float = 30.0):
        return asyncio.run_coroutine_threadsafe(fn(), self.loop).result(timeout_s)

    def stop(self) -> None:
        try:
            self.call(self.worker.stop, 30.0)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10.0)

    @property
    def grpc(self) -> str:
        return self.worker.grpc_address

    @property
    def http(self) -> str:
        return f"http://{self.worker.http_address}"


# What Ray raises when a new local head does not come up in time: its GCS never wrote its port
# file, or its raylet did not register within Ray's fixed 30 s. Seen in CI late in a run, for a
# minute at a time, with a second start working.
RAY_START_TIMEOUTS = ("Timed out waiting for file", "timed out during startup")


def start_local_ray(namespace: str, attempts: int = 3, budget_s: float = 100.0, **kwargs) -> None:
    """``ray.init(address="local")`` (a fresh Ray of this process's own even if a ``ray start``
    head runs on this host), 2 CPUs, no dashboard. A start that timed out (`RAY_START_TIMEOUTS`)
    has the processes it started killed, then Ray's state reset (``ray.shutdown()``, bounded:
    once, in CI, it hung for the rest of the test's time after such a start), and is tried again,
    up to ``attempts`` times while another start fits in ``budget_s`` (under pytest's 120 s for a
    test and its fixtures). Any other failure is raised at once. (How long the GCS gets to write
    its port file: tests/conftest.py.)"""
    import os

    import ray

    import psutil

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    args = dict(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, namespace=namespace)
    args.update(kwargs)
    deadline = time.monotonic() + budget_s
    for attempt in range(1, attempts + 1):
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        started = time.monotonic()
        try:
            ray.init(**args)
            return
        except Exception as exc:  # Ray raises RuntimeError or a bare Exception for these
            _kill_children_since(before)  # (first: a half-started head's GCS and raylet)
            _reset_ray(ray, exc)
            took = time.monotonic() - started
            if (attempt == attempts or not any(m in str(exc) for m in RAY_START_TIMEOUTS)
                    or time.monotonic() + 2.0 * attempt + took > deadline):
                raise
            time.sleep(2.0 * attempt)


def _reset_ray(ray, cause: BaseException, timeout_s: float = 15.0) -> None:
    """``ray.shutdown()`` on a thread of its own, waited for at most ``timeout_s``; an error
    naming ``cause`` when it does not return (Ray's state is then unknown: no second start)."""
    import threading

    done = threading.Event()

    def run() -> None:
        try:
            ray.shutdown()
        finally:
            done.set()

    threading.Thread(target=run, name="ray-shutdown", daemon=True).start()
    if not done.wait(timeout_s):
        raise RuntimeError(f"ray.shutdown() did not return within {timeout_s:.0f} s after a failed start") from cause


def _kill_children_since(before: set[int]) -> None:
    """Kill this process's children not in `before`: what a failed ``ray.init`` started. Ray
    builds its head node (GCS, raylet, reaper) before it records it, so a start that times out
    leaves those processes running, unknown to ``ray.shutdown()``, until the test process ends."""
    import psutil

    new = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    for p in new:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(new, timeout=10.0)


def wait_until(pred, timeout_s: float = 10.0, interval_s: float = 0.02):
    """Poll `pred` until true; TimeoutError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        time.sleep(interval_s)


# Where small_topology_yaml's clusters find their made model: set for the whole pytest session
# by tests/conftest.py (one directory under pytest's base temp), so that only the first `up` of
# a session makes it (~3 s on 2 cores) and the others load it, as a user's second `up` does.
# None (outside pytest): each topology's own `tmp`/models.
SHARED_MODEL_CACHE: str | None = None


def small_topology_yaml(cluster: str, tmp, router_policy=None, own_model_cache: bool = False) -> str:
    """A 1P1D CPU topology with a tiny made model, free ports and a 3 s lease, the run dir under
    `tmp`: what the launcher and sweep tests start. The model is made in the session's shared
    cache (SHARED_MODEL_CACHE) on first use; `own_model_cache`: in `tmp`/models, so that this
    cluster's `up` makes it itself (a test of the first `up` a user runs)."""
    policy = f"router_policy: {router_policy}\n" if router_policy else ""
    cache = f"{tmp}/models" if own_model_cache or SHARED_MODEL_CACHE is None else SHARED_MODEL_CACHE
    return f"""\
cluster: {cluster}
model:
  path: auto
  cache_dir: {cache}
  make: {{num_layers: 2, hidden_size: 128, num_heads: 4, num_kv_heads: 2, intermediate_size: 256}}
roles:
  prefill:
    replicas: 1
    resources: {{num_cpus: 1}}
    engine: {{device: cpu, kv_cache_memory_bytes: 33554432}}
  decode:
    replicas: 1
    resources: {{num_cpus: 1}}
    engine: {{device: cpu, kv_cache_memory_bytes: 33554432}}
    ports: {{grpc: 0, http: 0}}
{policy}etcd: {{lease_ttl_s: 3}}
run_dir: {tmp}/runs
"""


class GatewayThread:
    """Starts a gateway (gateway/server.py) on a private event loop."""

    def __init__(self, cfg):
        from pdserve.gateway.server import Gateway

        self.gateway = Gateway(cfg)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="gateway-loop", daemon=True)

    def start(self) -> "GatewayThread":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.gateway.start(), self.loop).result(60)
        return self

    def stop(self) -> None:
        try:
            asyncio.run_coroutine_threadsafe(self.gateway.stop(), self.loop).result(30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
