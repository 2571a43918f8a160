"""What a simulated run measured, in the terms of `vllm bench serve`.

TTFT, TPOT (per request: ``(e2e - TTFT) / (tokens - 1)``), ITL (every gap between two tokens
of a stream) and E2E percentiles over the completed requests; goodput is the completed
requests that met every SLO given (``ttft_ms``, ``tpot_ms``) per second of the run, as vLLM's
``--goodput`` counts it; a refused request is not completed. Also: each role's utilisation
(engine busy time over the run), queue depth over time, the router's routes and reasons, the
admission's refusals, and how far the router's predicted TTFT was from the simulated one
(median absolute error per route).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100), linear between ranks, as numpy's default."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


@dataclass(frozen=True)
class Slo:
    ttft_ms: float | None = None
    tpot_ms: float | None = None


def mean_step_ms(sim, kind: str = "decode") -> float | None:
    """The decode workers' mean engine step of ``kind`` (ms): "decode" (no prompt tokens) or
    "mixed", as their cost models time it (the real workers' pdserve_engine_step_seconds)."""
    workers = sim.workers("decode")
    n = sum(d.counts[f"{kind}_steps"] for d in workers)
    return sum(d.counts[f"{kind}_ms"] for d in workers) / n if n else None


def summarize(sim, slo: Slo = Slo()) -> dict:
    """The figures of a finished `Simulation` (sim/cluster.py)."""
    recs = sim.records
    done = [r for r in recs if r.finished is not None]
    end = max([r.finished for r in done] + [r.arrival for r in recs] + [0.0])
    duration = end if end > 0 else 1e-9
    ttft = [(r.first_token - r.arrival) * 1e3 for r in done]
    tpot = [((r.finished - r.first_token) * 1e3 / (r.tokens - 1)) if r.tokens > 1 else 0.0 for r in done]
    e2e = [(r.finished - r.arrival) * 1e3 for r in done]
    good = 0
    for t1, t2 in zip(ttft, tpot):
        if (slo.ttft_ms is None or t1 <= slo.ttft_ms) and (slo.tpot_ms is None or t2 <= slo.tpot_ms):
            good += 1
    routes = Counter(r.route for r in recs if r.refused is None)
    reasons = Counter(r.reason for r in recs if r.refused is None)
    refused = Counter(r.refused for r in recs if r.refused is not None)
    errors: dict[str, list[float]] = {"local": [], "remote": []}
    for r in done:
        if r.predicted_ttft_ms > 0 and not r.fell_back and r.route in errors:
            measured = (r.first_token - r.arrival) * 1e3
            errors[r.route].append(abs(r.predicted_ttft_ms - measured) / max(measured, 1e-9))

    def stats(xs):
        return {"mean": round(sum(xs) / len(xs), 2) if xs else None,
                **{f"p{q}": _r(percentile(xs, q)) for q in (50, 90, 99)}}

    def utilization(role):
        ws = sim.workers(role)
        span = sum((w.ended_at if w.ended_at is not None else duration) - w.started_at for w in ws)
        return round(sum(w.engine.busy_ms for w in ws) / 1e3 / span, 3) if ws and span > 0 else None

    depth = [s["queue_depth"] for s in sim.samples]
    return {
        "topology": sim.topology.label,
        "requests": len(recs), "completed": len(done), "refused": dict(refused),
        "duration_s": round(duration, 3),
        "goodput_req_s": round(good / duration, 4), "good": good,
        "throughput_req_s": round(len(done) / duration, 4),
        "output_tokens_s": round(sum(r.tokens for r in done) / duration, 1),
        "ttft_ms": stats(ttft), "tpot_ms": stats(tpot), "itl_ms": stats(sim.itls_ms), "e2e_ms": stats(e2e),
        "routes": dict(routes), "reasons": dict(reasons),
        "prediction_error_median": {k: _r(percentile(v, 50), 3) for k, v in errors.items() if v},
        "utilization": {"decode": utilization("decode"), "prefill": utilization("prefill")},
        "queue_depth": {"max": max(depth, default=0), "mean": round(sum(depth) / len(depth), 2) if depth else 0},
        "events": sim.events,
    }


def _r(x: float | None, nd: int = 2) -> float | None:
    return None if x is None else round(x, nd)


def table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """A Markdown table of ``rows`` (dicts) with ``columns`` (title, dotted key)."""
    def get(row, key):
        v = row
        for part in key.split("."):
            v = v.get(part) if isinstance(v, dict) else None
        return "" if v is None else (f"{v:g}" if isinstance(v, float) else str(v))
    head = "| " + " | ".join(t for t, _ in columns) + " |"
    rule = "|" + "---|" * len(columns)
    body = ["| " + " | ".join(get(r, k) for _, k in columns) + " |" for r in rows]
    return "\n".join([head, rule, *body])
