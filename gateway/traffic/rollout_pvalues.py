"""The p-values of a rollout step's tests (pure ``math``): the one-sided Mann-Whitney U
test, the pooled two-proportion z-test and Fisher's exact test, and the percentile the
effect gates read (issue 18; :mod:`gateway.traffic.rollout_stats` decides on them).

**Why no scipy.** ``scipy.stats.mannwhitneyu(x, y, alternative="greater",
method="asymptotic")`` and ``scipy.stats.fisher_exact(..., alternative="greater")`` are the
reference implementations, and the tests check :func:`mann_whitney_greater` and
:func:`fisher_greater` against them to 1e-9 (scipy is a test-only dependency). The
gateway only needs the large-sample normal approximation of U (both sides hold at least
``min_samples`` >= 30 values, past the n > 20 that scipy's own documentation asks of it)
and a hypergeometric tail, about 50 lines of ``math``; scipy 1.17 is a 35 MB wheel, 113 MB
installed (numpy besides), and ``import scipy.stats`` took 0.7 s here: a cost to every
gateway start and worker for those lines. :func:`percentile` is numpy's default
(``linear``) interpolation, also checked against numpy in the tests.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections import Counter
from collections.abc import Sequence

__all__ = ["fisher_greater", "mann_whitney_greater", "normal_sf", "percentile",
           "two_proportion_greater", "u_statistic"]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values`` with linear interpolation between
    order statistics (numpy's default method, Hyndman & Fan's type 7). Empty: ValueError."""
    if not values:
        raise ValueError("percentile of no values")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def normal_sf(z: float) -> float:
    """P(Z > z) for a standard normal Z."""
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def u_statistic(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """The Mann-Whitney U of ``x`` over ``y`` and its variance under the null hypothesis,
    tie-corrected (Lehmann, *Nonparametrics*, 1975): ``(U, Var U)``; its mean is
    ``len(x) len(y) / 2``. Needs both sides non-empty (``ValueError``)."""
    n1, n2 = len(x), len(y)
    if n1 == 0 or n2 == 0:
        raise ValueError("Mann-Whitney U needs values on both sides")
    # U = sum over x of (#y below it + half the #y equal to it): the midrank formula
    # (rank sum of x - n1 (n1 + 1) / 2) counted with two bisections per x on sorted y,
    # without sorting the pooled (value, side) pairs, which the live gateway paid for at
    # every comparison of a rollout's step
    ys = sorted(y)
    u = 0.0
    for v in x:
        lo = bisect_left(ys, v)
        u += lo + 0.5 * (bisect_right(ys, v, lo) - lo)
    counts = Counter(x)
    counts.update(y)
    tie_term = float(sum(t**3 - t for t in counts.values() if t > 1))
    n = n1 + n2
    var = n1 * n2 / 12.0 * ((n + 1) - tie_term / (n * (n - 1)))
    return u, var


def mann_whitney_greater(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """One-sided Mann-Whitney U test that ``x`` is stochastically greater than ``y``:
    ``(U of x, p-value)``. Normal approximation with the tie correction of the variance
    and a 0.5 continuity correction, exactly ``scipy.stats.mannwhitneyu(x, y,
    alternative="greater", method="asymptotic")`` (Mann & Whitney 1947; the tie term:
    Lehmann, *Nonparametrics*, 1975). All values tied: p = 1. Needs both sides non-empty."""
    u, var = u_statistic(x, y)
    if var <= 0.0:
        return u, 1.0
    z = (u - len(x) * len(y) / 2.0 - 0.5) / math.sqrt(var)
    return u, normal_sf(z)


def two_proportion_greater(
    errors_a: int, n_a: int, errors_b: int, n_b: int
) -> tuple[float, float]:
    """One-sided pooled two-proportion z-test that rate a (``errors_a / n_a``) exceeds rate
    b: ``(z, p-value)`` with ``z = (p_a - p_b) / sqrt(p (1 - p) (1/n_a + 1/n_b))`` and ``p``
    the pooled rate (Agresti, *Categorical Data Analysis*, the large-sample test). No
    errors or all errors on both sides: ``(0, 1)``. Needs ``n_a, n_b > 0``."""
    if n_a <= 0 or n_b <= 0:
        raise ValueError("a two-proportion test needs requests on both sides")
    pa, pb = errors_a / n_a, errors_b / n_b
    pooled = (errors_a + errors_b) / (n_a + n_b)
    se = math.sqrt(pooled * (1.0 - pooled) * (1.0 / n_a + 1.0 / n_b))
    if se == 0.0:
        return 0.0, 1.0
    z = (pa - pb) / se
    return z, normal_sf(z)


def _log_comb(n: int, k: int) -> float:
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


def fisher_greater(errors_a: int, n_a: int, errors_b: int, n_b: int) -> float:
    """One-sided Fisher exact test that rate a exceeds rate b: the p-value ``P(X >=
    errors_a)`` for ``X`` hypergeometric (``n_a`` draws from ``n_a + n_b`` requests of which
    ``errors_a + errors_b`` failed), i.e. ``scipy.stats.fisher_exact(table,
    alternative="greater")`` (Fisher 1935; Agresti, *Categorical Data Analysis*)."""
    total, bad = n_a + n_b, errors_a + errors_b
    hi = min(bad, n_a)
    if errors_a > hi:
        return 0.0
    base = _log_comb(total, n_a)
    terms = [_log_comb(bad, x) + _log_comb(total - bad, n_a - x) - base
             for x in range(errors_a, hi + 1) if n_a - x <= total - bad]
    if not terms:
        return 0.0
    top = max(terms)
    return min(1.0, math.exp(top) * math.fsum(math.exp(t - top) for t in terms))
