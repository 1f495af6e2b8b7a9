"""A session's gate from its cases to its one conclusion: :func:`assess` (judge, price) and
:func:`conclude`, pure functions of the records handed in, run by the pytest plugin and
``python -m decodebench.gate`` alike; re-measuring is the runner's (:mod:`decodebench.runner.settle`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from ..results import Result
from ..shapes import DecodeShapes
from . import cost
from .decision import Policy, Verdict
from .reference import named
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
    notes: list[str] = field(default_factory=list)  # what the figures are of, where that is not the whole step

    def lines(self, policy: Policy) -> list[str]:
        """The report: a line per verdict, slowest first, the step lines, the notes, the conclusion."""
        lines = format_verdicts(self.verdicts) + [s.line(policy.step_threshold) for s in self.steps] + self.notes
        return lines + ([self.conclusion.line] if self.conclusion else [])


def partial_step(steps: Mapping[int, object]) -> str | None:
    """What "% of step" is a share of when the predicted step lacks components, or None.

    >>> from types import SimpleNamespace as NS
    >>> step = NS(missing=("moe: no fused moe result", "rmsnorm: no rmsnorm result (q latent)"),
    ...           groups_us=lambda: {"rmsnorm": 4.0, "moe": 0.0})
    >>> partial_step({8: step})
    '% of step: a share of the step predicted from the kernel results at hand (rmsnorm in part), which lacks moe'
    """
    lacking = {line.split(":", 1)[0] for step in steps.values() for line in step.missing}
    if not lacking:
        return None
    have = sorted({group for step in steps.values() for group, us in step.groups_us().items() if us})
    covered = ", ".join(f"{group} in part" if group in lacking else group for group in have)
    return (f"% of step: a share of the step predicted from the kernel results at hand ({covered or 'none'}), "
            f"which lacks {', '.join(sorted(lacking - set(have)))}")


def assess(cases: Sequence[CaseInput], policy: Policy, *, shapes: DecodeShapes | None = None,
           prediction_entries: Sequence[Result] = (), notes: Mapping[str, Sequence[str]] | None = None) -> Judgment:
    """Judge the session's cases, price every verdict and judge the predicted step; the
    conclusion is :func:`conclude`'s (it needs what the caller knows of an empty session).
    ``notes``: lines to keep with a case's verdict (a re-measure that failed), by case.

    >>> entry = {"stats": {"data": [1e-5] * 5}, "extra_info": {"timer": "kernel"}}
    >>> judged = assess([CaseInput("a", entry, (("0001", entry),))], Policy(), notes={"a": ["re-measure failed"]})
    >>> judged.verdicts[0].verdict.value, judged.verdicts[0].notes, judged.steps
    ('undecided', ('re-measure failed',), [])
    """
    notes = notes or {}
    verdicts = [replace(v, notes=(*v.notes, *notes.get(v.name, ()))) for v in judge(cases, policy)]
    judgment = Judgment(verdicts)
    if shapes is not None and verdicts:
        records = {c.name: c.current for c in cases if not c.current.problem}  # refused: not priced
        tokens = [r.tokens for r in records.values() if r.tokens is not None]  # the session's, not the baseline's
        steps = cost.predicted_steps([*records.values(), *prediction_entries], shapes, tokens, policy.step_context)
        judgment.verdicts = cost.price(verdicts, records, shapes, steps)
        shared = any(v.step_share is not None for v in judgment.verdicts)
        judgment.notes = [note for note in [partial_step(steps)] if note and shared]
        judgment.steps = cost.step_changes(judgment.verdicts, steps, policy) if policy.step_threshold else []
    return judgment


def conclude(verdicts: Sequence[CaseVerdict], steps: Sequence[cost.StepChange], policy: Policy, *,
             gate: float | None, allow_empty: bool, nothing_why: str, selected: int | None = None,
             interrupted: bool = False, signal: str | None = None, new: Sequence[str] = ()) -> Conclusion:
    """The single conclusion of a session: A/B and stored mode alike. An interrupted session names
    the ``signal`` that interrupted it where one did (not where ``-x`` stopped it). Every case that
    ran is counted: judged, not comparable, or ``new`` (no stored run: named).

    >>> conclude([], [], Policy(), gate=0.05, allow_empty=False, nothing_why="no stored result in b/fp").line
    'gate FAILED: nothing was compared (no stored result in b/fp); --gate-allow-empty passes such a run'
    >>> conclude([], [], Policy(), gate=0.05, allow_empty=False, nothing_why="", selected=16, interrupted=True).line
    'gate FAILED: interrupted, 0 of 16 selected cases judged; no conclusion'
    >>> conclude([], [], Policy(), gate=0.05, allow_empty=False, nothing_why="", selected=16, interrupted=True,
    ...          signal="SIGTERM").line
    'gate FAILED: interrupted by SIGTERM, 0 of 16 selected cases judged; no conclusion'
    """
    judged = [v for v in verdicts if v.verdict is not Verdict.INCOMPARABLE]
    slower = sum(v.verdict is Verdict.SLOWER for v in judged)
    if interrupted:
        of = f" of {selected} selected" if selected is not None else ""
        by = f" by {signal}" if signal else ""
        return Conclusion(f"gate FAILED: interrupted{by}, {len(judged)}{of} cases judged; no conclusion", True,
                          len(judged), interrupted=True)
    unjudged = _unjudged(len(verdicts) - len(judged), new)
    if gate is None and policy.step_threshold is None:
        line = f"{slower} slower{unjudged}; gate off (--gate PCT fails the run on a slower verdict)"
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
    undecided = [v for v in judged if v.verdict is Verdict.UNDECIDED]
    if undecided:
        noisy = sum(v.detectable is None or v.detectable > policy.threshold for v in undecided)
        parts.append(f"{len(undecided)} undecided, {noisy} of them too noisy to gate at {policy.threshold:.1%}")
    if unjudged:
        parts.append(unjudged[2:])
    if steps:
        worst = max(steps, key=lambda s: s.share)
        parts.append(f"decode step {worst.share:+.2%} at M={worst.tokens}"
                     + (f", {len(step_slower)} step(s) slower by more than {policy.step_threshold:.1%}"
                        if step_slower else ""))
    return Conclusion(f"gate {'FAILED' if failed else 'passed'}: " + "; ".join(parts), failed, len(judged))


def _unjudged(incomparable: int, new: Sequence[str]) -> str:
    """``; 2 not comparable; 3 new (no stored run here: a, b, c)``, or nothing.

    >>> _unjudged(0, ["t::a"])
    '; 1 new (no stored run here: a)'
    """
    parts = [f"{incomparable} not comparable"] if incomparable else []
    if new:
        parts.append(f"{len(new)} new (no stored run here: {named(new)})")
    return "".join(f"; {part}" for part in parts)
