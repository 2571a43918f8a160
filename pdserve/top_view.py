"""What one frame of `pdserve top` shows, as lines of text: the workers (role, state, load, KV
use, rates), the prefill queue and the scheduler wait, TTFT/TPOT percentiles over the last
minute, and the routes and fallbacks of the last minute. Built from each worker's etcd record
(the dicts `pdserve status` reads, status_cmd.py) and its ring of /metrics scrapes
(top_metrics.py). Pure: `pdserve top` (top_cmd.py) draws the lines, on a terminal or stdout.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pdserve.top_metrics import Ring, Scrape, Span

RATE_WINDOW_S = 10.0  # rates: over the scrapes of the last 10 s
WINDOW_S = 60.0  # percentiles, routes and fallbacks: over the last minute
DASH = "-"

# The decode worker's metric names (decode/metrics.py) and the prefill worker's (prefill/metrics.py).
TTFT, TPOT, SCHED_WAIT = ("pdserve_time_to_first_token_seconds", "pdserve_time_per_output_token_seconds",
                          "pdserve_request_queue_seconds")


@dataclass
class Worker:
    """One registered worker as a frame sees it: its etcd record (status_cmd's member dict), its
    scrapes, and why the last scrape failed (None: it did not)."""

    worker_id: str
    record: dict
    ring: Ring
    error: str | None = None
    url: str | None = None  # the /metrics it is scraped at (None: its record names none)

    @property
    def role(self) -> str:
        return str(self.record.get("role", "?"))

    def span(self, window_s: float) -> Span | None:
        return None if self.error else self.ring.span(window_s)

    @property
    def latest(self) -> Scrape | None:
        return None if self.error else self.ring.latest


@dataclass
class Header:
    cluster: str
    etcd: list[str]
    interval_s: float
    etcd_error: str | None = None  # etcd did not answer this time: the members are the last known


def _num(v: float | None, fmt: str = "{:.0f}") -> str:
    return DASH if v is None else fmt.format(v)


def ms(seconds: float | None) -> str:
    if seconds is None:
        return DASH
    v = seconds * 1e3
    return f"{v:.1f}ms" if v < 10 else f"{v:.0f}ms"


def _pct(v) -> str:
    return DASH if v is None else f"{100 * float(v):.0f}%"


COLUMNS = (("WORKER", 14), ("ROLE", 8), ("STATE", 12), ("RUN", 4), ("WAIT", 4), ("RKV", 4), ("KV", 5),
           ("BUSY", 5), ("REQ/S", 7), ("IN TOK/S", 9), ("OUT TOK/S", 9), ("DONE", 7))


def _row(cells: list[str]) -> str:
    out = []
    for (name, width), cell in zip(COLUMNS, cells):
        out.append(f"{cell:<{width}}" if name in ("WORKER", "ROLE", "STATE") else f"{cell:>{width}}")
    return " ".join(out).rstrip()


def _state(w: Worker) -> str:
    if w.error is not None:
        return "unreachable"
    return "draining" if w.record.get("load", {}).get("draining") else "up"


def worker_row(w: Worker) -> str:
    """WORKER ROLE STATE RUN WAIT RKV KV BUSY REQ/S IN TOK/S OUT TOK/S DONE (DASH: not known)."""
    load, s, rate = w.record.get("load", {}), w.latest, w.span(RATE_WINDOW_S)
    kv = load.get("kv_usage")
    if w.role == "decode":
        gauge = (lambda name: s.value(name)) if s else (lambda name: None)
        run, wait, rkv = (gauge(f"pdserve_num_requests_{k}") for k in ("running", "waiting", "waiting_remote_kv"))
        run = load.get("running") if run is None else run
        wait = load.get("waiting") if wait is None else wait
        kv_gauge = s.value("pdserve_kv_cache_usage_ratio") if s else None
        kv = kv if kv_gauge is None else kv_gauge
        names = ("pdserve_requests_total", "pdserve_prompt_tokens_total", "pdserve_generation_tokens_total")
    else:
        run, wait, rkv = load.get("inflight"), None, None
        names = ("pdserve_prefill_tasks_done_total", "pdserve_prefill_tokens_computed_total", "")
    # A labelled counter has no sample before its first increment: 0 on a worker that answered.
    rates = [(rate.rate(n) or 0.0) if rate and n else None for n in names]
    done = (s.value(names[0]) or 0.0) if s else None
    return _row([w.worker_id, w.role, _state(w), _num(run), _num(wait), _num(rkv), _pct(kv), _pct(load.get("busy")),
                 _num(rates[0], "{:.2f}"), _num(rates[1], "{:.1f}"), _num(rates[2], "{:.1f}"), _num(done)])


def _merged(spans: list[Span], histogram: str) -> list[tuple[float, float]]:
    out: dict[float, float] = {}
    for sp in spans:
        for le, n in sp.observations(histogram):
            out[le] = out.get(le, 0.0) + n
    return sorted(out.items())


def latency_lines(decode: list[Worker]) -> list[str]:
    """TTFT, TPOT and the scheduler wait per decode worker (and all of them), last minute."""
    from pdserve.cluster.load import quantile

    head = (f"{'latency, last 60 s':<20} {'reqs':>5}  {'TTFT p50':>8} {'p90':>7} {'p99':>7}  "
            f"{'TPOT p50':>8} {'p90':>7} {'p99':>7}  {'wait p50':>8} {'p90':>7}")
    rows = [(w.worker_id, [sp]) for w in decode if (sp := w.span(WINDOW_S)) is not None]
    if len(rows) > 1:
        rows.append(("all decode", [sp for _, s in rows for sp in s]))
    lines = [head]
    for name, spans in rows:
        cells = []
        for hist, qs in ((TTFT, (0.5, 0.9, 0.99)), (TPOT, (0.5, 0.9, 0.99)), (SCHED_WAIT, (0.5, 0.9))):
            b = _merged(spans, hist)
            cells.append([ms(quantile(b, q)) for q in qs])
        n = _merged(spans, TTFT)
        lines.append(f"  {name:<18} {_num(n[-1][1] if n else 0):>5}  {cells[0][0]:>8} {cells[0][1]:>7} "
                     f"{cells[0][2]:>7}  {cells[1][0]:>8} {cells[1][1]:>7} {cells[1][2]:>7}  "
                     f"{cells[2][0]:>8} {cells[2][1]:>7}")
    if not rows:
        lines.append("  (no decode worker scraped twice yet)")
    return lines


def _counts(counts: dict[tuple[str, ...], float]) -> str:
    """{(route, reason): n} as "local 3 (short_prompt 2, empty_pool 1), remote 1 (cost 1)"."""
    by_first: dict[str, dict[str, float]] = {}
    for key, n in counts.items():
        by_first.setdefault(key[0], {})[key[1] if len(key) > 1 else ""] = n
    parts = []
    for first, rest in sorted(by_first.items()):
        detail = ", ".join(f"{k} {v:.0f}" for k, v in sorted(rest.items(), key=lambda kv: -kv[1]) if k)
        parts.append(f"{first} {sum(rest.values()):.0f}" + (f" ({detail})" if detail else ""))
    return ", ".join(parts) or "none"


def queue_and_route_lines(decode: list[Worker]) -> list[str]:
    live = [w for w in decode if w.latest is not None]
    scrape = live[0].latest if live else None
    if scrape is not None:
        depth, tokens, pool = (scrape.value(f"pdserve_prefill_{k}")
                               for k in ("queue_depth", "queue_tokens", "pool_size"))
        queue = (f"prefill queue (as {live[0].worker_id} sees it): depth {_num(depth)}, {_num(tokens)} tokens "
                 f"queued; prefill pool {_num(pool)}")
    else:
        queue = "prefill queue: unknown (no decode worker's /metrics answered)"
    routes: dict[tuple[str, ...], float] = {}
    fallbacks: dict[tuple[str, ...], float] = {}
    for w in decode:
        sp = w.span(WINDOW_S)
        if sp is None:
            continue
        for k, n in sp.increase("pdserve_router_decisions_total", "route", "reason").items():
            routes[k] = routes.get(k, 0.0) + n
        for k, n in sp.increase("pdserve_remote_prefill_fallbacks_total", "reason").items():
            key = ("remote->local", *k)
            fallbacks[key] = fallbacks.get(key, 0.0) + n
    return [queue, f"routes, last 60 s: {_counts(routes)}", f"fallbacks, last 60 s: {_counts(fallbacks)}"]


def frame(header: Header, workers: list[Worker], now: float | None = None) -> list[str]:
    """The lines of one frame."""
    clock = time.strftime("%H:%M:%S", time.localtime(time.time() if now is None else now))
    lines = [f"pdserve top  (q quits)  {clock}  cluster {header.cluster}  every {header.interval_s:g} s  "
             f"etcd {','.join(header.etcd)}"]
    if header.etcd_error:
        lines.append(f"etcd did not answer: {header.etcd_error} (the workers as last read)")
    lines += ["", _row([c for c, _ in COLUMNS])]
    for w in sorted(workers, key=lambda w: (w.role != "decode", w.worker_id)):
        lines.append(worker_row(w))
        if w.error is not None:
            lines.append(f"  {w.worker_id}: /metrics {w.url or '(none in its record)'}: {w.error}")
    if not workers:
        lines.append("  (no worker registered in etcd)")
    decode = sorted((w for w in workers if w.role == "decode"), key=lambda w: w.worker_id)
    lines += ["", *queue_and_route_lines(decode), "", *latency_lines(decode)]
    return lines
