import pytest

from decodebench.compare import (
    GateThresholds,
    Verdict,
    compare_benchmark,
    compare_runs,
    compare_samples,
    format_comparisons,
    parse_threshold,
    runs_of,
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


# --- runs: between-run variation -------------------------------------------------------------

FAST = BASE
SLOW = _scaled(1.40)  # a cold or disturbed run: 40 % slower, tight within itself


def test_one_slow_run_against_one_fast_run_was_slower_with_samples_alone():
    # a run-blind test calls this a regression, with a tiny p-value
    c = compare_samples("k", SLOW, FAST)
    assert c.verdict is Verdict.SLOWER
    assert c.p_value < 1e-4


def test_drift_in_either_order_never_fails_once_the_case_is_remeasured():
    # baseline slow, now fast (the cold run first): at most FASTER
    assert compare_runs([SLOW], [FAST, FAST]).verdict in {Verdict.FASTER, Verdict.SAME, Verdict.UNDECIDED}
    # baseline fast, now one slow run then two normal re-measures: not a regression
    c = compare_runs([FAST], [SLOW, FAST, FAST])
    assert c.verdict is Verdict.SAME
    assert c.runs == (1, 3)
    # one slow run and one normal: the runs overlap, so the verdict waits for more runs
    assert compare_runs([FAST], [SLOW, FAST]).verdict is Verdict.UNDECIDED


def test_a_30_percent_slowdown_in_every_run_is_slower():
    c = compare_runs([FAST, _scaled(1.02)], [_scaled(1.30), _scaled(1.31)], GateThresholds(threshold=0.05))
    assert c.verdict is Verdict.SLOWER
    assert c.ratio == pytest.approx(1.305 / 1.01)  # median of run medians on each side
    assert c.runs == (2, 2)


def test_baseline_runs_spread_widens_what_counts_as_drift():
    # stored runs 0 % and +20 %: a new level of +19 % is inside what the baseline itself did
    c = compare_runs([FAST, _scaled(1.20)], [_scaled(1.19), _scaled(1.19)])
    assert c.verdict is Verdict.UNDECIDED
    assert "among the other side" in c.reason


def test_level_is_the_median_of_run_floors():
    c = compare_runs([[1.0, 1.0, 1.0], [2.0, 2.0, 2.0], [1.2, 1.2, 1.2]], [[1.2, 1.2, 1.2]])
    assert c.ratio == pytest.approx(1.0)
    assert c.verdict is Verdict.SAME


def test_runs_with_too_few_samples_are_left_out():
    c = compare_runs([[1.0, 1.0]], [[1.0, 1.0, 1.0]])
    assert c.verdict is Verdict.UNDECIDED
    assert c.runs == (0, 1)


def test_runs_of_an_entry_include_its_remeasured_runs():
    entry = {"stats": {"data": [1.0, 1.1, 1.2]}, "extra_info": {"resamples": [[1.3, 1.3, 1.3]]}}
    assert runs_of(entry) == [[1.0, 1.1, 1.2], [1.3, 1.3, 1.3]]


def test_a_result_marked_invalid_is_never_gated():
    current = _entry(_scaled(3.0))
    current["extra_info"]["invalid"] = "client TPOT 0.01 ms disagrees with server TPOT 3.9 ms"
    c = compare_benchmark(current, [_entry(BASE)], GateThresholds())
    assert c.verdict is Verdict.INCOMPARABLE
    assert "client TPOT 0.01 ms disagrees" in c.reason


def test_an_invalid_stored_result_is_never_a_baseline():
    bad = _entry(_scaled(0.1))
    bad["extra_info"]["invalid"] = "collapsed TPOT"
    assert compare_benchmark(_entry(BASE), [_entry(BASE), bad], GateThresholds()).verdict is Verdict.SAME
    only_bad = compare_benchmark(_entry(BASE), [bad], GateThresholds())
    assert only_bad.verdict is Verdict.INCOMPARABLE
    assert only_bad.reason == "no valid baseline (collapsed TPOT)"


def test_baselines_of_another_timer_are_left_out_of_the_runs():
    c = compare_benchmark(_entry(BASE), [_entry(_scaled(0.1), timer="graph"), _entry(BASE)], GateThresholds())
    assert (c.verdict, c.runs) == (Verdict.SAME, (1, 1))


def test_a_change_measured_on_an_oversubscribed_cpu_is_not_a_verdict():
    busy = _entry(_scaled(1.5))
    busy["extra_info"]["telemetry_before"] = {"loadavg_1m": 13.1, "cpus": 2}
    c = compare_benchmark(busy, [_entry(BASE)], GateThresholds())
    assert c.verdict is Verdict.UNDECIDED
    assert c.reason.endswith("the CPU was oversubscribed while measuring (load average 13.1 on 2 CPUs): "
                             "contention, not evidence")
    quiet = _entry(_scaled(1.5))
    quiet["extra_info"]["telemetry_before"] = {"loadavg_1m": 2.5, "cpus": 2}
    assert compare_benchmark(quiet, [_entry(BASE)], GateThresholds()).verdict is Verdict.SLOWER


def test_the_load_limit_is_a_threshold():
    busy = _entry(_scaled(1.5))
    busy["extra_info"]["telemetry_after"] = {"loadavg_1m": 13.1, "cpus": 2}
    relaxed = GateThresholds(max_load_per_cpu=10)
    assert compare_benchmark(busy, [_entry(BASE)], relaxed).verdict is Verdict.SLOWER


def _session(runs, timer="kernel"):
    return {"fullname": "k", "stats": {"data": runs[0]}, "extra_info": {"timer": timer, "resamples": runs[1:]}}


def test_one_stored_session_needs_the_margin_two_sessions_do_not():
    # +12.6 % in every current run (as two identical H200 sessions showed for a cuBLAS GEMM)
    now = _session([_scaled(1.126)] * 3)
    one = compare_benchmark(now, [_session([FAST])], GateThresholds())
    assert one.verdict is Verdict.UNDECIDED
    assert "one stored session" in one.reason
    two = compare_benchmark(now, [_session([FAST]), _session([_scaled(1.01)])], GateThresholds())
    assert two.verdict is Verdict.SLOWER
    # a change beyond threshold + margin (30 %) is SLOWER against a single session
    big = compare_benchmark(_session([_scaled(1.3)] * 2), [_session([FAST])], GateThresholds())
    assert big.verdict is Verdict.SLOWER


def test_a_stored_slow_run_that_its_session_re_measured_does_not_hide_a_regression():
    # two stored sessions; the second began with a cold run (+50 %) that its gate re-measured
    stored = [_session([FAST]), _session([_scaled(1.5), _scaled(1.01)])]
    regressed = _session([_scaled(1.3), _scaled(1.31)])
    assert compare_benchmark(regressed, stored, GateThresholds()).verdict is Verdict.SLOWER
    # a session's runs taken one by one: the cold run would count as the baseline's spread
    flat = compare_runs([_scaled(1.5), _scaled(1.01)], [_scaled(1.3), _scaled(1.31)])
    assert flat.verdict is not Verdict.SLOWER
    assert compare_benchmark(regressed, [_session([_scaled(1.5), _scaled(1.01)])], GateThresholds()).verdict \
        is Verdict.SLOWER


def test_every_current_run_must_clear_the_threshold_for_a_slower_verdict():
    stored = [_session([FAST]), _session([_scaled(1.01)])]
    one_normal = _session([_scaled(1.5), _scaled(1.03)])  # a slow process, then a normal one
    c = compare_benchmark(one_normal, stored, GateThresholds())
    assert c.verdict is Verdict.UNDECIDED and "within the threshold" in c.reason
    both = _session([_scaled(1.5), _scaled(1.2)])
    assert compare_benchmark(both, stored, GateThresholds()).verdict is Verdict.SLOWER


def test_against_one_stored_session_every_run_must_clear_threshold_plus_margin():
    stored = [_session([FAST])]
    # a slow first run and a fresh-process run at +9 %: beyond 5 % but not beyond 5 % + 10 %
    c = compare_benchmark(_session([_scaled(1.5), _scaled(1.09)]), stored, GateThresholds())
    assert c.verdict is Verdict.UNDECIDED
    assert compare_benchmark(_session([_scaled(1.5), _scaled(1.3)]), stored, GateThresholds()).verdict is Verdict.SLOWER


def test_with_three_stored_sessions_one_slow_outlier_session_does_not_hide_a_regression():
    # the first stored session met a slow moment in its only run (nothing re-measured it)
    stored = [_session([_scaled(1.4)]), _session([FAST]), _session([_scaled(1.01)])]
    assert compare_benchmark(_session([_scaled(1.3), _scaled(1.31)]), stored, GateThresholds()).verdict is Verdict.SLOWER
    # with two stored sessions the outlier still counts as their spread
    two = [_session([_scaled(1.4)]), _session([FAST])]
    assert compare_benchmark(_session([_scaled(1.3), _scaled(1.31)]), two, GateThresholds()).verdict is Verdict.UNDECIDED


def _probed(runs, probes, timer="wall"):
    entry = _session(runs, timer)
    entry["extra_info"]["speed_probe_us"] = [probes[0], probes[0]]
    entry["extra_info"]["resample_probes_us"] = [[p, p] for p in probes[1:]]
    return entry


def test_a_run_taken_while_the_machine_itself_was_slow_is_set_aside():
    stored = [_probed([FAST], [500.0]), _probed([_scaled(1.01)], [502.0])]
    # both runs +30 %, and so was the fixed probe workload around them: the machine, not the kernel
    slow_machine = compare_benchmark(_probed([_scaled(1.3), _scaled(1.31)], [640.0, 650.0]), stored, GateThresholds())
    assert slow_machine.verdict is Verdict.UNDECIDED
    assert "2 of 2 runs at machine speed probe +30%" in slow_machine.reason and "not evidence" in slow_machine.reason
    # the same slowdown with the probe where it was: a regression
    regressed = compare_benchmark(_probed([_scaled(1.3), _scaled(1.31)], [505.0, 498.0]), stored, GateThresholds())
    assert regressed.verdict is Verdict.SLOWER
    # one run in a slow moment, two normal: the normal ones decide
    mixed = compare_benchmark(_probed([_scaled(1.3), _scaled(1.0), _scaled(1.01)], [640.0, 501.0, 499.0]),
                              stored, GateThresholds())
    assert mixed.verdict is Verdict.SAME and "runs set aside: 1 of 3 runs" in mixed.reason
    # half of them off: no side is picked
    half = compare_benchmark(_probed([_scaled(1.3), _scaled(1.0)], [640.0, 501.0]), stored, GateThresholds())
    assert half.verdict is Verdict.UNDECIDED


def test_a_baseline_taken_while_the_machine_was_slow_never_selects_the_current_runs_that_match_it():
    # the one stored session ran in a slow period (probe 650); now two normal runs (probe 550)
    # and one that met a slow moment again (probe 650, +20 %): keeping only that one would be SLOWER
    stored = [_probed([FAST], [650.0])]
    now = _probed([_scaled(1.0), _scaled(1.2), _scaled(1.01)], [550.0, 650.0, 548.0])
    c = compare_benchmark(now, stored, GateThresholds())
    assert c.verdict is Verdict.UNDECIDED and "the machine changed" in c.reason


def test_results_without_a_probe_are_judged_as_before():
    stored = [_session([FAST], "wall"), _session([_scaled(1.01)], "wall")]
    assert compare_benchmark(_probed([_scaled(1.3), _scaled(1.31)], [640.0, 650.0]), stored,
                             GateThresholds()).verdict is Verdict.SLOWER
