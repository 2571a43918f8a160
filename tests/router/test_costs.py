"""CostModel: seeds, EMA arithmetic, transfer fit, reload behaviour."""

from __future__ import annotations

import math

import pytest

from pdserve.router.costs import CostEstimates, CostModel
from pdserve.router.policy import CostModelParams

KV = 128 * 1024


def model(**params) -> CostModel:
    return CostModel(CostModelParams(**params), kv_bytes_per_token=KV)


def test_fresh_model_reports_the_policy_seeds():
    est = model(prefill_local_ms_per_token=0.3, transfer_bandwidth_gb_per_s=5, transfer_setup_ms=1.5).snapshot()
    assert est.prefill_local_ms_per_token == 0.3
    assert est.transfer_bytes_per_ms == 5e6
    assert est.transfer_setup_ms == 1.5
    assert est.kv_bytes_per_token == KV


def test_prefill_sample_moves_the_estimate_by_alpha():
    m = model(prefill_local_ms_per_token=0.1, ema_alpha=0.25)
    m.observe_prefill(tokens=1000, ms=500.0, where="local")  # sample 0.5 ms/token
    assert m.snapshot().prefill_local_ms_per_token == pytest.approx(0.1 + 0.25 * (0.5 - 0.1))


def test_local_and_remote_prefill_are_tracked_separately():
    m = model(prefill_local_ms_per_token=0.1, prefill_remote_ms_per_token=0.1, ema_alpha=1.0)
    m.observe_prefill(tokens=100, ms=30.0, where="remote")
    est = m.snapshot()
    assert (est.prefill_local_ms_per_token, est.prefill_remote_ms_per_token) == (0.1, pytest.approx(0.3))


def test_decode_step_updates_step_time_and_per_token_time():
    m = model(ema_alpha=1.0)
    m.observe_decode_step(ms=40.0, batch=16)
    est = m.snapshot()
    assert (est.decode_step_ms, est.decode_ms_per_token) == (40.0, 2.5)


def test_repeated_samples_converge_on_the_measured_value():
    m = model(prefill_remote_ms_per_token=1.0, ema_alpha=0.2)
    for _ in range(100):
        m.observe_prefill(tokens=2000, ms=100.0, where="remote")
    assert m.snapshot().prefill_remote_ms_per_token == pytest.approx(0.05, rel=1e-6)


def test_same_size_transfers_update_bandwidth_and_keep_setup():
    m = model(transfer_setup_ms=2.0, ema_alpha=1.0)
    m.observe_transfer(num_bytes=10_000_000, ms=12.0)  # 10 MB in 10 ms after setup
    m.observe_transfer(num_bytes=10_000_000, ms=12.0)
    est = m.snapshot()
    assert est.transfer_setup_ms == 2.0
    assert est.transfer_bytes_per_ms == pytest.approx(1e6)


def test_varied_transfer_sizes_recover_setup_and_bandwidth():
    # Truth: 3 ms setup + 4 GB/s (4e6 bytes/ms); seeds are far off.
    m = model(transfer_setup_ms=0.5, transfer_bandwidth_gb_per_s=20)
    for size in [1e6, 8e6, 2e6, 16e6, 4e6, 32e6] * 5:
        m.observe_transfer(num_bytes=int(size), ms=3.0 + size / 4e6)
    est = m.snapshot()
    assert est.transfer_setup_ms == pytest.approx(3.0, rel=1e-6)
    assert est.transfer_bytes_per_ms == pytest.approx(4e6, rel=1e-6)


def test_transfer_prediction_is_setup_plus_bytes_over_bandwidth():
    est = model(transfer_setup_ms=2.0, transfer_bandwidth_gb_per_s=10).snapshot()
    assert est.transfer_ms(1000) == pytest.approx(2.0 + 1000 * KV / 1e7)


def test_zero_token_observations_change_nothing():
    m = model()
    before = m.snapshot()
    m.observe_prefill(tokens=0, ms=5.0, where="local")
    m.observe_decode_step(ms=5.0, batch=0)
    m.observe_transfer(num_bytes=0, ms=1.0)
    assert m.snapshot() == before


@pytest.mark.parametrize("ms", [-1.0, math.nan, math.inf])
def test_impossible_timings_are_rejected(ms):
    with pytest.raises(ValueError):
        model().observe_prefill(tokens=10, ms=ms, where="local")


def test_unknown_prefill_location_is_rejected():
    with pytest.raises(ValueError, match="local' or 'remote"):
        model().observe_prefill(tokens=10, ms=1.0, where="elsewhere")  # type: ignore[arg-type]


def test_snapshot_is_an_immutable_value():
    m = model(ema_alpha=1.0)
    first = m.snapshot()
    m.observe_prefill(tokens=10, ms=10.0, where="local")
    assert first.prefill_local_ms_per_token == 0.1
    assert isinstance(first, CostEstimates)


def test_reload_keeps_measured_values_and_adopts_new_seeds_for_unmeasured():
    m = model(prefill_local_ms_per_token=0.1, prefill_remote_ms_per_token=0.1, ema_alpha=1.0)
    m.observe_prefill(tokens=10, ms=5.0, where="local")
    m.update_params(CostModelParams(prefill_local_ms_per_token=9.0, prefill_remote_ms_per_token=0.7, ema_alpha=0.5))
    est = m.snapshot()
    assert est.prefill_local_ms_per_token == pytest.approx(0.5)  # measured: kept
    assert est.prefill_remote_ms_per_token == 0.7  # never measured: new seed
    m.observe_prefill(tokens=10, ms=15.0, where="local")  # new alpha 0.5
    assert m.snapshot().prefill_local_ms_per_token == pytest.approx(1.0)


def test_model_requires_a_positive_kv_size():
    with pytest.raises(ValueError, match="kv_bytes_per_token"):
        CostModel(CostModelParams(), kv_bytes_per_token=0)


# -- ArrivalRate ----------------------------------------------------------------------


def test_arrival_rate_converges_to_a_steady_rate():
    from pdserve.router.costs import ArrivalRate

    r = ArrivalRate(tau_s=5.0)
    assert r.rate(0.0) == 0.0
    for i in range(200):  # 4 requests per second for 50 s
        r.observe(i * 0.25)
    assert r.rate(200 * 0.25) == pytest.approx(4.0, rel=0.1)


def test_arrival_rate_decays_when_traffic_stops():
    from pdserve.router.costs import ArrivalRate

    r = ArrivalRate(tau_s=5.0)
    for i in range(100):
        r.observe(i * 0.5)
    now = 99 * 0.5
    before = r.rate(now)
    assert r.rate(now + 5.0) == pytest.approx(before * math.exp(-1))
    assert r.rate(now + 60.0) < 0.01
    assert r.rate(now - 1.0) == before  # a clock read out of order does not inflate it


def test_arrival_rate_rejects_a_bad_time_constant():
    from pdserve.router.costs import ArrivalRate

    with pytest.raises(ValueError, match="tau_s"):
        ArrivalRate(tau_s=0)


def test_one_outlier_cannot_poison_a_measured_estimate():
    """A step slowed 100x by one pathological request moves the decode estimate by at
    most alpha x (factor - 1), not alpha x 99; a lasting change still gets through."""
    m = model(decode_step_ms=20.0, ema_alpha=0.2, ema_outlier_factor=4.0)
    for _ in range(3):  # the first measurements move freely (seeds may be far off)
        m.observe_decode_step(ms=20.0, batch=4)
    m.observe_decode_step(ms=2000.0, batch=4)
    assert m.snapshot().decode_step_ms == pytest.approx(20.0 + 0.2 * (80.0 - 20.0))
    for _ in range(30):
        m.observe_decode_step(ms=200.0, batch=4)
    assert m.snapshot().decode_step_ms == pytest.approx(200.0, rel=0.02)


def test_first_measurements_replace_a_far_off_seed_freely():
    m = model(prefill_local_ms_per_token=0.01, ema_alpha=1.0)
    m.observe_prefill(tokens=100, ms=100.0, where="local")  # 1 ms/token, 100x the seed
    assert m.snapshot().prefill_local_ms_per_token == pytest.approx(1.0)
