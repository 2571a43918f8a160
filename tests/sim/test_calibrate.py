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

    monkeypatch.setattr(cal, "SCALES", tuple(round(1.0 + 0.1 * i, 1) for i in range(11)))  # coarser: faster
    reqs = sorted(generate(mix("long-prompt", 1.5, 40), 1) + generate(mix("decode-heavy", 1.0, 25), 2, 500),
                  key=lambda r: (r.t, r.rid))
    base = replace(BASE, contention_scope="cluster")
    truth = calibrated(base, 1.4, 20.0, 30.0 if topology.prefill else 0.0, "truth",
                       contention_ms_per_token=1.0).with_noise(0.2)
    real = Simulation(reqs, truth, DEFAULT_POLICY, topology, seed=3).run()
    prof, figures = fit(reqs, base, DEFAULT_POLICY, topology, measured_from(real), seed=3, contention=(0.0, 1.0, 2.0))
    # the fitted profile reproduces the run (scale and contention trade off a little: both
    # lengthen steps, so only their effect is asserted tightly)
    for key in ("ttft_p50", "ttft_p90", "itl_p50", "itl_p90"):
        assert figures[key]["simulated"] == pytest.approx(figures[key]["measured"], rel=0.1), key
    assert figures["contention_ms_per_token"] == 1.0  # on this grid, the truth
    assert prof.contention_scope == "cluster"
    assert figures["noise_cv"] == pytest.approx(0.2, abs=0.1) and prof.noise_cv == figures["noise_cv"]
    assert figures["step_scale"] == pytest.approx(1.4, abs=0.1)
    assert figures["request_overhead_ms"] == pytest.approx(20.0, abs=8.0)
    if topology.prefill:
        assert figures["remote_overhead_ms"] == pytest.approx(30.0, abs=12.0)
    assert prof.request_overhead_ms == pytest.approx(figures["request_overhead_ms"], abs=0.01)
    assert figures["prefill_scale"] == pytest.approx(1.4, abs=0.2)
    assert any("calibrated on a real run" in a for a in prof.assumptions)


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
