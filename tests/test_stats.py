import math

import pytest

from decodebench import stats


def test_quantiles_interpolate():
    values = [4.0, 1.0, 3.0, 2.0]
    assert stats.quantile(values, 0.0) == 1.0
    assert stats.quantile(values, 1.0) == 4.0
    assert stats.median(values) == 2.5
    assert stats.quantile(values, 0.25) == 1.75


def test_dispersion_is_iqr_over_median():
    assert stats.dispersion([10.0, 10.0, 10.0]) == 0.0
    assert stats.dispersion([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx(2.0 / 3.0)


def test_median_ci_from_order_statistics():
    values = [float(i) for i in range(1, 101)]
    assert stats.median_ci(values) == (40.0, 61.0)
    assert stats.median_precision(values) == pytest.approx(10.5 / 50.5)


def test_precision_needs_three_samples():
    assert math.isinf(stats.median_precision([1.0, 1.0]))
    assert stats.median_precision([1.0, 1.0, 1.0]) == 0.0


def test_mann_whitney_matches_scipy_asymptotic():
    # scipy.stats.mannwhitneyu(a, b, method="asymptotic") -> p = 0.0009391056991171899
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    b = [11, 12, 13, 14, 15, 16, 17, 18]
    assert stats.mann_whitney_p(a, b) == pytest.approx(0.0009391056991171899, rel=1e-9)


def test_mann_whitney_with_ties_matches_scipy():
    # scipy.stats.mannwhitneyu([1, 2, 2, 3, 3, 3], [2, 3, 4, 4, 5, 5], method="asymptotic")
    # -> statistic 5.5, pvalue 0.047967873742731204 (computed with scipy 1.x on this machine)
    p = stats.mann_whitney_p([1, 2, 2, 3, 3, 3], [2, 3, 4, 4, 5, 5])
    assert p == pytest.approx(0.047967873742731204, rel=1e-9)


def test_identical_samples_are_not_different():
    assert stats.mann_whitney_p([1.0] * 10, [1.0] * 10) == 1.0
