"""The threshold and score policies of the offload decision (docs/router.md, ``policy:
threshold`` and ``policy: score``), and the high-priority queue bypass they share with the
cost model. Pure functions; router/decide.py applies them in its precedence.
"""

from __future__ import annotations

from pdserve.common import Priority
from pdserve.router.policy import RouterPolicy
from pdserve.router.values import ClusterSnapshot, RequestFeatures, Route

# Score sums are compared after rounding to this many decimals, so that
# 0.1 + 0.2 "equals" 0.3 and a tie is a tie (ties stay local).
SCORE_DECIMALS = 9

# What each rule returns: (route, reason code, human detail, score).
Routed = tuple[Route, str, str, float | None]


def bypasses_queue(features: RequestFeatures, policy: RouterPolicy) -> bool:
    """Whether this request ignores the prefill queue (high-priority override)."""
    return features.priority is Priority.HIGH and policy.router.overrides.high_priority_bypass_queue


def threshold_rule(features, snapshot, policy, trace) -> Routed:
    t = policy.router.threshold
    eff = features.eff_len
    depth = 0 if bypasses_queue(features, policy) else snapshot.prefill_queue_depth
    long_prompt = eff >= t.prefill_length_threshold
    queue_ok = depth < t.prefill_queue_max
    if trace is not None:
        trace.append(f"eff_len {eff} >= prefill_length_threshold {t.prefill_length_threshold}: {long_prompt}")
        trace.append(f"prefill_queue_depth {depth} < prefill_queue_max {t.prefill_queue_max}: {queue_ok}")
    if long_prompt and queue_ok:
        return "remote", "threshold_long_prompt", (
            f"eff_len {eff} >= {t.prefill_length_threshold} and queue depth {depth} < {t.prefill_queue_max}"
        ), None
    active = snapshot.decode_active_requests
    busy = active >= t.decode_load_threshold and eff >= t.busy_min_length
    if trace is not None:
        trace.append(
            f"decode_active_requests {active} >= decode_load_threshold {t.decode_load_threshold} "
            f"and eff_len {eff} >= busy_min_length {t.busy_min_length}: {busy}"
        )
    if busy:
        return "remote", "threshold_decode_busy", (
            f"decode busy ({active} active >= {t.decode_load_threshold}) "
            f"and eff_len {eff} >= {t.busy_min_length}"
        ), None
    if long_prompt:
        return "local", "threshold_queue_full", f"prefill queue depth {depth} >= {t.prefill_queue_max}", None
    return "local", "threshold_short_prompt", f"eff_len {eff} < {t.prefill_length_threshold}", None


def score_metric(name: str, features: RequestFeatures, snapshot: ClusterSnapshot, bypass: bool) -> float:
    """The value of one score metric (the list in docs/router.md, policy ``score``)."""
    if name == "prefill_length":
        return features.eff_len
    if name == "prompt_length":
        return features.prompt_len
    if name == "prefix_hit_ratio":
        if features.prompt_len == 0:
            return 0.0
        return min(features.cached_len, features.prompt_len) / features.prompt_len
    if name == "prefill_queue_depth":
        return 0 if bypass else snapshot.prefill_queue_depth
    if name == "prefill_queue_tokens":
        return 0 if bypass else snapshot.prefill_queue_tokens
    if name == "decode_active_requests":
        return snapshot.decode_active_requests
    if name == "decode_kv_usage":
        return snapshot.decode_kv_usage
    if name == "prefill_pool_size":
        return snapshot.prefill_pool_size
    raise ValueError(f"unknown score metric {name!r}")


def score_rule(features, snapshot, policy, trace) -> Routed:
    s = policy.router.disaggregated_router
    if not s.enable:
        return "local", "score_disabled", "disaggregated_router.enable is false", None
    bypass = bypasses_queue(features, policy)
    total = 0.0
    for rule in s.policies:
        value = score_metric(rule.metric, features, snapshot, bypass)
        fired = value >= rule.threshold
        if fired:
            total += rule.weight if rule.action == "prefer_remote" else -rule.weight
        if trace is not None:
            sign = "+" if rule.action == "prefer_remote" else "-"
            vote = f"{sign}{rule.weight:g}" if fired else "0"
            trace.append(f"{rule.metric} {value:g} >= {rule.threshold:g}: {fired} -> {vote}")
    total = round(total, SCORE_DECIMALS)
    if total > s.remote_prefill_min_score:
        return "remote", "score_above_min", f"score {total:g} > {s.remote_prefill_min_score:g}", total
    return "local", "score_below_min", f"score {total:g} <= {s.remote_prefill_min_score:g}", total
