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
