"""The noncentral chi-square tail behind every sampler check's stated false-alarm rate."""

from __future__ import annotations

import itertools
import math
import statistics

import numpy as np
import pytest

from goldens import multinomial

ALPHA = 1e-6


@pytest.mark.parametrize("df", [1, 9, 19])
def test_the_false_alarm_rate_is_alpha_at_no_distance_and_grows_to_one(df: int) -> None:
    """Exactly what the sampler checks state: alpha when the engine's distribution is the
    golden's, rising with the distance, 1 far off. The product of Poisson weights started at
    exp(-lam / 2) underflowed from lam ~ 1490: 1.0026 at 1480, then 0 (planted: that sum)."""
    x = multinomial.critical(df, ALPHA)
    assert multinomial.noncentral_sf(x, df, 0.0) == pytest.approx(ALPHA, rel=1e-6)
    lams = [0.0, 1e-3, 0.5, 10.0, 100.0, 1e3, 1480.0, 1500.0, 2000.0, 1e4, 1e5]
    rates = [multinomial.noncentral_sf(x, df, lam) for lam in lams]
    assert all(0.0 <= rate <= 1.0 for rate in rates), rates
    # non-decreasing (to the series' 1e-12 truncation), and all but 1 from lam 1,480 on
    assert all(b >= a - 1e-12 for a, b in itertools.pairwise(rates)), rates
    assert min(rates[-5:]) > 1 - 1e-9, rates


@pytest.mark.parametrize(("df", "lam"), [(1, 10.0), (9, 10.0), (9, 40.0), (19, 60.0)])
def test_the_tail_matches_seeded_noncentral_draws(df: int, lam: float) -> None:
    """Against numpy's noncentral chi-square draws (seeded): within 5 binomial standard
    errors at a threshold the tail puts between a few percent and most of the mass."""
    x = multinomial.critical(df, 1e-2)
    draws = np.random.default_rng(0).noncentral_chisquare(df, lam, 200_000)
    seen = float((draws > x).mean())
    expected = multinomial.noncentral_sf(x, df, lam)
    assert abs(seen - expected) <= 5 * np.sqrt(expected * (1 - expected) / draws.size), (
        seen,
        expected,
    )


def test_a_sampler_far_from_its_golden_is_inconclusive_not_a_clean_verdict() -> None:
    """2,000 draws of an engine whose own distribution is 0.5 nats from the golden's: the
    false-alarm rate is 1 (harness/llama3/sampler_check.py reads more than 10 alpha as
    INCONCLUSIVE); the underflowing sum gave 0, a clean PASS or FAIL."""
    df = 9
    rate = multinomial.noncentral_sf(multinomial.critical(df, ALPHA), df, 2 * 2000 * 0.5)
    assert rate > 10 * ALPHA


def test_the_critical_value_holds_past_a_thousand_degrees_of_freedom() -> None:
    """critical() bisected over [0, 1000] and capped there: from df ~800 at alpha 1e-6 it gave
    1000, where chi2_sf is near 1 (planted: that bracket). Now its tail is alpha at df 2000,
    it agrees with the Wilson-Hilferty cube-root approximation (independent of chi2_sf;
    within 0.1% here), and it increases with df."""
    df = 2000
    x = multinomial.critical(df, ALPHA)
    assert multinomial.chi2_sf(x, df) == pytest.approx(ALPHA, rel=0.01)
    z = statistics.NormalDist().inv_cdf(1 - ALPHA)
    wilson_hilferty = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    assert x == pytest.approx(wilson_hilferty, rel=1e-3)
    dfs = [1, 9, 100, 500, 799, 800, 801, 1000, 2000, 5000]
    values = [multinomial.critical(d, ALPHA) for d in dfs]
    assert all(b > a for a, b in itertools.pairwise(values)), values
