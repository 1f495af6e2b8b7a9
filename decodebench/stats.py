"""Small distribution-free statistics on timing samples (pure Python, no numpy needed)."""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = [
    "dispersion",
    "mann_whitney_p",
    "median",
    "median_ci",
    "median_precision",
    "quantile",
]

Z95 = 1.959963984540054


def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile ``q`` in [0, 1] of ``values``.

    >>> quantile([1.0, 2.0, 3.0, 4.0], 0.5)
    2.5
    """
    if not values:
        raise ValueError("quantile of no values")
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float:
    return quantile(values, 0.5)


def dispersion(values: Sequence[float]) -> float:
    """Interquartile range over median: how spread the samples themselves are.

    >>> dispersion([1.0, 1.0, 2.0, 3.0, 3.0])
    1.0
    """
    mid = median(values)
    return (quantile(values, 0.75) - quantile(values, 0.25)) / mid if mid else math.inf


def median_ci(values: Sequence[float], z: float = Z95) -> tuple[float, float]:
    """Distribution-free confidence interval of the median from order statistics.

    With n samples the ranks n/2 -+ z*sqrt(n)/2 bound the median at about the
    coverage that ``z`` names (95 % by default); no normality is assumed.

    >>> median_ci([float(i) for i in range(1, 101)])
    (40.0, 61.0)
    """
    ordered = sorted(values)
    n = len(ordered)
    half_width = z * math.sqrt(n) / 2
    lo = max(0, math.floor(n / 2 - half_width) - 1)  # rank n/2 - hw, 1-based
    hi = min(n - 1, math.ceil(n / 2 + half_width))  # rank 1 + n/2 + hw, 1-based
    return ordered[lo], ordered[hi]


def median_precision(values: Sequence[float]) -> float:
    """Half-width of the median's 95 % interval relative to the median (inf if < 3 samples)."""
    if len(values) < 3:
        return math.inf
    lo, hi = median_ci(values)
    mid = median(values)
    return (hi - lo) / 2 / mid if mid > 0 else math.inf


def mann_whitney_p(a: Sequence[float], b: Sequence[float]) -> float:
    """Two-sided p-value of the Mann-Whitney U test.

    Normal approximation with continuity and tie corrections (scipy's "asymptotic").

    Timing samples are skewed (a floor and a tail), so a rank test fits them better
    than a t-test. Good for the sample counts a benchmark collects (>= 8 per side).

    >>> round(mann_whitney_p([1, 2, 3, 4, 5, 6, 7, 8], [11, 12, 13, 14, 15, 16, 17, 18]), 5)
    0.00094
    """
    n1, n2 = len(a), len(b)
    if n1 == 0 or n2 == 0:
        return 1.0
    ranks, tie_term = _ranks([*a, *b])
    r1 = sum(ranks[:n1])
    u1 = r1 - n1 * (n1 + 1) / 2
    mean_u = n1 * n2 / 2
    n = n1 + n2
    var_u = n1 * n2 / 12 * ((n + 1) - tie_term / (n * (n - 1)))
    if var_u <= 0:
        return 1.0
    z = (abs(u1 - mean_u) - 0.5) / math.sqrt(var_u)
    return math.erfc(max(z, 0.0) / math.sqrt(2))


def _ranks(values: Sequence[float]) -> tuple[list[float], float]:
    """Average ranks (1-based) and the tie correction sum of t^3 - t."""
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    tie_term = 0.0
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for idx in order[i : j + 1]:
            ranks[idx] = (i + j) / 2 + 1
        t = j - i + 1
        tie_term += t**3 - t
        i = j + 1
    return ranks, tie_term
