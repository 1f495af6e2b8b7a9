import json

INJECTED_US = [1.0, 1.1, 0.9, 1.0, 1.05]

BENCH_MODULE = f"""
import pytest
from decodebench.bridge import DEVICE_CLOCK, record_samples

@pytest.mark.benchmark(timer=DEVICE_CLOCK)
def test_injected(benchmark):
    record_samples(benchmark, [v * 1e-6 for v in {INJECTED_US!r}], {{"note": "injected"}})
"""


def test_injected_samples_are_the_stored_stats(pytester):
    pytester.makepyfile(test_injected=BENCH_MODULE)
    out = pytester.path / "out.json"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--benchmark-json={out}")
    result.assert_outcomes(passed=1)
    bench = json.loads(out.read_text())["benchmarks"][0]
    stats = bench["stats"]
    assert stats["data"] == [v * 1e-6 for v in INJECTED_US]
    assert stats["rounds"] == 5
    assert stats["iterations"] == 1
    assert abs(stats["median"] - 1.0e-6) < 1e-15
    assert abs(stats["min"] - 0.9e-6) < 1e-15
    assert abs(stats["max"] - 1.1e-6) < 1e-15
    assert bench["options"]["timer"] == "device_clock"
    assert bench["extra_info"] == {"note": "injected"}


def test_recording_with_the_host_timer_is_refused(pytester):
    pytester.makepyfile(
        test_wrong_timer="""
        from decodebench.bridge import record_samples

        def test_plain(benchmark):
            record_samples(benchmark, [1e-6, 2e-6])
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*timer is not decodebench's device clock*"])


def test_histogram_option_draws_the_device_samples(pytester):
    pytester.makepyfile(test_injected=BENCH_MODULE)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--benchmark-histogram={pytester.path / 'hist'}")
    result.assert_outcomes(passed=1)
    (svg,) = pytester.path.glob("hist*.svg")
    assert "test_injected" in svg.read_text()
