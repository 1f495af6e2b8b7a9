"""One verdict per case, from stored runs alone: the pure function behind the gate.

:func:`judge` takes every case of a session — its current entry and, in stored mode, its
stored entries oldest first; in A/B mode the entry carries both sides' rounds — and returns a
:class:`CaseVerdict` per case. It pools the run-to-run spread across cases (op, then all of
the fingerprint and timer, :mod:`decodebench.gate.decision`), so it judges a session as a
whole; the live session and ``python -m decodebench.gate`` call it on the same data and
print the same lines.

Stored mode is the unpaired form of the model (the history's runs against this session's,
after the persistent step and the levels of :mod:`decodebench.gate.series`); A/B mode is the
paired form (round i of A against round i of B: drift that hits both cancels).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from .. import stats
from . import runs as R
from .decision import (
    CASE_PRIOR_DF,
    PRIOR_DF,
    Estimate,
    Policy,
    Spread,
    Verdict,
    decide,
    fit_prior,
    paired_estimate,
    per_test_alpha,
    pooled,
    shrink,
    unpaired_estimate,
)
from .entry import Entry, read_entry
from .series import Level, Point, find_step, level_gaps, levels_of

__all__ = ["CaseInput", "CaseVerdict", "judge"]


@dataclass(frozen=True)
class CaseInput:
    """A case to judge: its entry now and its stored entries ``(label, entry)``, oldest first,
    each read once into a record (:func:`~decodebench.gate.entry.read_entry`; a stored entry may
    come as one, from the baseline). An entry now that cannot be used is INCOMPARABLE, naming
    why; a stored one is left out."""

    name: str
    current: Mapping  # the entry as given: the pricing and the writers read it
    history: tuple[tuple[str, Entry], ...] = ()
    record: Entry = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "record", read_entry(self.current))
        object.__setattr__(self, "history", tuple((label, e if isinstance(e, Entry) else read_entry(e))
                                                  for label, e in self.history))


@dataclass(frozen=True)
class CaseVerdict:
    """The verdict on one case, the numbers behind it, and what it costs the decode step."""

    name: str
    verdict: Verdict
    reason: str
    ratio: float | None = None  # level now / level then (B / A in A/B mode)
    low: float | None = None  # the interval of the ratio
    high: float | None = None
    runs: tuple[int, int] = (0, 0)  # runs (rounds) then and now
    paired: bool = False
    step: str | None = None  # a persistent step over the stored series
    kernels: str | None = None  # how this run's kernels differ from the baseline's
    base_s: float | None = None  # the baseline's level, seconds per call
    se: float | None = None  # standard error of the log change
    df: float | None = None
    spread: float | None = None  # the run-to-run spread judged by (log scale, one run)
    tokens: int | None = None  # decode batch of the case's shape point
    calls: int | None = None  # calls per decode step
    cost_us: float | None = None  # change of the decode step, µs
    step_share: float | None = None  # cost_us over the predicted step
    notes: tuple[str, ...] = field(default=())

    def record(self) -> dict[str, object]:
        """What a result's ``extra_info["gate"]`` keeps of its verdict (both modes alike)."""
        keys = ("verdict", "ratio", "low", "high", "spread", "runs", "paired", "step", "kernels", "reason",
                "tokens", "calls", "cost_us", "step_share")
        out = {k: getattr(self, k) for k in keys}
        out["verdict"], out["runs"] = self.verdict.value, list(self.runs)
        return out


@dataclass
class _Case:
    """Working state of one case while the session is judged."""

    given: CaseInput
    paired: bool
    group: str
    timer: str | None
    now: list[float] = field(default_factory=list)  # log run values now (B rounds in A/B)
    now_kernels: list = field(default_factory=list)
    points: list[Point] = field(default_factory=list)  # stored results (stored mode)
    differences: list[float] = field(default_factory=list)  # B - A per process pair (A/B mode)
    rounds: int = 0  # paired rounds behind them
    refused: str | None = None
    busy: str | None = None
    readable: bool = True  # the entry passed validation: its fields may be read
    _levels: dict[int, list[Level]] = field(default_factory=dict)  # by window start: found once a judgement

    def window(self, start: int = 0) -> tuple[list[float], list]:
        points = self.points[start:]
        return [v for p in points for v in p.values], [k for p in points for k in p.kernels]

    def levels(self, threshold: float, start: int = 0) -> list[Level]:
        """The baseline's levels from stored result ``start`` on (the priors, the case's own
        spread and its verdict read the same ones)."""
        if start not in self._levels:
            self._levels[start] = levels_of(*self.window(start), threshold)
        return self._levels[start]

    def own_groups(self, threshold: float, start: int = 0) -> list[Sequence[float]]:
        if self.paired:
            return [self.differences]
        return [lv.values for lv in self.levels(threshold, start)] + [self.now]


def judge(cases: Sequence[CaseInput], policy: Policy) -> list[CaseVerdict]:
    """A verdict per case (same order), the spread pooled over the session's cases.

    >>> def entry(scale, runs=1):
    ...     data = [scale * (1 + 0.001 * i) for i in range(10)]
    ...     return {"stats": {"data": data}, "extra_info": {"timer": "kernel", "component": "x",
    ...             "resamples": [data] * (runs - 1)}}
    >>> history = (("0001", entry(1e-5, 3)), ("0002", entry(1e-5, 3)))
    >>> [v.verdict.value for v in judge([CaseInput("a", entry(1e-5, 2), history),
    ...                                  CaseInput("b", entry(1.3e-5, 2), history)], Policy())]
    ['same', 'slower']
    """
    work = [_prepare(c, policy) for c in cases]
    live = [w for w in work if not w.refused]
    alpha = per_test_alpha(policy, len(live))
    priors = _priors(live, policy.threshold)
    verdicts = [_finish(w, priors, policy, alpha) for w in work]
    return _stepped_up(work, verdicts, priors, policy, len(live))


# Levels tried between the Bonferroni level and the session's (1 - confidence) when a case's own smallest
# SLOWER level is searched (a geometric grid: the step-up level is found to within a factor of about 1.06).
_STEP_UP_GRID = 96


def _stepped_up(work: Sequence[_Case], verdicts: list[CaseVerdict], priors: _Priors, policy: Policy,
                live: int) -> list[CaseVerdict]:
    """The Benjamini–Hochberg step-up over the session's SLOWER tests, once a case is SLOWER at the
    Bonferroni level: an UNDECIDED case is SLOWER when its smallest SLOWER level is within the
    step-up's (k x (1 - confidence) / cases, k the most cases whose levels are each within theirs).

    A session without a SLOWER at the Bonferroni level is left as it is, so whether a session passes is
    Bonferroni's decision (the chance that an unchanged build fails stays within 1 - confidence); once
    one case is SLOWER, the cases called are those the step-up calls, whose expected share of false ones
    is at most 1 - confidence. SAME, FASTER and UNDECIDED stay at the Bonferroni level."""
    bonferroni = per_test_alpha(policy, live)
    rejected = sum(v.verdict is Verdict.SLOWER for v in verdicts)
    if not rejected or live < 2:
        return verdicts
    q = 1 - policy.confidence
    grid = [bonferroni * (q / bonferroni) ** (i / _STEP_UP_GRID) for i in range(1, _STEP_UP_GRID + 1)]
    smallest: dict[int, float] = {}  # case index -> the smallest level of the grid at which it is SLOWER
    for index, (case, verdict) in enumerate(zip(work, verdicts, strict=True)):
        if case.refused or verdict.verdict is not Verdict.UNDECIDED:
            continue
        if _finish(case, priors, policy, q).verdict is not Verdict.SLOWER:
            continue
        low, high = 0, len(grid) - 1  # grid[high] == q is SLOWER; find the first SLOWER level by bisection
        while low < high:
            middle = (low + high) // 2
            if _finish(case, priors, policy, grid[middle]).verdict is Verdict.SLOWER:
                high = middle
            else:
                low = middle + 1
        smallest[index] = grid[low]
    levels = sorted([bonferroni] * rejected + list(smallest.values()))
    k = max((rank for rank, level in enumerate(levels, 1) if level <= rank * q / live), default=rejected)
    step_up = k * q / live
    out = list(verdicts)
    for index, level in smallest.items():
        if level <= step_up:
            judged = _finish(work[index], priors, policy, step_up)
            if judged.verdict is Verdict.SLOWER:
                out[index] = replace(judged, reason=f"{judged.reason}; at the step-up level {step_up:.2g} "
                                                    f"(Benjamini–Hochberg: {k} of {live} cases slower)")
    return out


def _prepare(given: CaseInput, policy: Policy) -> _Case:
    entry = given.record
    if entry.problem:  # never read further: an impossible number must not reach a statistic
        return _Case(given, False, "", None, refused=f"this result cannot be judged: {entry.problem}",
                     readable=False)
    history = [(label, stored) for label, stored in given.history if not stored.problem]
    case = _Case(given, entry.paired is not None, entry.group, entry.timer)
    case.refused = _refusal(entry, history)
    if case.refused:
        return case
    if case.paired:
        case.differences, case.rounds = R.pair_differences(entry)
    else:
        case.now, case.now_kernels = R.run_values(entry)
        for label, stored in history:
            if not stored.invalid and not _unlike(entry, stored):
                values, kernels = R.run_values(stored)
                if values:
                    case.points.append(Point(label, tuple(values), tuple(kernels)))
    stored = [e for _, e in history]
    case.busy = next(filter(None, (R.contention(e, policy.max_load_per_cpu) for e in [entry, *stored])), None)
    return case


def _refusal(entry: Entry, history: Sequence[tuple[str, Entry]]) -> str | None:
    """Why ``entry`` cannot be judged at all, or None."""
    if entry.invalid:
        return f"this result is marked invalid: {entry.invalid}"
    if entry.paired is not None:
        return None
    valid = [e for _, e in history if not e.invalid]
    if not valid:
        reasons = "; ".join(filter(None, (e.invalid for _, e in history))) or "none stored"
        return f"no valid baseline ({reasons})"
    same_timer = [e for e in valid if R.timer_of(e) == R.timer_of(entry)]  # a storage may hold several timers
    if not same_timer:
        timers = ", ".join(sorted({repr(R.timer_of(e)) for e in valid}))
        return (f"timer {R.timer_of(entry)!r} now, no stored run of it (stored: {timers}): a timer is no "
                "baseline of another")
    return _unlike(entry, same_timer[-1])


def _unlike(entry: Entry, stored: Entry) -> str | None:
    """How ``stored`` was measured other than ``entry`` (timer, setup), making it no baseline of it."""
    if stored.timer != entry.timer:
        return f"timer {entry.timer!r} now, {stored.timer!r} in the baseline"
    return R.setup_change(entry, stored)


@dataclass(frozen=True)
class _Priors:
    """Per op group: the spread a case of it is shrunk towards (df = the weight it gets:
    :data:`~.decision.CASE_PRIOR_DF` for run values, :data:`~.decision.PRIOR_DF` for paired
    differences)."""

    by_group: dict[tuple, Spread]
    gaps: dict[tuple, list[float]] = field(default_factory=dict)  # level gaps (log) the op's cases show

    def spread_for(self, case: _Case, own: Spread) -> Spread:
        return shrink(own, self.by_group.get(_group_of(case), Spread()))

    def borrowed_for(self, case: _Case, levels: list[Level], runs: int) -> list[Level]:
        """While the case's own ``runs`` are no more than the op's spread is worth to it
        (:data:`CASE_PRIOR_DF`) and show one level, the levels its op's other cases show (else
        those of its component's other ops: the same library's kernels), borrowed: its level
        moved up by each of their gaps. None otherwise. Not across components: on the H200 only
        cuBLAS GEMMs move between levels (docs/validation.md)."""
        if len(levels) > 1 or runs > CASE_PRIOR_DF:
            return []
        key = _group_of(case)
        gaps, origin = self.gaps.get(key), "its op's cases"
        if not gaps:
            gaps = [g for k, gs in self.gaps.items() if k[:2] == key[:2] and _component(k) == _component(key)
                    for g in gs]
            origin = "its component's other ops"
        return [levels[0].moved(g, origin) for g in _distinct(gaps)]


def _group_of(case: _Case) -> tuple:
    return case.paired, case.timer, case.group


def _priors(cases: Sequence[_Case], threshold: float) -> _Priors:
    """The op priors: each op's pooled spread (its cases at every shape point) shrunk towards all
    ops of its timer, weighted by how alike the ops' spreads are (:func:`fit_prior`); a case then
    leans on its op's prior with :data:`CASE_PRIOR_DF` df at most (a paired case with
    :data:`PRIOR_DF`). Paired differences and unpaired run values are kept apart: they are other
    quantities."""
    groups: dict[tuple, list] = {}
    for case in cases:
        groups.setdefault(_group_of(case), []).extend(case.own_groups(threshold))
    ops = {key: pooled(runs, "op") for key, runs in groups.items()}
    by_group = {}
    for key, op in ops.items():
        peers = [s for k, s in ops.items() if k[:2] == key[:2]]
        everything = fit_prior(peers, "all cases") or _capped(pooled([r for k, rs in groups.items()
                                                                      if k[:2] == key[:2] for r in rs], "all cases"))
        moderated = shrink(op, everything)
        weight = PRIOR_DF if key[0] else CASE_PRIOR_DF
        by_group[key] = Spread(moderated.variance, min(weight, moderated.df), moderated.source)
    gaps: dict[tuple, list[float]] = {}
    for case in cases:
        if not case.paired:
            gaps.setdefault(_group_of(case), []).extend(level_gaps(case.levels(threshold)))
    return _Priors(by_group, {key: g for key, g in gaps.items() if g})


def _component(key: tuple) -> str:
    """The component and backend of an op's group key (``dense_gemm|vllm``)."""
    return "|".join(key[2].split("|")[:2])


def _distinct(gaps: list[float], apart: float = 0.01) -> list[float]:
    """``gaps`` without those within ``apart`` (log) of a smaller one kept: one level per cluster."""
    kept: list[float] = []
    for gap in sorted(gaps):
        if not kept or gap - kept[-1] > apart:
            kept.append(gap)
    return kept


def _capped(spread: Spread) -> Spread:
    return Spread(spread.variance, min(spread.df, PRIOR_DF), spread.source)


def _finish(case: _Case, priors: _Priors, policy: Policy, alpha: float) -> CaseVerdict:
    name = case.given.name
    tokens = case.given.record.tokens
    base = CaseVerdict(name, Verdict.INCOMPARABLE, case.refused or "", tokens=tokens, paired=case.paired)
    if case.refused:
        return base
    if case.paired:
        verdict = _judge_paired(case, priors, policy, alpha, base)
    else:
        verdict = _judge_stored(case, priors, policy, alpha, base)
    if case.busy and verdict.verdict in (Verdict.SLOWER, Verdict.FASTER):
        verdict = replace(verdict, verdict=Verdict.UNDECIDED, reason=f"{verdict.reason}; {case.busy}: contention, "
                          "not evidence")
    return verdict


def _judge_paired(case: _Case, priors: _Priors, policy: Policy, alpha: float, base: CaseVerdict) -> CaseVerdict:
    pairs = len(case.differences)
    if not pairs:
        return replace(base, verdict=Verdict.UNDECIDED, reason=f"no round with {R.MIN_SAMPLES}+ samples on both sides")
    spread = priors.spread_for(case, pooled([case.differences], "case"))
    estimate = paired_estimate(case.differences, spread)
    runs_a = case.given.record.paired.runs_a
    base_s = stats.median([stats.floor(r) for r in runs_a if len(r) >= R.MIN_SAMPLES])
    verdict = replace(base, runs=(pairs, pairs), base_s=base_s)
    return _decided(verdict, estimate, policy.threshold, alpha, f"{case.rounds} rounds paired A then B")


def _judge_stored(case: _Case, priors: _Priors, policy: Policy, alpha: float, base: CaseVerdict) -> CaseVerdict:
    if not case.points or not case.now:
        side = "the baseline" if not case.points else "this session"
        return replace(base, verdict=Verdict.UNDECIDED, reason=f"{side} has no run with {R.MIN_SAMPLES}+ samples")
    threshold = policy.threshold
    spread = priors.spread_for(case, pooled(case.own_groups(threshold), "case"))
    step = find_step(case.points, case.now, spread, threshold, alpha)
    start = step.index if step else 0
    if step:
        spread = priors.spread_for(case, pooled(case.own_groups(threshold, start), "case"))
    values, _ = case.window(start)
    levels = case.levels(threshold, start)
    verdict, estimate, level, note, why = _against_levels(levels, case.now, case.now_kernels, spread, threshold,
                                                          alpha)
    if verdict is Verdict.SLOWER:
        verdict, estimate, level, why = _unless_borrowed(priors.borrowed_for(case, levels, len(values)), case.now,
                                                         spread, alpha, (verdict, estimate, level, why))
    result = replace(base, runs=(len(values), len(case.now)), base_s=math.exp(stats.mean(level.values)),
                     step=step.describe() if step else None, kernels=note)
    where = why or ("" if len(levels) == 1 else f"nearest of {len(levels)} levels: {level.describe()}")
    return _decided(result, estimate, threshold, alpha, where, verdict)


def _against_levels(levels: Sequence[Level], now: Sequence[float], now_kernels: Sequence, spread: Spread,
                    threshold: float, alpha: float) -> tuple[Verdict, Estimate, Level, str | None, str | None]:
    """Judge against the level whose kernels this run shares, else against every level.

    SLOWER (FASTER) only if every level says so. SAME only against the lowest level: a run that
    matches a higher one may be a slowdown from a lower one by about their gap, which no number
    of runs at one level tells apart, so it is UNDECIDED, saying why. Returns the decision, the
    estimate shown (the level that decided, else the nearest), that level, the kernel note and
    why the levels left it undecided."""
    signature = now_kernels[0] if now_kernels and len(set(now_kernels)) == 1 else None
    note = None
    known = [lv for lv in levels if lv.kernels is not None]
    if signature is not None and known:
        matching = [lv for lv in known if lv.kernels == signature]
        if matching:
            levels = matching
        else:
            note = _kernel_change(known[-1].kernels, signature)
    judged = [(decide(e, threshold, alpha), e, lv) for lv in levels
              for e in [unpaired_estimate(lv.values, now, spread)]]
    nearest = min(judged, key=lambda j: abs(j[1].change))
    if len(judged) == 1:
        return judged[0][0], judged[0][1], judged[0][2], note, None
    lowest = min(judged, key=lambda j: stats.mean(j[2].values))
    if lowest[0] is Verdict.SAME:
        return Verdict.SAME, lowest[1], lowest[2], note, None
    verdicts = {v for v, _, _ in judged}
    if len(verdicts) == 1 and verdicts <= {Verdict.SLOWER, Verdict.FASTER}:
        return verdicts.pop(), nearest[1], nearest[2], note, None
    same = next((j for j in judged if j[0] is Verdict.SAME), None)
    why = None
    if same is not None:
        gap = math.expm1(stats.mean(same[2].values) - stats.mean(lowest[2].values))
        why = (f"matches the level at {same[2].describe()}, {gap:+.1%} from the lowest: a slowdown that large "
               "from the lowest would look the same")
        nearest = same
    return Verdict.UNDECIDED, nearest[1], nearest[2], note, why


def _unless_borrowed(borrowed: Sequence[Level], now: Sequence[float], spread: Spread, alpha: float,
                     found: tuple) -> tuple:
    """``found`` (a SLOWER), or UNDECIDED where a borrowed level cannot be told from the runs now
    (its interval holds no change): a move to a level the case's op shows, which the case's few
    runs could not have shown yet, looks the same as a slowdown by that gap."""
    for level in borrowed:
        estimate = unpaired_estimate(level.values, now, spread)
        low, high = estimate.interval(alpha)
        if low <= 0 <= high:
            gap = math.expm1(stats.mean(level.values) - stats.mean(found[2].values))
            return (Verdict.UNDECIDED, estimate, level,
                    f"matches the level at {level.describe()}, {gap:+.1%} from its own: a slowdown that large "
                    "would look the same")
    return found


def _kernel_change(then: frozenset, now: frozenset) -> str:
    gone = sorted(name for name, _ in then - now)
    new = sorted(name for name, _ in now - then)
    return "kernels differ from the baseline's: " + "; ".join(
        part for part in (f"now {', '.join(_short(n) for n in new)}" if new else "",
                          f"no longer {', '.join(_short(n) for n in gone)}" if gone else "") if part)


def _short(kernel: str, limit: int = 60) -> str:
    return kernel if len(kernel) <= limit else kernel[: limit - 1] + "…"


def _decided(verdict: CaseVerdict, estimate: Estimate, threshold: float, alpha: float, where: str,
             decision: Verdict | None = None) -> CaseVerdict:
    """``verdict`` with the decision (``estimate``'s own unless given), the interval and the reason line."""
    decision = decision or decide(estimate, threshold, alpha)
    low, high = estimate.interval(alpha)
    then, now = verdict.runs
    detail = [f"runs {then} then {now}" if not verdict.paired else f"{now} process pairs"]
    if estimate.df > 0:
        detail.append(f"interval {math.exp(low):.3f}–{math.exp(high):.3f}x")
        detail.append(f"run spread {estimate.spread.sigma:.2%} ({estimate.spread.source})")
    if where:
        detail.append(where)
    if decision is Verdict.SAME:
        head = f"within ±{threshold:.1%}"
    elif decision is Verdict.UNDECIDED:
        change = f"{math.expm1(estimate.change):+.1%}"
        if estimate.df <= 0:
            head = f"{change}, no spread to judge by: one run a side cannot settle it"
        elif -math.log1p(threshold) <= low and high <= math.log1p(threshold):
            head = f"{change}, within ±{threshold:.1%} of a level that is not the lowest"
        elif (then, now) == (1, 1) and not verdict.paired:
            head = (f"{change}, one run a side cannot settle it: with a spread borrowed from "
                    f"{estimate.spread.source} the interval reaches past ±{threshold:.1%}")
        else:
            head = f"{change}, the interval reaches past ±{threshold:.1%}"
    else:  # beyond the threshold, and the interval at the session's level excludes no change
        head = f"{math.expm1(estimate.change):+.1%}, beyond {'+' if decision is Verdict.SLOWER else '-'}{threshold:.1%}"
    if verdict.kernels:
        detail.append(verdict.kernels)
    if verdict.step:
        detail.append(verdict.step)
    tail = ": more runs decide" if decision is Verdict.UNDECIDED else ""
    return replace(verdict, verdict=decision, ratio=estimate.ratio,
                   low=math.exp(low) if estimate.df > 0 else None, high=math.exp(high) if estimate.df > 0 else None,
                   se=estimate.se, df=estimate.df, spread=estimate.spread.sigma if estimate.df > 0 else None,
                   reason=f"{head}; {', '.join(detail)}{tail}")
