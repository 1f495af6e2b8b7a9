"""Small distribution-free statistics on timing samples (pure Python, no numpy needed)."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

__all__ = ["digamma", "dispersion", "f_survival", "floor", "mean", "median", "median_ci", "median_precision",
           "quantile", "student_t_cdf", "student_t_quantile", "trigamma", "trigamma_inverse"]

Z95 = 1.959963984540054
# A run's floor: interference only adds time, so a low quantile moves least between runs. The
# gate summarises a run by it and the injected slowdown is sized from it (docs/validation.md).
RUN_QUANTILE = 0.1


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


def floor(values: Sequence[float]) -> float:
    """A run's floor: its :data:`RUN_QUANTILE` quantile.

    >>> floor([10.0, 10.0, 11.0, 12.0, 30.0, 45.0, 50.0, 60.0, 61.0, 90.0, 95.0])
    10.0
    """
    return quantile(values, RUN_QUANTILE)


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


def mean(values: Sequence[float]) -> float:
    if not values:
        raise ValueError("mean of no values")
    return math.fsum(values) / len(values)


def student_t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom (``df`` may be fractional).

    Through the regularized incomplete beta function: P(|T| > t) = I_{df/(df+t^2)}(df/2, 1/2).

    >>> round(student_t_cdf(2.353363, 3), 5), student_t_cdf(0.0, 7)
    (0.95, 0.5)
    """
    if df <= 0:
        raise ValueError(f"degrees of freedom must be positive, not {df}")
    tail = 0.5 * _incomplete_beta(df / (df + t * t), df / 2, 0.5)
    return 1 - tail if t > 0 else tail


def student_t_survival(t: float, df: float) -> float:
    """P(T > t) for Student's t with ``df`` degrees of freedom, exact in the far tail (a p-value).

    >>> round(student_t_survival(2.353363, 3), 5), student_t_survival(0.0, 7), student_t_survival(40.0, 20) < 1e-19
    (0.05, 0.5, True)
    """
    if df <= 0:
        raise ValueError(f"degrees of freedom must be positive, not {df}")
    tail = 0.5 * _incomplete_beta(df / (df + t * t), df / 2, 0.5)
    return tail if t > 0 else 1 - tail


@functools.lru_cache(maxsize=4096)  # a session asks for the same few (level, df) pairs again and again
def student_t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (bisection on the CDF).

    >>> round(student_t_quantile(0.95, 3), 4), round(student_t_quantile(1 - 0.05 / 600, 9), 3)
    (2.3534, 6.16)
    """
    if not 0 < p < 1:
        raise ValueError(f"quantile level must lie strictly between 0 and 1, not {p}")
    if p < 0.5:
        return -student_t_quantile(1 - p, df)
    lo, hi = 0.0, 1.0
    while student_t_cdf(hi, df) < p:
        lo, hi = hi, hi * 2
    for _ in range(200):  # far below float resolution long before the bound
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if student_t_cdf(mid, df) < p else (lo, mid)
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return (lo + hi) / 2


def f_survival(f: float, df1: float, df2: float) -> float:
    """P(F > f) for Fisher's F with ``df1`` and ``df2`` degrees of freedom: I_{df2/(df2+df1 f)}(df2/2, df1/2).

    >>> f_survival(1.0, 2, 2), round(f_survival(19.0, 2, 2), 4), f_survival(0.0, 3, 5)
    (0.5, 0.05, 1.0)
    """
    if df1 <= 0 or df2 <= 0:
        raise ValueError(f"degrees of freedom must be positive, not {df1} and {df2}")
    return 1.0 if f <= 0 else _incomplete_beta(df2 / (df2 + df1 * f), df2 / 2, df1 / 2)


def _incomplete_beta(x: float, a: float, b: float) -> float:
    """Regularized incomplete beta I_x(a, b), by its continued fraction (modified Lentz)."""
    if x <= 0:
        return 0.0
    if x >= 1:
        return 1.0
    if x > (a + 1) / (a + b + 2):  # the fraction converges fast only below this point
        return 1 - _incomplete_beta(1 - x, b, a)
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    tiny = 1e-300
    c, d = 1.0, 1 - (a + b) * x / (a + 1)
    d = 1 / (d if abs(d) > tiny else tiny)
    fraction = d
    for m in range(1, 500):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1 + numerator * d
            d = 1 / (d if abs(d) > tiny else tiny)
            c = 1 + numerator / c
            c = c if abs(c) > tiny else tiny
            fraction *= c * d
        if abs(c * d - 1) < 1e-15:
            break
    return math.exp(log_front) * fraction / a


def digamma(x: float) -> float:
    """psi(x) = d/dx log Gamma(x), for x > 0 (recurrence up to 6, then the asymptotic series).

    >>> round(digamma(1.0), 6), round(digamma(0.5), 6)
    (-0.577216, -1.96351)
    """
    shift = 0.0
    while x < 6:
        shift -= 1 / x
        x += 1
    f = 1 / (x * x)
    return shift + math.log(x) - 0.5 / x - f * (1 / 12 - f * (1 / 120 - f * (1 / 252 - f / 240)))


def trigamma(x: float) -> float:
    """psi'(x), for x > 0.

    >>> round(trigamma(1.0), 6), round(trigamma(0.5), 6)
    (1.644934, 4.934802)
    """
    shift = 0.0
    while x < 6:
        shift += 1 / (x * x)
        x += 1
    f = 1 / (x * x)
    return shift + 1 / x + f / 2 + f / x * (1 / 6 - f * (1 / 30 - f * (1 / 42 - f / 30)))


def trigamma_inverse(y: float) -> float:
    """The x > 0 with trigamma(x) = y (Newton's method on 1/trigamma, as limma's trigammaInverse).

    >>> round(trigamma_inverse(trigamma(3.7)), 6)
    3.7
    """
    if y <= 0:
        raise ValueError(f"trigamma takes only positive values, not {y}")
    if y > 1e7:
        return 1 / math.sqrt(y)
    if y < 1e-6:
        return 1 / y
    x = 0.5 + 1 / y
    for _ in range(50):
        step = trigamma(x) * (1 - trigamma(x) / y) / _tetragamma(x)
        x += step
        if -step / x < 1e-10:
            break
    return x


def _tetragamma(x: float) -> float:
    shift = 0.0
    while x < 6:
        shift -= 2 / x**3
        x += 1
    f = 1 / (x * x)
    return shift - f - f / x - f * f * (1 / 2 - f * (1 / 6 - f * (1 / 6 - f * 3 / 10)))
