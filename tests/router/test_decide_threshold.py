"""The threshold policy (docs/router.md), edges included."""

from __future__ import annotations

import pytest

from pdserve.router.decide import decide


@pytest.fixture
def policy(rt):
    return rt.policy(router={"policy": "threshold"})


def test_prompt_of_255_tokens_stays_local(rt, policy):
    d = decide(rt.req(255), rt.snap(policy), policy)
    assert (d.route, d.reason) == ("local", "threshold_short_prompt")


def test_prompt_of_256_tokens_goes_remote(rt, policy):
    d = decide(rt.req(256), rt.snap(policy), policy)
    assert (d.route, d.reason) == ("remote", "threshold_long_prompt")


def test_threshold_applies_to_uncached_tokens_not_prompt_length(rt, policy):
    d = decide(rt.req(300, cached_len=45), rt.snap(policy), policy)
    assert d.route == "local"  # eff_len 255


def test_queue_depth_just_below_max_still_goes_remote(rt, policy):
    d = decide(rt.req(1000), rt.snap(policy, prefill_queue_depth=9), policy)
    assert d.route == "remote"


def test_queue_depth_at_max_keeps_long_prompt_local(rt, policy):
    d = decide(rt.req(1000), rt.snap(policy, prefill_queue_depth=10), policy)
    assert (d.route, d.reason) == ("local", "threshold_queue_full")


def test_busy_decode_sends_medium_prompt_remote(rt, policy):
    d = decide(rt.req(64), rt.snap(policy, decode_active_requests=8), policy)
    assert (d.route, d.reason) == ("remote", "threshold_decode_busy")


def test_decode_one_below_load_threshold_keeps_medium_prompt_local(rt, policy):
    d = decide(rt.req(64), rt.snap(policy, decode_active_requests=7), policy)
    assert d.route == "local"


def test_busy_decode_keeps_prompt_below_busy_min_length_local(rt, policy):
    d = decide(rt.req(63), rt.snap(policy, decode_active_requests=20), policy)
    assert d.route == "local"


def test_busy_decode_rule_ignores_a_full_queue(rt, policy):
    snapshot = rt.snap(policy, prefill_queue_depth=50, decode_active_requests=8)
    assert decide(rt.req(1000), snapshot, policy).reason == "threshold_decode_busy"


def test_high_priority_bypasses_the_queue_max(rt, policy):
    d = decide(rt.req(1000, priority="high"), rt.snap(policy, prefill_queue_depth=10), policy)
    assert (d.route, d.reason) == ("remote", "threshold_long_prompt")


def test_queue_bypass_can_be_switched_off(rt):
    policy = rt.policy(router={"policy": "threshold", "overrides": {"high_priority_bypass_queue": False}})
    d = decide(rt.req(1000, priority="high"), rt.snap(policy, prefill_queue_depth=10), policy)
    assert d.route == "local"


def test_custom_thresholds_are_honoured(rt):
    policy = rt.policy(router={"policy": "threshold", "threshold": {"prefill_length_threshold": 1024}})
    assert decide(rt.req(1023), rt.snap(policy), policy).route == "local"
    assert decide(rt.req(1024), rt.snap(policy), policy).route == "remote"


def test_threshold_decision_has_no_score(rt, policy):
    assert decide(rt.req(1000), rt.snap(policy), policy).score is None
