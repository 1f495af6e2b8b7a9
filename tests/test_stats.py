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


