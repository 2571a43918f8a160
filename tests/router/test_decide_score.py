"""The score policy: arithmetic, ">=" crossing, strict ">" against the minimum, ties."""

from __future__ import annotations

import pytest

from pdserve.router.decide import decide, score_metric


def score_policy(rt, rules, min_score=0.5, enable=True):
    return rt.policy(router={
        "policy": "score",
        "disaggregated_router": {"enable": enable, "policies": rules, "remote_prefill_min_score": min_score},
    })


def rule(metric, threshold, action, weight):
    return {"metric": metric, "threshold": threshold, "action": action, "weight": weight}


@pytest.fixture
def example(rt):
    return rt.policy(router={"policy": "score"})  # the documented default rules (docs/router.md)


def test_long_prompt_scores_its_weight_and_goes_remote(rt, example):
    d = decide(rt.req(256), rt.snap(example), example)
    assert (d.route, d.reason, d.score) == ("remote", "score_above_min", 0.7)


def test_deep_queue_subtracts_its_weight(rt, example):
    d = decide(rt.req(256), rt.snap(example, prefill_queue_depth=10), example)
    assert d.score == pytest.approx(0.4)
    assert (d.route, d.reason) == ("local", "score_below_min")


def test_metric_just_below_threshold_does_not_vote(rt, example):
    d = decide(rt.req(255), rt.snap(example, prefill_queue_depth=9), example)
    assert (d.route, d.score) == ("local", 0.0)


def test_only_the_queue_vote_gives_a_negative_score(rt, example):
    d = decide(rt.req(10), rt.snap(example, prefill_queue_depth=10), example)
    assert d.score == pytest.approx(-0.3)


def test_score_equal_to_min_score_stays_local(rt):
    policy = score_policy(rt, [rule("prefill_length", 1, "prefer_remote", 0.5)])
    d = decide(rt.req(100), rt.snap(policy), policy)
    assert (d.route, d.score) == ("local", 0.5)


def test_floating_point_tie_is_still_a_tie(rt):
    # 0.1 + 0.2 is 0.30000000000000004 in binary floating point.
    policy = score_policy(
        rt, [rule("prefill_length", 1, "prefer_remote", 0.1), rule("prompt_length", 1, "prefer_remote", 0.2)],
        min_score=0.3,
    )
    assert decide(rt.req(100), rt.snap(policy), policy).route == "local"


def test_score_a_hair_above_min_goes_remote(rt):
    policy = score_policy(rt, [rule("prefill_length", 1, "prefer_remote", 0.500001)])
    assert decide(rt.req(100), rt.snap(policy), policy).route == "remote"


def test_several_votes_add_up(rt):
    policy = score_policy(rt, [
        rule("prefill_length", 100, "prefer_remote", 0.4),
        rule("decode_active_requests", 4, "prefer_remote", 0.3),
        rule("decode_kv_usage", 0.9, "prefer_local", 0.15),
    ], min_score=0.5)
    d = decide(rt.req(100), rt.snap(policy, decode_active_requests=4, decode_kv_usage=0.95), policy)
    assert d.score == pytest.approx(0.55)
    assert d.route == "remote"


def test_disabled_score_policy_keeps_everything_local(rt):
    policy = score_policy(rt, [rule("prefill_length", 1, "prefer_remote", 5.0)], enable=False)
    d = decide(rt.req(5000), rt.snap(policy), policy)
    assert (d.route, d.reason) == ("local", "score_disabled")


def test_empty_rule_list_scores_zero_and_stays_local(rt):
    policy = score_policy(rt, [])
    d = decide(rt.req(5000), rt.snap(policy), policy)
    assert (d.route, d.score) == ("local", 0.0)


def test_high_priority_sees_an_empty_queue(rt, example):
    d = decide(rt.req(256, priority="high"), rt.snap(example, prefill_queue_depth=50), example)
    assert (d.route, d.score) == ("remote", 0.7)


@pytest.mark.parametrize(
    ("metric", "expected"),
    [
        ("prefill_length", 300),
        ("prompt_length", 400),
        ("prefix_hit_ratio", 0.25),
        ("prefill_queue_depth", 3),
        ("prefill_queue_tokens", 900),
        ("decode_active_requests", 5),
        ("decode_kv_usage", 0.6),
        ("prefill_pool_size", 4),
    ],
)
def test_each_metric_reads_its_documented_value(rt, metric, expected):
    policy = rt.policy()
    snapshot = rt.snap(
        policy, prefill_queue_depth=3, prefill_queue_tokens=900, decode_active_requests=5,
        decode_kv_usage=0.6, prefill_pool_size=4,
    )
    assert score_metric(metric, rt.req(400, cached_len=100), snapshot, bypass=False) == pytest.approx(expected)


def test_prefix_hit_ratio_of_an_empty_prompt_is_zero(rt):
    policy = rt.policy()
    assert score_metric("prefix_hit_ratio", rt.req(0), rt.snap(policy), bypass=False) == 0.0
