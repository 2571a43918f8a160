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


def test_a_verifying_step_is_priced_per_token_each_stream_got():
    # speculative decoding: a 40 ms step gave each of 16 streams 2.5 tokens on average, so they
    # see a token every 16 ms, and each token emitted cost 1 ms of the step
    m = model(ema_alpha=1.0)
    m.observe_decode_step(ms=40.0, batch=16, tokens_per_stream=2.5)
    est = m.snapshot()
    assert (est.decode_step_ms, est.decode_ms_per_token) == (16.0, 1.0)
    for bad in (0.5, float("nan")):
        with pytest.raises(ValueError, match="tokens_per_stream"):
            m.observe_decode_step(ms=40.0, batch=16, tokens_per_stream=bad)


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


# -- the step cost curve (issue 28) -------------------------------------------------------------

def curve(m: CostModel) -> tuple[float, float, float, float]:
    e = m.snapshot()
    return e.step_fixed_ms, e.step_decode_ms_per_seq, e.prefill_local_ms_per_token, e.prefill_attention_ms_per_kpair


TRUE = (12.0, 0.8, 0.3, 0.5)  # the curve the tests' "machine" follows


def pairs(p: int, start: int = 0) -> int:
    return p * start + p * (p + 1) // 2


def true_step(d: int, p: int, start: int = 0) -> float:
    return TRUE[0] + TRUE[1] * d + TRUE[2] * p + TRUE[3] * pairs(p, start) / 1e3


def mixed_steps(n: int):
    for i in range(n):  # decode-only steps, prefill-only steps (some deep into a prompt), mixed ones
        d, p, s = [(4, 0, 0), (0, 256, 0), (8, 64, 512), (1, 0, 0), (0, 32, 0), (2, 512, 1024)][i % 6]
        yield true_step(d, p, s), d, p, pairs(p, s)


def test_the_step_curve_is_recovered_from_mixed_steps():
    m = model(step_fixed_ms=1.0, step_decode_ms_per_seq=5.0, prefill_local_ms_per_token=2.0)
    for ms, d, p, q in mixed_steps(120):
        m.observe_step(ms, d, p, q)
    assert curve(m) == pytest.approx(TRUE, rel=0.02)
    assert m.snapshot().step_ms(3, 100, pairs(100, 300)) == pytest.approx(true_step(3, 100, 300), rel=0.02)


def test_a_direction_recent_steps_do_not_exercise_keeps_its_value():
    m = model()
    for ms, d, p, q in mixed_steps(120):
        m.observe_step(ms, d, p, q)
    for _ in range(500):  # a long decode-only stretch with one batch size: says nothing of prompts
        m.observe_step(true_step(4, 0), 4, 0)
    assert m.snapshot().prefill_local_ms_per_token == pytest.approx(0.3, rel=0.05)
    assert m.snapshot().step_ms(4, 0) == pytest.approx(true_step(4, 0), rel=0.01)


def test_one_stalled_step_moves_the_curve_little():
    m = model()
    for ms, d, p, q in mixed_steps(60):
        m.observe_step(ms, d, p, q)
    before = m.snapshot().step_ms(4, 0)
    m.observe_step(100 * true_step(4, 0), 4, 0)  # a GC pause
    assert m.snapshot().step_ms(4, 0) < 1.5 * before


def test_calibration_replaces_the_seeds():
    seeds = dict(step_fixed_ms=10.0, step_decode_ms_per_seq=0.5, prefill_local_ms_per_token=0.1, decode_step_ms=25.0)
    m = model(**seeds)
    steps = [(true_step(d, p), d, p, pairs(p)) for d, p in [(0, 32), (0, 128), (0, 512), (0, 128), (8, 0), (8, 0),
                                                            (8, 128), (1, 0), (1, 0)]]
    m.calibrate(steps)
    assert curve(m) == pytest.approx(TRUE, rel=0.01)
    assert m.snapshot().remote_ratio == pytest.approx(1.0)  # no prefill worker measured yet: same engine
    assert m.snapshot().decode_step_ms == pytest.approx(true_step(8, 0))  # the median decode-only step
    # a policy reload afterwards keeps the calibrated figures (they are measured, not seeds)
    m.update_params(CostModelParams(**{**seeds, "step_fixed_ms": 99.0, "prefill_local_ms_per_token": 9.0}))
    assert curve(m) == pytest.approx(TRUE, rel=0.01)


def test_the_curve_stays_physical():
    m = model()
    m.calibrate([(5.0, 0, 100, pairs(100)), (5.0, 0, 200, pairs(200)), (5.0, 4, 0, 0)])  # flat: no cost visible
    fixed, per_seq, per_token, per_kpair = curve(m)
    assert fixed >= 0 and per_seq >= 0 and per_token > 0 and per_kpair >= 0


def test_a_prefill_worker_twice_as_slow_doubles_the_remote_compute():
    m = model(ema_alpha=0.5)
    m.calibrate([(true_step(d, p), d, p, pairs(p)) for d, p in [(0, 32), (0, 128), (0, 512), (8, 0), (1, 0), (8, 128)]])
    for _ in range(20):  # a prompt of 300 after 100 cached, alone in its batch, at half this worker's speed
        m.observe_remote_prefill(300, 100, 2 * (TRUE[0] + TRUE[2] * 300 + TRUE[3] * pairs(300, 100) / 1e3))
    e = m.snapshot()
    assert e.remote_ratio == pytest.approx(2.0, rel=1e-3)
    assert e.prefill_compute_ms(400, where="remote") == pytest.approx(2 * e.prefill_compute_ms(400), rel=1e-3)


def test_ttft_residuals_learn_what_the_formula_leaves_out_per_route():
    m = model(ema_alpha=0.5)
    for _ in range(20):
        m.observe_ttft("remote", measured_ms=130.0, formula_ms=100.0)
        m.observe_ttft("local", measured_ms=95.0, formula_ms=100.0)
    e = m.snapshot()
    assert e.ttft_residual_remote_ms == pytest.approx(30.0, abs=0.01)
    assert e.ttft_residual_local_ms == pytest.approx(-5.0, abs=0.01)


def test_the_local_drain_is_wall_time_per_prompt_token_over_backlog_steps():
    """observe_drain: back-to-back backlog steps count the gaps between them; the rate is
    published once DRAIN_MIN_TOKENS were seen, and follows a load that changes."""
    from pdserve.router.costs import DRAIN_MIN_TOKENS, DRAIN_WINDOW_STEPS
    m = model(prefill_local_ms_per_token=0.1)
    t = 0.0
    for _ in range(DRAIN_MIN_TOKENS // 100 - 1):  # not enough tokens yet: unknown (0)
        t += 0.05
        m.observe_drain(t, 40.0, 100, 500)
    assert m.snapshot().local_drain_ms_per_token == 0.0
    for _ in range(200):  # 50 ms apart (a 40 ms step + a 10 ms gap), 100 prompt tokens each
        t += 0.05
        m.observe_drain(t, 40.0, 100, 500)
    assert m.snapshot().local_drain_ms_per_token == pytest.approx(0.5, rel=1e-3)
    t += 0.05
    m.observe_drain(t, 20.0, 0, 0)  # the backlog is gone (a decode step)
    t += 5.0  # an idle pause, then a prompt's first step: its own time only, not the pause
    m.observe_drain(t, 40.0, 100, 500)
    assert m.snapshot().local_drain_ms_per_token < 0.5
    for _ in range(10 * DRAIN_WINDOW_STEPS):  # the load changes: steps now 100 ms apart
        t += 0.1
        m.observe_drain(t, 90.0, 100, 500)
    assert m.snapshot().local_drain_ms_per_token == pytest.approx(1.0, rel=1e-3)
    m.observe_drain(t + 0.1, 10.0, 0, 0)  # a step without backlog or prompt: no sample
    assert m.snapshot().local_drain_ms_per_token == pytest.approx(1.0, rel=1e-3)


def test_backlog_steps_without_prompt_tokens_slow_the_drain():
    """A backlog that made no progress (say, the KV pool full) is time spent, no tokens gained."""
    m = model(prefill_local_ms_per_token=0.1)
    t = 0.0
    for i in range(400):
        t += 0.05
        m.observe_drain(t, 50.0, 100 if i % 2 else 0, 1000)
    assert m.snapshot().local_drain_ms_per_token == pytest.approx(1.0, rel=0.05)


def test_a_borrow_is_cheaper_only_while_reading_beats_computing_and_slow_reads_turn_it_off():
    """Both workers borrow a prefix only when reading it is predicted cheaper than computing it
    (CostEstimates.borrow_cheaper): a prefill worker once borrowed whenever a holder had two more
    blocks. Fed measured loans that crawl, the model stops borrowing."""
    m = model(prefill_local_ms_per_token=0.1, prefill_attention_ms_per_kpair=0.0, transfer_bandwidth_gb_per_s=10,
              transfer_setup_ms=2.0, ema_alpha=0.5)
    cheaper, read_ms, compute_ms = m.snapshot().borrow_cheaper(1024, 0)
    assert cheaper and read_ms == pytest.approx(2.0 + 1024 * KV / 1e7) and compute_ms == pytest.approx(102.4)
    assert not m.snapshot().borrow_cheaper(16, 0)[0]  # 1.6 ms of compute against a 2 ms setup
    for n in (256, 1024, 4096, 256, 1024, 4096):  # measured loans: 5 ms setup, then 100 kB/ms
        m.observe_transfer(n * KV, 5.0 + n * KV / 1e5)
    cheaper, read_ms, compute_ms = m.snapshot().borrow_cheaper(1024, 0)
    assert not cheaper and read_ms > compute_ms
