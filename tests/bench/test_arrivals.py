"""The arrival process: Poisson at the asked rate, burstiness as the gamma shape, inf = all at once."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pdserve.bench.serve import arrival_offsets


def test_poisson_arrivals_have_the_asked_mean_rate():
    offsets = arrival_offsets(20_000, request_rate=4.0, burstiness=1.0, seed=7)
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and np.all(gaps >= 0)
    rate = len(gaps) / offsets[-1]
    assert rate == pytest.approx(4.0, rel=0.03)
    # Exponential gaps: coefficient of variation 1, and P(gap > mean) = 1/e.
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)
    assert np.mean(gaps > 0.25) == pytest.approx(math.exp(-1), abs=0.02)


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_burstiness_keeps_the_rate_and_sets_the_variability(burstiness):
    gaps = np.diff(arrival_offsets(20_000, request_rate=2.0, burstiness=burstiness, seed=1))
    assert gaps.mean() == pytest.approx(0.5, rel=0.05)
    # Gamma with shape k: CV = 1 / sqrt(k).
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.1)


def test_same_seed_same_arrivals():
    a = arrival_offsets(50, 3.0, seed=11)
    assert np.array_equal(a, arrival_offsets(50, 3.0, seed=11))
    assert not np.array_equal(a, arrival_offsets(50, 3.0, seed=12))


def test_infinite_rate_releases_everything_at_once():
    assert np.array_equal(arrival_offsets(5, math.inf), np.zeros(5))


@pytest.mark.parametrize("rate, burstiness", [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.0)])
def test_rate_and_burstiness_must_be_positive(rate, burstiness):
    with pytest.raises(ValueError):
        arrival_offsets(3, rate, burstiness)
