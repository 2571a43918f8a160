"""What a finished request reports and teaches: its breakdown, and the TTFT prediction check.

`breakdown` builds the per-request breakdown the final chunk carries (route, reason, the
predicted TTFT of both routes, queue wait, prefill, transfer, sizes) and feeds the
worker's per-request histograms. `check_prediction` compares the route's predicted TTFT
with the measured one (the ratio histogram, a log line when off by more than 2x) and
feeds the cost model's residual (router/costs.py).
"""

from __future__ import annotations

import logging

from .final_info import FinalInfo
from .ingress import Prepared
from .metrics import WorkerMetrics
from .policy_state import PolicyState

log = logging.getLogger(__name__)


def check_prediction(prep: Prepared, went_remote: bool, extra: dict, measured_ms: float, metrics: WorkerMetrics,
                     policy: PolicyState) -> None:
    """Compare the route's predicted TTFT with the measured one: the ratio histogram, a log
    line when it is off by more than 2x, and the route's residual (router/costs.py). The local
    residual learns from prompts admitted with no local backlog only: what the step formula
    leaves out (the API, the first token's delivery), not how a queue happened to drain."""
    d = prep.decision
    route = "remote" if went_remote else "local"
    if route != d.route or extra.get("fell_back_to_local") or len(prep.prompt_ids) <= prep.cached_len:
        return  # not the route that was predicted, or nothing to prefill: no lesson in it
    predicted = d.predicted_ttft_ms
    if predicted <= 0:
        return
    ratio = measured_ms / predicted
    metrics.ttft_prediction(route, ratio)
    if not 0.5 <= ratio <= 2.0:
        log.info("TTFT prediction off %.1fx: route %s predicted %.0f ms, measured %.0f ms "
                 "(prompt %d tokens, %d cached; %s)", ratio, route, predicted, measured_ms,
                 len(prep.prompt_ids), prep.cached_len, d.detail)
    if route == "local" and prep.local_backlog:
        return  # behind a backlog the error is the backlog's (its drain is measured apart, router/costs.py)
    formula = predicted - prep.residual_ms
    outlier = policy.policy.router.cost_model.ema_outlier_factor
    if formula > 0:  # one pathological request (a fault, a stall) moves the residual little
        measured_ms = min(max(measured_ms, formula / outlier), formula * outlier)
    policy.costs.observe_ttft(route, measured_ms, formula)


def breakdown(prep: Prepared, final: FinalInfo | None, extra: dict, now: float, worker_id: str,
              metrics: WorkerMetrics) -> dict:
    """The request's final breakdown (route, reason, predictions, timings, sizes), and the
    per-request histograms it feeds."""
    d = prep.decision
    b = {
        "route": extra.get("route", d.route), "reason": extra.get("reason", f"{d.reason}: {d.detail}"),
        "score": d.score or 0.0, "predicted_ttft_local_ms": d.predicted_ttft_local_ms,
        "predicted_ttft_remote_ms": d.predicted_ttft_remote_ms,
        "e2e_ms": (now - prep.arrival) * 1e3, "worker_id": worker_id,
        "prompt_tokens": len(prep.prompt_ids), "cached_tokens": prep.cached_len,
    }
    for k in ("transfer_ms", "transfer_bytes", "prefill_worker", "attempts", "fell_back_to_local",
              "queue_wait_ms", "prefill_ms"):
        if k in extra:
            b[k] = extra[k]
    if final is not None:
        # The whole completion (a resumed request's count includes what it resumed after: the
        # client's usage); this worker's own tokens feed its histograms and counters.
        b["completion_tokens"] = final.completion_tokens
        generated = final.completion_tokens - len(prep.inp.resume_ids or ())
        if final.first_token_time is not None:
            b["ttft_ms"] = (final.first_token_time - prep.arrival) * 1e3
            b.setdefault("queue_wait_ms", ((final.first_scheduled_time or final.first_token_time) - prep.arrival) * 1e3)
            if final.first_scheduled_time is not None:
                b.setdefault("prefill_ms", (final.first_token_time - final.first_scheduled_time) * 1e3)
            metrics.queue_wait.observe(b["queue_wait_ms"] / 1e3)
            if generated > 1:
                metrics.tpot.observe((final.finish_time - final.first_token_time) / (generated - 1))
        if final.spec_tokens is not None:  # speculative decoding on (docs/speculative.md)
            b["spec_draft_tokens"], b["spec_accepted_tokens"] = final.spec_tokens
        metrics.generation_tokens.inc(generated)
        metrics.prefix_hit_tokens.inc(final.cached_tokens)
    metrics.e2e.observe(now - prep.arrival)
    return b
