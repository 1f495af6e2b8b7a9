"""The session's gate: what to compare against, the verdicts, re-measuring, one conclusion.

The plugin wires this into pytest; everything here works on plain data (stored
JSON entries, the current entries, re-measure closures), so it is tested without a
benchmark run.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from .baselines import History
from .compare import Comparison, GateThresholds, Run, Verdict

__all__ = [
    "Baseline",
    "Conclusion",
    "GatePolicy",
    "Pending",
    "as_run",
    "baseline_from_history",
    "conclude",
    "needs_more_runs",
    "settle",
    "settle_all",
    "unconfirmed",
    "verdict_record",
    "why_nothing",
]


@dataclass(frozen=True)
class GatePolicy:
    """``threshold``: fail on SLOWER beyond it (None: report only); ``allow_empty``: pass a run
    that compared nothing; ``resamples``: extra runs at most per unsettled case;
    ``history``: stored results of this fingerprint that form the baseline;
    ``max_load_per_cpu``: see :class:`~decodebench.compare.GateThresholds`."""

    threshold: float | None = None
    allow_empty: bool = False
    resamples: int = 2
    history: int = 5
    max_load_per_cpu: float = GateThresholds.max_load_per_cpu

    @property
    def thresholds(self) -> GateThresholds:
        threshold = self.threshold or GateThresholds().threshold
        return GateThresholds(threshold=threshold, max_load_per_cpu=self.max_load_per_cpu)


@dataclass
class Baseline:
    """Stored entries per test node id (oldest first), where they came from, and what was wrong."""

    source: str  # the file or folder named in messages
    entries: dict[str, list[Mapping]] = field(default_factory=dict)
    problem: str | None = None  # why there is nothing to compare against
    skipped: tuple[str, ...] = ()  # files passed over, with the reason
    foreign: set[int] = field(default_factory=set)  # ids of entries from another fingerprint


def baseline_from_history(history: History, count: int) -> Baseline:
    """The newest ``count`` readable results of a fingerprint's folder as one baseline.

    >>> from pathlib import Path
    >>> baseline_from_history(History(Path("b/fp"), (), ()), 5).problem
    'no stored result in b/fp (first run on this machine?)'
    """
    chosen = history.newest(count)
    baseline = Baseline(str(chosen[-1].path) if chosen else str(history.folder), skipped=history.skipped)
    if not chosen:
        baseline.problem = history.why_empty()
    for result in chosen:
        for name, entry in result.entries().items():
            baseline.entries.setdefault(name, []).append(entry)
    return baseline


def needs_more_runs(comparison: Comparison) -> bool:
    """UNDECIDED needs more runs to settle; a SLOWER resting on a single current run needs
    a second one to confirm it (one run cannot tell a regression from a slow moment)."""
    if comparison.verdict is Verdict.UNDECIDED:
        return True
    return comparison.verdict is Verdict.SLOWER and comparison.runs[1] < 2


def settle(
    judge: Callable[[], Comparison],
    remeasure: Callable[[], Run | Sequence[float]] | None,
    add_run: Callable[[Run], None],
    rounds: int,
) -> Comparison:
    """Judge, then re-measure and judge again while the verdict is unsettled, ``rounds`` times at most.
    ``remeasure`` returns a :class:`~decodebench.compare.Run` (or just its samples).

    >>> from decodebench.compare import compare_runs
    >>> runs = [[1.3, 1.3, 1.3]]
    >>> judge = lambda: compare_runs([[1.0, 1.0, 1.01]], runs)
    >>> settle(judge, lambda: [1.0, 1.0, 1.0], lambda run: runs.append(run.samples), 2).verdict  # a moment
    <Verdict.SAME: 'same'>
    """
    case, comparison = Pending(judge, remeasure, add_run), judge()
    for _ in range(rounds if remeasure else 0):
        if not needs_more_runs(comparison):
            break
        comparison = _settle_once(case, comparison)
        if _FAILED in comparison.reason:
            return comparison
    return unconfirmed(comparison) if remeasure and rounds else comparison


def as_run(result: Run | Sequence[float]) -> Run:
    """A re-measure's result as a :class:`~decodebench.compare.Run`."""
    return result if isinstance(result, Run) else Run(list(result))


@dataclass(frozen=True)
class Pending:
    """One case to settle: how to judge it, re-measure it, and keep a new run."""

    judge: Callable[[], Comparison]
    remeasure: Callable[[], Run | Sequence[float]] | None
    add_run: Callable[[Run], None]


def settle_all(cases: Sequence[Pending], rounds: int, end_round: Callable[[], None] = lambda: None) -> list[Comparison]:
    """:func:`settle` for many cases, round by round: each round re-measures every unsettled
    case once, so the runs of one case lie apart in time (a slow moment rarely hits both).
    ``end_round`` runs after each round that re-measured something, and once more at the end
    whatever happened (the plugin stops the round's fresh process there).

    >>> from decodebench.compare import compare_runs
    >>> runs = [[1.3, 1.3, 1.3]]
    >>> case = Pending(lambda: compare_runs([[1.0, 1.0, 1.01]], runs), lambda: [1.0] * 3, lambda r: runs.append(r.samples))
    >>> [c.verdict.value for c in settle_all([case], 2)]
    ['same']
    """
    verdicts = [case.judge() for case in cases]
    try:
        for _ in range(rounds):
            todo = [i for i, c in enumerate(verdicts) if needs_more_runs(c) and cases[i].remeasure is not None]
            if not todo:
                break
            for i in todo:
                verdicts[i] = _settle_once(cases[i], verdicts[i])
            end_round()
    finally:
        end_round()
    return [unconfirmed(v) if c.remeasure is not None and rounds else v for c, v in zip(cases, verdicts, strict=True)]


_FAILED = "re-measure failed"


def _settle_once(case: Pending, comparison: Comparison) -> Comparison:
    try:
        case.add_run(as_run(case.remeasure()))
    except Exception as exc:  # a failing re-measure must not hide the verdict it was meant to settle
        return _with_reason(comparison, f"{_FAILED}: {type(exc).__name__}: {exc}")
    return case.judge()


def unconfirmed(comparison: Comparison) -> Comparison:
    """A SLOWER that still rests on one current run once the re-measures are spent is UNDECIDED:
    no second run showed it (each re-measure fell in a moment the gate set aside, or was
    normal). A SLOWER whose re-measure failed stays SLOWER.

    >>> unconfirmed(Comparison("k", Verdict.SLOWER, 1.3, 1e-6, "+30%", (2, 1))).verdict
    <Verdict.UNDECIDED: 'undecided'>
    """
    if comparison.verdict is not Verdict.SLOWER or comparison.runs[1] >= 2 or _FAILED in comparison.reason:
        return comparison
    return Comparison(comparison.name, Verdict.UNDECIDED, comparison.ratio, comparison.p_value,
                      f"{comparison.reason}; seen in one run only, no re-measure confirmed it", comparison.runs)


def _with_reason(c: Comparison, extra: str) -> Comparison:
    return Comparison(c.name, c.verdict, c.ratio, c.p_value, f"{c.reason}; {extra}", c.runs)


@dataclass(frozen=True)
class Conclusion:
    line: str  # the one line that ends the verdicts
    failed: bool
    compared: int  # comparisons that could be judged (not INCOMPARABLE)


def conclude(comparisons: Sequence[Comparison], policy: GatePolicy, nothing_why: str) -> Conclusion:
    """The single conclusion of a session. ``nothing_why`` says why nothing was compared,
    used only when nothing was.

    >>> conclude([], GatePolicy(threshold=0.05), "no stored result in b/fp").line
    'gate FAILED: nothing was compared (no stored result in b/fp); --gate-allow-empty passes such a run'
    """
    judged = [c for c in comparisons if c.verdict is not Verdict.INCOMPARABLE]
    slower = sum(c.verdict is Verdict.SLOWER for c in judged)
    if policy.threshold is None:
        line = f"{slower} slower; gate off (--gate PCT fails the run on a slower verdict)"
        return Conclusion(line if judged else f"nothing was compared ({nothing_why})", False, len(judged))
    if not judged:
        if policy.allow_empty:
            return Conclusion(f"gate passed (--gate-allow-empty): nothing was compared ({nothing_why})", False, 0)
        return Conclusion(f"gate FAILED: nothing was compared ({nothing_why}); "
                          "--gate-allow-empty passes such a run", True, 0)
    status = "FAILED" if slower else "passed"
    skipped = len(comparisons) - len(judged)
    tail = f"; {skipped} not comparable" if skipped else ""
    return Conclusion(f"gate {status}: {slower} of {len(judged)} significantly slower by more than "
                      f"{policy.threshold:.1%}{tail}", bool(slower), len(judged))


def why_nothing(baseline: Baseline | None, ran: int, comparisons: Sequence[Comparison]) -> str:
    """Why a session compared nothing, naming the file or folder.

    >>> why_nothing(None, 3, [])
    '--benchmark-compare was not given, so there is no baseline'
    """
    if baseline is None:
        return "--benchmark-compare was not given, so there is no baseline"
    if baseline.problem:
        return baseline.problem
    if not ran:
        return f"no benchmark ran in this session (all skipped or deselected); baseline {baseline.source}"
    if not comparisons:
        return f"none of this session's {ran} benchmarks is in {baseline.source}"
    reasons = sorted({c.reason for c in comparisons})
    return f"against {baseline.source}: " + "; ".join(reasons[:3]) + (" …" if len(reasons) > 3 else "")


def verdict_record(c: Comparison) -> dict[str, object]:
    """What a result's ``extra_info`` keeps of its verdict."""
    return {"verdict": c.verdict.value, "ratio": c.ratio, "p_value": c.p_value, "reason": c.reason,
            "runs": list(c.runs)}

