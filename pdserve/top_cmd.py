"""`pdserve top`: a live terminal view of a running cluster, refreshed every `--interval`.

Each tick reads the workers' records from etcd (status_cmd.py's reader) and scrapes each
worker's Prometheus /metrics (a decode worker's HTTP port, a prefill worker's `metrics`
endpoint) concurrently; the scrapes go into one ring per worker (top_metrics.py) and
top_view.py turns them into the frame's lines. Drawn with curses; `q` quits. `--once` prints
one frame to stdout (two scrapes `--interval` apart, so that rates show) and exits. A worker
whose /metrics does not answer is shown as unreachable with the reason; etcd not answering
keeps the workers as last read and says so.
"""

from __future__ import annotations

import asyncio
import os
import ssl
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.topology_args import add_topology_arg, load_topology_arg
from pdserve.top_metrics import Ring, Scrape
from pdserve.top_view import WINDOW_S, Header, Worker, frame

if TYPE_CHECKING:
    import httpx

    from pdserve.cluster.etcd_auth import EtcdTLS
    from pdserve.cluster.security import ClientTLS

ETCD_TIMEOUT_S = 3.0
MAX_INTERVAL_S = 60.0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "top", help="a live terminal view of a running cluster: workers, load, KV, rates, latency, routes",
        description=("Show the workers of a running cluster (role, state, running and waiting requests, KV "
                     "use, busy fraction, request and token rates), the prefill queue, TTFT / TPOT / "
                     "scheduler-wait percentiles and the routes and fallbacks of the last minute, from the "
                     "workers' etcd records and their Prometheus /metrics, refreshed every --interval. "
                     "q quits. The cluster is `pdserve up`'s (its state file), or --etcd with --cluster."))
    add_topology_arg(p)
    p.add_argument("--etcd", default=None, metavar="ENDPOINTS",
                   help="etcd endpoints host:port[,host:port]; with --cluster, without `pdserve up`'s state file")
    p.add_argument("--cluster", default=None, help="the topology's cluster name (with --etcd)")
    p.add_argument("--interval", type=float, default=1.0, metavar="SECONDS",
                   help="seconds between frames (default 1)")
    p.add_argument("--once", action="store_true",
                   help="print one frame to stdout and exit (two scrapes --interval apart, so rates show)")
    p.set_defaults(func=top)


def _target(args):
    """(etcd endpoints, cluster, etcd TLS, the decode workers' HTTP TLS or None): from --etcd and
    --cluster, else from `pdserve up`'s state file; TLS from the topology when its file exists."""
    from pdserve.cluster.keys import check_name, parse_endpoints
    from pdserve.cluster.security import internal_client_tls

    if not 0 < args.interval <= MAX_INTERVAL_S:
        raise ValueError(f"--interval {args.interval:g}: must be > 0 and at most {MAX_INTERVAL_S:g} seconds")
    if (args.etcd is None) != (args.cluster is None):
        raise ValueError("--etcd and --cluster go together (or neither: read `pdserve up`'s state file)")
    topo = load_topology_arg(args.topology) if args.etcd is None or Path(args.topology).is_file() else None
    http_tls = internal_client_tls(topo.security, topo.resolve) if topo is not None else None
    etcd_tls = topo.etcd_tls("operator", "worker") if topo is not None else None
    if args.etcd is None:
        from pdserve.launcher import ClusterState, state_path

        state = ClusterState.load(state_path(topo))
        return state.etcd_endpoints, state.cluster, etcd_tls, http_tls
    endpoints = [e.strip() for e in args.etcd.split(",") if e.strip()]
    try:
        parse_endpoints(endpoints)
    except ValueError as exc:
        raise ValueError(f"--etcd {args.etcd!r}: {exc}") from None
    return endpoints, check_name("--cluster", args.cluster), etcd_tls, http_tls


def metrics_url(record: dict, https: bool) -> str | None:
    """Where a worker serves /metrics: a prefill worker's `metrics` endpoint (plaintext), a decode
    worker's HTTP port (over TLS when the topology serves it so); None when its record names none."""
    eps = record.get("endpoints") or {}
    if eps.get("metrics"):
        return f"http://{eps['metrics']}/metrics"
    if eps.get("http"):
        return f"{'https' if https else 'http'}://{eps['http']}/metrics"
    return None


class Collector:
    """The workers as last read from etcd, and their scrapes; `tick()` refreshes both."""

    def __init__(self, endpoints: list[str], cluster: str, etcd_tls: EtcdTLS | None = None,
                 http_tls: ClientTLS | None = None, interval_s: float = 1.0):
        self.endpoints, self.cluster, self.etcd_tls, self.http_tls = endpoints, cluster, etcd_tls, http_tls
        self.header = Header(cluster, endpoints, interval_s)
        self.workers: dict[str, Worker] = {}
        self.scrape_timeout_s = max(0.5, min(2.0, interval_s))
        self._client: httpx.AsyncClient | None = None

    def _http(self) -> httpx.AsyncClient:
        import httpx

        if self._client is None:
            verify: ssl.SSLContext | bool = True
            if self.http_tls is not None:
                verify = ssl.create_default_context(cafile=self.http_tls.ca_file)
                if self.http_tls.cert_file:
                    verify.load_cert_chain(self.http_tls.cert_file, self.http_tls.key_file)
            self._client = httpx.AsyncClient(timeout=self.scrape_timeout_s, verify=verify)
        return self._client

    async def tick(self) -> None:
        from pdserve.cluster.records import TRANSIENT_ERRORS, short_error
        from pdserve.status_cmd import read_members

        try:
            members = await asyncio.wait_for(read_members(self.endpoints, self.cluster, self.etcd_tls), ETCD_TIMEOUT_S)
        except (*TRANSIENT_ERRORS, asyncio.TimeoutError) as exc:
            self.header.etcd_error = short_error(exc) if str(exc) else f"no answer within {ETCD_TIMEOUT_S:g} s"
        else:
            self.header.etcd_error = None
            for wid in set(self.workers) - set(members):
                del self.workers[wid]  # left the cluster (its lease ended)
            for wid, record in members.items():
                w = self.workers.get(wid)
                if w is None or w.record.get("role") != record.get("role"):
                    w = self.workers[wid] = Worker(wid, record, Ring(WINDOW_S))
                w.record = record
                w.url = metrics_url(record, https=self.http_tls is not None)
        await asyncio.gather(*(self._scrape(w) for w in list(self.workers.values())))

    async def _scrape(self, w: Worker) -> None:
        import httpx

        if w.url is None:
            w.error = "its etcd record names no /metrics endpoint"
            return
        server_name = self.http_tls.server_name if self.http_tls is not None and w.url.startswith("https") else None
        try:
            r = await self._http().get(w.url, extensions={"sni_hostname": server_name} if server_name else None)
            if r.status_code != 200:
                w.error = f"HTTP {r.status_code}"
                return
            scrape = Scrape.parse(r.text)
        except httpx.TimeoutException:
            w.error = f"no answer within {self.scrape_timeout_s:g} s"
        except (httpx.HTTPError, OSError, ValueError, ssl.SSLError) as exc:
            w.error = f"{type(exc).__name__}: {str(exc) or 'failed'}"[:160]
        else:
            w.error = None
            w.ring.add(time.monotonic(), scrape)

    def lines(self) -> list[str]:
        return frame(self.header, list(self.workers.values()))

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


def top(args) -> int:
    """`pdserve top`: 0 when quit with q (or, with --once, when etcd answered)."""
    endpoints, cluster, etcd_tls, http_tls = _target(args)
    collector = Collector(endpoints, cluster, etcd_tls, http_tls, args.interval)
    loop = asyncio.new_event_loop()
    try:
        if args.once:
            return _once(loop, collector, args.interval)
        if not (sys.stdin.isatty() and sys.stdout.isatty()):
            raise ValueError("needs a terminal (use --once to print one frame)")
        import curses

        # ncurses takes LINES / COLUMNS from the environment over the terminal's own size: values
        # exported by some earlier process would cut the frame and survive every resize.
        for name in ("LINES", "COLUMNS"):
            os.environ.pop(name, None)
        return curses.wrapper(lambda screen: _live(screen, loop, collector, args.interval))
    finally:
        loop.run_until_complete(collector.close())
        loop.close()


def _once(loop, collector: Collector, interval_s: float) -> int:
    loop.run_until_complete(collector.tick())
    if collector.header.etcd_error is None and collector.workers:
        time.sleep(interval_s)  # a second scrape, so that rates and the window's figures show
        loop.run_until_complete(collector.tick())
    print("\n".join(collector.lines()), flush=True)
    return 1 if collector.header.etcd_error else 0


def _live(screen, loop, collector: Collector, interval_s: float) -> int:
    import curses

    try:
        curses.curs_set(0)
    except curses.error:
        pass  # a terminal that cannot hide the cursor
    while True:
        started = time.monotonic()
        loop.run_until_complete(collector.tick())
        _draw(screen, collector.lines())
        deadline = started + interval_s
        while True:  # keys until the next tick; at least one look, however long the tick took
            screen.timeout(max(0, int((deadline - time.monotonic()) * 1000)))
            key = screen.getch()
            if key in (ord("q"), ord("Q")):
                return 0
            if key == curses.KEY_RESIZE:
                _draw(screen, collector.lines())
            elif key == -1:
                break  # no key before the deadline


def _draw(screen, lines: list[str]) -> None:
    import curses

    height, width = screen.getmaxyx()
    screen.erase()
    for y, line in enumerate(lines[:height]):
        try:
            screen.addnstr(y, 0, line, max(0, width - 1), curses.A_BOLD if y == 0 else curses.A_NORMAL)
        except curses.error:
            pass  # the bottom-right cell of a small terminal
    screen.refresh()
