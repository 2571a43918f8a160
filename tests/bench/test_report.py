"""The sweep summary (peak goodput, rate sustained within SLO, ratios) and `pdserve bench report`."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.cli import main as bench_main
from pdserve.bench.report import summary_markdown, sweep_summary


def run(rate: float, goodput: float, attainment: float) -> dict:
    return {"request_rate": rate, "request_goodput": goodput, "slo_attainment": attainment}


RESULTS = {
    # attains 90 % up to rate 4, then collapses
    "colocated": {"2": run(2, 1.9, 0.95), "4": run(4, 3.6, 0.9), "6": run(6, 0.5, 0.1)},
    # misses at the lowest rate already, but peaks high later
    "always-remote": {"2": run(2, 1.6, 0.8), "4": run(4, 3.9, 0.97), "6": run(6, 4.0, 0.7)},
    # attains everywhere: unordered keys must not matter
    "conditional": {"6": run(6, 5.7, 0.95), "2": run(2, 1.9, 1.0), "4": run(4, 3.8, 0.95)},
}


def test_peak_goodput_and_the_rate_sustained_within_slo():
    s = sweep_summary(RESULTS, attainment=0.9)
    assert s["modes"]["colocated"] == {"peak_goodput": 3.6, "peak_goodput_rate": 4, "max_rate_at_attainment": 4}
    # 0.97 at rate 4 does not count: rate 2 already missed, so nothing is "sustained"
    assert s["modes"]["always-remote"] == {"peak_goodput": 4.0, "peak_goodput_rate": 6, "max_rate_at_attainment": None}
    assert s["modes"]["conditional"]["max_rate_at_attainment"] == 6
    r = s["ratios"]["conditional"]
    assert r["colocated"]["peak_goodput"] == pytest.approx(5.7 / 3.6)
    assert r["colocated"]["max_rate_at_attainment"] == pytest.approx(6 / 4)
    assert r["always-remote"]["max_rate_at_attainment"] is None  # no ratio to "none"
    assert s["ratios"]["always-remote"]["conditional"]["max_rate_at_attainment"] is None


def test_a_stricter_attainment_lowers_the_sustained_rate():
    s = sweep_summary(RESULTS, attainment=0.96)
    assert s["modes"]["colocated"]["max_rate_at_attainment"] is None
    assert s["modes"]["conditional"]["max_rate_at_attainment"] == 2


def test_markdown_compares_each_conditional_mode_with_the_baselines():
    text = summary_markdown(sweep_summary(RESULTS))
    assert "| conditional / colocated | 1.58x | 1.50x |" in text
    assert "| conditional / always-remote | 1.43x | - |" in text
    assert "colocated / conditional" not in text and "always-remote / colocated" not in text
    assert "| always-remote | 4.00 | 6 | none |" in text


def test_report_command_prints_the_summary_of_a_sweep_json(tmp_path, capsys):
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"config": {"request_rates": [2, 4, 6]}, "results": {}}))
    assert bench_main(["report", str(path)]) == 0
    assert "peak goodput" in capsys.readouterr().out
    assert bench_main(["report", str(path), "--attainment", "1.5"]) == 2
    assert "--attainment" in capsys.readouterr().err
    assert bench_main(["report", str(tmp_path / "missing.json")]) == 2
    assert "no such file" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("[]")
    assert bench_main(["report", str(tmp_path / "bad.json")]) == 2
    assert "not a sweep.json" in capsys.readouterr().err


def test_every_mode_of_a_sweep_gets_its_own_plot_colour():
    from pdserve.bench.plots import COLORS, mode_color

    modes = ["colocated", "always-remote", "conditional", "conditional-length-split", "conditional-tpot"]
    colours = [mode_color(m, modes) for m in modes]
    assert len(set(colours)) == len(modes)
    assert colours[:3] == [COLORS[m] for m in modes[:3]]  # the three modes look the same in every sweep
