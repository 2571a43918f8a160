"""What a worker publishes as the `load` of its etcd record, and how it measures it.

The planner (cluster/planner/) and `pdserve status` read these keys; the workers
write them every `load_report_s` through `join.publish_load`. Cumulative figures
(`*_s`, counts, token totals) let a reader compute rates over its own interval;
windowed figures (`busy`, latency percentiles) describe the last `WINDOW_S`.

    both roles   t               wall-clock time of this reading (rates are timed by it)
                 busy            fraction of the window the engine was working (0-1)
                 busy_s          cumulative seconds of work
                 kv_usage        fraction of KV blocks in use (0-1)
                 gpu_util        the GPU's utilisation as NVML reports it (0-1); only on a
                                 CUDA device where NVML answers
                 inflight        requests (decode) or tasks (prefill) held now
    prefill      tokens          cumulative prompt tokens computed
                 tasks           cumulative tasks served
    decode       running, waiting            the engine's scheduler queues now
                 requests        cumulative requests that got their first token
                 prompt_tokens, output_tokens   cumulative
                 decode_steps, decode_ms, decode_seqs   cumulative over decode-only steps
                                 (mean step time and batch size from their deltas)
                 ttft_p50_ms, ttft_p90_ms, itl_p50_ms, itl_p90_ms   over the window;
                                 absent while the window saw no sample

Dependency-free apart from what a histogram's `collect()` returns, so both roles
and the control plane can use it.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable

WINDOW_S = 60.0  # the window of the windowed figures


class Windowed:
    """Deltas of cumulative readings over the last `window_s`: keeps one reading per call
    to `add` and compares the newest with the oldest still inside the window."""

    def __init__(self, window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self.clock = clock
        self._readings: deque[tuple[float, Any]] = deque()  # (time, a reading of the caller's kind)

    def add(self, reading) -> tuple[float, Any, Any] | None:
        """Record `reading`; return (seconds spanned, oldest reading, newest) or None."""
        now = self.clock()
        self._readings.append((now, reading))
        while len(self._readings) > 2 and now - self._readings[1][0] >= self.window_s:
            self._readings.popleft()
        t0, first = self._readings[0]
        if now - t0 <= 0:
            return None
        return now - t0, first, reading


class BusyMeter:
    """Cumulative busy time of an engine loop, and its busy fraction over the window."""

    def __init__(self, window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic):
        self.busy_s = 0.0
        self._window = Windowed(window_s, clock)

    def add(self, seconds: float) -> None:
        self.busy_s += max(0.0, seconds)

    def snapshot(self) -> dict:
        span = self._window.add(self.busy_s)
        busy = 0.0 if span is None else min(1.0, max(0.0, (span[2] - span[1]) / span[0]))
        return {"t": round(time.time(), 3), "busy": round(busy, 4), "busy_s": round(self.busy_s, 3)}


def histogram_buckets(hist) -> list[tuple[float, float]]:
    """(upper bound, cumulative count) of a prometheus_client histogram (a labelled child)."""
    out = []
    for family in hist.collect():
        for s in family.samples:
            if s.name.endswith("_bucket"):
                out.append((float(s.labels["le"]), s.value))
    return out


def quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """The q-quantile of cumulative (upper bound, count) buckets, interpolated linearly
    inside its bucket (Prometheus's histogram_quantile); None without samples. A quantile
    in the +Inf bucket is reported as the highest finite bound."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return lower
            width = count - below
            return lower + (bound - lower) * ((rank - below) / width if width > 0 else 1.0)
        lower, below = bound, count
    return lower


class LatencyWindow:
    """Windowed percentiles of a cumulative histogram, from its bucket deltas."""

    def __init__(self, hist, window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic):
        self.hist = hist
        self._window = Windowed(window_s, clock)

    def percentiles_ms(self, name: str, qs=(0.5, 0.9)) -> dict:
        span = self._window.add(histogram_buckets(self.hist))
        if span is None:
            return {}
        old = dict(span[1])
        delta = [(le, count - old.get(le, 0.0)) for le, count in span[2]]
        out = {}
        for q in qs:
            v = quantile(delta, q)
            if v is not None:
                out[f"{name}_p{int(q * 100)}_ms"] = round(v * 1e3, 2)
        return out


def counter_value(counter) -> float:
    """The value of a prometheus_client counter (a labelled child)."""
    for family in counter.collect():
        for s in family.samples:
            if s.name.endswith("_total"):
                return s.value
    return 0.0


def gpu_load(device) -> dict:
    """{"gpu_util": 0-1} for a CUDA `device` whose utilisation NVML reports (through
    torch.cuda.utilization, which needs the nvidia-ml-py package); {} anywhere else."""
    try:
        import torch

        dev = torch.device(device)
        if dev.type != "cuda" or not torch.cuda.is_available():
            return {}
        return {"gpu_util": round(torch.cuda.utilization(dev) / 100.0, 4)}
    except Exception:  # noqa: BLE001  (no NVML, no driver: the busy fraction stands in)
        return {}
