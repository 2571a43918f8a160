"""The cost_model policy: predictions, hysteresis, and choices that flip as
the cluster and the calibrated costs change.

Seed costs (defaults): 0.1 ms/token prefill both sides, 128 KiB KV per token
over 10 GB/s (0.0131072 ms/token) + 2 ms setup, ITL weight 0.1, min gain 5 ms.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pdserve.router.costs import CostModel
from pdserve.router.decide import decide
from pdserve.router.loader import load_policy_file

REPO = Path(__file__).resolve().parents[2]

from_seed = pytest.approx


@pytest.fixture
def policy(rt):
    """The cost model with the ITL penalty weight these formula checks were written with (0.1;
    the shipped default is 1.0: test_the_default_weighs_a_streams_stall_like_ttft)."""
    return rt.policy(router={"policy": "cost_model", "cost_model": {"itl_penalty_weight": 0.1}})


def test_predictions_follow_the_documented_formulas(rt, policy):
    snapshot = rt.snap(
        policy, prefill_pool_size=2, prefill_queue_tokens=1000, local_prefill_queue_tokens=300,
        decode_backlog_tokens=10,
    )
    d = decide(rt.req(2000), snapshot, policy)
    decode_wait = 10 * 1.0
    assert d.predicted_ttft_local_ms == from_seed(300 * 0.1 + decode_wait + 2000 * 0.1)
    assert d.predicted_ttft_remote_ms == from_seed(
        1000 * 0.1 / 2 + decode_wait + 2000 * 0.1 + 2000 * 131072 / 1e7 + 2.0
    )


def test_idle_decode_worker_keeps_a_long_prompt_local(rt, policy):
    # No one to stall and no local backlog: the transfer only adds time.
    d = decide(rt.req(2000), rt.snap(policy), policy)
    assert (d.route, d.reason) == ("local", "cost_local_cheaper")


def test_busy_decode_worker_offloads_a_long_prompt(rt, policy):
    d = decide(rt.req(2000), rt.snap(policy, decode_active_requests=8), policy)
    assert (d.route, d.reason) == ("remote", "cost_remote_cheaper")
    assert d.score == from_seed((200 + 0.1 * 8 * 200) - (200 + 26.2144 + 2))


def test_the_default_weighs_a_streams_stall_like_ttft(rt, policy):
    """The shipped default (the file and the field's default: 1.0) counts each decoding
    stream's ms of stall during a local prefill as one ms of the new request's TTFT: a
    60-token prompt with 8 streams decoding goes remote, which the 0.1 weight kept local."""
    shipped = load_policy_file(REPO / "pdserve/configs/router/default.yaml")
    assert shipped.router.cost_model.itl_penalty_weight == 1.0 == rt.policy().router.cost_model.itl_penalty_weight
    default = rt.policy(router={"policy": "cost_model"})
    tenth = decide(rt.req(60), rt.snap(policy, decode_active_requests=8), policy, explain=True)
    full = decide(rt.req(60), rt.snap(default, decode_active_requests=8), default, explain=True)
    assert tenth.route == "local" and full.route == "remote", (tenth, full)
    assert full.predicted_ttft_local_ms == tenth.predicted_ttft_local_ms  # the penalty is not a TTFT
    assert decide(rt.req(60), rt.snap(default), default).route == "local"  # nothing decoding: no stall


def test_local_backlog_makes_remote_cheaper(rt, policy):
    d = decide(rt.req(2000), rt.snap(policy, local_prefill_queue_tokens=1000), policy)
    assert d.route == "remote"


def test_short_queue_goes_remote_deep_queue_flips_to_local(rt, policy):
    # Remote wins by 131.8 ms minus 0.1 ms per queued token (pool of 1).
    short = rt.snap(policy, prefill_pool_size=1, decode_active_requests=8,
                    prefill_queue_depth=2, prefill_queue_tokens=1000)
    deep = rt.snap(policy, prefill_pool_size=1, decode_active_requests=8,
                   prefill_queue_depth=4, prefill_queue_tokens=2000)
    assert decide(rt.req(2000), short, policy).route == "remote"
    assert decide(rt.req(2000), deep, policy).route == "local"


def test_more_prefill_workers_drain_the_same_queue_faster(rt, policy):
    one = rt.snap(policy, prefill_pool_size=1, decode_active_requests=8, prefill_queue_tokens=2000)
    four = rt.snap(policy, prefill_pool_size=4, decode_active_requests=8, prefill_queue_tokens=2000)
    assert decide(rt.req(2000), one, policy).route == "local"
    assert decide(rt.req(2000), four, policy).route == "remote"


def test_fast_link_goes_remote_slow_link_flips_to_local(rt, policy):
    fast = rt.snap(policy, rt.costs(policy, transfer_bytes_per_ms=1e7), decode_active_requests=8)
    slow = rt.snap(policy, rt.costs(policy, transfer_bytes_per_ms=1e6), decode_active_requests=8)
    assert decide(rt.req(2000), fast, policy).route == "remote"
    assert decide(rt.req(2000), slow, policy).route == "local"


def exact_costs(rt, policy):
    # Integers throughout so the gain is exact: transfer 1 ms/token, no setup.
    return rt.costs(
        policy, prefill_local_ms_per_token=1.0, prefill_remote_ms_per_token=1.0,
        kv_bytes_per_token=1000, transfer_bytes_per_ms=1000.0, transfer_setup_ms=0.0,
    )


def test_gain_exactly_min_gain_stays_local(rt, policy):
    snapshot = rt.snap(policy, exact_costs(rt, policy), local_prefill_queue_tokens=15)
    d = decide(rt.req(10), snapshot, policy)
    assert d.score == 5.0
    assert d.route == "local"


def test_gain_just_above_min_gain_goes_remote(rt, policy):
    snapshot = rt.snap(policy, exact_costs(rt, policy), local_prefill_queue_tokens=16)
    d = decide(rt.req(10), snapshot, policy)
    assert (d.route, d.score) == ("remote", 6.0)


def test_min_gain_is_configurable(rt):
    policy = rt.policy(router={"policy": "cost_model", "cost_model": {"min_gain_ms": 0}})
    snapshot = rt.snap(policy, exact_costs(rt, policy), local_prefill_queue_tokens=11)
    assert decide(rt.req(10), snapshot, policy).route == "remote"


def test_zero_itl_weight_ignores_decode_load(rt):
    policy = rt.policy(router={"policy": "cost_model", "cost_model": {"itl_penalty_weight": 0}})
    d = decide(rt.req(2000), rt.snap(policy, decode_active_requests=64), policy)
    assert d.route == "local"


def test_measured_slow_local_prefill_moves_the_decision_remote(rt, policy):
    model = CostModel(policy.router.cost_model, kv_bytes_per_token=128 * 1024)
    loads = dict(decode_active_requests=2, prefill_queue_tokens=1000, prefill_pool_size=1)
    assert decide(rt.req(2000), rt.snap(policy, model.snapshot(), **loads), policy).route == "local"
    for _ in range(10):
        model.observe_prefill(tokens=2000, ms=600.0, where="local")  # 0.3 ms/token measured
    assert decide(rt.req(2000), rt.snap(policy, model.snapshot(), **loads), policy).route == "remote"


def test_measured_slow_transfers_move_the_decision_local(rt, policy):
    model = CostModel(policy.router.cost_model, kv_bytes_per_token=128 * 1024)
    loads = dict(decode_active_requests=8)
    assert decide(rt.req(2000), rt.snap(policy, model.snapshot(), **loads), policy).route == "remote"
    for _ in range(20):
        model.observe_transfer(num_bytes=2000 * 128 * 1024, ms=400.0)  # ~0.66 GB/s measured
    assert decide(rt.req(2000), rt.snap(policy, model.snapshot(), **loads), policy).route == "local"


def test_high_priority_prediction_skips_the_queue(rt, policy):
    snapshot = rt.snap(policy, prefill_queue_tokens=100_000, decode_active_requests=8)
    normal = decide(rt.req(2000), snapshot, policy)
    high = decide(rt.req(2000, priority="high"), snapshot, policy)
    assert normal.route == "local"
    assert high.route == "remote"
    assert high.predicted_ttft_remote_ms < normal.predicted_ttft_remote_ms


# -- the blocking penalty: requests arriving while a local prefill runs -------------


def test_blocking_penalty_follows_the_documented_formula(rt, policy):
    # 2000 tokens x 0.1 ms = 200 ms local prefill; 5 req/s -> 1 arrival expected, waiting 100 ms.
    d = decide(rt.req(2000), rt.snap(policy, arrival_rate_per_s=5.0), policy)
    local_prefill = 200.0
    penalty = 1.0 * (5.0 / 1000 * local_prefill) * local_prefill / 2
    assert d.score == from_seed(200 + penalty - (200 + 26.2144 + 2))
    assert d.route == "remote"


def test_steady_traffic_sends_long_prompts_remote_and_keeps_short_ones_local(rt, policy):
    # The same idle-looking worker as test_idle_decode_worker_keeps_a_long_prompt_local,
    # but with requests arriving at 2/s: the long prefill would stall them.
    snapshot = rt.snap(policy, arrival_rate_per_s=2.0)
    assert decide(rt.req(2000), snapshot, policy).route == "remote"
    assert decide(rt.req(64), snapshot, policy).route == "local"


def test_blocking_penalty_grows_with_the_square_of_the_local_prefill(rt, policy):
    snapshot = rt.snap(policy, arrival_rate_per_s=2.0)
    gain = {n: decide(rt.req(n), snapshot, policy).score for n in (1000, 2000)}
    transfer = {n: n * 131072 / 1e7 + 2.0 for n in (1000, 2000)}
    penalty = {n: gain[n] + transfer[n] for n in gain}  # gain = penalty - transfer (same prefill costs)
    assert penalty[2000] == from_seed(4 * penalty[1000])


def test_zero_blocking_weight_is_pure_ttft(rt):
    policy = rt.policy(router={"policy": "cost_model", "cost_model": {"blocking_penalty_weight": 0}})
    d = decide(rt.req(2000), rt.snap(policy, arrival_rate_per_s=50.0), policy)
    assert d.route == "local"


def test_a_fully_cached_prompt_pays_no_blocking_penalty(rt, policy):
    d = decide(rt.req(2000, cached_len=2000), rt.snap(policy, arrival_rate_per_s=50.0), policy)
    assert (d.route, d.reason) == ("local", "fully_cached")


# -- TPOT pressure: decode steps near the TPOT SLO send prompts remote ----------------


def pressed(rt, policy, step_ms: float, **fields):
    return rt.snap(policy, rt.costs(policy, decode_step_ms=step_ms), **fields)


@pytest.fixture
def tpot_policy(rt):
    return rt.policy(router={"policy": "cost_model", "cost_model": {"tpot_pressure_fraction": 0.8}},
                     qos={"ttft_slo_ms": 500})


def test_tpot_pressure_is_off_by_default(rt, policy):
    assert decide(rt.req(64), pressed(rt, policy, 1000.0), policy).route == "local"


def test_tpot_pressure_sends_a_short_prompt_remote_that_ttft_alone_keeps_local(rt, tpot_policy):
    # Default qos: tpot_slo_ms 50, fraction 0.8 -> pressure from a 40 ms decode step.
    assert decide(rt.req(64), pressed(rt, tpot_policy, 39.9), tpot_policy).route == "local"
    d = decide(rt.req(64), pressed(rt, tpot_policy, 40.0), tpot_policy)
    assert (d.route, d.reason) == ("remote", "cost_tpot_pressure")
    assert d.score == from_seed(d.predicted_ttft_remote_ms - d.predicted_ttft_local_ms)


def test_tpot_pressure_yields_when_the_remote_route_would_miss_the_ttft_slo(rt, tpot_policy):
    # 8000 queued tokens x 0.1 ms / 2 workers = 400 ms wait + 64-token prefill: ~409 ms < 500 ms SLO.
    ok = pressed(rt, tpot_policy, 45.0, prefill_queue_tokens=8000)
    assert decide(rt.req(64), ok, tpot_policy).reason == "cost_tpot_pressure"
    # 10000 tokens: ~509 ms > 500 ms: back to the plain cost comparison (local here).
    deep = pressed(rt, tpot_policy, 45.0, prefill_queue_tokens=10000)
    assert decide(rt.req(64), deep, tpot_policy).reason == "cost_local_cheaper"
    # The request's own, looser TTFT SLO wins over qos.ttft_slo_ms.
    assert decide(rt.req(64, ttft_slo_ms=2000), deep, tpot_policy).reason == "cost_tpot_pressure"


def test_tpot_pressure_follows_the_qos_tpot_slo_and_can_be_turned_off(rt):
    loose = rt.policy(router={"policy": "cost_model", "cost_model": {"tpot_pressure_fraction": 0.8}},
                      qos={"tpot_slo_ms": 100})
    assert decide(rt.req(64), pressed(rt, loose, 45.0), loose).route == "local"  # 45 < 0.8 x 100
    off = rt.policy(router={"policy": "cost_model", "cost_model": {"tpot_pressure_fraction": 0}})
    assert decide(rt.req(64), pressed(rt, off, 1000.0), off).route == "local"


def test_tpot_pressure_is_explained(rt, tpot_policy):
    d = decide(rt.req(64), pressed(rt, tpot_policy, 45.0), tpot_policy, explain=True)
    assert any("TPOT pressure: decode step 45.0 ms" in line for line in d.trace)
    assert "near tpot_slo_ms 50" in d.detail


def test_a_chunked_local_prefill_pays_the_step_base_per_chunk(rt, policy):
    """A local prefill runs in chunks of the worker's prefill budget; each chunk's step pays the
    step curve's fixed part plus the decoding requests' part (here 10 ms + 2 x 1 ms)."""
    costs = rt.costs(policy, step_fixed_ms=10.0, step_decode_ms_per_seq=1.0)
    plain = rt.snap(policy, costs, decode_active_requests=2)
    chunked = rt.snap(policy, costs, decode_active_requests=2, local_prefill_budget_tokens=150)
    idle = rt.snap(policy, costs, local_prefill_budget_tokens=150)
    assert decide(rt.req(2000), plain, policy).predicted_ttft_local_ms == from_seed(2000 * 0.1 + 12)  # one step
    assert decide(rt.req(2000), chunked, policy).predicted_ttft_local_ms == from_seed(2000 * 0.1 + 14 * 12)
    assert decide(rt.req(2000), idle, policy).predicted_ttft_local_ms == from_seed(2000 * 0.1 + 14 * 10)
    assert decide(rt.req(2000), chunked, policy).route == "remote"


def test_a_local_backlog_shares_its_chunks_with_the_new_prompt(rt, policy):
    costs = rt.costs(policy, step_fixed_ms=10.0)
    s = rt.snap(policy, costs, local_prefill_queue_tokens=100, local_prefill_budget_tokens=150)
    d = decide(rt.req(100), s, policy)
    # backlog alone: 1 step + 100 tokens; backlog + prompt: 2 steps + 200 tokens
    assert d.predicted_queue_wait_ms == from_seed(10 + 100 * 0.1) or d.route == "remote"
    assert d.predicted_ttft_local_ms == from_seed(2 * 10 + 200 * 0.1)


def test_learned_residuals_are_added_to_each_route(rt, policy):
    costs = rt.costs(policy, ttft_residual_local_ms=7.0, ttft_residual_remote_ms=30.0)
    d = decide(rt.req(2000), rt.snap(policy, costs), policy)
    assert d.predicted_ttft_local_ms == from_seed(2000 * 0.1 + 7)
    assert d.predicted_ttft_remote_ms == from_seed(2000 * 0.1 + 2000 * 131072 / 1e7 + 2.0 + 30)
    cached = decide(rt.req(100, cached_len=100), rt.snap(policy, costs), policy)
    assert cached.predicted_ttft_local_ms == 0.0  # nothing to prefill: no residual either


def test_a_chunked_local_prefill_blocks_arrivals_for_one_chunk_only(rt, policy):
    """The blocking penalty prices arrivals waiting for the step under way: unchunked, the whole
    prefill; chunked by the step plan, one chunk's step."""
    costs = rt.costs(policy, step_fixed_ms=10.0)
    whole = decide(rt.req(2000), rt.snap(policy, costs, arrival_rate_per_s=2.0), policy)
    chunked = decide(rt.req(2000), rt.snap(policy, costs, arrival_rate_per_s=2.0, local_prefill_budget_tokens=200),
                     policy)
    local_whole = 10 + 200.0  # one step: 10 ms + 2000 x 0.1
    assert whole.score == from_seed(local_whole + 2.0 / 1000 * local_whole * local_whole / 2 - whole.predicted_ttft_remote_ms)
    local_chunked = 10 * 10 + 200.0  # ten steps
    step = 10 + 200 * 0.1  # one chunk's step
    assert chunked.score == from_seed(local_chunked + 2.0 / 1000 * local_chunked * step / 2
                                      - chunked.predicted_ttft_remote_ms)


def test_a_short_prompt_behind_a_local_backlog_is_predicted_beside_it(rt, policy):
    """The scheduler gives a waiting prompt half of each step beside a running prefill: a short
    prompt's local TTFT is a step or two, not the whole backlog."""
    costs = rt.costs(policy, step_fixed_ms=10.0)
    s = rt.snap(policy, costs, local_prefill_queue_tokens=4000, local_prefill_queue_requests=1,
                local_prefill_budget_tokens=200)
    d = decide(rt.req(50), s, policy)
    assert d.predicted_ttft_local_ms == from_seed(10 + 200 * 0.1)  # one shared step: 50 <= 100
    assert d.predicted_queue_wait_ms <= 30.0 or d.route == "remote"
    long_ = decide(rt.req(4000), s, policy)  # longer than half a step: it finishes behind the backlog
    assert long_.predicted_ttft_local_ms == from_seed(40 * 10 + 8000 * 0.1)
    over_half = decide(rt.req(101), s, policy)  # just over half a step: behind too, not beside
    assert over_half.predicted_ttft_local_ms > d.predicted_ttft_local_ms + 4000 * 0.1


def test_a_prefill_worker_holding_the_prefix_computes_only_past_it(rt, policy):
    """remote_cached_len (the prefill workers' KV events): the remote prediction drops the
    compute of the tokens that worker holds, not their transfer, and can turn the choice."""
    snapshot = rt.snap(policy)
    blind = decide(rt.req(2000), snapshot, policy)
    seen = decide(rt.req(2000, remote_cached_len=1500), snapshot, policy, explain=True)
    transfer = 2000 * 131072 / 1e7 + 2.0
    assert blind.predicted_ttft_remote_ms == from_seed(2000 * 0.1 + transfer)
    assert seen.predicted_ttft_remote_ms == from_seed(500 * 0.1 + transfer)
    assert seen.predicted_ttft_local_ms == blind.predicted_ttft_local_ms  # the local route gains nothing
    assert (blind.route, seen.route) == ("local", "remote")
    assert any("holds 1500 prompt tokens cached" in line for line in seen.trace)
    # Held no further than what this worker holds itself: nothing changes; the last token is
    # always computed.
    same = decide(rt.req(2000, cached_len=1600, remote_cached_len=1500), snapshot, policy)
    assert same.predicted_ttft_remote_ms == decide(rt.req(2000, cached_len=1600), snapshot, policy).predicted_ttft_remote_ms
    whole = decide(rt.req(2000, remote_cached_len=2000), snapshot, policy)
    assert whole.predicted_ttft_remote_ms == from_seed(1 * 0.1 + transfer)
    with pytest.raises(ValueError, match="remote_cached_len"):
        rt.req(10, remote_cached_len=-1)


def test_a_second_tier_hit_is_loaded_back_locally_when_loading_costs_less(rt, policy):
    """tier_cached_len (this worker's second KV tier): the local prediction computes only past
    it and adds its load; the remote one is unchanged (a prefill worker computes those tokens)."""
    snapshot = rt.snap(policy)
    blind = decide(rt.req(2000), snapshot, policy)
    cheap = dataclasses.replace(snapshot, costs=dataclasses.replace(snapshot.costs, tier_load_ms_per_token=0.01))
    seen = decide(rt.req(2000, tier_cached_len=1600), cheap, policy, explain=True)
    assert seen.predicted_ttft_remote_ms == blind.predicted_ttft_remote_ms
    assert seen.predicted_ttft_local_ms < blind.predicted_ttft_local_ms - 1600 * (0.1 - 0.01) * 0.9
    assert any("second KV tier holds 1600 more prompt tokens" in line for line in seen.trace)
    # Loading dearer than computing: the local route computes everything, as without a tier.
    dear = dataclasses.replace(snapshot, costs=dataclasses.replace(snapshot.costs, tier_load_ms_per_token=1.0))
    assert decide(rt.req(2000, tier_cached_len=1600), dear, policy).predicted_ttft_local_ms == \
        blind.predicted_ttft_local_ms
    # The whole prompt in the tier: its last token is still computed.
    whole = decide(rt.req(2000, tier_cached_len=2000), cheap, policy)
    assert whole.predicted_ttft_local_ms > decide(rt.req(2000, cached_len=1999), cheap, policy).predicted_ttft_local_ms
    with pytest.raises(ValueError, match="tier_cached_len"):
        rt.req(10, tier_cached_len=-1)


def test_a_local_prefill_that_can_borrow_counts_the_read_not_the_compute(rt, policy):
    """peer_reads (decode/borrow.py): the prefix a prefill worker holds past this worker's is
    read at the transfer's cost instead of computed; without peer_reads, the local route gains
    nothing from it (test above)."""
    snapshot = rt.snap(policy)
    blind = decide(rt.req(2000, remote_cached_len=1500), snapshot, policy)
    reads = decide(rt.req(2000, remote_cached_len=1500, peer_reads=True), snapshot, policy, explain=True)
    transfer = 1500 * 131072 / 1e7 + 2.0
    assert reads.predicted_ttft_remote_ms == blind.predicted_ttft_remote_ms
    saved = blind.predicted_ttft_local_ms - reads.predicted_ttft_local_ms
    assert saved == pytest.approx(1500 * 0.1 - transfer, rel=0.1)  # 1500 tokens' compute, less their read
    assert any("a local prefill would read the 1500 prompt tokens" in line for line in reads.trace)
    # Dearer to read than to compute: unchanged.
    slow = dataclasses.replace(snapshot, costs=dataclasses.replace(snapshot.costs, transfer_bytes_per_ms=1.0))
    assert decide(rt.req(2000, remote_cached_len=1500, peer_reads=True), slow, policy).predicted_ttft_local_ms == \
        decide(rt.req(2000, remote_cached_len=1500), slow, policy).predicted_ttft_local_ms


def test_a_measured_drain_prices_the_local_backlog_and_the_prompt_behind_it(rt, policy):
    """Once the backlog's drain is measured (wall ms per prompt token), a prompt behind a local
    backlog waits backlog x drain and prefills at the same rate; without a backlog, the step
    formula holds whatever the drain."""
    costs = rt.costs(policy, step_fixed_ms=10.0, local_drain_ms_per_token=0.8)
    s = rt.snap(policy, costs, local_prefill_queue_tokens=1000, local_prefill_queue_requests=2,
                local_prefill_budget_tokens=200)
    d = decide(rt.req(500, override="local"), s, policy)
    assert d.predicted_queue_wait_ms == from_seed(1000 * 0.8)
    assert d.predicted_ttft_local_ms == from_seed(1500 * 0.8)
    idle = decide(rt.req(500, override="local"), rt.snap(policy, costs, local_prefill_budget_tokens=200), policy)
    assert idle.predicted_ttft_local_ms == from_seed(3 * 10 + 500 * 0.1)
    short = decide(rt.req(50, override="local"), s, policy)  # beside the backlog: one shared step
    assert short.predicted_ttft_local_ms == from_seed(10 + 200 * 0.1)


def test_a_request_admitted_during_a_step_waits_for_what_is_left_of_it(rt, policy):
    """The engine schedules a new request after the step under way, and reserves a remote
    one's blocks after it: what is left of that step (step_in_flight_ms) adds to both routes'
    TTFT, so it does not change the choice; beside a backlog too; a backlog timed by its
    measured drain (which counts the steps as they came) does not take it."""
    costs = rt.costs(policy, step_fixed_ms=10.0)
    idle = decide(rt.req(50, override="local"), rt.snap(policy, costs), policy)
    busy = decide(rt.req(50, override="local"), rt.snap(policy, costs, step_in_flight_ms=30.0), policy)
    assert busy.predicted_ttft_local_ms == from_seed(idle.predicted_ttft_local_ms + 30.0)
    assert busy.predicted_queue_wait_ms == from_seed(30.0)
    assert busy.predicted_ttft_remote_ms == from_seed(idle.predicted_ttft_remote_ms + 30.0)
    long_idle = decide(rt.req(2000), rt.snap(policy, costs, decode_active_requests=8), policy)
    long_busy = decide(rt.req(2000), rt.snap(policy, costs, decode_active_requests=8, step_in_flight_ms=30.0), policy)
    assert (long_busy.route, long_busy.score) == (long_idle.route, from_seed(long_idle.score))
    backlog = dict(local_prefill_queue_tokens=4000, local_prefill_queue_requests=1, local_prefill_budget_tokens=200)
    beside = decide(rt.req(50), rt.snap(policy, costs, step_in_flight_ms=30.0, **backlog), policy)
    assert beside.predicted_ttft_local_ms == from_seed(30 + 10 + 200 * 0.1)  # then one shared step
    drained = rt.costs(policy, step_fixed_ms=10.0, local_drain_ms_per_token=0.8)
    behind = decide(rt.req(500, override="local"),
                    rt.snap(policy, drained, step_in_flight_ms=30.0, **backlog), policy)
    assert behind.predicted_ttft_local_ms == from_seed(4500 * 0.8)


def test_what_is_left_of_a_step_is_its_predicted_time_less_what_has_passed(rt, policy):
    costs = rt.costs(policy, step_fixed_ms=10.0, step_decode_ms_per_seq=2.0)
    assert costs.step_left_ms(None, 5.0) == 0.0  # not stepping
    step = (100.0, 4, 100, 0)  # started at t=100 s: 4 streams and 100 prompt tokens, 28 ms predicted
    assert costs.step_left_ms(step, 100.008) == pytest.approx(28.0 - 8.0)
    assert costs.step_left_ms(step, 100.5) == 0.0  # overran its prediction: nothing more is expected


@pytest.mark.parametrize("stale_after", [0, 16])
def test_a_route_dropped_after_a_bad_run_is_tried_again(rt, stale_after):
    """Residuals learn only from the route taken: after a run of stalled remote requests the
    remote residual alone would keep every prompt local for good (``residual_stale_after: 0``).
    With the default it decays toward the formula while local requests are measured, remote is
    tried again, and its residual is then relearned from what remote really costs."""
    policy = rt.policy({"cost_model": {"ema_alpha": 0.2, "residual_stale_after": stale_after,
                                       "prefill_remote_ms_per_token": 0.05,
                                       "blocking_penalty_weight": 0.0, "itl_penalty_weight": 0.0}})
    model = CostModel(policy.router.cost_model, kv_bytes_per_token=128 * 1024)
    for _ in range(8):  # a stall: remote took 4x what its formula said
        model.observe_ttft("remote", measured_ms=4 * 400.0, formula_ms=400.0)
    true_extra = {"local": 0.0, "remote": 5.0}  # what each route really adds to its formula
    routes = []
    for _ in range(200):
        est = model.snapshot()
        d = decide(rt.req(2000), rt.snap(policy, rt.costs(policy, ttft_residual_local_ms=est.ttft_residual_local_ms,
                                                          ttft_residual_remote_ms=est.ttft_residual_remote_ms)),
                   policy)
        residual = est.ttft_residual_remote_ms if d.route == "remote" else est.ttft_residual_local_ms
        formula = d.predicted_ttft_ms - residual
        model.observe_ttft(d.route, measured_ms=formula + true_extra[d.route], formula_ms=formula)
        routes.append(d.route)
    assert routes[0] == "local"  # the stall's residual first sends the prompt local
    if stale_after == 0:
        assert set(routes) == {"local"}  # locked in: remote is never measured again
    else:
        assert routes[-50:] == ["remote"] * 50  # remote is faster by its formula, and is chosen again
        assert model.snapshot().ttft_residual_remote_ms == pytest.approx(5.0, abs=0.5)


def test_a_grammar_new_at_the_edge_adds_its_compile_time_to_the_remote_route_only(rt, policy):
    # Busy decode worker: remote wins by 160 - 28.2144 = 131.8 ms without a grammar to compile.
    snap = rt.snap(policy, decode_active_requests=8)
    plain = decide(rt.req(2000), snap, policy)
    assert plain.route == "remote"
    slow = decide(dataclasses.replace(rt.req(2000), grammar_compile_ms=200.0), snap, policy)
    assert slow.predicted_ttft_remote_ms == from_seed(plain.predicted_ttft_remote_ms + 200.0)
    assert slow.predicted_ttft_local_ms == from_seed(plain.predicted_ttft_local_ms)
    assert (slow.route, slow.reason) == ("local", "cost_local_cheaper")
    explained = decide(dataclasses.replace(rt.req(2000), grammar_compile_ms=200.0), snap, policy, explain=True)
    assert any("grammar was new here (compiled in 200.0 ms)" in line for line in explained.trace)
