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


def test_the_g_test_p_value_is_the_chi_square_tail_of_2_sum_k_log_k_over_n_p() -> None:
    """The module's G-test: G = 2 sum k ln(k / (n p)) over the drawn tokens, its p-value the
    chi-square tail with one degree of freedom fewer than the expected distribution has
    tokens, a token never drawn included (df 2 here: the tail is exp(-G / 2), no chi2_sf
    involved). Plants caught: G without its factor 2; df from the tokens drawn (1 here)."""
    expected = {0: 0.5, 1: 0.3, 2: 0.2}
    drawn = [0] * 30 + [1] * 10  # token 2 never drawn
    g = 2 * (30 * math.log(30 / (40 * 0.5)) + 10 * math.log(10 / (40 * 0.3)))
    assert multinomial.g_test(drawn, expected) == pytest.approx(math.exp(-g / 2), rel=1e-9)
    # df 1: the tail is erfc(sqrt(G / 2)); draws in proportion give G 0 and p 1
    g = 2 * (30 * math.log(30 / 20) + 10 * math.log(10 / 20))
    p = multinomial.g_test([5] * 30 + [7] * 10, {5: 0.5, 7: 0.5})
    assert p == pytest.approx(math.erfc(math.sqrt(g / 2)), rel=1e-9)
    assert multinomial.g_test([0] * 5 + [1] * 3 + [2] * 2, expected) == pytest.approx(1.0)


def test_a_token_the_expected_distribution_never_gives_is_a_certain_rejection() -> None:
    """g_test's docstring: a drawn token outside `expected` gives p 0.0 however likely the
    rest; an expected distribution of one token cannot reject (p 1.0). Plant caught: the
    outside-token check dropped (a KeyError, or a p-value from the other draws)."""
    assert multinomial.g_test([0] * 500 + [9], {0: 0.5, 1: 0.5}) == 0.0
    assert multinomial.g_test([0, 0, 3], {0: 1.0}) == 0.0
    assert multinomial.g_test([4] * 50, {4: 1.0}) == 1.0


def test_power_is_one_minus_the_chance_of_never_drawing_a_leaked_token() -> None:
    """power()'s docstring: where `actual` gives tokens `expected` never does, one such draw
    rejects, so the power is 1 - (1 - leaked)^n whatever alpha. Plant caught: leaked^n."""
    actual, expected = {0: 0.5, 1: 0.4, 9: 0.1}, {0: 0.5, 1: 0.5}
    for n in (1, 10, 100):
        assert multinomial.power(actual, expected, n, ALPHA) == pytest.approx(1 - 0.9**n)


@pytest.mark.parametrize(("tokens", "lam"), [(10, 50.0), (100, 100.0)])
def test_power_follows_the_noncentral_tail_at_lambda_2_n_kl(tokens: int, lam: float) -> None:
    """power()'s docstring: the noncentral chi-square's tail at lambda = 2 n KL(actual ||
    expected) in its normal approximation (mean df + lambda, variance 2 (df + 2 lambda)).
    Where that approximation is close (within 0.002 and 0.005 here) it agrees with the exact
    tail noncentral_sf (checked against numpy's draws above) to 0.02. Plant caught: the
    variance 2 (df + lambda) (0.073 and 0.052 off)."""
    expected = {t: 1 / tokens for t in range(tokens)}
    actual = {t: (1.2 if t % 2 else 0.8) / tokens for t in range(tokens)}
    kl = sum(p * math.log(p / expected[t]) for t, p in actual.items())
    n = round(lam / (2 * kl))
    df, lam = tokens - 1, 2 * n * kl
    exact = multinomial.noncentral_sf(multinomial.critical(df, ALPHA), df, lam)
    assert 0.05 < exact < 0.95  # where the power is neither 0 nor 1
    assert multinomial.power(actual, expected, n, ALPHA) == pytest.approx(exact, abs=0.02)
