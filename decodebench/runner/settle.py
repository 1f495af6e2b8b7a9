"""Re-measuring until decided: the runner's loop around the judge (docs/gate.md, "Re-measuring before
the report").

Each round re-measures every case that is not SAME once (so a case's runs lie apart in time), at most
``Policy.resamples`` rounds, then the session is judged again. A SLOWER or FASTER is called only at a
case's last look (:func:`~decodebench.gate.decision.stays_open`): a regression is a change that holds in
further processes (on the 2-core CI machine with a CPU-bound neighbour, 2 of 30 identical sessions had a
case at 1.60–1.66× on its one 30 ms run). What a re-measure returns is kept (:class:`Remeasured`) and
appended to its case's record at each judgment (:func:`with_kept`); it is stored by the one writer,
:func:`decodebench.results.stored_entry`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from ..gate.decision import Policy, Verdict, stays_open
from ..gate.verdict import CaseInput, CaseVerdict, judge
from ..harness import Run
from ..results import with_rounds, with_run
from .ab import Rounds

__all__ = ["Remeasured", "describe_round", "failures", "settle", "with_kept"]


@dataclass
class Remeasured:
    """What each case's re-measures returned, in order, for the writer at storage."""

    runs: dict[str, list[Run | Rounds]] = field(default_factory=dict)

    def add(self, name: str, measured: Run | Rounds) -> None:
        self.runs.setdefault(name, []).append(measured)


def settle(cases: Callable[[], Sequence[CaseInput]], remeasure: Mapping[str, Callable[[], Run | Rounds]],
           policy: Policy, end_round: Callable[[], None] = lambda: None,
           on_round: Callable[[int, Sequence[CaseVerdict]], None] = lambda number, todo: None,
           kept: Remeasured | None = None) -> list[CaseVerdict]:
    """Judge, then re-measure the UNDECIDED cases that can be, round by round, and judge again.

    ``cases`` gives the session's cases as they stand (their neighbours looked for again); each
    ``remeasure[name]()`` returns one more run of its case, which is kept (``kept``) and appended to
    the case's record at every judgment. A re-measure that fails is noted on its verdict and not
    retried. ``on_round(number, verdicts)`` is told before each round what it re-measures;
    ``end_round`` runs after each round and once at the end, whatever happened (an interrupt
    included: it propagates after the round's processes are stopped).

    >>> now = lambda: [CaseInput("a", {"stats": {"data": [1.3e-5] * 5}}, (("0001", {"stats": {"data": [1e-5] * 5}}),))]
    >>> judge(now(), Policy())[0].verdict.value  # one run now, one stored: no spread to judge by yet
    'undecided'
    >>> kept = Remeasured()
    >>> settle(now, {"a": lambda: Run([1.301e-5] * 5)}, Policy(), kept=kept)[0].verdict.value, len(kept.runs["a"])
    ('slower', 2)
    """
    kept = kept if kept is not None else Remeasured()
    verdicts = judge(with_kept(cases(), kept), policy)
    failed: dict[str, str] = {}
    try:
        for number in range(1, policy.resamples + 1):
            todo = [v for v in verdicts if stays_open(v.verdict) and v.name in remeasure and v.name not in failed]
            if not todo:
                break
            on_round(number, todo)
            for name in [v.name for v in todo]:
                try:
                    measured = remeasure[name]()
                except Exception as exc:  # a failing re-measure must not hide the verdict it was to settle
                    failed[name] = f"re-measure failed: {type(exc).__name__}: {exc}"
                    continue
                kept.add(name, measured)
            end_round()
            verdicts = judge(with_kept(cases(), kept), policy)
    finally:
        end_round()
    return [replace(v, notes=(*v.notes, failed[v.name])) if v.name in failed else v for v in verdicts]


def with_kept(cases: Sequence[CaseInput], kept: Remeasured) -> list[CaseInput]:
    """The cases, each with its kept re-measures appended to its record."""
    out = []
    for case in cases:
        record = case.current
        for measured in kept.runs.get(case.name, ()):
            record = (with_rounds(record, measured.runs_a, measured.runs_b, measured.pairs)
                      if isinstance(measured, Rounds) else with_run(record, measured.samples, measured.kernels))
        out.append(replace(case, current=record))
    return out


def describe_round(number: int, rounds: int, todo: Sequence[CaseVerdict]) -> str:
    """The line a session prints before a re-measure round.

    >>> v = CaseVerdict("t", Verdict.SLOWER, "", runs=(3, 1))
    >>> describe_round(1, 2, [v, replace(v, verdict=Verdict.UNDECIDED)])
    'decodebench gate: re-measure round 1 of 2: 2 cases (1 undecided, 1 slower so far, confirmed only on every round)'
    """
    undecided = sum(v.verdict is Verdict.UNDECIDED for v in todo)
    parts = [f"{undecided} undecided"] if undecided else []
    for verdict in (Verdict.SLOWER, Verdict.FASTER):
        count = sum(v.verdict is verdict for v in todo)
        if count:
            parts.append(f"{count} {verdict.value} so far, confirmed only on every round")
    cases = f"{len(todo)} case{'s' if len(todo) != 1 else ''}"
    return f"decodebench gate: re-measure round {number} of {rounds}: {cases} ({', '.join(parts)})"


def failures(verdicts: Sequence[CaseVerdict]) -> dict[str, tuple[str, ...]]:
    """The notes :func:`settle` put on its verdicts (a re-measure that failed), by case, for the judge.

    >>> failures([CaseVerdict("t", Verdict.SAME, "", notes=("re-measure failed: OSError: gone",))])
    {'t': ('re-measure failed: OSError: gone',)}
    """
    return {v.name: v.notes for v in verdicts if v.notes}
