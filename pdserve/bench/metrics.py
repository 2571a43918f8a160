"""Serving metrics of one benchmark run, from the per-request records.

Field names follow vLLM's `bench serve` JSON where the meaning is the same
(`request_throughput`, `output_throughput`, `mean_ttft_ms`, `median_ttft_ms`,
`p99_ttft_ms`, `mean_tpot_ms`, `mean_itl_ms`, `mean_e2el_ms`, `completed`,
`total_input_tokens`, `total_output_tokens`, `request_goodput`, ...), and the
definitions are vLLM's too:

- TTFT: request sent -> first token received, on the client.
- TPOT: (E2E - TTFT) / (output tokens - 1), per request with > 1 token.
- ITL: the gap between consecutive streamed messages that carry tokens.
- E2EL: request sent -> last message received.
- Percentiles: numpy's default (linear interpolation).
- Goodput: completed requests per second that meet every SLO given with
  ``--goodput ttft:MS tpot:MS e2el:MS`` (a one-token request has TPOT 0).

pdserve adds `request_goodput_per_worker` (goodput divided by the worker count:
per GPU when each worker holds one),
`slo_attainment` (good / sent), the route mix and handoff breakdown from each
request's final breakdown, and the same figures per request kind.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

SLO_METRICS = ("ttft", "tpot", "e2el")
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)
# Breakdown fields summarised per route (the handoff: where a request's TTFT went).
REMOTE_PARTS = ("queue_wait_ms", "prefill_ms", "transfer_ms", "ttft_ms", "transfer_bytes")
LOCAL_PARTS = ("queue_wait_ms", "prefill_ms", "ttft_ms")


@dataclass
class RequestRecord:
    """What the client saw of one request (times in ms; `start_s` from the run's start)."""

    index: int
    kind: str
    prompt_len: int  # tokens, the server's count when it sent one
    output_len: int  # tokens asked for
    target: str = ""
    scheduled_s: float = 0.0  # when the arrival process released it
    start_s: float = 0.0  # when it was sent (later than scheduled under --max-concurrency)
    end_s: float = 0.0  # when it ended: last message, error or cancellation
    success: bool = False
    error: str = ""
    ttft_ms: float | None = None
    e2el_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    finish_reason: str = ""
    breakdown: dict = field(default_factory=dict)

    @property
    def tpot_ms(self) -> float | None:
        """vLLM's TPOT; None for a failed or one-token request."""
        if not self.success or self.completion_tokens < 2 or self.ttft_ms is None or self.e2el_ms is None:
            return None
        return (self.e2el_ms - self.ttft_ms) / (self.completion_tokens - 1)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["tpot_ms"] = self.tpot_ms
        return d


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"--goodput {item!r}: use NAME:MS with NAME one of {', '.join(SLO_METRICS)}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if not ms > 0:
            raise ValueError(f"--goodput {item!r}: the SLO must be > 0 ms")
        slos[name] = ms
    return slos


def meets_slos(rec: RequestRecord, slos: dict[str, float]) -> bool:
    """A completed request whose TTFT, TPOT and E2E latency are each within its SLO (<=)."""
    if not rec.success:
        return False
    values = {"ttft": rec.ttft_ms, "tpot": rec.tpot_ms or 0.0, "e2el": rec.e2el_ms}
    return all(values[name] is not None and values[name] <= limit for name, limit in slos.items())


def percentile_key(p: float) -> str:
    """vLLM's spelling: 99 -> "p99", 99.9 -> "p99.9"."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def latency_stats(values: list[float], name: str, percentiles) -> dict:
    """mean/median/std and the percentiles of one metric, in ms (None when there is no sample)."""
    arr = np.asarray(values, dtype=float)
    empty = arr.size == 0
    out = {
        f"mean_{name}_ms": None if empty else float(arr.mean()),
        f"median_{name}_ms": None if empty else float(np.median(arr)),
        f"std_{name}_ms": None if empty else float(arr.std()),
    }
    for p in percentiles:
        out[f"{percentile_key(p)}_{name}_ms"] = None if empty else float(np.percentile(arr, p))
    return out


def samples(records: list[RequestRecord]) -> dict[str, list[float]]:
    """The raw latency samples of the completed requests, per metric."""
    ok = [r for r in records if r.success]
    return {
        "ttft": [r.ttft_ms for r in ok if r.ttft_ms is not None],
        "tpot": [r.tpot_ms for r in ok if r.tpot_ms is not None],
        "itl": [x for r in ok for x in r.itl_ms],
        "e2el": [r.e2el_ms for r in ok if r.e2el_ms is not None],
    }


def route_mix(records: list[RequestRecord]) -> dict:
    """How the router sent the completed requests, and why (reason codes counted)."""
    ok = [r for r in records if r.success and r.breakdown]
    routes: dict[str, int] = {}
    reasons: dict[str, int] = {}
    for r in ok:
        route = r.breakdown.get("route") or "unknown"
        routes[route] = routes.get(route, 0) + 1
        code = str(r.breakdown.get("reason", "")).split(":", 1)[0].strip() or "unknown"
        reasons[code] = reasons.get(code, 0) + 1
    return {
        "routes": routes,
        "remote_fraction": (routes.get("remote", 0) / len(ok)) if ok else None,
        "fell_back_to_local": sum(1 for r in ok if r.breakdown.get("fell_back_to_local")),
        "reasons": dict(sorted(reasons.items(), key=lambda kv: -kv[1])),
        "by_worker": _count(ok, lambda r: r.breakdown.get("worker_id") or r.target),
        "by_prefill_worker": _count([r for r in ok if r.breakdown.get("route") == "remote"],
                                    lambda r: r.breakdown.get("prefill_worker") or "unknown"),
    }


def _count(records, key) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in records:
        k = str(key(r))
        out[k] = out.get(k, 0) + 1
    return out


def handoff_breakdown(records: list[RequestRecord]) -> dict:
    """Mean and median of the server-side TTFT parts, per route (from the final breakdowns)."""
    out = {}
    for route, parts in (("remote", REMOTE_PARTS), ("local", LOCAL_PARTS)):
        rs = [r for r in records if r.success and r.breakdown.get("route") == route]
        summary: dict = {"count": len(rs)}
        for part in parts:
            vals = np.asarray([float(r.breakdown[part]) for r in rs if part in r.breakdown], dtype=float)
            unit = part.rsplit("_", 1)[-1]
            base = part[: -len(unit) - 1]
            summary[f"mean_{base}_{unit}"] = float(vals.mean()) if vals.size else None
            summary[f"median_{base}_{unit}"] = float(np.median(vals)) if vals.size else None
        out[route] = summary
    return out


def by_kind(records: list[RequestRecord], slos: dict[str, float], percentiles) -> dict:
    """The headline figures per request kind (short/long, group, ...)."""
    out = {}
    for kind in sorted({r.kind for r in records}):
        rs = [r for r in records if r.kind == kind]
        s = samples(rs)
        row = {"num_requests": len(rs), "completed": sum(r.success for r in rs),
               "good": sum(meets_slos(r, slos) for r in rs) if slos else None,
               "routes": _count([r for r in rs if r.success and r.breakdown], lambda r: r.breakdown.get("route"))}
        for name in ("ttft", "tpot", "e2el"):
            stats = latency_stats(s[name], name, percentiles)
            row.update({k: v for k, v in stats.items() if not k.startswith("std_")})
        out[kind] = row
    return out


def compute_metrics(records: list[RequestRecord], duration_s: float, *, slos: dict[str, float] | None = None,
                    percentiles=DEFAULT_PERCENTILES, num_workers: int | None = None) -> dict:
    """The result of one run, as a JSON-ready dict (raw samples not included: see `records_json`)."""
    slos = slos or {}
    ok = [r for r in records if r.success]
    dur = max(duration_s, 1e-9)
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.completion_tokens for r in ok)
    good = sum(meets_slos(r, slos) for r in records) if slos else None
    errors = _count([r for r in records if not r.success], lambda r: r.error.split(":", 1)[0] or "unknown")
    out = {
        "duration": duration_s,
        "num_prompts": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": errors,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / dur,
        "request_goodput": (good / dur) if slos else None,
        "request_goodput_per_worker": (good / dur / num_workers) if slos and num_workers else None,
        "good_requests": good,
        "slo_attainment": (good / len(records)) if slos and records else None,
        "goodput_slos_ms": slos,
        "output_throughput": total_out / dur,
        "total_token_throughput": (total_in + total_out) / dur,
        "percentiles": [float(p) for p in percentiles],
    }
    s = samples(records)
    for name in LATENCY_METRICS:
        out.update(latency_stats(s[name], name, percentiles))
    out["route_mix"] = route_mix(records)
    out["handoff"] = handoff_breakdown(records)
    out["by_kind"] = by_kind(records, slos, percentiles)
    return out


def json_safe(x):
    """The same document with float infinities as "inf" (JSON has no infinity)."""
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


def records_json(records: list[RequestRecord]) -> list[dict]:
    """The raw per-request samples, so any figure can be recomputed."""
    return [r.to_dict() for r in records]


def format_summary(m: dict, title: str = "Serving Benchmark Result") -> str:
    """vLLM-style text block of the headline figures."""
    pct = [percentile_key(p) for p in m["percentiles"]]
    lines = [f"{'=' * 18} {title} {'=' * 18}"]

    def row(label, value, fmt="{:.2f}"):
        lines.append(f"{label:<40}{'-' if value is None else fmt.format(value):>12}")

    row("Successful requests:", m["completed"], "{}")
    row("Failed requests:", m["failed"], "{}")
    row("Benchmark duration (s):", m["duration"])
    row("Total input tokens:", m["total_input_tokens"], "{}")
    row("Total generated tokens:", m["total_output_tokens"], "{}")
    row("Request throughput (req/s):", m["request_throughput"])
    if m["request_goodput"] is not None:
        slo = " ".join(f"{k}:{v:g}" for k, v in m["goodput_slos_ms"].items())
        row(f"Request goodput (req/s) [{slo}]:", m["request_goodput"])
        row("SLO attainment (good / sent):", m["slo_attainment"], "{:.1%}")
    row("Output token throughput (tok/s):", m["output_throughput"])
    for name, label in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append(f"{'-' * 15}{label}{'-' * 15}")
        row(f"Mean {name.upper()} (ms):", m[f"mean_{name}_ms"])
        row(f"Median {name.upper()} (ms):", m[f"median_{name}_ms"])
        for p in pct:
            row(f"{p.upper()} {name.upper()} (ms):", m[f"{p}_{name}_ms"])
    mix = m["route_mix"]
    if mix["routes"]:
        lines.append(f"{'-' * 15}Routes and handoff{'-' * 15}")
        routes = ", ".join(f"{k} {v}" for k, v in sorted(mix["routes"].items()))
        lines.append(f"{'Routes:':<40}{routes:>12}")
        row("Fell back to local:", mix["fell_back_to_local"], "{}")
        rem = m["handoff"]["remote"]
        if rem["count"]:
            row("Remote: mean queue wait (ms):", rem["mean_queue_wait_ms"])
            row("Remote: mean prefill (ms):", rem["mean_prefill_ms"])
            row("Remote: mean transfer (ms):", rem["mean_transfer_ms"])
            row("Remote: mean KV bytes:", rem["mean_transfer_bytes"], "{:.0f}")
    lines.append("=" * (len(title) + 38))
    return "\n".join(lines)
