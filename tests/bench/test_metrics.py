"""Serving metrics: vLLM's TPOT, goodput arithmetic, percentile names, route mix and handoff."""

from __future__ import annotations

import pytest

from pdserve.bench.metrics import RequestRecord, compute_metrics, meets_slos, parse_goodput, percentile_key


def rec(i, ttft, e2el, tokens, success=True, kind="short", route="local", **breakdown):
    return RequestRecord(index=i, kind=kind, prompt_len=10, output_len=tokens, success=success,
                         error="" if success else "RESOURCE_EXHAUSTED: predicted TTFT 900 ms",
                         ttft_ms=ttft, e2el_ms=e2el, completion_tokens=tokens if success else 0,
                         itl_ms=[(e2el - ttft) / max(1, tokens - 1)] * max(0, tokens - 1) if success else [],
                         breakdown={"route": route, "reason": "cost_local_cheaper: x", **breakdown} if success else {})


def test_tpot_is_decode_time_over_tokens_after_the_first():
    assert rec(0, 100.0, 1000.0, 10).tpot_ms == pytest.approx(100.0)
    assert rec(1, 100.0, 100.0, 1).tpot_ms is None  # one token: no TPOT sample
    assert rec(2, None, None, 5, success=False).tpot_ms is None


def test_parse_goodput():
    assert parse_goodput(["ttft:500", "tpot:50", "e2el:2000.5"]) == {"ttft": 500.0, "tpot": 50.0, "e2el": 2000.5}
    assert parse_goodput(None) == {}
    for bad in ("itl:5", "ttft", "ttft:fast", "ttft:0"):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput([bad])


def test_a_good_request_meets_every_slo_inclusive():
    slos = {"ttft": 200.0, "tpot": 50.0}
    assert meets_slos(rec(0, 200.0, 200.0 + 9 * 50.0, 10), slos)  # both exactly at the limit
    assert not meets_slos(rec(1, 201.0, 300.0, 10), slos)  # TTFT over
    assert not meets_slos(rec(2, 100.0, 100.0 + 9 * 51.0, 10), slos)  # TPOT over
    assert meets_slos(rec(3, 150.0, 150.0, 1), slos)  # one token: TPOT counts as 0
    assert not meets_slos(rec(4, None, None, 10, success=False), slos)  # failed is never good


def test_goodput_arithmetic():
    records = [
        rec(0, 100.0, 1000.0, 10),  # TPOT 100: bad
        rec(1, 100.0, 550.0, 10),  # TPOT 50: good
        rec(2, 600.0, 1050.0, 10),  # TTFT 600: bad
        rec(3, 50.0, 500.0, 10),  # good
        rec(4, None, None, 10, success=False),  # refused
    ]
    m = compute_metrics(records, duration_s=2.0, slos={"ttft": 500.0, "tpot": 50.0}, num_workers=2)
    assert m["completed"] == 4 and m["failed"] == 1 and m["num_prompts"] == 5
    assert m["good_requests"] == 2
    assert m["request_goodput"] == pytest.approx(1.0)  # 2 good / 2 s
    assert m["request_goodput_per_worker"] == pytest.approx(0.5)
    assert m["slo_attainment"] == pytest.approx(0.4)  # 2 of 5 sent
    assert m["request_throughput"] == pytest.approx(2.0)
    assert m["total_output_tokens"] == 40 and m["output_throughput"] == pytest.approx(20.0)
    assert m["errors"] == {"RESOURCE_EXHAUSTED": 1}


def test_no_slo_means_no_goodput():
    m = compute_metrics([rec(0, 1.0, 2.0, 2)], 1.0)
    assert m["request_goodput"] is None and m["slo_attainment"] is None


def test_configured_percentiles_use_vllm_names():
    assert percentile_key(99) == "p99" and percentile_key(99.9) == "p99.9"
    m = compute_metrics([rec(i, float(i), float(i) + 90, 10) for i in range(1, 101)], 10.0, percentiles=[25, 99.9])
    assert m["p25_ttft_ms"] == pytest.approx(25.75) and "p99.9_e2el_ms" in m and "p90_ttft_ms" not in m
    assert m["median_ttft_ms"] == pytest.approx(50.5) and m["mean_ttft_ms"] == pytest.approx(50.5)
    assert m["mean_tpot_ms"] == pytest.approx(10.0) and m["mean_itl_ms"] == pytest.approx(10.0)


def test_empty_samples_are_none_not_zero():
    m = compute_metrics([rec(0, None, None, 4, success=False)], 1.0, slos={"ttft": 1.0})
    assert m["mean_ttft_ms"] is None and m["p99_tpot_ms"] is None and m["request_goodput"] == 0.0


def test_route_mix_and_handoff_breakdown_come_from_the_final_breakdowns():
    records = [
        rec(0, 10.0, 50.0, 5, route="local", queue_wait_ms=1.0, prefill_ms=4.0, ttft_ms=5.0),
        rec(1, 30.0, 70.0, 5, kind="long", route="remote", queue_wait_ms=2.0, prefill_ms=20.0, transfer_ms=3.0,
            transfer_bytes=1000, ttft_ms=28.0, prefill_worker="prefill-0"),
        rec(2, 50.0, 90.0, 5, kind="long", route="remote", queue_wait_ms=4.0, prefill_ms=30.0, transfer_ms=5.0,
            transfer_bytes=3000, ttft_ms=44.0, prefill_worker="prefill-0", fell_back_to_local=False),
        rec(3, 10.0, 50.0, 5, route="local", fell_back_to_local=True, queue_wait_ms=3.0, prefill_ms=6.0, ttft_ms=9.0),
    ]
    m = compute_metrics(records, 1.0)
    mix = m["route_mix"]
    assert mix["routes"] == {"local": 2, "remote": 2} and mix["remote_fraction"] == 0.5
    assert mix["fell_back_to_local"] == 1 and mix["reasons"] == {"cost_local_cheaper": 4}
    assert mix["by_prefill_worker"] == {"prefill-0": 2}
    rem, loc = m["handoff"]["remote"], m["handoff"]["local"]
    assert rem["count"] == 2 and rem["mean_prefill_ms"] == 25.0 and rem["mean_transfer_ms"] == 4.0
    assert rem["mean_transfer_bytes"] == 2000.0 and rem["mean_queue_wait_ms"] == 3.0
    assert loc["count"] == 2 and loc["mean_prefill_ms"] == 5.0 and loc["median_ttft_ms"] == 7.0
    assert m["by_kind"]["long"]["routes"] == {"remote": 2} and m["by_kind"]["short"]["completed"] == 2
