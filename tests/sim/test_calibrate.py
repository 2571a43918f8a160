"""Calibration (sim/calibrate.py): a run made with known serving costs gives those costs back."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pdserve.router import DEFAULT_POLICY
from pdserve.sim.calibrate import calibrated, fit
from pdserve.sim.cluster import SimTopology, Simulation
from pdserve.sim.profile import CostProfile, StepModel
from pdserve.sim.workload import generate, mix

BASE = CostProfile(name="base", source="hand-written", kv_bytes_per_token=6144,
                   steps={1: StepModel(7.0, 0.15, 0.11, 0.1, 0.7, kv_blocks=2048)},
                   transfer_setup_ms=1.0, transfer_gb_per_s=4.0, queue_hop_ms=1.0)


def measured_from(sim) -> dict[int, dict]:
    """What a client would have measured of a run (here: a simulated one with known costs)."""
    gaps: dict[int, list[float]] = {}
    out = {}
    for r in sim.records:
        if r.first_token is None:
            continue
        out[r.rid] = {"ttft_ms": (r.first_token - r.arrival) * 1e3, "itl_ms": gaps.get(r.rid, [])}
    # per-request gaps are not kept by the simulation: spread its ITLs over the requests
    itls = list(sim.itls_ms)
    for i, rid in enumerate(sorted(out)):
        out[rid]["itl_ms"] = itls[i::len(out)]
    return out


@pytest.mark.parametrize("topology", [SimTopology(0, 1), SimTopology(1, 1)])
def test_fit_recovers_known_serving_costs(topology, monkeypatch):
    """A run made with a contention the fit must find among others (the box shares one host)."""
    import pdserve.sim.calibrate as cal

    # A 0.05 grid (the product's step) over 1.0-2.0: with 0.1 steps a scale one step off is made up
    # for by the overheads, and which side wins turns on the run's details.
    monkeypatch.setattr(cal, "SCALES", tuple(round(1.0 + 0.05 * i, 2) for i in range(21)))
    reqs = sorted(generate(mix("long-prompt", 1.5, 40), 1) + generate(mix("decode-heavy", 1.0, 25), 2, 500),
                  key=lambda r: (r.t, r.rid))
    base = replace(BASE, contention_scope="cluster")
    truth = calibrated(base, 1.4, 20.0, 30.0 if topology.prefill else 0.0, "truth",
                       contention_ms_per_token=1.0).with_noise(0.2)
    # Both routes well represented, so that the local and the remote overheads can each be told
    # apart (the shipped ITL weight, 1.0, sends most of this mix remote once streams decode).
    cm = DEFAULT_POLICY.router.cost_model.model_copy(update={"itl_penalty_weight": 0.1})
    policy = DEFAULT_POLICY.model_copy(update={"router": DEFAULT_POLICY.router.model_copy(update={"cost_model": cm})})
    real = Simulation(reqs, truth, policy, topology, seed=3).run()
    prof, figures = fit(reqs, base, policy, topology, measured_from(real), seed=3, contention=(0.0, 1.0, 2.0))
    # the fitted profile reproduces the run (scale and contention trade off a little: both
    # lengthen steps, so only their effect is asserted tightly)
    for key in ("ttft_p50", "ttft_p90", "itl_p50", "itl_p90"):
        assert figures[key]["simulated"] == pytest.approx(figures[key]["measured"], rel=0.1), key
    assert prof.contention_scope == "cluster"
    # This run does not tell contention from step scale: both lengthen the steps, and since the
    # step plan takes whole prompts when the streams can absorb them (engine/step_budget.py),
    # contention 2 with a smaller scale can reproduce it as well as the truth. What must hold:
    # the fit's choice explains the run at least as well as the truth's contention does, and
    # at the truth's contention the other costs are found.
    at_truth = figures["by_contention"][1.0]  # the fit at the truth's contention, as fit(contention=(1.0,)) gives
    assert figures["loss"] <= at_truth["loss"]
    # Another contention trades against the step scale in the one direction that can: more
    # contention with shorter steps, less with longer ones.
    chosen = figures["contention_ms_per_token"]
    assert chosen == 1.0 or (chosen > 1.0) == (figures["step_scale"] < at_truth["step_scale"]), figures
    assert at_truth["noise_cv"] == pytest.approx(0.2, abs=0.1)
    assert at_truth["step_scale"] == pytest.approx(1.4, abs=0.1 + 1e-9)  # within one step of the grid
    assert at_truth["request_overhead_ms"] == pytest.approx(20.0, abs=8.0)
    if topology.prefill:
        assert at_truth["remote_overhead_ms"] == pytest.approx(30.0, abs=12.0)
    assert prof.request_overhead_ms == pytest.approx(figures["request_overhead_ms"], abs=0.01)
    assert prof.noise_cv == figures["noise_cv"]
    assert at_truth["prefill_scale"] == pytest.approx(1.4, abs=0.2)
    assert any("calibrated on a real run" in a for a in prof.assumptions)


def test_fit_tells_prompt_tokens_outside_the_engine_from_prefill(monkeypatch):
    """A cost per prompt token outside the engine is found when prefix hits tell it from the
    prefill's compute (long prompts, short prefills), and left at 0 when nothing does."""
    import pdserve.sim.calibrate as cal

    monkeypatch.setattr(cal, "SCALES", (1.0, 1.2, 1.4))
    monkeypatch.setattr(cal, "NOISE_CV", (0.0,))
    head = sorted(generate(mix("long-prompt", 1.5, 30), 1) + generate(mix("decode-heavy", 1.0, 20), 2, 500),
                  key=lambda r: (r.t, r.rid))
    start = max(r.t for r in head) + 5.0
    hits = [replace(r, t=r.t + start) for r in generate(mix("prefix", 1.0, 24), 3, 900)]
    truth = calibrated(BASE, 1.2, 10.0, ms_per_prompt_token=0.03, note="truth")
    topo = SimTopology(0, 1)
    with_hits = head + hits
    real = Simulation(with_hits, truth, DEFAULT_POLICY, topo, seed=3).run()
    assert sum(1 for r in real.records if r.cached_len) >= cal.MIN_HITS  # the trace has what the fit needs
    prof, figures = fit(with_hits, BASE, DEFAULT_POLICY, topo, measured_from(real), seed=3)
    assert figures["request_ms_per_prompt_token"] == pytest.approx(0.03, rel=0.35)
    assert prof.request_ms_per_prompt_token == pytest.approx(figures["request_ms_per_prompt_token"], abs=1e-5)
    assert figures["request_overhead_ms"] == pytest.approx(10.0, abs=8.0)
    assert figures["prefill_scale"] == pytest.approx(1.2, abs=0.2)
    # the prefix hits' TTFT: predicted as the run measured it (0.03 ms x ~650 tokens is ~20 ms of it)
    refit = Simulation(hits, prof, DEFAULT_POLICY, topo, seed=3).run()
    again = Simulation(hits, truth, DEFAULT_POLICY, topo, seed=3).run()
    p50 = [sorted((r.first_token - r.arrival) for r in s.records)[len(hits) // 2] for s in (refit, again)]
    assert p50[0] == pytest.approx(p50[1], rel=0.1)
    # without hits nothing tells the two apart: no per-token cost, the slope takes it
    plain = Simulation(head, truth, DEFAULT_POLICY, topo, seed=3).run()
    _, figures = fit(head, BASE, DEFAULT_POLICY, topo, measured_from(plain), seed=3)
    assert figures["request_ms_per_prompt_token"] == 0.0


def test_fit_splits_the_period_into_engine_steps_and_streaming(monkeypatch):
    """Given the engines' own mean step, the step scale is fitted to it and the rest of the
    tokens' period goes between the steps (what the cost model and the step budget never see)."""
    import pdserve.sim.calibrate as cal
    from pdserve.sim.report import mean_step_ms

    monkeypatch.setattr(cal, "SCALES", (1.0, 1.2, 1.4, 1.6, 1.8))
    monkeypatch.setattr(cal, "NOISE_CV", (0.0,))
    reqs = sorted(generate(mix("long-prompt", 1.0, 20), 1) + generate(mix("decode-heavy", 3.0, 40), 2, 500),
                  key=lambda r: (r.t, r.rid))
    topo = SimTopology(0, 1)
    truth = calibrated(BASE, 1.2, 10.0, gap_ms_per_token=1.5, note="truth")
    real = Simulation(reqs, truth, DEFAULT_POLICY, topo, seed=3).run()
    step = mean_step_ms(real)
    prof, figures = fit(reqs, BASE, DEFAULT_POLICY, topo, measured_from(real), seed=3, decode_step_ms=step)
    assert figures["step_scale"] == pytest.approx(1.2, abs=0.05)
    assert figures["stream_gap_ms_per_token"] == pytest.approx(1.5, abs=0.3)
    assert prof.stream_gap_ms_per_token == figures["stream_gap_ms_per_token"]
    # the gap lengthens the period, not the steps the cost model times
    again = Simulation(reqs, prof, DEFAULT_POLICY, topo, seed=3).run()
    assert mean_step_ms(again) == pytest.approx(step, rel=0.05)
    assert max(again.itls_ms) > 0 and sorted(again.itls_ms)[len(again.itls_ms) // 2] > step
    # without the engines' steps the scale takes the whole period
    _, alone = fit(reqs, BASE, DEFAULT_POLICY, topo, measured_from(real), seed=3)
    assert alone["stream_gap_ms_per_token"] == 0.0 and alone["step_scale"] > figures["step_scale"]


def test_prompt_fit_needs_hits_and_shrugs_off_queued_ones():
    from pdserve.sim.calibrate import MIN_HITS, _prompt_fit

    # cold prompts: measured = 4 + 1.5 x simulated + 0.02 x tokens (simulated ~ tokens / 3)
    cold = [(n / 3, 4.0 + 1.5 * n / 3 + 0.02 * n, n, 0) for n in range(100, 1100, 100)]
    hits = [(30.0, 4.0 + 1.5 * 30 + 0.02 * n, n, 512) for n in range(600, 600 + 10 * MIN_HITS, 10)]
    hits[0] = (30.0, 900.0, 600, 512)  # one queued behind a long prefill: the median ignores it
    slope, per_token = _prompt_fit(cold + hits, 0.0)
    assert per_token == pytest.approx(0.02, rel=0.05) and slope == pytest.approx(1.5, rel=0.05)
    # too few hits: nothing tells a token's cost outside the engine from its prefill
    assert _prompt_fit(cold + hits[:MIN_HITS - 1], 0.0)[1] == 0.0
    slope, per_token = _prompt_fit(cold, 0.0)  # the slope takes both
    assert per_token == 0.0 and slope == pytest.approx(1.5 + 0.02 * 3, rel=0.01)


def test_fit_needs_measurements():
    with pytest.raises(ValueError, match="measured TTFTs"):
        fit(generate(mix("long-prompt", 1.0, 3), 0), BASE, DEFAULT_POLICY, SimTopology(0, 1), {})


def test_cli_calibrates_from_files(tmp_path, monkeypatch, capsys):
    import json

    import pdserve.sim.calibrate as cal
    from pdserve.cli import main
    from pdserve.sim.profile import load_profile
    from pdserve.sim.workload import save_trace

    monkeypatch.setattr(cal, "SCALES", (1.0, 1.2, 1.4, 1.6))
    reqs = generate(mix("long-prompt", 1.5, 30), 4, first_rid=1000)
    real = Simulation(reqs, calibrated(BASE, 1.2, 15.0), DEFAULT_POLICY, SimTopology(0, 1), seed=0).run()
    save_trace(reqs, tmp_path / "t.jsonl")
    with open(tmp_path / "m.jsonl", "w") as f:
        for rid, m in measured_from(real).items():
            f.write(json.dumps({"rid": rid, **m}) + "\n")
    BASE.save(tmp_path / "base.yaml")
    args = ["sim", "calibrate", "--profile", str(tmp_path / "base.yaml"), "--trace", str(tmp_path / "t.jsonl"),
            "--measured", str(tmp_path / "m.jsonl"), "--out", str(tmp_path / "served.yaml")]
    assert main(args) == 0
    served = load_profile(tmp_path / "served.yaml")
    assert served.steps[1].fixed_ms == pytest.approx(BASE.steps[1].fixed_ms * 1.2)
    assert served.request_overhead_ms == pytest.approx(15.0, abs=5.0)
    assert "step_scale: 1.2" in capsys.readouterr().out
    (tmp_path / "bad.jsonl").write_text('{"rid": 5, "ttft_ms": 3}\n')
    assert main([*args[:7], str(tmp_path / "bad.jsonl"), *args[8:]]) == 2
    assert "rid 5 is not in" in capsys.readouterr().err


def test_the_scale_search_finds_a_valleys_floor_with_a_third_of_the_runs():
    from pdserve.sim.calibrate import SCALES, _grid_min

    for floor in SCALES:
        calls = []

        def loss(s):
            calls.append(s)
            return abs(s - floor) + (0.01 if s > floor else 0.0)  # asymmetric: ties cannot hide a wrong pick
        assert _grid_min(SCALES, loss) == floor
        assert len(calls) <= len(SCALES) // 2, (floor, len(calls))
