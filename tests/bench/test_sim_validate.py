"""bench/sim_validate.py: a simulated figure is the median over as many simulated runs as
the real ones it is compared with (each measured figure is the median of the repetitions)."""

from __future__ import annotations

import statistics

from bench.sim_validate import _simulated_once, simulated_summary
from pdserve.router import DEFAULT_POLICY
from pdserve.sim.profile import CostProfile, StepModel
from pdserve.sim.report import Slo
from pdserve.sim.workload import generate, mix

PROFILE = CostProfile(name="t", source="hand-written", kv_bytes_per_token=6144,
                      steps={1: StepModel(7.0, 0.15, 0.11, 0.1, 0.7, kv_blocks=2048)},
                      transfer_setup_ms=1.0, transfer_gb_per_s=4.0, queue_hop_ms=1.0).with_noise(0.3)


def test_each_simulated_figure_is_the_median_of_its_runs():
    trace = generate(mix("decode-heavy", 3.0, 30), 7)
    slo = Slo(1500.0, 50.0)
    runs = [_simulated_once(trace, PROFILE, "2d", DEFAULT_POLICY, slo, 5 + k) for k in range(3)]
    assert len({r["ttft_p99"] for r in runs}) > 1  # the seeds draw different noise: a median means something
    out = simulated_summary(trace, PROFILE, "2d", DEFAULT_POLICY, slo, 5, reps=3)
    for key in ("goodput_req_s", "ttft_p50", "ttft_p99", "itl_p99", "duration_s"):
        assert out[key] == statistics.median(r[key] for r in runs), key
    assert out["sim_reps"] == 3
    assert simulated_summary(trace, PROFILE, "2d", DEFAULT_POLICY, slo, 5) == runs[0]  # one run: itself


def test_the_same_rows_are_reported_calibrated_and_uncalibrated(tmp_path, capsys):
    """`comparison` puts each row's errors from both profiles side by side and counts the rows
    within the bounds each way; `--report` prints it from recorded results, running nothing."""
    import json

    from bench.sim_validate import comparison, main

    def row(mix, cal, unc):
        return {"system": "2d", "mix": mix, "rate": 1.0,
                "error": dict(zip(("goodput_req_s", "ttft_p50", "ttft_p99", "itl_p99"), cal)),
                "uncalibrated_error": dict(zip(("goodput_req_s", "ttft_p50", "ttft_p99", "itl_p99"), unc))}

    rows = [row("long-prompt", (0.01, -0.04, 0.18, -0.2), (0.01, -0.29, -0.32, -0.8)),
            row("prefix", (0.0, -0.16, 0.01, 0.5), (0.0, -0.1, 0.2, None))]
    out = comparison(rows, {"2d": {"uncalibrated": "measured: 35 steps", "calibrated": "calibrated on a real run"}})
    assert "| 2d | long-prompt | 1 | +1% / +1% | -4% / -29% | +18% / -32% | -20% / -80% | **yes** / no |" in out
    assert "| 2d | prefix | 1 | +0% / +0% | -16% / -10% | +1% / +20% | +50% / n/a | no / **yes** |" in out
    assert "calibrated 1 of 2 rows, uncalibrated 1 of 2" in out
    assert "2d: uncalibrated = measured: 35 steps; calibrated = calibrated on a real run" in out
    path = tmp_path / "result.json"
    path.write_text(json.dumps({"rows": rows}))
    assert main(["--report", str(path)]) == 0
    assert "calibrated 1 of 2 rows, uncalibrated 1 of 2" in capsys.readouterr().out


def test_the_scale_study_says_what_its_profile_rests_on(tmp_path):
    """bench/sim_scale.py: a roofline, a measured profile and a calibrated one are told apart, and
    the basis heads the table and titles the plot."""
    import dataclasses

    from bench.sim_scale import describe, plot, report
    from pdserve.sim.calibrate import calibrated
    from pdserve.sim.profile import GPUS, MODELS, roofline

    roof = roofline(MODELS["llama-3-70b"], GPUS["h100"], (4, 8))
    assert describe(roof).endswith("roofline, uncalibrated (no served run fitted)")
    measured = dataclasses.replace(PROFILE, source="measured: 35 steps")
    assert describe(measured).endswith("measured, uncalibrated (no served run fitted)")
    fitted = calibrated(measured, 1.4, 30.0, note="a served run")
    assert "measured, calibrated (calibrated on a real run (a served run)" in describe(fitted)
    best = {"candidate": "1P1D (TP 8/8) conditional", "goodput_req_s": 4.0, "goodput_per_device": 0.25,
            "ttft_ms": {"p99": 900.0}, "tpot_ms": {"p99": 30.0}}
    doc = {"profile": roof.to_dict(), "profile_basis": describe(roof), "slo": {"ttft_ms": 2000.0, "tpot_ms": 60.0},
           "mixes": {"rag": {"rate_per_gpu": 0.25, "scales": {"16": {"best": {"conditional": best}}}}}}
    assert report(doc).startswith(f"Profile: {describe(roof)}")
    plot(doc, tmp_path / "scale.png")
    assert (tmp_path / "scale.png").stat().st_size > 0
