"""Load generator: send a workload to decode workers over gRPC and time every token.

Arrivals follow vLLM's `bench serve`: inter-arrival gaps are drawn from a
gamma distribution with shape ``burstiness`` and mean ``1 / request_rate``
(burstiness 1 = Poisson; < 1 burstier; > 1 more regular); a rate of ``inf``
releases every request at once, and ``max_concurrency`` caps the requests in
flight (``inf`` rate + a cap = a fixed-concurrency closed loop). A run is
bounded by the number of requests and, optionally, by ``duration_s`` (no
arrival after it) and ``drain_timeout_s`` (requests still running that long
after the last arrival are cancelled and count as failed).

Requests go round-robin over the targets (every decode worker is an ingress).
Each one is streamed, so TTFT and inter-token gaps are measured on the
client; the final message's breakdown (route, reason, queue wait, prefill,
KV transfer) is kept with the record.
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from dataclasses import dataclass

import numpy as np

from .datasets import SampleRequest
from .metrics import RequestRecord


@dataclass
class LoadConfig:
    """How requests are released and sent (the CLI fills it)."""

    request_rate: float = math.inf  # requests/s; inf = all at once
    burstiness: float = 1.0  # gamma shape of the inter-arrival gaps; 1 = Poisson
    max_concurrency: int | None = None  # cap on requests in flight
    duration_s: float | None = None  # no arrival after this many seconds
    drain_timeout_s: float = 300.0  # after the last arrival, cancel what is still running
    request_timeout_s: float = 600.0  # gRPC deadline of one request
    seed: int = 0
    temperature: float = 0.0
    ignore_eos: bool = True  # generate exactly output_len tokens, like vLLM's random dataset
    route: str = "auto"  # auto | local | remote (routing override)
    priority: str = "normal"
    progress: bool = True


def arrival_offsets(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Release times (s from the start) of n requests: 0, then gamma gaps of mean 1/rate."""
    if not request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {request_rate}")
    if not burstiness > 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    if math.isinf(request_rate) or n <= 1:
        return np.zeros(n)
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


class Progress:
    """One self-overwriting status line on stderr (a plain line every ~10 % when not a terminal)."""

    def __init__(self, total: int, label: str = "", enabled: bool = True, stream=sys.stderr):
        self.total, self.label, self.enabled, self.stream = total, label, enabled, stream
        self.done = self.failed = self.inflight = 0
        self.t0 = time.monotonic()
        self._last = 0.0
        self._tty = hasattr(stream, "isatty") and stream.isatty()
        self._next_pct = 10

    def update(self, *, started: int = 0, finished: int = 0, failed: int = 0, was_started: bool = True) -> None:
        self.inflight += started - (finished if was_started else 0)
        self.done += finished
        self.failed += failed
        self._draw()

    def _draw(self, final: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        pct = 100 * self.done // max(1, self.total)
        if self._tty and not final and now - self._last < 0.1:
            return
        if not self._tty and (pct < self._next_pct if not final else self._next_pct > 100):
            return  # not a terminal: one line per 10 %, and the last line once
        self._last = now
        width = 30
        fill = width * self.done // max(1, self.total)
        line = (f"{self.label}[{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} done, "
                f"{self.inflight} in flight, {self.failed} failed, {now - self.t0:.1f} s")
        if self._tty:
            self.stream.write("\r" + line + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
            self._next_pct = (pct // 10 + 1) * 10
        self.stream.flush()

    def close(self) -> None:
        self._draw(final=True)


async def _send(client, rec: RequestRecord, req: SampleRequest, cfg: LoadConfig, t0: float,
                sem: asyncio.Semaphore | None, progress: Progress) -> None:
    """Stream one request and fill its record (never raises, except cancellation)."""
    import grpc

    from pdserve.api.client import breakdown_dict

    sent = False
    try:
        if sem is not None:
            await sem.acquire()
        sent = True
        progress.update(started=1)
        st = time.perf_counter()
        rec.start_s = st - t0
        last = None
        async for msg in client.stream(req.prompt, timeout_s=cfg.request_timeout_s, max_tokens=req.output_len,
                                       temperature=cfg.temperature, ignore_eos=cfg.ignore_eos, route=cfg.route,
                                       priority=cfg.priority):
            now = time.perf_counter()
            if msg.token_ids:
                if last is None:
                    rec.ttft_ms = (now - st) * 1e3
                else:
                    rec.itl_ms.append((now - last) * 1e3)
                last = now
                rec.completion_tokens += len(msg.token_ids)
            if msg.finish_reason:
                rec.finish_reason = msg.finish_reason
                rec.breakdown = breakdown_dict(msg.breakdown)
        rec.e2el_ms = (time.perf_counter() - st) * 1e3
        rec.success = bool(rec.finish_reason) and rec.ttft_ms is not None
        if not rec.success:
            rec.error = "INCOMPLETE: the stream ended without a final message"
        if rec.breakdown.get("prompt_tokens"):
            rec.prompt_len = int(rec.breakdown["prompt_tokens"])
    except grpc.aio.AioRpcError as exc:
        rec.error = f"{exc.code().name}: {exc.details()}"
    except asyncio.CancelledError:
        rec.error = "CANCELLED: still " + ("running" if sent else "waiting for a concurrency slot") + \
            " at the drain timeout"
        raise
    except Exception as exc:  # noqa: BLE001  (one broken request must not end the run; it is recorded)
        rec.error = f"CLIENT_ERROR: {exc.__class__.__name__}: {exc}"
    finally:
        rec.end_s = time.perf_counter() - t0
        if sent and sem is not None:
            sem.release()
        progress.update(finished=1, failed=0 if rec.success else 1, was_started=sent)


async def run_load(targets: list[str], requests: list[SampleRequest], cfg: LoadConfig,
                   label: str = "", offsets: np.ndarray | None = None) -> tuple[list[RequestRecord], float]:
    """Send `requests` to `targets`; returns the records of the requests released and the duration (s).

    The duration runs from the first release to the end of the last request,
    whatever its outcome (vLLM's `benchmark_duration`). `offsets`: release times (s)
    to use instead of the config's arrival process (a trace whose rate changes).
    """
    from pdserve.api import AsyncClient

    if not targets:
        raise ValueError("no target: give --target HOST:PORT or --topology FILE of a running cluster")
    if cfg.max_concurrency is not None and cfg.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {cfg.max_concurrency}")
    if offsets is None:
        offsets = arrival_offsets(len(requests), cfg.request_rate, cfg.burstiness, cfg.seed)
    offsets = np.asarray(offsets)[:len(requests)]
    if cfg.duration_s is not None:
        offsets = offsets[offsets <= cfg.duration_s]
    n = len(offsets)
    clients = [AsyncClient(t, timeout_s=cfg.request_timeout_s) for t in targets]
    sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    progress = Progress(n, label, cfg.progress)
    records = [RequestRecord(index=i, kind=req.kind, prompt_len=req.prompt_len, output_len=req.output_len,
                             target=targets[i % len(targets)], scheduled_s=float(offsets[i]))
               for i, req in enumerate(requests[:n])]
    tasks = []
    t0 = time.perf_counter()
    try:
        for i in range(n):
            delay = t0 + offsets[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_send(clients[i % len(clients)], records[i], requests[i], cfg, t0,
                                                   sem, progress)))
        done, pending = await asyncio.wait(tasks, timeout=cfg.drain_timeout_s) if tasks else (set(), set())
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        for rec in records:
            if not rec.success and not rec.error:  # cancelled before its task ever ran
                rec.error, rec.end_s = "CANCELLED: never sent", time.perf_counter() - t0
    finally:
        progress.close()
        for c in clients:
            await c.close()
    duration = max((r.end_s for r in records), default=time.perf_counter() - t0)
    return records, duration


def model_info(target: str, timeout_s: float = 30.0) -> dict:
    """The served model's card (id, max_model_len, vocab_size) from one decode worker."""
    from pdserve.api import Client

    with Client(target, timeout_s=timeout_s) as c:
        c.wait_ready(timeout_s)
        models = c.list_models()
    if not models:
        raise RuntimeError(f"{target} serves no model")
    return models[0]
