"""bench/planner.py's own arithmetic: the trace, replica-seconds, reaction time, goodput."""

from __future__ import annotations

import pytest

from pdserve.bench.metrics import RequestRecord
from pdserve.bench.planner import parse_phases, summarize, trace_offsets


def test_phases_parse_and_bad_ones_name_the_flag():
    assert parse_phases("20:0.5,60:2") == [(20.0, 0.5), (60.0, 2.0)]
    with pytest.raises(ValueError, match="--phases"):
        parse_phases("20-0.5")
    with pytest.raises(ValueError, match="--phases"):
        parse_phases("20:0")


def test_the_trace_follows_each_phase_rate():
    offs = trace_offsets([(100, 0.5), (100, 4.0)], seed=1)
    low, high = (offs < 100).sum(), ((offs >= 100) & (offs < 200)).sum()
    assert 30 < low < 75 and 320 < high < 480, (low, high)
    assert (offs[1:] >= offs[:-1]).all()


def rec(i, t, ttft, ok=True):
    r = RequestRecord(index=i, kind="random", prompt_len=100, output_len=4, scheduled_s=t, success=ok)
    r.ttft_ms, r.e2el_ms, r.completion_tokens = ttft, None if ttft is None else ttft + 30, 4
    return r


def test_summary_counts_replica_seconds_reaction_and_goodput():
    phases = [(10, 0.5), (10, 2.0)]
    timeline = [(t * 1.0, 1 if t < 14 else 2, 1) for t in range(0, 21)]
    decisions = [{"t": 11.5, "role": "prefill", "action": "up", "reason": "threshold_up", "current": 1,
                  "desired": 2}]
    records = [rec(0, 1, 100), rec(1, 12, 5000), rec(2, 15, 200), rec(3, 16, None, ok=False)]
    s = summarize({"mode": "planner", "records": records, "duration": 20, "timeline": timeline,
                   "decisions": decisions}, phases, {"ttft": 1000})
    # 14 s at 2 workers + 6 s at 3 workers (timeline samples 0..20 s)
    assert s["replica_seconds"] == pytest.approx(14 * 2 + 6 * 3)
    assert s["reaction_decision_s"] == pytest.approx(1.5) and s["reaction_registered_s"] == pytest.approx(4.0)
    assert s["failed"] == 1 and s["goodput_rps"] == pytest.approx(2 / 20) and s["slo_attainment"] == 0.5
    assert [p["slo_attainment"] for p in s["per_phase"]] == [1.0, pytest.approx(1 / 3)]
