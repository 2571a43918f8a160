"""Admission: admit, refuse (with the predicted TTFT and a retry hint) or
admit degraded. docs/router.md (``qos`` keys); exact rules in ``admit``'s docstring.

Admission predicts the TTFT of the route the router would pick for the
request now (it calls ``decide``), so QoS and routing never disagree about
what a request will cost. The decode worker admits before its prefix-cache
lookup, so ``cached_len`` may still be 0 here: the prediction is then
conservative, and the worker decides again once it knows ``cached_len``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from pdserve.common import Priority
from pdserve.router.decide import decide
from pdserve.router.policy import QosPolicy, RouterPolicy
from pdserve.router.values import ClusterSnapshot, Decision, RequestFeatures


class Admission(NamedTuple):
    """The answer to "may this request in?".

    ``reason`` is a stable code for metrics labels, ``detail`` the message a
    refused client sees (it carries the predicted TTFT). ``max_tokens`` is
    the limit to run the request with (lowered when ``degraded``).
    ``retry_after_ms`` is set on refusals. ``preempt_low_priority`` asks the
    scheduler to let this high-priority request jump queued low-priority work.
    An immutable NamedTuple, like ``Decision``.
    """

    ok: bool
    reason: str
    detail: str
    predicted_ttft_ms: float
    max_tokens: int | None
    degraded: bool
    retry_after_ms: int | None
    preempt_low_priority: bool
    decision: Decision


def admit(features: RequestFeatures, snapshot: ClusterSnapshot, policy: RouterPolicy) -> Admission:
    """Admit or refuse one request.

    With P the predicted TTFT of the route ``decide`` picks and W its
    predicted queue wait (time before this request's own prefill starts):

    1. ``high`` priority is always admitted (``high_priority``); when P is
       over its SLO it is flagged ``preempt_low_priority``.
    2. ``enable_early_rejection: false`` admits everything else.
    3. W > ``max_queue_wait_ms`` refuses ``normal`` and ``low``
       (``queue_wait_exceeded``); so does a prompt whose uncached tokens, with the
       local prompts already waiting, exceed the KV pool's free token slots while
       streams are decoding (``kv_pool_full``, when ``reject_when_kv_full``): it
       could only run by preempting them.
    4. ``low``: refused when P > ``low_priority_threshold_ms``, or > the
       request's own ``ttft_slo_ms`` when it set one and
       ``reject_on_slo_violation`` is on (``low_priority_ttft``).
    5. ``normal``: refused when ``reject_on_slo_violation`` is on and P > the
       request's ``ttft_slo_ms`` (else ``qos.ttft_slo_ms``) (``ttft_slo``).
    6. Otherwise admitted. An admitted ``low`` request is degraded to
       ``degrade.low_priority_max_tokens`` while the worker is under pressure:
       the decode step EMA is over ``tpot_slo_ms`` or P is over the TTFT SLO.

    Comparisons are strict: a prediction equal to its limit is admitted.
    The retry hint is the excess over the limit, rounded up to whole ms: how
    long the backlog needs to drain that much, assuming no new arrivals.
    """
    q = policy.qos
    decision = decide(features, snapshot, policy)
    ttft = decision.predicted_ttft_ms
    slo = features.ttft_slo_ms if features.ttft_slo_ms is not None else q.ttft_slo_ms

    if features.priority is Priority.HIGH:
        preempt = ttft > slo
        note = "; may preempt queued low-priority work" if preempt else ""
        return Admission(
            True, "high_priority", f"high priority is always admitted (predicted TTFT {ttft:.0f} ms){note}",
            ttft, features.max_tokens, False, None, preempt, decision,
        )

    if q.enable_early_rejection:
        wait = decision.predicted_queue_wait_ms
        if wait > q.max_queue_wait_ms:
            return _refuse(
                "queue_wait_exceeded",
                f"predicted queue wait {wait:.0f} ms exceeds max_queue_wait_ms {q.max_queue_wait_ms:g} "
                f"(predicted TTFT {ttft:.0f} ms)",
                wait - q.max_queue_wait_ms, features, decision,
            )
        free = snapshot.kv_free_tokens
        need = features.eff_len + snapshot.local_prefill_queue_tokens
        if q.reject_when_kv_full and free is not None and need > free and snapshot.decode_active_requests:
            return _refuse(
                "kv_pool_full",
                f"the KV pool has {free} free token slots; this prompt needs {features.eff_len} beside "
                f"{snapshot.local_prefill_queue_tokens} waiting (predicted TTFT {ttft:.0f} ms)",
                max(ttft, snapshot.costs.decode_step_ms), features, decision,
            )
        limit, label = _ttft_limit(features, q)
        if limit is not None and ttft > limit:
            code = "low_priority_ttft" if features.priority is Priority.LOW else "ttft_slo"
            return _refuse(
                code, f"predicted TTFT {ttft:.0f} ms exceeds {label} {limit:g} ms",
                ttft - limit, features, decision,
            )

    max_tokens, degraded = _degrade(features, snapshot, q, ttft, slo)
    detail = f"admitted (predicted TTFT {ttft:.0f} ms)"
    if degraded:
        detail += f"; low priority under pressure: max_tokens capped at {max_tokens}"
    return Admission(
        True, "admitted_degraded" if degraded else "admitted", detail,
        ttft, max_tokens, degraded, None, False, decision,
    )


class TokenLimit(NamedTuple):
    """The tokens one tenant may claim on a worker (``qos.max_tokens_per_tenant``) and where
    that number comes from, as a refusal names it."""

    tokens: int
    source: str


# qos.max_tokens_per_tenant null: this many times the worker's KV pool. One pool's worth running
# and several more queued (vLLM queues whatever one client sends; a single-client benchmark that
# overloads a worker on purpose must meet the same queue here, not 429s), while a call or a client
# claiming more than eight pools at once (128 sequences with a large max_tokens) is refused
# instead of preempting everyone's sequences for minutes.
DEFAULT_TENANT_POOLS = 8


def tenant_token_limit(q: QosPolicy, kv_pool_tokens: int | None) -> TokenLimit | None:
    """``qos.max_tokens_per_tenant``; when it is null, DEFAULT_TENANT_POOLS x the worker's KV
    pool (its token slots, ``kv_pool_tokens``); None when that is not known either (no bound)."""
    if q.max_tokens_per_tenant is not None:
        return TokenLimit(q.max_tokens_per_tenant, f"qos.max_tokens_per_tenant {q.max_tokens_per_tenant}")
    if kv_pool_tokens is None:
        return None
    return TokenLimit(DEFAULT_TENANT_POOLS * kv_pool_tokens,
                      f"qos.max_tokens_per_tenant null: {DEFAULT_TENANT_POOLS} x this worker's KV pool of "
                      f"{kv_pool_tokens} tokens")


class TokenShare(NamedTuple):
    """The answer to "may this tenant's call claim these tokens?" ``retry_after_ms`` is set
    when waiting can help (the tenant's own calls in flight hold the rest); a call that
    claims more than the limit alone gets none: it must ask for less."""

    ok: bool
    detail: str
    retry_after_ms: int | None


# A tenant's claims end with its calls; when, nothing here knows (the per-key sequence share,
# api/surface.py, gives the same hint).
TENANT_RETRY_AFTER_MS = 1000


def admit_tenant_tokens(held: int, claim: int, limit: TokenLimit, what: str = "") -> TokenShare:
    """May a call claiming ``claim`` tokens (its prompts + max_tokens of each of its
    sequences; ``what`` says how they add up) start while its tenant's calls in flight claim
    ``held``? Admitted when held + claim <= the limit (equal is admitted, as in ``admit``)."""
    if held + claim <= limit.tokens:
        return TokenShare(True, "admitted", None)
    claims = f"this call claims {claim} tokens" + (f" ({what})" if what else "")
    if claim > limit.tokens:
        return TokenShare(False, f"{claims}, more than the {limit.tokens} one tenant may claim on this worker "
                          f"({limit.source}); lower max_tokens or send fewer sequences (n, prompts)", None)
    return TokenShare(False, f"{claims} beside the {held} its tenant's calls in flight claim, over the "
                      f"{limit.tokens} one tenant may claim on this worker ({limit.source}); wait for some to "
                      f"finish or lower max_tokens; retry in ~{TENANT_RETRY_AFTER_MS} ms", TENANT_RETRY_AFTER_MS)


def _ttft_limit(features: RequestFeatures, q: QosPolicy) -> tuple[float | None, str]:
    own = features.ttft_slo_ms if q.reject_on_slo_violation else None
    if features.priority is Priority.LOW:
        if own is not None and own < q.low_priority_threshold_ms:
            return own, "the request's ttft_slo_ms"
        return q.low_priority_threshold_ms, "low_priority_threshold_ms"
    if not q.reject_on_slo_violation:
        return None, ""
    if own is not None:
        return own, "the request's ttft_slo_ms"
    return q.ttft_slo_ms, "qos.ttft_slo_ms"


def _degrade(
    features: RequestFeatures, snapshot: ClusterSnapshot, q: QosPolicy, ttft: float, slo: float
) -> tuple[int | None, bool]:
    cap = q.degrade.low_priority_max_tokens
    if features.priority is not Priority.LOW or cap is None:
        return features.max_tokens, False
    under_pressure = snapshot.costs.decode_step_ms > q.tpot_slo_ms or ttft > slo
    if not under_pressure or (features.max_tokens is not None and features.max_tokens <= cap):
        return features.max_tokens, False
    return cap, True


def _refuse(
    reason: str, detail: str, excess_ms: float, features: RequestFeatures, decision: Decision
) -> Admission:
    retry_ms = max(1, math.ceil(excess_ms))
    return Admission(
        False, reason, f"{detail}; retry in ~{retry_ms} ms",
        decision.predicted_ttft_ms, features.max_tokens, False, retry_ms, False, decision,
    )
