"""A new runner's first nights: the spread a short history is judged by, SAME only inside the
threshold, FASTER confirmed like SLOWER; checked on literal numbers and on every committed session."""

import gzip
import json
import math
import re
from pathlib import Path

import pytest

from decodebench.gate import CaseInput, Policy, Verdict, judge
from decodebench.gate.decision import CASE_PRIOR_DF
from decodebench.runner.settle import settle
from tests.conftest import validation_script

ROOT = Path(__file__).resolve().parent.parent
RAW = ROOT / "validation/gate/h200"


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
            assert 1 / 1.05 <= v.low and v.high <= 1.05, v.reason


def test_a_faster_case_is_confirmed_on_every_round_like_a_slower_one():
    # lm_head on two levels, 114.6 µs stored (the upper one), 105.0 µs now: FASTER on one look
    history = (("0001", entry(114.6e-6, 114.7e-6, 114.5e-6, op="lm_head")),)
    runs = [105.0e-6]

    def inputs():
        return [CaseInput("lm_head", entry(*runs, op="lm_head"), history)]

    assert judge(inputs(), Policy(threshold=0.05))[0].verdict is Verdict.FASTER
    (found,) = settle(inputs, {"lm_head": lambda: runs.append(114.6e-6)}, Policy(threshold=0.05))
    assert len(runs) == 3  # open on both rounds
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


def test_a_case_with_more_runs_than_the_op_prior_is_worth_borrows_no_level():
    history, cases = two_level_night(*[10.0 + 0.01 * (i % 2) for i in range(CASE_PRIOR_DF + 1)])
    mover = judged_mover(history, cases, 11.2, 11.21, 11.19)
    assert mover.verdict is Verdict.SLOWER, mover.reason  # its own five runs at one level speak for it


def _script():
    """validation/gate/short_history.py, the simulation that wrote the committed raw file."""
    return validation_script("validation/gate/short_history.py")


STEP_H100 = [f"validation/gate/h100-2026-12-06-step-{s}/night-{n}.json.gz" for s, nights in (("a", 6), ("b", 4))
             for n in range(1, nights + 1)]
"""The H100 step-timer sequences of ``validation/gate/nights.sh``: nights 1-5 and the injected night 6, then 1-4."""
STEP_H100_INJECTED = "validation/gate/h100-2026-12-06-step-a/night-6.json.gz"


def _sessions(which: str) -> tuple[list[tuple[str, dict]], list[tuple[str, dict]]]:
    """Every committed session of a GPU's nightly kernels: (unchanged build, ``--inject-slowdown 5%``)."""
    module = _script()
    if which == "h200":
        unchanged, injected = module.UNCHANGED, module.INJECTED
    else:
        unchanged, injected = [p for p in STEP_H100 if p != STEP_H100_INJECTED], [STEP_H100_INJECTED]
    return [(p, module.load(p).entries) for p in unchanged], [(p, module.load(p).entries) for p in injected]


@pytest.mark.parametrize("which", ["h200", "h100-step"])
@pytest.mark.parametrize("threshold", [0.03, 0.05])
def test_no_same_on_a_committed_session_has_an_interval_past_the_threshold(threshold, which):
    unchanged, injected = _sessions(which)
    limit = math.log1p(threshold)
    judged = same = 0
    for path, entries in (*unchanged, *injected):
        history = [(p, e) for p, e in unchanged if p != path]
        cases = [CaseInput(n, e, tuple((p, h[n]) for p, h in history if n in h)) for n, e in entries.items()
                 if any(n in h for _, h in history)]
        for v in judge(cases, Policy(threshold=threshold)):
            judged += 1
            if v.verdict is Verdict.SAME:
                same += 1
                assert -limit <= math.log(v.low) and math.log(v.high) <= limit, f"{path}: {v.name}: {v.reason}"
    sessions = len(unchanged) + len(injected)
    assert judged > 190 * sessions and same > 0  # every committed session judged, and SAME does occur


@pytest.mark.parametrize(("folder", "least"), [("h100-2026-12-06-step-a", 300), ("h100-2026-12-06-step-b", 300),
                                               ("h100-2026-12-06-step-c", 100)])
def test_no_same_the_gate_said_on_the_gpu_nights_has_an_interval_past_its_threshold(folder, least):
    """The verdicts the live nights recorded (``extra_info.gate``), each at its night's ``--gate``."""
    said = 0
    for path in sorted((ROOT / "validation/gate" / folder).glob("night-*.json.gz")):
        gate = re.search(r"--gate (\d+)%", path.with_name(path.name.replace(".json.gz", ".log")).read_text())
        limit = math.log1p(int(gate.group(1)) / 100)
        for b in json.loads(gzip.decompress(path.read_bytes()))["benchmarks"]:
            verdict = b["extra_info"].get("gate") or {}
            if verdict.get("verdict") == "same":
                said += 1
                assert -limit <= math.log(verdict["low"]) and math.log(verdict["high"]) <= limit, b["name"]
    assert said > least  # the gated nights said SAME on most cases (c: night 2 only)


def test_the_committed_simulation_has_no_same_past_the_threshold_and_its_table_is_its_raw_file():
    module = _script()
    raw = json.loads((RAW / "short-history.json").read_text())
    assert not [r for r in raw["nights"] if r["same_beyond"]]
    table = (RAW / "short-history.md").read_text()
    assert table == f"$ {raw['command']}\n\n{module.tables(raw['nights'])}{module.LEVELS_HEAD}{raw['level_table']}"
    validation = (ROOT / "docs/validation.md").read_text()
    before = json.loads((RAW / "model-before/short-history.json").read_text())["nights"]
    borrowed = json.loads((RAW / "model-before-borrowed/short-history.json").read_text())["nights"]
    injected_rows = lambda nights: [line for line in module.tables(nights).splitlines()  # noqa: E731
                                    if line.startswith("| 3% |") and line.count("|") == 12]
    unchanged_rows = [line for line in module.tables(raw["nights"]).splitlines()
                      if line.startswith(("| 5% |", "| 3% |")) and line.count("|") == 13]
    shown = [*unchanged_rows, *injected_rows(raw["nights"]), *injected_rows(borrowed),
             *(line for line in injected_rows(before) if line.startswith("| 3% | 5 |"))]
    assert len(shown) == 8 + 5 + 5 + 1
    for line in shown:
        assert line in validation, line


def test_the_h100_simulation_is_its_raw_file_and_a_history_longer_than_its_sessions_is_refused(capsys):
    module = _script()
    raw = json.loads((ROOT / "validation/gate/h100/short-history.json").read_text())
    assert "--unchanged" in raw["command"] and not [r for r in raw["nights"] if r["injected"]]
    table = (ROOT / "validation/gate/h100/short-history.md").read_text()
    assert table == f"$ {raw['command']}\n\n{module.tables(raw['nights'])}{module.LEVELS_HEAD}{raw['level_table']}"
    two = ["validation/gate/h100-2026-12-06/night-1.json.gz", "validation/gate/h100-2026-12-06/night-2.json.gz"]
    with pytest.raises(SystemExit):
        module.main(["--unchanged", *two, "--injected", "--histories", "1,2"])
    assert "at most 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        module.main(["--unchanged", *two, "--injected", *two, "--histories", "1", "--power-histories", "1,3"])
    assert "--power-histories 1,3: more stored runs than the 2 --unchanged sessions" in capsys.readouterr().err


def test_the_h100_step_simulation_is_its_raw_file_and_its_rows_are_in_the_docs():
    """validation/gate/h100-step: the nights of nights.sh (step timer, one H100) judged offline; the table is
    what the script prints from the raw records, and docs/validation.md shows its rows."""
    module = _script()
    raw = json.loads((ROOT / "validation/gate/h100-step/short-history.json").read_text())
    assert all(p in raw["command"] for p in STEP_H100)
    assert not [r for r in raw["nights"] if r["same_beyond"]]
    tables = module.tables(raw["nights"])
    table = (ROOT / "validation/gate/h100-step/short-history.md").read_text()
    assert table == f"$ {raw['command']}\n\n{tables}{module.LEVELS_HEAD}{raw['level_table']}"
    validation = (ROOT / "docs/validation.md").read_text()
    shown = [line for line in tables.splitlines() if (line.startswith("| 5% |") and line.count("|") == 13)
             or (line.startswith("| 3% |") and line.count("|") == 12)]
    assert len(shown) == 4 + 5
    for line in shown:
        assert line in validation, line
