from pathlib import Path

from decodebench.baselines import History, StoredResult
from decodebench.compare import Comparison, Verdict, compare_runs
from decodebench.gate import (
    Baseline,
    GatePolicy,
    Pending,
    baseline_from_history,
    conclude,
    needs_more_runs,
    settle,
    settle_all,
    why_nothing,
)

FAST = [1.00, 1.01, 0.99, 1.00, 1.02, 0.98, 1.00, 1.01, 0.99, 1.00]
SLOW = [v * 1.4 for v in FAST]


def _settle(current_runs, remeasured, rounds=2):
    calls = []

    def remeasure():
        calls.append(1)
        return remeasured[len(calls) - 1]

    judge = lambda: compare_runs([FAST], current_runs)  # noqa: E731
    return settle(judge, remeasure, lambda run: current_runs.append(run.samples), rounds), len(calls)


def test_a_slow_moment_is_settled_by_remeasuring():
    c, calls = _settle([SLOW], [FAST, FAST])
    assert (c.verdict, calls) == (Verdict.SAME, 2)  # UNDECIDED after one re-run, SAME after two


def test_a_real_slowdown_is_confirmed_by_one_more_run_and_no_more():
    c, calls = _settle([SLOW], [SLOW, SLOW])
    assert (c.verdict, calls, c.runs) == (Verdict.SLOWER, 1, (1, 2))


def test_remeasuring_is_bounded():
    c, calls = _settle([SLOW], [FAST, SLOW, FAST, SLOW], rounds=3)
    assert calls == 3
    c, calls = _settle([SLOW], [FAST], rounds=0)
    assert (c.verdict, calls) == (Verdict.SLOWER, 0)


def test_a_failing_remeasure_keeps_the_verdict_and_says_why():
    def broken():
        raise RuntimeError("device lost")

    c = settle(lambda: compare_runs([FAST], [SLOW]), broken, lambda run: None, 2)
    assert c.verdict is Verdict.SLOWER
    assert c.reason.endswith("re-measure failed: RuntimeError: device lost")


def test_without_a_remeasure_closure_the_first_verdict_stands():
    c = settle(lambda: compare_runs([FAST], [SLOW]), None, lambda run: None, 2)
    assert (c.verdict, c.runs) == (Verdict.SLOWER, (1, 1))


def test_which_verdicts_need_more_runs():
    one = Comparison("k", Verdict.SLOWER, 1.4, 0.0, "", (1, 1))
    two = Comparison("k", Verdict.SLOWER, 1.4, 0.0, "", (1, 2))
    assert needs_more_runs(one)
    assert not needs_more_runs(two)
    assert needs_more_runs(Comparison("k", Verdict.UNDECIDED, 1.1, 0.2, ""))
    assert not needs_more_runs(Comparison("k", Verdict.FASTER, 0.6, 0.0, "", (1, 1)))


def _c(verdict):
    return Comparison("k", verdict, 1.0, 0.5, "r")


def test_one_conclusion_per_session():
    policy = GatePolicy(threshold=0.05)
    assert conclude([_c(Verdict.SAME), _c(Verdict.INCOMPARABLE)], policy, "x").line == (
        "gate passed: 0 of 1 significantly slower by more than 5.0%; 1 not comparable")
    failed = conclude([_c(Verdict.SLOWER), _c(Verdict.SAME)], policy, "x")
    assert (failed.failed, failed.line) == (True, "gate FAILED: 1 of 2 significantly slower by more than 5.0%")


def test_nothing_compared_fails_the_gate_unless_allowed():
    everything_foreign = [_c(Verdict.INCOMPARABLE)]
    strict = conclude(everything_foreign, GatePolicy(threshold=0.05), "baseline b/fp/0003.json is foreign")
    assert strict.failed
    assert strict.line.startswith("gate FAILED: nothing was compared (baseline b/fp/0003.json is foreign)")
    allowed = conclude([], GatePolicy(threshold=0.05, allow_empty=True), "no stored result in b/fp")
    assert not allowed.failed
    off = conclude([], GatePolicy(), "no stored result in b/fp")
    assert (off.failed, off.line) == (False, "nothing was compared (no stored result in b/fp)")


def test_why_nothing_names_the_file_or_folder():
    base = Baseline("b/fp/0002_x.json")
    assert why_nothing(base, 0, []).startswith("no benchmark ran in this session")
    assert why_nothing(base, 4, []) == "none of this session's 4 benchmarks is in b/fp/0002_x.json"
    incomparable = [Comparison("k", Verdict.INCOMPARABLE, None, None, "timer 'wall' now, 'kernel' in the baseline")]
    assert why_nothing(base, 1, incomparable) == (
        "against b/fp/0002_x.json: timer 'wall' now, 'kernel' in the baseline")


def _result(name, entries):
    return StoredResult(Path(f"b/fp/{name}"), {"benchmarks": [{"fullname": e} for e in entries]})


def test_baseline_takes_the_newest_results_oldest_first():
    history = History(Path("b/fp"), (_result("0001.json", ["a"]), _result("0002.json", ["a", "b"]),
                                     _result("0003.json", ["a"])), ("b/fp/0004.json is not valid JSON",))
    baseline = baseline_from_history(history, 2)
    assert baseline.source == "b/fp/0003.json"
    assert [len(baseline.entries["a"]), len(baseline.entries["b"])] == [2, 1]
    assert baseline.skipped == ("b/fp/0004.json is not valid JSON",)
    assert baseline.problem is None


def test_settle_all_remeasures_round_by_round():
    order = []

    def pending(name, remeasured):
        runs = [SLOW]

        def remeasure():
            order.append(name)
            return remeasured

        return Pending(lambda: compare_runs([FAST], runs), remeasure, lambda run: runs.append(run.samples))

    verdicts = settle_all([pending("a", FAST), pending("b", SLOW), pending("c", FAST)], rounds=2)
    assert [v.verdict for v in verdicts] == [Verdict.SAME, Verdict.SLOWER, Verdict.SAME]
    assert order == ["a", "b", "c", "a", "c"]  # b is confirmed after round 1; a and c need round 2


def test_settle_all_ends_every_round_and_once_more_when_a_remeasure_raises():
    events = []

    def failing():
        events.append("measure")
        raise RuntimeError("worker died")

    runs = [SLOW]
    case = Pending(lambda: compare_runs([FAST], runs), failing, lambda run: runs.append(run.samples))
    (verdict,) = settle_all([case], rounds=2, end_round=lambda: events.append("end"))
    assert verdict.verdict is Verdict.SLOWER  # the failed re-measure leaves the first verdict, and says why
    assert "re-measure failed: RuntimeError: worker died" in verdict.reason
    assert events == ["measure", "end", "measure", "end", "end"]  # tried again next round; ended once more


def test_a_slower_no_re_measure_confirmed_is_undecided_and_a_failed_re_measure_keeps_it():
    runs = [SLOW]
    set_aside = Pending(lambda: compare_runs([FAST], runs[:1]), lambda: SLOW, lambda run: runs.append(run.samples))
    (verdict,) = settle_all([set_aside], rounds=2)  # the judge never counts the re-measures (set aside)
    assert verdict.verdict is Verdict.UNDECIDED and "no re-measure confirmed it" in verdict.reason
    assert len(runs) == 3

    def broken():
        raise RuntimeError("worker died")

    (kept,) = settle_all([Pending(lambda: compare_runs([FAST], [SLOW]), broken, lambda run: None)], rounds=2)
    assert kept.verdict is Verdict.SLOWER
    # without re-measuring (none possible, or 0 rounds) a single-run SLOWER stands as before
    (alone,) = settle_all([Pending(lambda: compare_runs([FAST], [SLOW]), None, lambda run: None)], rounds=2)
    assert alone.verdict is Verdict.SLOWER
