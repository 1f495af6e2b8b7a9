"""A new runner's first nights: the spread a short history is judged by, SAME only inside the
threshold, FASTER confirmed like SLOWER; checked on literal numbers."""

import pytest

from decodebench.gate import CaseInput, Policy, Verdict, judge
from decodebench.gate.decision import CASE_PRIOR_DF, unseen_chance
from decodebench.harness import Run
from decodebench.runner.settle import Remeasured, settle


def entry(*floors, op="uniform", m=1, component="mla_decode"):
    """An MLA-like entry whose runs have the given floors (s): the first is its data, the rest re-measures."""
    runs = [[f * (1 + 0.0005 * (i % 5)) for i in range(20)] for f in floors]
    return {"stats": {"data": runs[0]}, "extra_info": {"timer": "kernel", "component": component, "backend": "vllm",
                                                      "shape": {"op": op, "batch": m}, "resamples": runs[1:]}}


def night_two(moving):
    """Night 2 of a new runner: one stored run per case; ten cases of one op whose runs agree to
    about 1 %, and ``moving``'s floors (µs, stored then now) for one more case."""
    cases = []
    for m in range(1, 11):
        base = 20e-6 * m
        cases.append(CaseInput(f"c{m}", entry(base * 1.004, base * 0.995, base * 1.009, m=m),
                               (("0001", entry(base, m=m)),)))
    stored, *now = moving
    cases.append(CaseInput("mover", entry(*(f * 1e-6 for f in now), m=99), (("0001", entry(stored * 1e-6, m=99)),)))
    return {v.name: v for v in judge(cases, Policy(threshold=0.05))}


def test_a_case_that_moves_more_than_its_op_is_undecided_on_night_two():
    # the MLA case of a new H100 runner: floors 20.06 µs stored, 21.85, 20.99 and 21.07 µs now
    # (the first run and two re-measures); its op's other cases agree to about 1 %
    found = night_two((20.06, 21.85, 20.99, 21.07))
    mover = found["mover"]
    assert mover.verdict is Verdict.UNDECIDED, mover.reason
    assert mover.df == 2 + CASE_PRIOR_DF == 6  # its own two df (three runs now) and the op's four
    assert mover.low < 1 < 1.10 < mover.high  # +6.2 %, interval wide enough to hold a 9 % move either way
    assert round(mover.ratio, 3) == 1.062  # the figure
    assert {v.verdict for n, v in found.items() if n != "mover"} == {Verdict.SAME}


def test_a_move_far_beyond_the_spread_is_still_slower_on_night_two():
    found = night_two((20.06, 26.0, 26.1, 25.9))  # +29.5 %, three runs now that agree
    assert found["mover"].verdict is Verdict.SLOWER, found["mover"].reason
    assert found["mover"].low > 1.05


def test_same_needs_the_interval_inside_the_threshold_on_every_verdict():
    found = night_two((20.06, 20.3, 20.1, 20.2))  # +0.7 %: SAME only if the whole interval is within 5 %
    for v in found.values():
        if v.verdict is Verdict.SAME:
            assert 1 / 1.05 <= v.low, v.reason
            assert v.high <= 1.05, v.reason


def test_a_faster_case_is_confirmed_on_every_round_like_a_slower_one():
    # lm_head on two levels, 114.6 µs stored (the upper one), 105.0 µs now: FASTER on one look
    history = (("0001", entry(114.6e-6, 114.7e-6, 114.5e-6, op="lm_head")),)
    inputs = [CaseInput("lm_head", entry(105.0e-6, op="lm_head"), history)]
    assert judge(inputs, Policy(threshold=0.05))[0].verdict is Verdict.FASTER
    kept = Remeasured()
    again = entry(114.6e-6)["stats"]["data"]  # one more run at the stored level
    (found,) = settle(lambda: inputs, {"lm_head": lambda: Run(again)}, Policy(threshold=0.05), kept=kept)
    assert len(kept.runs["lm_head"]) == 2  # open on both rounds
    assert found.verdict is Verdict.UNDECIDED, found.reason  # one of three runs away: not FASTER


def two_level_night(*floors):
    """A case with ``floors`` stored (µs, one run each) and 10.5 µs now on three runs, beside four
    cases of its op whose stored runs sit on two levels 12 % apart (10.0 and 11.2 µs, same kernel)."""
    cases = []
    for m in range(1, 5):
        history = (("0001", entry(10.0e-6, 11.2e-6, m=m, op="q_a")), ("0002", entry(10.0e-6, 11.2e-6, m=m, op="q_a")))
        cases.append(CaseInput(f"peer{m}", entry(10.0e-6, 10.02e-6, 9.99e-6, m=m, op="q_a"), history))
    history = tuple((f"{i:04d}", entry(f * 1e-6, m=99, op="q_a")) for i, f in enumerate(floors, 1))
    return history, cases


def judged_mover(history, cases, *now, op="q_a", component="mla_decode"):
    history = tuple((label, {**e, "extra_info": {**e["extra_info"], "component": component,
                                                 "shape": {"op": op, "batch": 99}}}) for label, e in history)
    mover = entry(*(f * 1e-6 for f in now), m=99, op=op, component=component)
    return judge([*cases, CaseInput("mover", mover, history)], Policy(threshold=0.05))[-1]


def test_a_move_to_a_level_its_op_shows_is_undecided_while_the_case_has_few_runs():
    # q_b M=4 on the H200: stored at 5.31 µs, then one process at 5.96 µs (+12 %), one kernel at both
    history, cases = two_level_night(10.0, 10.01)
    mover = judged_mover(history, cases, 11.2, 11.21, 11.19)
    assert mover.verdict is Verdict.UNDECIDED, mover.reason
    assert "a level gap its op's cases show" in mover.reason
    assert "+12.0%" in mover.reason


def test_a_slowdown_unlike_the_op_level_gap_is_still_slower():
    history, cases = two_level_night(10.0, 10.01)
    mover = judged_mover(history, cases, 13.0, 13.01, 12.99)  # +30 %: no level the op shows
    assert mover.verdict is Verdict.SLOWER, mover.reason


def test_a_case_borrows_the_gap_of_another_op_of_its_component_and_never_of_another_component():
    history, cases = two_level_night(10.0, 10.01)
    other_op = judged_mover(history, cases, 11.2, 11.21, 11.19, op="q_b")
    assert other_op.verdict is Verdict.UNDECIDED, other_op.reason
    assert "its component's other ops" in other_op.reason
    other_component = judged_mover(history, cases, 11.2, 11.21, 11.19, op="fused", component="moe")
    assert other_component.verdict is Verdict.SLOWER, other_component.reason


def test_a_level_a_case_never_showed_weighs_less_with_each_run_it_shows_on_one_level():
    # four of the op's five cases show two levels, half their runs on the upper one: a run lands on
    # a level the mover has not shown with chance 0.5 * P(it has one | its runs all missed it)
    assert unseen_chance(0.8, 0.5, 2) == pytest.approx(0.5 * 0.2 / (0.2 + 0.2))
    assert unseen_chance(0.8, 0.5, 12) < 1e-3
    few = judged_mover(*two_level_night(10.0, 10.01), 11.2, 11.21, 11.19)
    assert few.verdict is Verdict.UNDECIDED, few.reason
    assert "+12.0% from its own, with chance 6.2" in few.reason or "chance 6.3%" in few.reason  # 0.25 over 4 gaps
    history, cases = two_level_night(*[10.0 + 0.01 * (i % 2) for i in range(12)])
    many = judged_mover(history, cases, 11.2, 11.21, 11.19)
    assert many.verdict is Verdict.SLOWER, many.reason  # its own twelve runs at one level speak for it
