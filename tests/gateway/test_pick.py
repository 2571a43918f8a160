"""The gateway's pick (gateway/pick.py): predicted TTFT per worker from what the gateway
measured and the workers published, the KV index's cached prefixes, exclusions, ties."""

from __future__ import annotations

import random
from collections import Counter

from pdserve.gateway.pick import KV_PENALTY_MS, WorkerState, choose, score


def workers(n=3, **kw):
    return [WorkerState(f"d{i}", f"127.0.0.1:{5000 + i}", **kw) for i in range(n)]


def test_a_worker_measured_slower_takes_proportionally_less():
    ws = workers(2)
    for _ in range(20):
        ws[0].observe_ttft(50.0, 100)   # 0.5 ms per token
        ws[1].observe_ttft(150.0, 100)  # 1.5 ms per token: a worker sharing its cores
    rng, sent = random.Random(0), Counter()
    for _ in range(400):  # each pick adds its prompt to that worker's queue, as the gateway does
        p = choose(ws, 100, {}, 0.0, rng)
        w = next(w for w in ws if w.worker_id == p.chosen)
        w.queued_tokens += 100
        sent[p.chosen] += 1
    assert 2.0 < sent["d0"] / sent["d1"] < 4.5, sent  # ~3x: the rates' ratio


def test_a_cached_prefix_outweighs_an_equal_queue():
    ws = workers(3)
    p = choose(ws, 1000, {"d2": 960}, 0.0, random.Random(0))
    assert p.chosen == "d2"
    by = {s.worker_id: s for s in p.scores}
    assert by["d2"].own_tokens == 40 and by["d0"].own_tokens == 1000
    assert by["d2"].ttft_ms < by["d0"].ttft_ms


def test_queue_step_and_full_pool_raise_the_prediction_by_their_terms():
    w = WorkerState("d", "a:1", rate_ms=1.0, load={"waiting": 0, "decode_ms": 300.0, "decode_steps": 10,
                                                   "kv_usage": 0.95})
    w.queued_tokens = 50
    s = score(w, 100, 0)
    assert s.queued_tokens == 50 and s.step_ms == 30.0
    assert abs(s.kv_penalty_ms - KV_PENALTY_MS * 0.5) < 1e-6
    assert abs(s.ttft_ms - (1.0 * 150 + 30.0 + KV_PENALTY_MS * 0.5)) < 1e-6
    w.load["waiting"] = 4  # its record reports more waiting work than this gateway sent it
    assert score(w, 100, 0).queued_tokens == int(4 * w.mean_prompt)


def test_draining_failed_and_tried_workers_are_excluded_with_reasons():
    ws = workers(4)
    ws[0].draining = True
    ws[1].avoid_until = 10.0
    p = choose(ws, 10, {}, 5.0, random.Random(0), exclude={"d2"})
    assert p.chosen == "d3"
    assert set(p.excluded) == {"d0", "d1", "d2"} and "draining" in p.excluded["d0"]
    none = choose(ws[:3], 10, {}, 5.0, random.Random(0), exclude={"d2"})
    assert none.chosen is None and none.scores == []


def test_ties_go_to_the_one_with_fewer_streams_of_two_drawn():
    ws = workers(2)
    ws[0].streams = 5
    picks = {choose(ws, 10, {}, 0.0, random.Random(s)).chosen for s in range(20)}
    assert picks == {"d1"}
    p = choose(ws, 10, {}, 0.0, random.Random(0))
    assert "tied" in p.reason


def test_random_routing_ignores_the_scores():
    ws = workers(3)
    ws[0].rate_ms = 100.0
    picks = Counter(choose(ws, 100, {}, 0.0, random.Random(s), routing="random").chosen for s in range(300))
    assert set(picks) == {"d0", "d1", "d2"} and min(picks.values()) > 60


def test_a_request_races_only_with_a_target_at_risk_and_an_idle_runner_up():
    from pdserve.gateway.pick import race_partner

    ws = workers(2)
    ws[0].rate_ms = ws[1].rate_ms = 1.0
    p = choose(ws, 400, {}, 0.0, random.Random(0))  # both predict 400 ms
    assert race_partner(p, None, 0.5) == (None, "no ttft_slo_ms")
    assert race_partner(p, 1000.0, 0.5) == (None, "no predicted tail")  # 400 < 0.5 x 1000
    other = "d1" if p.chosen == "d0" else "d0"
    assert race_partner(p, 500.0, 0.5) == (other, "race")
    ws[1].queued_tokens = 10  # d1: 410 ms, so d0 is chosen and d1, the runner-up, has work queued
    busy = choose(ws, 400, {}, 0.0, random.Random(0), tie=0.0, tie_ms=0.0)
    assert busy.chosen == "d0"
    assert race_partner(busy, 500.0, 0.5) == (None, "refused_load")
    assert race_partner(choose(ws[:1], 400, {}, 0.0, random.Random(0)), 500.0, 0.5) == (None, "one worker")


def test_the_race_budget_is_a_fraction_of_the_last_window():
    from pdserve.gateway.pick import RaceBudget

    b = RaceBudget(0.25, window_s=10.0)
    for t in range(8):
        b.start(float(t))
    assert [b.take(8.0) for _ in range(3)] == [True, True, False]  # 2 of 8
    assert not b.take(15.0)  # starts 0-4 left the window: 3 starts, 2 races already
    for t in range(16, 24):
        b.start(float(t))
    assert b.take(24.0) and b.take(24.0) and not b.take(24.0)  # the old races left: 2 of 8 again


def test_a_worker_measured_slow_is_tried_again_once_that_is_old_news():
    ws = workers(2)
    ws[0].observe_ttft(50.0, 100, now=0.0)     # 0.5 ms/token
    ws[1].observe_ttft(1000.0, 100, now=0.0)   # 10 ms/token: a passing neighbour
    assert choose(ws, 100, {}, 1.0, random.Random(0)).chosen == "d0"
    ws[0].measured_at = 60.0  # d0 keeps being measured; d1's figure is a minute old
    later = choose(ws, 100, {}, 60.0, random.Random(0))
    by = {s.worker_id: s for s in later.scores}
    assert by["d1"].rate_ms < 0.6 and abs(by["d0"].rate_ms - 0.5) < 1e-9


def test_the_step_a_request_waits_behind_is_the_recent_one_not_the_history():
    """A worker slow once and idle since (its neighbour left) publishes a cumulative step mean
    that never changes: taken as is, no gateway would pick it again, a fresh one included."""
    w = WorkerState("d1", "a:1")
    w.set_load({"running": 2, "decode_steps": 10, "decode_ms": 400.0})
    assert w.step_ms() == 40.0  # first record, streams running: the cumulative mean
    w.set_load({"running": 2, "decode_steps": 15, "decode_ms": 450.0})
    assert w.step_ms() == 10.0  # the steps since the last record
    w.set_load({"running": 0, "decode_steps": 15, "decode_ms": 450.0})
    assert w.step_ms() == 0.0  # no step since: nothing to wait behind
    fresh = WorkerState("d1", "a:1")
    fresh.set_load({"running": 0, "decode_steps": 15, "decode_ms": 450.0})
    assert fresh.step_ms() == 0.0  # a fresh gateway does not inherit the old slowness
    fresh.set_load({"running": 1, "decode_steps": 2, "decode_ms": 30.0})  # restarted: counters went back
    assert fresh.step_ms() == 15.0
    # A fresh gateway: d0 decoding at 15 ms a step, d1 idle with 40 ms steps in its history.
    d0, d1 = WorkerState("d0", "a:2"), WorkerState("d1", "a:1")
    d0.set_load({"running": 3, "decode_steps": 100, "decode_ms": 1500.0})
    d1.set_load({"running": 0, "decode_steps": 10, "decode_ms": 400.0})
    p = choose([d0, d1], 16, {}, 0.0, random.Random(0), tie=0.0, tie_ms=0.0)
    assert p.chosen == "d1", p.as_dict()
    d1.load, d1.recent_step_ms = {"running": 0, "decode_steps": 10, "decode_ms": 400.0}, None  # read as before
    assert choose([d0, d1], 16, {}, 0.0, random.Random(0), tie=0.0, tie_ms=0.0).chosen == "d0"
