"""Worker selection per strategy (POLICY.md section 2)."""

from __future__ import annotations

import pytest

from pdserve.router.policy import PoolSelection, RouterPolicy
from pdserve.router.select import WorkerCandidate, latency_costs, select_worker


def pool(strategy: str, **weights) -> PoolSelection:
    return PoolSelection.model_validate({"strategy": strategy, "weights": weights})


W = WorkerCandidate


def test_no_candidates_selects_nobody():
    s = select_worker([], pool("least_requests"))
    assert (s.worker_id, s.reason) == (None, "no_candidates")


def test_round_robin_cycles_with_explicit_counter():
    workers = [W("a"), W("b"), W("c")]
    counter, picks = 0, []
    for _ in range(4):
        s = select_worker(workers, pool("round_robin"), rr_counter=counter)
        picks.append(s.worker_id)
        counter = s.next_rr_counter
    assert picks == ["a", "b", "c", "a"]


def test_round_robin_is_a_pure_function_of_the_counter():
    workers = [W("a"), W("b")]
    assert select_worker(workers, pool("round_robin"), rr_counter=7).worker_id == "b"
    assert select_worker(workers, pool("round_robin"), rr_counter=7).worker_id == "b"


def test_least_requests_picks_the_fewest_active():
    workers = [W("a", active_requests=5), W("b", active_requests=2), W("c", active_requests=9)]
    assert select_worker(workers, pool("least_requests")).worker_id == "b"


def test_least_requests_tie_goes_to_lower_kv_then_worker_id():
    workers = [W("b", active_requests=2), W("a", active_requests=2), W("c", active_requests=2, kv_usage=0.0)]
    assert select_worker(workers, pool("least_requests")).worker_id == "a"
    workers[1] = W("a", active_requests=2, kv_usage=0.5)
    assert select_worker(workers, pool("least_requests")).worker_id == "b"


def test_prefix_aware_picks_the_longest_cached_prefix():
    workers = [W("a", prefix_match_tokens=64), W("b", prefix_match_tokens=512, active_requests=9), W("c")]
    s = select_worker(workers, pool("prefix_aware"))
    assert (s.worker_id, s.reason) == ("b", "prefix_aware")


def test_prefix_aware_without_any_match_falls_back_to_least_requests():
    workers = [W("a", active_requests=3), W("b", active_requests=1)]
    s = select_worker(workers, pool("prefix_aware"))
    assert (s.worker_id, s.reason) == ("b", "prefix_aware_no_match")


def test_kv_aware_picks_the_most_free_kv():
    workers = [W("a", kv_usage=0.7), W("b", kv_usage=0.2, active_requests=30), W("c", kv_usage=0.5)]
    assert select_worker(workers, pool("kv_aware")).worker_id == "b"


def test_latency_cost_lets_an_exact_prefix_outweigh_load():
    workers = [W("idle", kv_usage=0.1), W("holder", kv_usage=0.9, active_requests=8, exact_prefix_match=True)]
    s = select_worker(workers, pool("latency_cost"))
    assert (s.worker_id, s.reason) == ("holder", "latency_cost")


def test_latency_cost_scores_follow_the_weights_table():
    c = W("x", kv_usage=0.5, active_requests=4, max_requests=8, memory_bandwidth_util=0.2,
          exact_prefix_match=True, recent_prefix=True)
    (_, score), = latency_costs([c], RouterPolicy().router.worker_selection.prefill.weights)
    assert score == pytest.approx(3.0 * 0.5 + 1.0 * 0.5 - 10.0 + 0.5 * 0.2 - 1.0)


def test_latency_cost_normalises_active_requests_by_the_busiest_without_capacity():
    scores = dict(latency_costs([W("a", active_requests=2), W("b", active_requests=8)], pool("latency_cost").weights))
    assert scores == {"a": pytest.approx(0.25), "b": pytest.approx(1.0)}


def test_prefill_and_decode_pools_can_weigh_differently():
    policy = RouterPolicy.model_validate({"router": {"worker_selection": {
        "prefill": {"strategy": "latency_cost", "weights": {"exact_prefix_match": -10.0}},
        "decode": {"strategy": "latency_cost", "weights": {"exact_prefix_match": 0.0}},
    }}})
    workers = [W("cold", kv_usage=0.1), W("warm", kv_usage=0.8, exact_prefix_match=True)]
    assert select_worker(workers, policy.router.worker_selection.prefill).worker_id == "warm"
    assert select_worker(workers, policy.router.worker_selection.decode).worker_id == "cold"


def test_latency_cost_tie_goes_to_worker_id():
    assert select_worker([W("b"), W("a")], pool("latency_cost")).worker_id == "a"


def test_candidate_kv_usage_must_be_a_fraction():
    with pytest.raises(ValueError, match="fraction 0-1"):
        W("a", kv_usage=75)


def test_non_round_robin_strategies_leave_the_counter_alone():
    assert select_worker([W("a")], pool("least_requests"), rr_counter=5).next_rr_counter == 5
