"""One verdict per case, from stored runs alone: the pure function behind the gate (:func:`judge`).

It builds each case's :class:`~.decision.Evidence` (stored mode: the history's runs against this
session's, after the persistent step and the levels of :mod:`.series`; A/B: round i of A against round
i of B) and hands the session's evidence to the rule of :mod:`.decision`. The run-to-run spread is
pooled across cases (op, then all of the fingerprint and timer), so a session is judged as a whole.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from .. import stats
from ..results import Result, read_entry
from . import runs as R
from .decision import (
    CASE_PRIOR_DF,
    Comparison,
    Evidence,
    Kind,
    Policy,
    PValues,
    Spread,
    Verdict,
    decide,
    family,
    fit_prior,
    p_values,
    per_test_alpha,
    pooled,
    shrink,
    unseen_chance,
)
from .series import Level, Point, find_step, level_gaps, levels_of

__all__ = ["CaseInput", "CaseVerdict", "judge"]


@dataclass(frozen=True)
class CaseInput:
    """A case to judge: its record now and its stored records ``(label, record)``, oldest first. An
    entry given as a document is read once into its record (:func:`~decodebench.results.read_entry`).
    A record now that cannot be used is INCOMPARABLE, naming why; a stored one is left out."""

    name: str
    current: Result  # the record now (with its re-measured runs): judged and priced
    history: tuple[tuple[str, Result], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "current", read_entry(self.current))
        object.__setattr__(self, "history", tuple((label, read_entry(e)) for label, e in self.history))


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
    detectable: float | None = None  # UNDECIDED: the smallest slowdown these runs could call SLOWER
    tokens: int | None = None  # decode batch of the case's shape point
    calls: int | None = None  # calls per decode step
    cost_us: float | None = None  # change of the decode step, µs
    step_share: float | None = None  # cost_us over the predicted step
    notes: tuple[str, ...] = field(default=())

    def record(self) -> dict[str, object]:
        """What a result's ``extra_info["gate"]`` keeps of its verdict (both modes alike)."""
        keys = ("verdict", "ratio", "low", "high", "spread", "runs", "paired", "step", "kernels", "reason",
                "tokens", "calls", "cost_us", "step_share", "detectable")
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
    """A verdict per case (same order): each case's evidence, its p-values, the session's family
    procedure over them, then :func:`~.decision.decide` (the rule: :mod:`.decision`).

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
    found = [_evidence(w, priors, policy.threshold, alpha) for w in work]
    ps = [p_values(f.evidence, policy.threshold) if f.evidence else None for f in found]
    level = family([p.slower if p and not f.evidence.contention else 1.0
                    for w, f, p in zip(work, found, ps, strict=True) if not w.refused], policy.confidence)
    called = f"Benjamini–Hochberg: {round(level * len(live) / (1 - policy.confidence))} of {len(live)} cases slower"
    return [_verdict(f, p, policy, level, alpha, called) for f, p in zip(found, ps, strict=True)]


@dataclass(frozen=True)
class _Found:
    """A case's evidence (None where it has none: refused, or no usable run), the verdict's fixed
    parts, and what its levels say for the reason line."""

    evidence: Evidence | None
    base: CaseVerdict
    levels: int = 1  # own levels compared with (the line names the nearest when there are more)
    note: str = ""  # A/B: how many rounds were paired


def _prepare(given: CaseInput, policy: Policy) -> _Case:
    entry = given.current
    if entry.problem:  # never read further: an impossible number must not reach a statistic
        return _Case(given, False, "", None, refused=f"this result cannot be judged: {entry.problem}")
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


def _refusal(entry: Result, history: Sequence[tuple[str, Result]]) -> str | None:
    """Why ``entry`` cannot be judged at all, or None."""
    if entry.invalid:
        return f"this result is marked invalid: {entry.invalid}"
    if entry.paired is not None:
        return None
    valid = [e for _, e in history if not e.invalid]
    if not valid:
        reasons = "; ".join(filter(None, (e.invalid for _, e in history))) or "none stored"
        return f"no valid baseline ({reasons})"
    same_timer = [e for e in valid if e.timer == entry.timer]  # a storage may hold several timers
    if not same_timer:
        timers = ", ".join(sorted({repr(e.timer) for e in valid}))
        return (f"timer {entry.timer!r} now, no stored run of it (stored: {timers}): a timer is no "
                "baseline of another")
    return _unlike(entry, same_timer[-1])


def _unlike(entry: Result, stored: Result) -> str | None:
    """How ``stored`` was measured other than ``entry`` (timer, setup), making it no baseline of it."""
    if stored.timer != entry.timer:
        return f"timer {entry.timer!r} now, {stored.timer!r} in the baseline"
    return R.setup_change(entry, stored)


@dataclass(frozen=True)
class _Priors:
    """Per op group: the spread a case of it is shrunk towards (df = the weight it gets,
    :data:`~.decision.CASE_PRIOR_DF`), the level gaps (log) the op's cases show, and how its
    cases land on levels: per case, whether it shows more than one, its runs, and those above its
    lowest level."""

    by_group: dict[tuple, Spread]
    gaps: dict[tuple, list[float]] = field(default_factory=dict)
    landings: dict[tuple, list[tuple[bool, int, int]]] = field(default_factory=dict)

    def spread_for(self, case: _Case, own: Spread) -> Spread:
        return shrink(own, self.by_group.get(_group_of(case), Spread()))

    def borrowed_for(self, case: _Case, levels: list[Level], runs: int) -> list[tuple[Level, float]]:
        """While the case's ``runs`` show one level, the levels its op's other cases show (else those
        of its component's other ops: the same library's kernels), borrowed: its level moved up by
        each of their gaps, with the chance that a run now lands on one (:func:`~.decision.unseen_chance`:
        the share of the cases that show two levels, and of their runs above the lowest, over the
        same cases). Not across components: on the H200 only cuBLAS GEMMs move between levels
        (docs/validation.md)."""
        if len(levels) > 1:
            return []
        key = _group_of(case)
        scope, origin = [key], "its op's cases"
        if not self.gaps.get(key):
            scope = [k for k in self.landings if k[:2] == key[:2] and _component(k) == _component(key)]
            origin = "its component's other ops"
        gaps = sorted(g for k in scope for g in self.gaps.get(k, []))
        if not gaps:
            return []
        landed = [one for k in scope for one in self.landings[k]]
        split = [one for one in landed if one[0]]
        upper = sum(u for _, _, u in split) / sum(n for _, n, _ in split)
        chance = unseen_chance(len(split) / len(landed), upper, runs)
        return [(levels[0].moved(g, origin), chance / len(gaps)) for g in gaps]


def _group_of(case: _Case) -> tuple:
    return case.paired, case.timer, case.group


def _priors(cases: Sequence[_Case], threshold: float) -> _Priors:
    """The op priors: each op's pooled spread (its cases at every shape point) shrunk towards all
    ops of its timer, weighted by how alike the ops' spreads are (:func:`fit_prior`); a case then
    leans on its op's prior with :data:`CASE_PRIOR_DF` df at most (a paired case: with all of the
    prior's df). Paired differences and unpaired run values are kept apart: they are other
    quantities."""
    groups: dict[tuple, list] = {}
    for case in cases:
        groups.setdefault(_group_of(case), []).extend(case.own_groups(threshold))
    ops = {key: pooled(runs, "op") for key, runs in groups.items()}
    by_group = {}
    for key, op in ops.items():
        peers = [s for k, s in ops.items() if k[:2] == key[:2]]
        everything = fit_prior(peers, "all cases") or pooled([r for k, rs in groups.items() if k[:2] == key[:2]
                                                              for r in rs], "all cases")
        moderated = shrink(op, everything)
        # paired differences (key[0]) lean on their op's spread with all its df: a case's 1-3 pairs are
        # too few to fit how far it strays from its op; run values lean with CASE_PRIOR_DF at most
        weight = moderated.df if key[0] else min(CASE_PRIOR_DF, moderated.df)
        by_group[key] = Spread(moderated.variance, weight, moderated.source)
    gaps: dict[tuple, list[float]] = {}
    landings: dict[tuple, list[tuple[bool, int, int]]] = {}
    for case in (c for c in cases if not c.paired):
        levels = case.levels(threshold)
        gaps.setdefault(_group_of(case), []).extend(level_gaps(levels))
        seen = sorted((lv for lv in levels if lv.values), key=lambda lv: stats.mean(lv.values))
        runs = [len(lv.values) for lv in seen]
        landings.setdefault(_group_of(case), []).append((len(runs) > 1, sum(runs), sum(runs[1:])))
    return _Priors(by_group, {key: g for key, g in gaps.items() if g}, landings)


def _component(key: tuple) -> str:
    """The component and backend of an op's group key (``dense_gemm|vllm``)."""
    return "|".join(key[2].split("|")[:2])


def _evidence(case: _Case, priors: _Priors, threshold: float, alpha: float) -> _Found:
    tokens = case.given.current.tokens
    base = CaseVerdict(case.given.name, Verdict.INCOMPARABLE, case.refused or "", tokens=tokens, paired=case.paired)
    if case.refused:
        return _Found(None, base)
    if case.paired:
        return _paired_evidence(case, priors, base)
    return _stored_evidence(case, priors, threshold, alpha, base)


def _paired_evidence(case: _Case, priors: _Priors, base: CaseVerdict) -> _Found:
    pairs = len(case.differences)
    if not pairs:
        return _Found(None, replace(base, verdict=Verdict.UNDECIDED,
                                    reason=f"no round with {R.MIN_SAMPLES}+ samples on both sides"))
    spread = priors.spread_for(case, pooled([case.differences], "case"))
    runs_a = case.given.current.paired.runs_a
    base_s = stats.median([stats.floor(r) for r in runs_a if len(r) >= R.MIN_SAMPLES])
    comparison = Comparison.paired(case.differences, spread, base_s=base_s)
    evidence = Evidence((comparison,), spread, (pairs, pairs), paired=True, contention=case.busy)
    return _Found(evidence, replace(base, runs=(pairs, pairs), base_s=base_s),
                  note=f"{case.rounds} rounds paired A then B")


def _stored_evidence(case: _Case, priors: _Priors, threshold: float, alpha: float, base: CaseVerdict) -> _Found:
    if not case.points or not case.now:
        side = "the baseline" if not case.points else "this session"
        return _Found(None, replace(base, verdict=Verdict.UNDECIDED,
                                    reason=f"{side} has no run with {R.MIN_SAMPLES}+ samples"))
    spread = priors.spread_for(case, pooled(case.own_groups(threshold), "case"))
    step = find_step(case.points, case.now, spread, threshold, alpha)
    start = step.index if step else 0
    if step:
        spread = priors.spread_for(case, pooled(case.own_groups(threshold, start), "case"))
    values, _ = case.window(start)
    levels = case.levels(threshold, start)
    judged, note = _matching(levels, case.now_kernels)
    judged = sorted(judged, key=lambda lv: stats.mean(lv.values))
    comparisons = [_compare(lv, case.now, spread, Kind.LOWEST if i == 0 else Kind.HIGHER)
                   for i, lv in enumerate(judged)]
    comparisons += [replace(_compare(lv, case.now, spread, Kind.BORROWED), chance=chance)
                    for lv, chance in priors.borrowed_for(case, levels, len(values))]
    evidence = Evidence(tuple(comparisons), spread, (len(values), len(case.now)), contention=case.busy)
    lowest = comparisons[0]
    verdict = replace(base, runs=evidence.runs, base_s=lowest.base_s, step=step.describe() if step else None,
                      kernels=note)
    return _Found(evidence, verdict, levels=len(judged))


def _matching(levels: Sequence[Level], now_kernels: Sequence) -> tuple[list[Level], str | None]:
    """The levels whose kernels this session's runs share, else every level with a note of how the
    kernels differ."""
    signature = now_kernels[0] if now_kernels and len(set(now_kernels)) == 1 else None
    known = [lv for lv in levels if lv.kernels is not None]
    if signature is None or not known:
        return list(levels), None
    matching = [lv for lv in known if lv.kernels == signature]
    return (matching, None) if matching else (list(levels), _kernel_change(known[-1].kernels, signature))


def _compare(level: Level, now: Sequence[float], spread: Spread, kind: Kind) -> Comparison:
    return Comparison.unpaired(level.values, now, spread, kind=kind, level=level.describe(),
                               base_s=math.exp(stats.mean(level.values)))


def _kernel_change(then: frozenset, now: frozenset) -> str:
    gone = sorted(name for name, _ in then - now)
    new = sorted(name for name, _ in now - then)
    return "kernels differ from the baseline's: " + "; ".join(
        part for part in (f"now {', '.join(_short(n) for n in new)}" if new else "",
                          f"no longer {', '.join(_short(n) for n in gone)}" if gone else "") if part)


def _short(kernel: str, limit: int = 60) -> str:
    return kernel if len(kernel) <= limit else kernel[: limit - 1] + "…"


def _verdict(found: _Found, p: PValues | None, policy: Policy, level: float, alpha: float,
             called: str) -> CaseVerdict:
    """The case's verdict with the comparison it shows, its interval (at the level it was called at)
    and the reason line."""
    evidence, verdict = found.evidence, found.base
    if evidence is None:
        return verdict
    decision = decide(evidence, p, level, alpha)
    shown, why = _shown(evidence, p, decision, policy.threshold, level, alpha)
    low, high = shown.interval(level if decision is Verdict.SLOWER and p.slower > alpha else alpha)
    detectable = evidence.detectable(policy.threshold, alpha) if decision is Verdict.UNDECIDED else None
    bounded = shown.df > 0
    verdict = replace(verdict, verdict=decision, ratio=shown.ratio, se=shown.se, df=shown.df,
                      low=math.exp(low) if bounded else None, high=math.exp(high) if bounded else None,
                      spread=evidence.spread.sigma if bounded else None, detectable=detectable,
                      base_s=shown.base_s)
    detail = _detail(found, verdict, shown, why, (low, high))
    if decision is Verdict.SLOWER and p.slower > alpha:
        detail.append(f"at the step-up level {level:.2g} ({called})")
    if detectable is not None:
        detail.append(f"it could call a slowdown of {detectable:+.1%} or more")
    if evidence.contention and (p.slower <= level or p.faster <= alpha):
        detail.append(f"{evidence.contention}: contention, not evidence")
    tail = ": more runs decide" if decision is Verdict.UNDECIDED else ""
    head = _head(decision, shown, evidence, policy.threshold, low, high)
    return replace(verdict, reason=f"{head}; {', '.join(detail)}{tail}")


def _detail(found: _Found, verdict: CaseVerdict, shown: Comparison, why: str | None,
            interval: tuple[float, float]) -> list[str]:
    """The reason line's facts: the runs, the interval and spread, the level shown, kernels, a step."""
    evidence = found.evidence
    detail = [f"runs {evidence.runs[0]} then {evidence.runs[1]}" if not evidence.paired
              else f"{evidence.runs[1]} process pairs"]
    if shown.df > 0:
        detail.append(f"interval {math.exp(interval[0]):.3f}–{math.exp(interval[1]):.3f}x")
        detail.append(f"run spread {evidence.spread.sigma:.2%} ({evidence.spread.source})")
    where = why or (f"nearest of {found.levels} levels: {shown.level}" if found.levels > 1 else found.note)
    return detail + [part for part in (where, verdict.kernels, verdict.step) if part]


def _shown(evidence: Evidence, p: PValues, decision: Verdict, threshold: float, level: float,
           alpha: float) -> tuple[Comparison, str | None]:
    """The comparison the verdict shows, and why its levels left it UNDECIDED where they did: the
    lowest level for SAME, else the nearest own level; an UNDECIDED that matches a higher level
    shows that level, one that a borrowed level kept from SLOWER names it."""
    own = evidence.own
    nearest = min(own, key=lambda c: abs(c.change))
    if decision is Verdict.SAME:
        return own[0], None
    if decision is not Verdict.UNDECIDED:
        return nearest, None
    limit = math.log1p(threshold)
    for c in own[1:]:
        low, high = c.interval(alpha)
        if -limit <= low and high <= limit:
            return c, (f"matches the level at {c.level}, {c.base_s / own[0].base_s - 1:+.1%} from the lowest: "
                       "a slowdown that large from the lowest would look the same")
    own_slower = max(c.tail(c.change) if c.change > limit else 1.0 for c in own)
    likeliest = max((c for c in evidence.comparisons if c.kind is Kind.BORROWED),
                    key=lambda c: c.chance * c.tail(c.change), default=None)
    if likeliest and own_slower <= level < p.slower and not evidence.contention:
        gap = likeliest.base_s / own[0].base_s - 1
        return nearest, (f"a run may land on the level at {likeliest.level}, {gap:+.1%} from its own, with "
                           f"chance {likeliest.chance:.1%}: with it p_slower is {p.slower:.2g}, above the session's "
                           f"{level:.2g}")
    return nearest, None


def _head(decision: Verdict, shown: Comparison, evidence: Evidence, threshold: float, low: float,
          high: float) -> str:
    change = f"{math.expm1(shown.change):+.1%}"
    if decision is Verdict.SAME:
        return f"within ±{threshold:.1%}"
    if decision in (Verdict.SLOWER, Verdict.FASTER):
        return f"{change}, beyond {'+' if decision is Verdict.SLOWER else '-'}{threshold:.1%}"
    if shown.df <= 0:
        return f"{change}, no spread to judge by: one run a side cannot settle it"
    if -math.log1p(threshold) <= low and high <= math.log1p(threshold):
        return f"{change}, within ±{threshold:.1%} of a level that is not the lowest"
    if evidence.runs == (1, 1) and not evidence.paired:
        return (f"{change}, one run a side cannot settle it: with a spread borrowed from "
                f"{evidence.spread.source} the interval reaches past ±{threshold:.1%}")
    return f"{change}, the interval reaches past ±{threshold:.1%}"
