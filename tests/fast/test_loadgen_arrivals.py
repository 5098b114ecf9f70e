"""Arrival processes have the configured rate and shape (fixed seeds, statistical bounds)."""

import numpy as np
import pytest

from prfaas_sgl.workload import arrivals
from prfaas_sgl.workload.arrivals import ArrivalSpec


def test_uniform_is_evenly_spaced():
    t = ArrivalSpec("uniform", 4.0).times(np.random.default_rng(0), 5)
    assert t.tolist() == [0.0, 0.25, 0.5, 0.75, 1.0]


def test_poisson_rate_and_exponential_gaps():
    n, rate = 20_000, 8.0
    t = ArrivalSpec("poisson", rate).times(np.random.default_rng(11), n)
    gaps = np.diff(t)
    assert t[0] == 0.0 and np.all(gaps >= 0)
    # mean gap 1/rate with relative standard error 1/sqrt(n) = 0.7%; allow 4 sigma
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)  # exponential: CV = 1
    # counts in 1 s windows: Poisson, so variance / mean (index of dispersion) ~ 1
    counts = np.bincount(t.astype(int))[:-1]
    assert counts.var() / counts.mean() == pytest.approx(1.0, abs=0.15)


def test_bursty_keeps_mean_rate_and_is_overdispersed():
    n, rate = 40_000, 8.0
    spec = ArrivalSpec("bursty", rate, on_s=0.5, off_s=1.5)
    t = spec.times(np.random.default_rng(5), n)
    assert np.all(np.diff(t) >= 0)
    # ~2500 on/off cycles: random cycle lengths give ~1.6% relative error on the overall rate
    assert n / t[-1] == pytest.approx(rate, rel=0.06)
    counts = np.bincount((t * 4).astype(int))[:-1]  # arrivals per 0.25 s window
    assert counts.var() / counts.mean() > 3  # bursts: far more variable than Poisson (measured ~5.8)
    assert (counts == 0).mean() > 0.5  # off periods (75% of the time) leave many empty windows


def test_same_seed_same_times():
    for kind in ("poisson", "bursty"):
        spec = ArrivalSpec(kind, 3.0)
        assert np.array_equal(spec.times(np.random.default_rng(2), 100), spec.times(np.random.default_rng(2), 100))


@pytest.mark.parametrize("kw", [dict(kind="gamma", rate=1.0), dict(kind="poisson", rate=0.0),
                                dict(kind="bursty", rate=1.0, on_s=0.0)])
def test_bad_arrival_specs(kw):
    with pytest.raises(ValueError):
        ArrivalSpec(**kw)


def test_window_form_is_the_simulators_and_stays_inside_the_horizon():
    """The simulator asks for all arrivals before a horizon; the load generator for the first n. Same draws."""
    t = arrivals.poisson(np.random.default_rng(3), 5.0, until=2000.0)
    assert np.all(np.diff(t) >= 0) and t[-1] < 2000.0 and t.size == pytest.approx(10_000, rel=0.05)
    on = arrivals.onoff(np.random.default_rng(3), 10.0, 1.0, 20.0, 20.0, until=4000.0)
    assert on[-1] < 4000.0 and on.size == pytest.approx(22_000, rel=0.15)  # mean rate (10 + 1) / 2
    assert arrivals.uniform(4.0, until=1.0).tolist() == [0.0, 0.25, 0.5, 0.75]
    with pytest.raises(ValueError, match="exactly one"):
        arrivals.poisson(np.random.default_rng(0), 1.0, n=3, until=1.0)
