import pytest

from decodebench.compare import (
    GateThresholds,
    Verdict,
    compare_benchmark,
    compare_samples,
    format_comparisons,
    parse_threshold,
)

BASE = [10.0, 10.1, 9.9, 10.0, 10.2, 9.8, 10.0, 10.1, 9.9, 10.0, 10.05, 9.95]


def _scaled(factor, values=BASE):
    return [v * factor for v in values]


def test_clear_slowdown_is_slower():
    c = compare_samples("k", _scaled(1.10), BASE)
    assert c.verdict is Verdict.SLOWER
    assert c.ratio == pytest.approx(1.10)
    assert c.p_value < 0.01


def test_clear_speedup_is_faster_and_not_slower():
    assert compare_samples("k", _scaled(0.8), BASE).verdict is Verdict.FASTER


def test_change_inside_threshold_is_same():
    assert compare_samples("k", _scaled(1.03), BASE).verdict is Verdict.SAME
    assert compare_samples("k", _scaled(1.03), BASE, GateThresholds(threshold=0.02)).verdict is Verdict.SLOWER


def test_noisy_shift_is_undecided_not_slower():
    noisy_base = [10, 30, 10, 30, 10, 30, 10, 30]
    noisy_now = [12, 30, 12, 30, 12, 31, 12, 33]
    c = compare_samples("k", noisy_now, noisy_base)
    assert c.verdict is Verdict.UNDECIDED
    assert "within-run noise: more runs decide" in c.reason


def test_too_few_samples_is_undecided():
    assert compare_samples("k", [1.0, 2.0], BASE).verdict is Verdict.UNDECIDED


def _entry(data, timer="kernel"):
    return {"fullname": "bench[x]", "stats": {"data": data}, "extra_info": {"timer": timer}}


def test_benchmark_entries_with_other_timer_are_incomparable():
    c = compare_benchmark(_entry(_scaled(2.0)), _entry(BASE, timer="graph"), GateThresholds())
    assert c.verdict is Verdict.INCOMPARABLE
    assert "timer 'kernel' now, 'graph' in the baseline" in c.reason


def test_foreign_fingerprint_is_incomparable():
    c = compare_benchmark(_entry(_scaled(2.0)), _entry(BASE), GateThresholds(), fingerprint_match=False)
    assert c.verdict is Verdict.INCOMPARABLE


def test_baseline_without_raw_samples_cannot_be_judged():
    baseline = {"fullname": "bench[x]", "stats": {"median": 1.0}, "extra_info": {"timer": "kernel"}}
    assert compare_benchmark(_entry(BASE), baseline, GateThresholds()).verdict is Verdict.UNDECIDED


def test_summary_lists_slower_first():
    lines = format_comparisons([compare_samples("a", BASE, BASE), compare_samples("b", _scaled(1.5), BASE)])
    assert lines[0].startswith("SLOWER")
    assert " b " in lines[0]
    assert lines[1].startswith("SAME")


@pytest.mark.parametrize(("text", "value"), [("5%", 0.05), ("0.5%", 0.005), ("0.1", 0.1)])
def test_parse_threshold(text, value):
    assert parse_threshold(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["five", "0", "-3%", "2000%"])
def test_parse_threshold_rejects(text):
    with pytest.raises(ValueError, match=repr(text)):
        parse_threshold(text)
