"""A session's gate from its cases to its one conclusion: judge, re-measure, price, conclude.

:func:`assess` is what both the pytest plugin and ``python -m decodebench.gate`` run: the
verdicts (:func:`~decodebench.gate.settle.settle`, which re-measures where it can), their
cost per decode step and the step changes (:mod:`~decodebench.gate.cost`), and the one line
that ends the report (:func:`conclude`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from ..shapes import DecodeShapes
from ..validate import entry_problem
from . import cost
from .decision import Policy, Verdict
from .settle import settle
from .summary import format_verdicts
from .verdict import CaseInput, CaseVerdict, judge

__all__ = ["Conclusion", "Judgment", "assess", "conclude"]


@dataclass(frozen=True)
class Conclusion:
    line: str  # the one line that ends the verdicts
    failed: bool
    compared: int  # verdicts that could be judged (not INCOMPARABLE)
    interrupted: bool = False


@dataclass
class Judgment:
    verdicts: list[CaseVerdict]
    steps: list[cost.StepChange] = field(default_factory=list)
    conclusion: Conclusion | None = None

    def lines(self, policy: Policy) -> list[str]:
        """The report: a line per verdict, slowest first, the step lines, the conclusion."""
        lines = format_verdicts(self.verdicts) + [s.line(policy.step_threshold) for s in self.steps]
        return lines + ([self.conclusion.line] if self.conclusion else [])


def assess(inputs: Callable[[], Sequence[CaseInput]], policy: Policy, *, gate: float | None, allow_empty: bool,
           nothing_why: Callable[[Sequence[CaseVerdict]], str], shapes: DecodeShapes | None = None,
           remeasure: Mapping[str, Callable[[], None]] | None = None, end_round: Callable[[], None] = lambda: None,
           prediction_entries: Sequence[Mapping] = (), selected: int | None = None,
           interrupted: bool = False,
           on_round: Callable[[int, Sequence[CaseVerdict]], None] = lambda number, todo: None) -> Judgment:
    """Judge the session's cases (re-measuring the undecided ones that can be), price every
    verdict, judge the predicted step, and conclude. ``gate``: the ``--gate`` threshold (None:
    report only); ``selected``: how many cases the session meant to run; ``on_round``: told
    before each re-measure round (:func:`~decodebench.gate.settle.settle`).

    An interrupt while re-measuring propagates (the round's processes stopped): the caller
    judges again with ``interrupted``."""
    # interrupted: judge what ran, re-measure nothing (the workers may be gone), conclude nothing
    verdicts = (judge(inputs(), policy) if interrupted
                else settle(inputs, remeasure or {}, policy, end_round, on_round))
    judgment = Judgment(verdicts)
    if shapes is not None and verdicts:
        entries = {c.name: c.current for c in inputs() if not entry_problem(c.current)}  # refused: not priced
        steps = cost.predicted_steps([*entries.values(), *prediction_entries], shapes, cost.tokens_in(entries))
        judgment.verdicts = cost.price(verdicts, entries, shapes, steps)
        judgment.steps = cost.step_changes(judgment.verdicts, steps, policy) if policy.step_threshold else []
    judgment.conclusion = conclude(judgment.verdicts, judgment.steps, policy, gate=gate, allow_empty=allow_empty,
                                   nothing_why=nothing_why(judgment.verdicts), selected=selected,
                                   interrupted=interrupted)
    return judgment


def conclude(verdicts: Sequence[CaseVerdict], steps: Sequence[cost.StepChange], policy: Policy, *,
             gate: float | None, allow_empty: bool, nothing_why: str, selected: int | None = None,
             interrupted: bool = False) -> Conclusion:
    """The single conclusion of a session: A/B and stored mode alike.

    >>> conclude([], [], Policy(), gate=0.05, allow_empty=False, nothing_why="no stored result in b/fp").line
    'gate FAILED: nothing was compared (no stored result in b/fp); --gate-allow-empty passes such a run'
    >>> conclude([], [], Policy(), gate=0.05, allow_empty=False, nothing_why="", selected=16, interrupted=True).line
    'gate FAILED: interrupted, 0 of 16 selected cases judged; no conclusion'
    """
    judged = [v for v in verdicts if v.verdict is not Verdict.INCOMPARABLE]
    slower = sum(v.verdict is Verdict.SLOWER for v in judged)
    if interrupted:
        of = f" of {selected} selected" if selected is not None else ""
        return Conclusion(f"gate FAILED: interrupted, {len(judged)}{of} cases judged; no conclusion", True, len(judged),
                          interrupted=True)
    if gate is None and policy.step_threshold is None:
        line = f"{slower} slower; gate off (--gate PCT fails the run on a slower verdict)"
        return Conclusion(line if judged else f"nothing was compared ({nothing_why})", False, len(judged))
    if not judged:
        if allow_empty:
            return Conclusion(f"gate passed (--gate-allow-empty): nothing was compared ({nothing_why})", False, 0)
        return Conclusion(f"gate FAILED: nothing was compared ({nothing_why}); "
                          "--gate-allow-empty passes such a run", True, 0)
    step_slower = [s for s in steps if s.verdict is Verdict.SLOWER]
    failed = bool((gate is not None and slower) or step_slower)
    beyond = f"by more than {gate:.1%} " if gate is not None else "(not gated) "
    parts = [f"{slower} of {len(judged)} cases significantly slower {beyond}"
             f"({policy.confidence:.0%} confidence for the session)"]
    undecided = sum(v.verdict is Verdict.UNDECIDED for v in judged)
    if undecided:
        parts.append(f"{undecided} undecided")
    if len(verdicts) > len(judged):
        parts.append(f"{len(verdicts) - len(judged)} not comparable")
    if steps:
        worst = max(steps, key=lambda s: s.share)
        parts.append(f"decode step {worst.share:+.2%} at M={worst.tokens}"
                     + (f", {len(step_slower)} step(s) slower by more than {policy.step_threshold:.1%}"
                        if step_slower else ""))
    return Conclusion(f"gate {'FAILED' if failed else 'passed'}: " + "; ".join(parts), failed, len(judged))
