"""The simulator (sim/): determinism, conservation, and that the decisions are the product's.

Runs are small (tens to hundreds of requests) on a hand-written profile; nothing here times
anything (the 10,000-request figure is in docs/PERFORMANCE.md).
"""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.cluster.planner.policy import parse_autoscale
from pdserve.router import DEFAULT_POLICY
from pdserve.sim import autoscale as sim_autoscale
from pdserve.sim import decode_sim
from pdserve.sim.cluster import SimTopology, Simulation
from pdserve.sim.profile import CostProfile, ProfileError, StepModel, profile_from_dict
from pdserve.sim.report import Slo, summarize
from pdserve.sim.search import candidates, search, variations, with_mode
from pdserve.sim.workload import generate, mix

PROFILE = CostProfile(
    name="test", source="hand-written", kv_bytes_per_token=16384,
    steps={1: StepModel(8.0, 0.2, 0.4, 0.05, 0.3, kv_blocks=2048),
           2: StepModel(5.0, 0.1, 0.2, 0.025, 0.15, kv_blocks=4096)},
    transfer_setup_ms=2.0, transfer_gb_per_s=4.0, queue_hop_ms=1.0, noise_cv=0.1)


def run(topology=SimTopology(1, 1), n=120, rate=3.0, seed=7, policy=DEFAULT_POLICY, name="long-prompt", **kw):
    reqs = generate(mix(name, rate, n), seed=seed)
    return Simulation(reqs, PROFILE, policy, topology, seed=seed, **kw).run()


def fingerprint(sim):
    return [(r.rid, r.worker, r.route, r.refused, r.first_token, r.finished, r.tokens) for r in sim.records]


def test_same_seed_same_result_and_another_seed_differs():
    a, b = run(), run()
    assert fingerprint(a) == fingerprint(b)
    assert summarize(a, Slo(1500, 50)) == summarize(b, Slo(1500, 50))
    assert fingerprint(run(seed=8)) != fingerprint(a)


@pytest.mark.parametrize("topology", [SimTopology(0, 1), SimTopology(1, 1), SimTopology(2, 3, ingress="gateway"),
                                      SimTopology(1, 2, 2, 1, ingress="random")])
def test_every_request_ends_once_and_nothing_is_left_held(topology):
    sim = run(topology, n=150, rate=6.0)
    recs = sim.records
    assert sorted(r.rid for r in recs) == list(range(150))  # each arrival recorded once
    for r in recs:
        if r.refused is None:
            assert r.finished is not None and r.first_token is not None, r
            assert r.tokens == r.output_len  # every token, no more
            assert r.arrival <= r.first_token <= r.finished
        else:
            assert r.first_token is None and r.tokens == 0
    for d in sim.decode:
        assert not d.inflight
        assert not d.local_prefills and d.pending_remote_tokens == d.pending_remote_requests == 0
        assert d.num_prefilling == d.num_decoding == 0
        assert d.engine.kv.usage == 0.0 and not d.engine.scheduler.has_work()
    for p in sim.prefill:
        assert not p.jobs and p.engine.kv.usage == 0.0
    assert len(sim.queue) == 0


def test_overload_refuses_with_the_admissions_reasons_and_still_conserves():
    sim = run(SimTopology(0, 1), n=200, rate=40.0)
    s = summarize(sim, Slo(1500, 50))
    assert s["refused"] and set(s["refused"]) <= {"queue_wait_exceeded", "kv_pool_full", "ttft_slo"}
    assert s["completed"] + sum(s["refused"].values()) == 200


def test_the_router_admission_and_scheduler_are_the_products(monkeypatch):
    """The simulator calls router.qos.admit (which calls router.decide) once per arrival and
    plans every step with engine/scheduler.py: a spy on the product's functions sees it."""
    import pdserve.engine.scheduler as scheduler_mod
    import pdserve.router.qos as qos

    decided = []
    real_decide = qos.decide
    monkeypatch.setattr(qos, "decide", lambda *a, **k: decided.append(1) or real_decide(*a, **k))
    planned = []
    real_plan = scheduler_mod.plan_budget
    monkeypatch.setattr(scheduler_mod, "plan_budget", lambda *a, **k: planned.append(1) or real_plan(*a, **k))
    assert decode_sim.admit is qos.admit
    sim = run(SimTopology(1, 1), n=40)
    assert len(decided) == 40
    assert planned  # the decode worker's SLO-aware budget, planned by the engine's scheduler
    assert isinstance(sim.decode[0].engine.scheduler, scheduler_mod.Scheduler)


def test_the_routers_mode_drives_the_routes():
    remote = summarize(run(policy=with_mode(DEFAULT_POLICY, "always_remote")))
    local = summarize(run(policy=with_mode(DEFAULT_POLICY, "always_local")))
    assert set(remote["routes"]) == {"remote"} and remote["reasons"] == {"mode_always_remote": 120}
    assert set(local["routes"]) == {"local"}
    assert remote["utilization"]["prefill"] > 0 and local["utilization"]["prefill"] == 0


def test_prefix_sharing_reaches_the_real_prefix_cache():
    sim = run(SimTopology(0, 1), n=60, rate=2.0, name="prefix")
    hits = [r.cached_len for r in sim.records if r.refused is None]
    assert sum(1 for h in hits if h >= 496) >= 50  # a 512-token group prefix, in whole 16-token blocks


def test_the_cost_model_learns_the_profiles_costs():
    """Calibrated at boot from simulated steps and refitted every step, the decode worker's cost
    model ends near the profile's per-token cost (it is the product's CostModel)."""
    sim = run(SimTopology(0, 1), n=60, rate=1.0)
    est = sim.decode[0].state.costs.snapshot()
    assert est.prefill_local_ms_per_token == pytest.approx(PROFILE.steps[1].prefill_ms_per_token, rel=0.35)
    uncalibrated = run(SimTopology(0, 1), n=1, rate=1.0, calibrate_at_boot=False)
    seed = DEFAULT_POLICY.router.cost_model.prefill_local_ms_per_token
    assert uncalibrated.decode[0].state.costs.snapshot().prefill_local_ms_per_token != est.prefill_local_ms_per_token
    assert seed > 0


def test_the_planner_scales_up_under_load_with_its_own_decide(monkeypatch):
    section = parse_autoscale("""
autoscale:
  prefill: {min_replicas: 1, max_replicas: 3, scale_up: {queue_length: 4}, scale_down: {queue_length: 0}}
  decode: {min_replicas: 1, max_replicas: 3, scale_up: {queue_length: 4}, scale_down: {queue_length: 0}}
  interval_s: 2
  cooldown_s: 4
  down_stable_s: 4
  gpu_budget: 6
""").autoscale
    calls = []
    real = sim_autoscale.decide
    monkeypatch.setattr(sim_autoscale, "decide", lambda *a, **k: calls.append(1) or real(*a, **k))
    scaler = sim_autoscale.Autoscaler(section, start_s=3.0)
    sim = run(SimTopology(1, 1), n=300, rate=25.0, autoscale=scaler)
    ups = [d for d in scaler.decisions if d["action"] == "up"]
    assert calls and ups
    assert len(sim.workers("decode")) + len(sim.workers("prefill")) > 2
    for r in sim.records:  # conservation holds across starts and drains
        assert (r.refused is None) == (r.finished is not None)


def test_search_ranks_candidates_within_the_budget():
    cands = candidates(4, (1, 2), profile=PROFILE)
    assert cands and all(c.topology.gpus <= 4 and c.topology.gpus * 2 >= 4 for c in cands)
    assert any(c.topology.prefill == 0 for c in cands) and any(c.topology.prefill_tp == 2 for c in cands)
    small = [c for c in cands if c.topology.gpus == 4 and c.topology.prefill_tp == c.topology.decode_tp == 1][:4]
    reqs = generate(mix("long-prompt", 8.0, 60), seed=1)
    rows = search(reqs, PROFILE, DEFAULT_POLICY, small, Slo(1500, 50), seed=1)
    goodputs = [r["goodput_req_s"] for r in rows]
    assert goodputs == sorted(goodputs, reverse=True)
    assert rows[0]["margin"]["goodput_vs_best"] == 1.0


def test_search_sweeps_router_and_qos_settings_and_refuses_bad_ones():
    """``--vary``: each combination of policy values is a candidate, and the simulation runs with
    them (here early rejection off serves what it refuses on an overload)."""
    grid = variations(["qos.enable_early_rejection=true,false", "router.cost_model.min_gain_ms=0,20"])
    assert len(grid) == 4 and (("qos.enable_early_rejection", False), ("router.cost_model.min_gain_ms", 20)) in grid
    cands = [c for c in candidates(2, (1,), profile=PROFILE, grid=grid) if c.topology.prefill == 0 and c.topology.gpus == 2]
    assert len(cands) == 4 and all("qos.enable_early_rejection=" in c.label for c in cands)
    assert cands[0].policy(DEFAULT_POLICY).qos.enable_early_rejection is True
    reqs = generate(mix("long-prompt", 12.0, 80), seed=2)
    rows = search(reqs, PROFILE, DEFAULT_POLICY, cands, Slo(1500, 50), seed=2)
    refused = {r["params"]["qos.enable_early_rejection"]: sum(r["refused"].values()) for r in rows}
    assert refused[True] > 0 and refused[False] < refused[True]
    with pytest.raises(ValueError, match="router.cost_model.min_gain: no such setting"):
        variations(["router.cost_model.min_gain=1"])
    with pytest.raises(ValueError, match="min_gain_ms"):
        variations(["router.cost_model.min_gain_ms=-5"])
    with pytest.raises(ValueError, match="expected PATH=V1,V2"):
        variations(["router.mode"])


def test_a_topology_the_profile_cannot_time_is_refused():
    from pdserve.sim.profile import ProfileError

    with pytest.raises(ProfileError, match="tensor_parallel_size 4"):
        Simulation([], PROFILE, DEFAULT_POLICY, SimTopology(1, 1, prefill_tp=4))
    with pytest.raises(ValueError, match="ingress"):
        SimTopology(ingress="dns")
    assert dataclasses.replace(SimTopology(2, 6, 4, 1)).gpus == 14


def test_streams_slow_the_steps_of_their_host_in_proportion_to_their_rate():
    """Contention (sim/profile.py): the moving token rate is what the decode worker streamed, and
    steps run 1 + rate x ms / 1000 times longer, on the worker's own host or on a shared one."""
    from pdserve.sim.engine import StreamLoad

    load = StreamLoad(window_s=1.0)
    for i in range(200):  # 100 tokens a step, every 0.1 s: 1000 tokens/s for 20 s
        load.add(i * 0.1, 100)
    assert load.rate(19.9) == pytest.approx(1000.0, rel=0.06)
    assert load.rate(24.9) < 10.0  # five windows after the last token
    quiet = dataclasses.replace(PROFILE, noise_cv=0.0)
    busy = dataclasses.replace(quiet, contention_ms_per_token=1.0)
    shared = dataclasses.replace(busy, contention_scope="cluster")
    reqs = generate(mix("decode-heavy", 4.0, 80), seed=5)
    base, own, box = (Simulation(reqs, p, DEFAULT_POLICY, SimTopology(1, 1), seed=5).run() for p in (quiet, busy, shared))
    mean_itl = [sum(s.itls_ms) / len(s.itls_ms) for s in (base, own, box)]
    assert mean_itl[1] > mean_itl[0] * 1.05  # the decode worker's own streams slow it
    # the prefill worker hears the decode worker's streams only where it shares its host
    assert own.prefill[0].engine.load.rate(own.now) == 0.0
    assert box.prefill[0].engine.load is box.stream_load is box.decode[0].engine.load
    # one step, planned at 500 tokens/s: 1.5 times the step model's time
    eng = box.prefill[0].engine
    eng.load = StreamLoad(window_s=1.0)
    eng.load.add(box.now, 500)
    req = eng.request("x", list(range(64)), 4, "normal", box.now)
    eng.scheduler.add(req)
    _, info = eng.plan()
    model = quiet.steps[1]
    assert info.ms == pytest.approx(model.step_ms(0, 64, info.pairs, 0) * 1.5, rel=1e-6)
    with pytest.raises(ProfileError, match="contention_scope"):
        profile_from_dict({**quiet.to_dict(), "contention_scope": "rack"})


def test_host_stalls_hold_everything_up_and_keep_the_run_whole():
    """A profile with host stalls (CostProfile.stall_*): deterministic, every request still
    ends once, the stalls happen at the profile's rate, and requests caught in one take longer."""
    from pdserve.sim.report import percentile

    stalled = dataclasses.replace(PROFILE, stall_rate_per_s=0.5, stall_median_ms=400.0, stall_sigma=0.3)
    reqs = generate(mix("decode-heavy", 3.0, 150), seed=7)

    def go(prof):
        return Simulation(reqs, prof, DEFAULT_POLICY, SimTopology(1, 1), seed=7).run()

    a, b, calm = go(stalled), go(stalled), go(PROFILE)
    assert fingerprint(a) == fingerprint(b) and a.stalls == b.stalls
    assert fingerprint(calm) == fingerprint(run(name="decode-heavy", rate=3.0, n=150))  # no stalls: as before
    assert not calm.stalls
    span = max(r.finished for r in a.records) - min(r.arrival for r in a.records)
    assert 0.25 * span <= len(a.stalls) <= 1.0 * span, (len(a.stalls), span)  # ~0.5 per second
    assert all(100 < ms < 2000 for _, ms in a.stalls)
    for r in a.records:
        assert r.refused is None and r.arrival <= r.first_token <= r.finished and r.tokens == r.output_len
    def ttfts(sim):
        return [(r.first_token - r.arrival) * 1e3 for r in sim.records]

    assert percentile(ttfts(a), 99) > percentile(ttfts(calm), 99) + 100


def test_host_stalls_are_the_silences_of_every_stream_while_one_decodes():
    from pdserve.sim.calibrate import host_stalls

    def stream(start, n, gap=0.02, hole=None):
        t, out = start, []
        for _ in range(n):
            out.append(t)
            t += gap + (0.6 if hole is not None and abs(t - hole) < gap / 2 else 0.0)
        return {"times": out}

    # two streams decoding 0-4 s with a 0.6 s hole at t=2 in both; then a lone stream after a
    # 3 s pause with nothing decoding (no stall: nothing was waiting for a token)
    run = [stream(0.0, 200, hole=2.0), stream(0.01, 200, hole=2.01), stream(10.0, 50)]
    got = host_stalls([run])
    assert got["stalls"] == 1 and 550 <= got["stall_median_ms"] <= 620, got
    assert got["stall_rate_per_s"] == pytest.approx(1 / got["decoding_s"], rel=1e-2)
    assert host_stalls([[stream(0.0, 100)]])["stalls"] == 0


def test_a_prompt_without_kv_room_is_held_as_the_worker_holds_it():
    """qos.kv_full_wait_ms as decode/frontend.py applies it: a prompt the pool cannot hold beside
    the streams waits for room instead of being refused at once, so a tight pool refuses fewer
    and completes more; every request still ends once, and a held one starts after its hold."""
    tight = dataclasses.replace(PROFILE, steps={k: dataclasses.replace(v, kv_blocks=160)
                                                for k, v in PROFILE.steps.items()})

    def with_wait(ms):
        return DEFAULT_POLICY.model_copy(update={"qos": DEFAULT_POLICY.qos.model_copy(
            update={"kv_full_wait_ms": ms})})

    reqs = generate(mix("long-prompt", 2.0, 150), seed=7)
    at_once = Simulation(reqs, tight, with_wait(0.0), SimTopology(0, 1), seed=7).run()
    held = Simulation(reqs, tight, with_wait(1000.0), SimTopology(0, 1), seed=7).run()
    a, h = summarize(at_once, Slo(1500, 50)), summarize(held, Slo(1500, 50))
    assert a["refused"].get("kv_pool_full", 0) > 0 and not any(r.held_since for r in at_once.records)
    assert h["refused"].get("kv_pool_full", 0) < a["refused"]["kv_pool_full"]
    assert h["completed"] > a["completed"]
    waited = [r for r in held.records if r.held_since is not None]
    assert waited and any(r.refused is None for r in waited)
    for r in held.records:
        assert (r.refused is None) == (r.finished is not None)
        if r.held_since is not None and r.first_token is not None:
            assert r.arrival <= r.held_since <= r.first_token
    assert h["completed"] + sum(h["refused"].values()) == 150
    assert not held.decode[0].held and not held.decode[0].inflight
