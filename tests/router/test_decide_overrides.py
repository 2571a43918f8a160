"""Modes, request overrides, priority overrides and their precedence."""

from __future__ import annotations

import pytest

from pdserve.router.decide import decide
from pdserve.router.values import RequestFeatures


def test_fully_cached_prompt_is_local_even_when_forced_remote(rt):
    policy = rt.policy(router={"mode": "always_remote"})
    d = decide(rt.req(4000, cached_len=4000, override="remote"), rt.snap(policy), policy)
    assert (d.route, d.reason) == ("local", "fully_cached")


def test_cached_len_beyond_prompt_counts_as_fully_cached(rt):
    policy = rt.policy(router={"mode": "always_remote"})
    assert decide(rt.req(100, cached_len=120), rt.snap(policy), policy).reason == "fully_cached"


def test_fully_cached_prompt_predicts_no_prefill_or_transfer(rt):
    policy = rt.policy()
    d = decide(rt.req(4000, cached_len=4000), rt.snap(policy), policy)
    assert d.predicted_ttft_local_ms == 0.0
    assert d.predicted_ttft_remote_ms == 0.0


def test_override_local_beats_always_remote(rt):
    policy = rt.policy(router={"mode": "always_remote"})
    d = decide(rt.req(4000, override="local"), rt.snap(policy), policy)
    assert (d.route, d.reason) == ("local", "override_local")


@pytest.mark.parametrize("mode, override", [("always_remote", "remote"), ("conditional", "auto")])
def test_prompt_logprobs_keep_a_long_prompt_local_whatever_asked(rt, mode, override):
    policy = rt.policy(router={"mode": mode})
    d = decide(rt.req(8000, override=override, prompt_logprobs=True), rt.snap(policy), policy)
    assert (d.route, d.reason) == ("local", "prompt_logprobs")
    if mode == "always_remote":  # (the same request without them goes where it asked)
        assert decide(rt.req(8000, override=override), rt.snap(policy), policy).route == "remote"


def test_a_lora_adapter_keeps_a_long_prompt_local_even_when_forced_remote(rt):
    policy = rt.policy(router={"mode": "always_remote"})
    d = decide(rt.req(8000, override="remote", lora_adapter=True), rt.snap(policy), policy)
    assert (d.route, d.reason) == ("local", "lora_adapter")
    both = decide(rt.req(8000, override="remote", lora_adapter=True, prompt_logprobs=True), rt.snap(policy), policy)
    assert both.reason == "prompt_logprobs"  # (the precedence: docs/router.md)


def test_override_remote_beats_always_local(rt):
    policy = rt.policy(router={"mode": "always_local"})
    d = decide(rt.req(10, override="remote"), rt.snap(policy), policy)
    assert (d.route, d.reason) == ("remote", "override_remote")


def test_override_remote_beats_a_local_policy_choice(rt):
    policy = rt.policy(router={"policy": "threshold"})
    assert decide(rt.req(10, override="remote"), rt.snap(policy), policy).route == "remote"


def test_override_remote_with_empty_pool_is_local(rt):
    policy = rt.policy()
    d = decide(rt.req(4000, override="remote"), rt.snap(policy, prefill_pool_size=0), policy)
    assert (d.route, d.reason) == ("local", "empty_pool")


@pytest.mark.parametrize("router", [
    {"mode": "always_remote"},
    {"policy": "threshold"},
    {"policy": "score"},
    {"policy": "cost_model"},
])
def test_empty_pool_means_local_for_every_mode_and_policy(rt, router):
    policy = rt.policy(router=router)
    snapshot = rt.snap(policy, prefill_pool_size=0, decode_active_requests=64)
    d = decide(rt.req(8000, priority="high"), snapshot, policy)
    assert (d.route, d.reason) == ("local", "empty_pool")


def test_empty_pool_rule_can_be_switched_off(rt):
    policy = rt.policy(router={"mode": "always_remote", "overrides": {"empty_pool_local": False}})
    assert decide(rt.req(4000), rt.snap(policy, prefill_pool_size=0), policy).route == "remote"


def test_always_local_mode_keeps_a_huge_prompt_local(rt):
    policy = rt.policy(router={"mode": "always_local"})
    d = decide(rt.req(100_000), rt.snap(policy, decode_active_requests=64), policy)
    assert (d.route, d.reason) == ("local", "mode_always_local")


def test_always_remote_mode_sends_a_tiny_prompt_remote(rt):
    policy = rt.policy(router={"mode": "always_remote"})
    d = decide(rt.req(1), rt.snap(policy), policy)
    assert (d.route, d.reason) == ("remote", "mode_always_remote")


def busy_policy(rt, **degrade):
    return rt.policy(router={"policy": "threshold"}, qos={"degrade": degrade} if degrade else None)


def test_low_priority_is_kept_local_when_the_pool_is_busy(rt):
    policy = busy_policy(rt)
    # Pool of 2, busy at queue depth >= 2 x 2 = 4; threshold still allows remote (< 10).
    d = decide(rt.req(1000, priority="low"), rt.snap(policy, prefill_queue_depth=4), policy)
    assert (d.route, d.reason) == ("local", "low_priority_pool_busy")


def test_low_priority_goes_remote_when_the_pool_is_not_busy(rt):
    policy = busy_policy(rt)
    d = decide(rt.req(1000, priority="low"), rt.snap(policy, prefill_queue_depth=3), policy)
    assert d.route == "remote"


def test_normal_priority_ignores_the_busy_pool_rule(rt):
    policy = busy_policy(rt)
    assert decide(rt.req(1000), rt.snap(policy, prefill_queue_depth=4), policy).route == "remote"


def test_busy_pool_rule_is_switched_by_the_qos_degrade_flag(rt):
    policy = busy_policy(rt, no_remote_prefill_for_low_priority_when_busy=False)
    d = decide(rt.req(1000, priority="low"), rt.snap(policy, prefill_queue_depth=4), policy)
    assert d.route == "remote"


def test_busy_limit_scales_with_pool_size(rt):
    policy = busy_policy(rt)
    big_pool = rt.snap(policy, prefill_queue_depth=4, prefill_pool_size=3)  # busy at 6
    assert decide(rt.req(1000, priority="low"), big_pool, policy).route == "remote"


def test_low_priority_forced_remote_still_goes_remote_when_busy(rt):
    policy = busy_policy(rt)
    d = decide(rt.req(1000, priority="low", override="remote"), rt.snap(policy, prefill_queue_depth=9), policy)
    assert d.route == "remote"


def test_explain_records_the_reasoning_and_plain_decide_does_not(rt):
    policy = rt.policy(router={"policy": "threshold"})
    explained = decide(rt.req(300), rt.snap(policy), policy, explain=True)
    plain = decide(rt.req(300), rt.snap(policy), policy)
    assert any("prefill_length_threshold 256" in line for line in explained.trace)
    assert explained.trace[-1].startswith("=> remote (threshold_long_prompt)")
    assert plain.trace == ()
    assert (plain.route, plain.reason) == (explained.route, explained.reason)


def test_queue_wait_is_reported_for_the_chosen_route(rt):
    policy = rt.policy(router={"mode": "always_remote"})
    d = decide(rt.req(100), rt.snap(policy, prefill_queue_tokens=400, prefill_pool_size=2), policy)
    assert d.predicted_queue_wait_ms == pytest.approx(400 * 0.1 / 2)
    assert d.predicted_ttft_ms == d.predicted_ttft_remote_ms


@pytest.mark.parametrize("bad", [
    dict(prompt_len=-1),
    dict(prompt_len=10, cached_len=-1),
    dict(prompt_len=10, priority="urgent"),
    dict(prompt_len=10, override="elsewhere"),
])
def test_request_features_refuse_impossible_values(bad):
    with pytest.raises(ValueError):
        RequestFeatures(**bad)
