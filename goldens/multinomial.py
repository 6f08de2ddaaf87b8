"""Draws against exact probabilities: the G-test, its chi-square tail and its power.

Used by the sampler's own proof (pipelines/llama3/tests/test_sampling.py) and by the
judgement of another engine's sampler (harness/llama3/sampler_check.py: the llama.cpp lane
and `golden_check --sampling`). A test states its
alpha; the G-test's false-alarm rate is then alpha for draws from the expected distribution
(asymptotically: the chi-square approximation of G, good with a few expected draws per token),
and its power against another distribution follows from the noncentral chi-square with
lambda = 2 n KL(actual || expected).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping


def chi2_sf(x: float, df: int) -> float:
    """P(chi-square with df degrees of freedom > x): the regularized upper gamma Q(df/2, x/2)
    (series below a + 1, Lentz's continued fraction above)."""
    a, x = df / 2.0, x / 2.0
    if x <= 0:
        return 1.0
    log_front = -x + a * math.log(x) - math.lgamma(a)
    if x < a + 1:
        term = total = 1.0 / a
        n = a
        while abs(term) > abs(total) * 1e-15:
            n += 1
            term *= x / n
            total += term
        return max(0.0, 1.0 - total * math.exp(log_front))
    b, c, d = x + 1 - a, 1e300, 1.0 / (x + 1 - a)
    h = d
    for i in range(1, 1000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = 1e-300 if abs(d) < 1e-300 else d
        c = b + an / c
        c = 1e-300 if abs(c) < 1e-300 else c
        d = 1.0 / d
        h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return math.exp(log_front) * h


def g_test(drawn: Iterable[int], expected: Mapping[int, float]) -> float:
    """The G-test's p-value of the draws against the expected probabilities (token -> p).
    A token the expected distribution never gives is a certain rejection (0.0)."""
    counts: dict[int, int] = {}
    for token in drawn:
        counts[int(token)] = counts.get(int(token), 0) + 1
    if not set(counts) <= set(expected):
        return 0.0
    if len(expected) == 1:
        return 1.0
    n = sum(counts.values())
    g = sum(2 * k * math.log(k / (n * expected[t])) for t, k in counts.items())
    return chi2_sf(g, len(expected) - 1)


def critical(df: int, alpha: float) -> float:
    """The G statistic above which the test rejects at `alpha`: bisection of chi2_sf over
    [0, hi], hi 1000 doubled until its tail is at most alpha (a fixed 1000 capped the answer
    from df ~800 at alpha 1e-6: the mean is df, the spread sqrt(2 df))."""
    lo, hi = 0.0, 1000.0
    while chi2_sf(hi, df) > alpha:
        lo, hi = hi, 2 * hi
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chi2_sf(mid, df) > alpha else (lo, mid)
    return hi


def power(actual: Mapping[int, float], expected: Mapping[int, float], n: int, alpha: float):
    """The G-test's power at `alpha` with `n` draws from `actual` against `expected`:
    1 - (1 - leaked)^n where `actual` gives tokens `expected` never does (one such draw
    rejects), else the noncentral chi-square's tail (lambda = 2 n KL, normal approximation)."""
    leaked = sum(p for t, p in actual.items() if t not in expected)
    if leaked > 0:
        return 1.0 - (1.0 - leaked) ** n
    kl = sum(p * math.log(p / expected[t]) for t, p in actual.items() if p > 0)
    df, lam = len(expected) - 1, 2 * n * kl
    z = (df + lam - critical(df, alpha)) / math.sqrt(2 * (df + 2 * lam))
    return 0.5 * math.erfc(-z / math.sqrt(2))


def noncentral_sf(x: float, df: int, lam: float) -> float:
    """P(noncentral chi-square(df, lam) > x): the Poisson(lam / 2) mixture of central tails.
    With the expected distribution a little off the true one (lam = 2 n KL(true || expected)),
    the test's false-alarm rate is noncentral_sf(critical(df, alpha), df, lam).

    The Poisson weights are taken in log space, from the most likely term outwards, until
    they are negligible: exp(-lam / 2) itself underflows to 0 from lam ~ 1490, where a
    product of weights started there made every weight 0 and the rate 0 (a sampler check
    far off its golden then read as no false alarm at all)."""
    if lam <= 0:
        return chi2_sf(x, df)
    mu = lam / 2
    mode = math.floor(mu)

    def term(j: int) -> tuple[float, float]:  # (Poisson weight of j, its share of the tail)
        weight = math.exp(-mu + j * math.log(mu) - math.lgamma(j + 1))
        return weight, weight * chi2_sf(x, df + 2 * j)

    total = 0.0
    for steps in (itertools.count(mode), range(mode - 1, -1, -1)):  # up from the mode, down
        for j in steps:
            weight, share = term(j)
            total += share
            if weight < 1e-18 and abs(j - mode) > 10:
                break
    return min(1.0, max(0.0, total))
