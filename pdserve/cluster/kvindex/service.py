"""The cluster's KV index as a service: follows every worker that publishes KV events (its
etcd record lists ``kv_events`` endpoints), keeps a `ClusterKVIndex` of them, and answers
over HTTP:

- ``GET /status``: per worker, the blocks it holds by tier, and how its subscription is
  doing (next sequence number, gaps, replays, snapshots);
- ``POST /explain`` with ``{"token_ids": [...]}``: each worker's cached prefix of that
  prompt, longest first, by tier (``pdserve kv explain``);
- ``GET /metrics``: Prometheus text (blocks per worker and tier, prefix hit rates of the
  queries answered, per worker and tier).

Restartable: it holds nothing of its own; a new one joins every worker by a snapshot.
ZMQ sockets belong to one thread (the follower); etcd callbacks hand it work over a queue.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from pdserve.cluster.registry import Registry

from pdserve.cluster.kvindex.index import ClusterKVIndex
from pdserve.cluster.kvindex.subscriber import KVEventSubscriber

log = logging.getLogger(__name__)

MAX_EXPLAIN_TOKENS = 1 << 20
IDLE_POLL_S = 0.1  # the follower's pace while it follows no worker


class KVIndexFollower:
    """Subscribers to a set of workers' KV events and the `ClusterKVIndex` over them, kept by a
    thread of its own (ZMQ sockets belong to one thread: `add`/`drop` hand it work). The
    service below feeds it from etcd; a decode worker feeds one from its prefill watch, to
    hint each remote task with the prefill workers' cached prefixes."""

    def __init__(self, poll_s: float = 0.005):
        self.poll_s = poll_s
        self.index: ClusterKVIndex | None = None  # created with the first worker's block size
        self.lock = threading.Lock()  # the index, between the follower and the askers' threads
        self.subs: dict[str, tuple[tuple[str, str], KVEventSubscriber]] = {}
        self.skipped: dict[str, str] = {}  # worker id -> why it is not followed
        self._work: queue.Queue = queue.Queue()
        # Askers on a request's path waiting for the lock: the follower steps aside for them
        # between two polls (a lock is not fair: a thread that polls in a loop would take it
        # back first, and a busy host then answered {} to every request). Counted when one
        # still waits longer than its `wait_s` (`hint_timeouts`, in `status`).
        self._readers = 0
        self._readers_lock = threading.Lock()
        self._readers_done = threading.Event()
        self._readers_done.set()
        self.hint_timeouts = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="kv-index", daemon=True)

    def start(self) -> "KVIndexFollower":
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)

    def member(self, info) -> None:
        """A worker record seen (added or updated): follow it if it publishes KV events."""
        eps = info.endpoints
        if "kv_events" in eps and "kv_events_replay" in eps:
            self._work.put(("add", info.worker_id, (eps["kv_events"], eps["kv_events_replay"]),
                            int(info.kv_layout.get("block_size", 0) or 0)))

    def gone(self, info) -> None:
        self._work.put(("drop", info.worker_id, None, 0))

    def _follow(self) -> None:
        while not self._stop.is_set():
            try:
                self._apply_work()
                busy = False
                for wid, (_, sub) in list(self.subs.items()):
                    if self._readers:  # a request waits for the index: let it in before the next poll
                        self._readers_done.wait(0.01)
                    with self.lock:
                        busy |= sub.poll(0.0) > 0
                if not busy:  # nobody followed yet: a slower pace (a decode worker always runs one)
                    self._stop.wait(self.poll_s if self.subs else IDLE_POLL_S)
            except Exception:  # noqa: BLE001  (logged; a bad worker must not stop the index)
                log.exception("KV index: following the workers failed")
                self._stop.wait(0.5)
        for _, sub in self.subs.values():
            sub.close()

    def _apply_work(self) -> None:
        while True:
            try:
                op, wid, eps, block_size = self._work.get_nowait()
            except queue.Empty:
                return
            old = self.subs.get(wid)
            if op == "drop" or (old is not None and old[0] != eps):
                if old is not None:
                    old[1].close()
                    del self.subs[wid]
                with self.lock:
                    if self.index is not None:
                        self.index.drop(wid)
            if op != "add" or wid in self.subs:
                continue
            with self.lock:
                if block_size < 1:
                    self.skipped[wid] = "its record names no KV block size (kv_layout.block_size)"
                    continue
                if self.index is None:
                    self.index = ClusterKVIndex(block_size)
                if block_size != self.index.block_size:
                    self.skipped[wid] = (f"block_size {block_size}, the index's is {self.index.block_size}: "
                                         "prefixes could not be compared")
                    log.warning("KV index: not following %s: %s", wid, self.skipped[wid])
                    continue
                self.skipped.pop(wid, None)
                sub = KVEventSubscriber(f"tcp://{eps[0]}", f"tcp://{eps[1]}")
                self.subs[wid] = (eps, sub)
                self.index.set_view(wid, sub.view)

    def _refresh_views(self) -> None:
        """A snapshot replaces a subscriber's view object: point the index at the current ones."""
        for wid, (_, sub) in self.subs.items():
            if self.index is not None and self.index.views.get(wid) is not sub.view:
                self.index.set_view(wid, sub.view)

    def cached_tokens(self, token_ids: list[int], wait_s: float = 0.01) -> dict[str, int]:
        """Per followed worker, the tokens of this prompt's prefix it holds (0s left out);
        not counted in the hit rates (a routing hint, not an operator's query). Asked on a
        request's path: when the follower holds the index longer than ``wait_s`` (a snapshot
        on its way), the answer is {} (no hint) rather than a wait."""
        with self._readers_lock:
            self._readers += 1
            self._readers_done.clear()
        try:
            got = self.lock.acquire(timeout=wait_s)
        finally:
            with self._readers_lock:
                self._readers -= 1
                if not self._readers:
                    self._readers_done.set()
        if not got:
            self.hint_timeouts += 1
            return {}
        try:
            self._refresh_views()
            if self.index is None:
                return {}
            return {h.worker_id: h.tokens for h in self.index.longest_prefixes(token_ids, count=False) if h.tokens}
        finally:
            self.lock.release()

    def status(self) -> dict:
        with self.lock:
            self._refresh_views()
            workers = {}
            for wid, (eps, sub) in sorted(self.subs.items()):
                workers[wid] = {"blocks": len(sub.view.blocks), "by_medium": _by_medium(sub.view),
                                "synced": sub.next_seq is not None, "next_seq": sub.next_seq, "gaps": sub.gaps,
                                "replayed": sub.replayed, "snapshots": sub.snapshots, "endpoint": eps[0]}
            idx = self.index
            return {"block_size": idx.block_size if idx else None,
                    "blocks": len(idx.hashes()) if idx else 0, "queries": idx.queries if idx else 0,
                    "workers": workers, "not_followed": dict(self.skipped), "hint_timeouts": self.hint_timeouts}

    def explain(self, token_ids: list[int]) -> dict:
        with self.lock:
            self._refresh_views()
            if self.index is None:
                return {"blocks": 0, "workers": [], "note": "no worker publishes KV events yet"}
            hits = self.index.longest_prefixes(token_ids)
            return {"prompt_tokens": len(token_ids), "blocks": len(token_ids) // self.index.block_size,
                    "block_size": self.index.block_size,
                    "workers": [{"worker_id": h.worker_id, "cached_blocks": h.blocks, "cached_tokens": h.tokens,
                                 "by_medium": {str(k): v for k, v in h.by_medium().items()}} for h in hits]}

    def metrics(self) -> str:
        with self.lock:
            self._refresh_views()
            lines = ["# HELP pdserve_kvindex_blocks Blocks a worker holds, by tier (from its KV events).",
                     "# TYPE pdserve_kvindex_blocks gauge"]
            for wid, (_, sub) in sorted(self.subs.items()):
                for medium, n in sorted(_by_medium(sub.view).items()):
                    lines.append(f'pdserve_kvindex_blocks{{worker="{wid}",medium="{medium}"}} {n}')
            idx = self.index
            lines += ["# HELP pdserve_kvindex_prefix_hit_blocks_total Prompt blocks found cached by the "
                      "queries answered, per worker and tier.", "# TYPE pdserve_kvindex_prefix_hit_blocks_total counter"]
            if idx is not None:
                for (wid, medium), n in sorted(idx.hit_blocks.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
                    lines.append(f'pdserve_kvindex_prefix_hit_blocks_total{{worker="{wid}",medium="{medium}"}} {n}')
            lines += ["# HELP pdserve_kvindex_prefix_asked_blocks_total Prompt blocks the queries asked about, "
                      "per worker (hit rate: hit / asked).", "# TYPE pdserve_kvindex_prefix_asked_blocks_total counter"]
            if idx is not None:
                for wid, n in sorted(idx.asked_blocks.items()):
                    lines.append(f'pdserve_kvindex_prefix_asked_blocks_total{{worker="{wid}"}} {n}')
            lines += ["# HELP pdserve_kvindex_resyncs_total Snapshots a subscription started over from.",
                      "# TYPE pdserve_kvindex_resyncs_total counter"]
            for wid, (_, sub) in sorted(self.subs.items()):
                lines.append(f'pdserve_kvindex_resyncs_total{{worker="{wid}"}} {sub.snapshots}')
            return "\n".join(lines) + "\n"


def _by_medium(view) -> dict[str, int]:
    media: dict[str, int] = {}
    for _, medium in view.blocks.values():
        media[str(medium)] = media.get(str(medium), 0) + 1
    return media


class KVIndexService:
    """The follower of every worker in a cluster's etcd, answering over HTTP."""

    def __init__(self, etcd_endpoints, cluster: str, host: str = "127.0.0.1", port: int = 0, *,
                 tls=None, poll_s: float = 0.005):
        self.etcd_endpoints, self.cluster, self.tls = etcd_endpoints, cluster, tls
        self.follower = KVIndexFollower(poll_s)
        self._http = ThreadingHTTPServer((host, port), _handler(self))
        self._http.daemon_threads = True
        self._http_thread = threading.Thread(target=self._http.serve_forever, name="kv-index-http", daemon=True)
        self.registry: Registry | None = None

    @property
    def url(self) -> str:
        host, port = self._http.server_address[:2]
        return f"http://{host!s}:{port}"

    @property
    def index(self) -> ClusterKVIndex | None:
        return self.follower.index

    async def start(self) -> "KVIndexService":
        self.follower.start()
        self._http_thread.start()
        self.registry = Registry(self.etcd_endpoints, self.cluster, tls=self.tls)
        await self.registry.watch_members(on_add=self.follower.member, on_update=self.follower.member,
                                          on_remove=self.follower.gone)
        log.info("KV index of cluster %s: %s", self.cluster, self.url)
        return self

    async def stop(self) -> None:
        if self.registry is not None:
            await self.registry.close(deregister=False)
        self.follower.close()
        self._http.shutdown()
        self._http.server_close()

    def status(self) -> dict:
        return {"cluster": self.cluster, **self.follower.status()}

    def explain(self, token_ids: list[int]) -> dict:
        return self.follower.explain(token_ids)

    def metrics(self) -> str:
        return self.follower.metrics()


def _handler(svc: KVIndexService):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt, *args):  # quiet: the service logs what matters
            log.debug("kv index http: " + fmt, *args)

        def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _error(self, code: int, message: str) -> None:
            self._send(code, json.dumps({"error": message}).encode())

        def do_GET(self):  # noqa: N802
            if self.path == "/status":
                self._send(200, json.dumps(svc.status()).encode())
            elif self.path == "/metrics":
                self._send(200, svc.metrics().encode(), "text/plain; version=0.0.4")
            else:
                self._error(404, f"no {self.path}: GET /status or /metrics, POST /explain")

        def do_POST(self):  # noqa: N802
            if self.path != "/explain":
                self._error(404, f"no {self.path}: POST /explain")
                return
            try:
                n = int(self.headers.get("Content-Length", "0"))
                body = json.loads(self.rfile.read(min(n, 16 * MAX_EXPLAIN_TOKENS)) or b"{}")
                tokens = body.get("token_ids") if isinstance(body, dict) else None
                if (not isinstance(tokens, list) or not tokens or len(tokens) > MAX_EXPLAIN_TOKENS
                        or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens)):
                    raise ValueError("token_ids must be a non-empty list of token ids (ints >= 0)")
            except (ValueError, json.JSONDecodeError) as exc:
                self._error(400, str(exc))
                return
            self._send(200, json.dumps(svc.explain(tokens)).encode())

    return Handler


def wait_synced(svc: KVIndexService, worker_ids, timeout_s: float) -> dict:
    """Poll `status()` until every listed worker is followed and synced; the status."""
    deadline = time.monotonic() + timeout_s
    while True:
        st = svc.status()
        if all(st["workers"].get(w, {}).get("synced") for w in worker_ids):
            return st
        if time.monotonic() > deadline:
            raise TimeoutError(f"KV index: workers {sorted(worker_ids)} not synced; status {st}")
        time.sleep(0.05)
