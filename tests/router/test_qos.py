"""QoS admission (docs/router.md, `qos` keys): admit, refuse with the predicted
TTFT and a retry hint, degrade; high priority always admitted.

Most tests use mode always_local so the prediction is simple arithmetic:
TTFT = (local backlog + eff_len) x 0.1 ms + decode backlog x 1.0 ms, and the
strict, opt-in refusal of a request whose predicted TTFT misses the SLO
(``STRICT``: the defaults only refuse a long queue wait or a full KV pool).
"""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.router.qos import admit


STRICT = {"ttft_slo_ms": 500, "reject_on_slo_violation": True, "low_priority_threshold_ms": 500}


@pytest.fixture
def local(rt):
    return rt.policy(router={"mode": "always_local"}, qos=STRICT)


def test_request_predicted_within_slo_is_admitted(rt, local):
    a = admit(rt.req(1000), rt.snap(local), local)
    assert (a.ok, a.reason) == (True, "admitted")
    assert a.predicted_ttft_ms == pytest.approx(100.0)


def test_normal_request_over_slo_is_refused_with_prediction_and_retry_hint(rt, local):
    a = admit(rt.req(1000), rt.snap(local, local_prefill_queue_tokens=5000), local)
    assert (a.ok, a.reason) == (False, "ttft_slo")
    assert "predicted TTFT 600 ms exceeds qos.ttft_slo_ms 500 ms" in a.detail
    assert a.retry_after_ms == 100


def test_prediction_equal_to_the_slo_is_admitted(rt, local):
    a = admit(rt.req(1000), rt.snap(local, local_prefill_queue_tokens=4000), local)
    assert a.predicted_ttft_ms == pytest.approx(500.0)
    assert a.ok


def test_retry_hint_is_rounded_up_to_a_whole_ms(rt, local):
    a = admit(rt.req(1002), rt.snap(local, local_prefill_queue_tokens=4000), local)
    assert (a.ok, a.retry_after_ms) == (False, 1)


def test_request_slo_tighter_than_policy_refuses(rt, local):
    a = admit(rt.req(1000, ttft_slo_ms=50), rt.snap(local), local)
    assert (a.ok, a.reason) == (False, "ttft_slo")
    assert "the request's ttft_slo_ms 50" in a.detail


def test_request_slo_looser_than_policy_admits(rt, local):
    a = admit(rt.req(1000, ttft_slo_ms=1000), rt.snap(local, local_prefill_queue_tokens=5000), local)
    assert a.ok


def test_slo_violation_rejection_can_be_switched_off_for_normal_priority(rt):
    policy = rt.policy(router={"mode": "always_local"}, qos={"reject_on_slo_violation": False})
    assert admit(rt.req(1000), rt.snap(policy, local_prefill_queue_tokens=5000), policy).ok


def test_decode_backlog_counts_toward_the_prediction(rt, local):
    a = admit(rt.req(1000), rt.snap(local, decode_backlog_tokens=450), local)
    assert a.predicted_ttft_ms == pytest.approx(550.0)
    assert not a.ok


def test_low_priority_is_refused_above_its_threshold(rt):
    policy = rt.policy(
        router={"mode": "always_local"},
        qos={"low_priority_threshold_ms": 300, "reject_on_slo_violation": False},
    )
    a = admit(rt.req(1000, priority="low"), rt.snap(policy, local_prefill_queue_tokens=2500), policy)
    assert (a.ok, a.reason) == (False, "low_priority_ttft")
    assert "predicted TTFT 350 ms exceeds low_priority_threshold_ms 300" in a.detail


def test_low_priority_with_a_tight_own_slo_is_refused(rt, local):
    a = admit(rt.req(1000, priority="low", ttft_slo_ms=80), rt.snap(local), local)
    assert (a.ok, a.reason) == (False, "low_priority_ttft")


def test_low_priority_below_its_threshold_is_admitted(rt, local):
    assert admit(rt.req(1000, priority="low"), rt.snap(local), local).ok


def test_high_priority_is_admitted_however_late(rt, local):
    a = admit(rt.req(1000, priority="high", ttft_slo_ms=10), rt.snap(local, local_prefill_queue_tokens=100_000), local)
    assert (a.ok, a.reason) == (True, "high_priority")
    assert a.predicted_ttft_ms > 10_000
    assert a.preempt_low_priority


def test_high_priority_within_slo_does_not_ask_to_preempt(rt, local):
    a = admit(rt.req(100, priority="high"), rt.snap(local), local)
    assert a.ok and not a.preempt_low_priority


def test_early_rejection_off_admits_everything(rt):
    policy = rt.policy(router={"mode": "always_local"}, qos={"enable_early_rejection": False})
    a = admit(rt.req(1000, priority="low"), rt.snap(policy, local_prefill_queue_tokens=100_000), policy)
    assert a.ok


def test_queue_wait_beyond_max_is_refused_whatever_the_slo(rt, local):
    a = admit(rt.req(10, ttft_slo_ms=1e6), rt.snap(local, local_prefill_queue_tokens=25_000), local)
    assert (a.ok, a.reason) == (False, "queue_wait_exceeded")
    assert a.retry_after_ms == 500


def pressured(rt, policy, **fields):
    return rt.snap(policy, rt.costs(policy, decode_step_ms=80.0), **fields)  # TPOT SLO is 50


def test_low_priority_under_tpot_pressure_is_capped(rt, local):
    a = admit(rt.req(100, priority="low", max_tokens=1000), pressured(rt, local), local)
    assert (a.ok, a.reason, a.max_tokens, a.degraded) == (True, "admitted_degraded", 200, True)


def test_low_priority_without_a_limit_gets_the_cap_under_pressure(rt, local):
    assert admit(rt.req(100, priority="low"), pressured(rt, local), local).max_tokens == 200


def test_low_priority_over_ttft_slo_but_under_its_threshold_is_degraded(rt):
    policy = rt.policy(router={"mode": "always_local"}, qos={"low_priority_threshold_ms": 2000, "ttft_slo_ms": 500})
    a = admit(rt.req(1000, priority="low", max_tokens=500), rt.snap(policy, local_prefill_queue_tokens=5000), policy)
    assert (a.ok, a.max_tokens) == (True, 200)


def test_low_priority_without_pressure_keeps_its_max_tokens(rt, local):
    a = admit(rt.req(100, priority="low", max_tokens=1000), rt.snap(local), local)
    assert (a.max_tokens, a.degraded) == (1000, False)


def test_low_priority_already_under_the_cap_is_not_degraded(rt, local):
    a = admit(rt.req(100, priority="low", max_tokens=50), pressured(rt, local), local)
    assert (a.max_tokens, a.degraded) == (50, False)


def test_null_cap_disables_degradation(rt):
    policy = rt.policy(router={"mode": "always_local"}, qos={"degrade": {"low_priority_max_tokens": None}})
    a = admit(rt.req(100, priority="low", max_tokens=1000), pressured(rt, policy), policy)
    assert (a.max_tokens, a.degraded) == (1000, False)


def test_normal_priority_is_never_degraded(rt, local):
    a = admit(rt.req(100, max_tokens=1000), pressured(rt, local), local)
    assert (a.max_tokens, a.degraded) == (1000, False)


def test_admission_predicts_the_route_the_router_picks(rt):
    policy = rt.policy()  # cost_model: busy decode sends 2000 tokens remote
    a = admit(rt.req(2000), rt.snap(policy, decode_active_requests=8), policy)
    assert a.decision.route == "remote"
    assert a.predicted_ttft_ms == a.decision.predicted_ttft_remote_ms


def test_saturating_low_priority_burst_refuses_some_and_admits_every_high(rt):
    """A decode worker with one prefill worker takes 200 low-priority requests
    (tight 300 ms SLO) interleaved with 20 high-priority ones. Admitted work
    piles up on the routes the router picks; nothing is dropped silently."""
    policy = rt.policy()
    snapshot = rt.snap(policy, prefill_pool_size=1, decode_active_requests=8)
    outcomes = {"low": [], "high": []}
    for i in range(220):
        priority = "high" if i % 11 == 10 else "low"
        a = admit(rt.req(800, priority=priority, ttft_slo_ms=300), snapshot, policy)
        outcomes[priority].append(a)
        if not a.ok:
            continue
        if a.decision.route == "remote":
            snapshot = dataclasses.replace(
                snapshot, prefill_queue_depth=snapshot.prefill_queue_depth + 1,
                prefill_queue_tokens=snapshot.prefill_queue_tokens + 800,
            )
        else:
            snapshot = dataclasses.replace(
                snapshot, local_prefill_queue_tokens=snapshot.local_prefill_queue_tokens + 800,
            )
    low_refused = [a for a in outcomes["low"] if not a.ok]
    assert len(outcomes["high"]) == 20 and all(a.ok for a in outcomes["high"])
    assert 0 < len(low_refused) < len(outcomes["low"])
    assert all("predicted TTFT" in a.detail and a.retry_after_ms >= 1 for a in low_refused)
    assert all(a.predicted_ttft_ms > 300 for a in low_refused)


# -- the defaults (issue 28): refuse only what would hurt requests already admitted --------

def test_by_default_a_request_predicted_over_the_slo_is_admitted(rt):
    policy = rt.policy(router={"mode": "always_local"})
    a = admit(rt.req(1000), rt.snap(policy, local_prefill_queue_tokens=12000), policy)  # 1300 ms > 1000 ms SLO
    assert a.ok and a.predicted_ttft_ms == pytest.approx(1300.0)


def test_by_default_a_long_predicted_queue_wait_is_refused_with_a_retry_hint(rt):
    policy = rt.policy(router={"mode": "always_local"})
    a = admit(rt.req(100), rt.snap(policy, local_prefill_queue_tokens=25000), policy)  # wait 2500 ms > 2000
    assert (a.ok, a.reason, a.retry_after_ms) == (False, "queue_wait_exceeded", 500)
    assert "predicted queue wait 2500 ms exceeds max_queue_wait_ms 2000" in a.detail


def test_a_prompt_the_free_kv_cannot_hold_is_refused_only_while_streams_hold_the_pool(rt):
    policy = rt.policy(router={"mode": "always_local"})
    full = rt.snap(policy, kv_free_tokens=1000, local_prefill_queue_tokens=600, decode_active_requests=3)
    a = admit(rt.req(500), full, policy)
    assert (a.ok, a.reason) == (False, "kv_pool_full")
    assert "1000 free token slots" in a.detail and a.retry_after_ms >= 1
    assert admit(rt.req(400), full, policy).ok  # 400 + 600 fits exactly
    idle = rt.snap(policy, kv_free_tokens=1000, local_prefill_queue_tokens=600)  # nobody to preempt
    assert admit(rt.req(500), idle, policy).ok
    unknown = rt.snap(policy, local_prefill_queue_tokens=600, decode_active_requests=3)
    assert admit(rt.req(500), unknown, policy).ok
    off = rt.policy(router={"mode": "always_local"}, qos={"reject_when_kv_full": False})
    assert admit(rt.req(500), rt.snap(off, kv_free_tokens=1000, local_prefill_queue_tokens=600,
                                      decode_active_requests=3), off).ok
