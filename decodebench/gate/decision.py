"""The gate's decision: each case's evidence, two p-values, one family procedure, a verdict.

**Evidence** (:class:`Evidence`, one per case; :func:`decodebench.gate.verdict.judge` builds it).
The unit is the *run*, one process's measurement, summarised by the log of its floor (10th
percentile). A case's evidence is the change ``d`` (log of now / then) of its runs now against
each level it could be on: its own levels (one per kernel signature, else at most two value
clusters, :mod:`.series`; the lowest first) and, while its runs show one level, the levels its
op's (else its component's) other cases show, borrowed and named, each with the chance ``pi_i``
that a run lands on it (:func:`unseen_chance`); the run-to-run spread ``sigma`` with its df (its
own runs shrunk towards its op's spread); the runs; the contention flag (load, or another session
on the device: :func:`~.runs.contention`). ``se = sigma * sqrt(1/n_then + 1/n_now)``; A/B: the
spread of the paired B - A differences over ``sqrt(pairs)``.

**p-values**, from Student's t with the spread's df, ``t = log(1 + threshold)``, ``S`` its upper tail:

* *slower*, the chance of an estimate this far above no change if there were none, the run's
  level drawn as the op's cases land: ``(1 - pi) p_own + sum_i pi_i S(d_i / se)``, ``pi = sum_i
  pi_i``, where ``p_own`` is the largest over the own levels of ``S(d / se)`` (1 where ``d <= t``).
  *faster* mirrors ``p_own`` over the own levels.
* *same* (within ``±t``, two one-sided tests against the lowest level):
  ``max(S((t - d) / se), S((t + d) / se))``.

Why a mixture: a cuBLAS GEMM lands on one of two levels per process (the H200's ``q_a``: 12-14 %
apart on one kernel), so a case whose ``n`` runs all show one level may have the other unseen,
with a chance that falls as ``(1 - u)^n``. Borrowing every gap at full weight while ``n <= 4``
and none after made a gap near the tested change hide it at 2-4 runs (most 5 %-at-3 % misses at
two and three stored runs) and dropped a 12 % level at five runs (the H200's failed nights).

**Family** (:func:`family`) over the session's ``m`` judged cases, ``q = 1 - confidence``:
Bonferroni decides pass or fail: SLOWER needs ``p_slower <= q / m``, so an unchanged build fails
with chance at most ``q``. Once a case is SLOWER, Benjamini–Hochberg decides which others are
called: ``k`` = the largest rank whose sorted ``p_slower`` is within ``k q / m``; every case
with ``p_slower <= k q / m`` is SLOWER (expected share of false ones at most ``q``).

**Verdict** (:func:`decide`): INCOMPARABLE when the case cannot be judged (no evidence is built);
SLOWER / FASTER at the family's levels, never on a contended run; SAME when ``p_same <= q / m``
(its interval at that level lies inside ``±t``); UNDECIDED otherwise, naming the smallest
slowdown this evidence could call: ``max(t, q_t(1 - q/m) * se)`` (:meth:`Evidence.detectable`).

**Last look** (:func:`stays_open`, run by :mod:`decodebench.runner.settle`): a case not SAME is
re-measured, up to ``Policy.resamples`` rounds, and a SLOWER or FASTER is called only on a case's
last look; the early looks end only as SAME, so they take no share of ``q``.
**Step gate** (:func:`judge_step`, priced by :mod:`.cost`): the predicted decode step's change
is one comparison, SLOWER when beyond ``step_threshold`` with ``p_slower <= q / token counts``.

**Knobs.** The user's, in :class:`Policy`: ``threshold``, ``confidence``, ``resamples``,
``history``, ``max_load_per_cpu``, ``step_threshold``, ``step_context``. Internal: :data:`CASE_PRIOR_DF`
(4, what the op's spread is worth to a case: limma's fit on the H200 sessions, 4.2; checked on the
H100 step nights; the gate's decision report, docs/validation.md) and
:data:`~.series.SPLIT_NULL_QUANTILE` (0.95, when one level's values split in two: the H200 ``q_a``
cases; checked on the H100 step nights, the same report); :data:`~.series._SPLIT_DRAWS` (10 000,
the size of the seeded simulation behind that split) and :data:`~.runs.MIN_SAMPLES` (3, a run's
floor needs samples) are definitions. A level's landing chances are the op's own counts, no knob.
A/B cases lean on their op's spread with all its df (chosen on the H200 A/A session; checked held
out on an H100 one: no SLOWER or FASTER, 69 of 69 SAME at 5 %, 66 at 3 %; the same report).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum

from .. import stats

__all__ = [
    "CASE_PRIOR_DF",
    "Comparison",
    "Evidence",
    "Kind",
    "PValues",
    "Policy",
    "Spread",
    "Verdict",
    "decide",
    "family",
    "fit_prior",
    "judge_step",
    "p_values",
    "per_test_alpha",
    "pooled",
    "run_value",
    "shrink",
    "stays_open",
    "unseen_chance",
]

CASE_PRIOR_DF = 4  # what the op's spread is worth to one case: limma's fit on the H200 sessions


class Verdict(str, Enum):
    SAME = "same"
    FASTER = "faster"
    SLOWER = "slower"
    UNDECIDED = "undecided"
    INCOMPARABLE = "incomparable"


@dataclass(frozen=True)
class Policy:
    """The gate's knobs. ``threshold``: the smallest relative change that matters;
    ``confidence``: the chance that an unchanged build passes the whole session;
    ``resamples``: re-measure rounds for a case that is not yet SAME (a SLOWER is called only
    after all of them, where the session can re-measure); ``history``: stored
    results of the fingerprint that form the baseline; ``max_load_per_cpu``: above this
    1-minute load average per CPU a CPU result says how busy the machine was, not how fast
    the kernel is; ``step_threshold``: fail when the predicted decode step is slower by more;
    ``step_context``: the context length (tokens) at which that step is predicted and priced."""

    threshold: float = 0.05
    confidence: float = 0.95
    resamples: int = 2
    history: int = 5
    max_load_per_cpu: float = 1.5
    step_threshold: float | None = None
    step_context: int = 8192


def run_value(samples: Sequence[float]) -> float:
    """A run's summary on the scale the model works on: the log of its floor (10th percentile).

    >>> round(math.exp(run_value([10.0, 10.0, 11.0, 12.0, 30.0, 45.0, 50.0, 60.0, 61.0, 90.0, 95.0])), 6)
    10.0
    """
    return math.log(stats.floor(samples))


@dataclass(frozen=True)
class Spread:
    """A run-to-run spread on the log scale: variance and the degrees of freedom behind it."""

    variance: float = 0.0
    df: float = 0.0
    source: str = "none"  # where it came from, for the reason line

    @property
    def sigma(self) -> float:
        return math.sqrt(self.variance)


def pooled(groups: Iterable[Sequence[float]], source: str = "runs") -> Spread:
    """The pooled within-group variance of log run values; each group brings ``len - 1`` df.

    >>> s = pooled([[0.0, 0.02], [1.0, 1.0, 1.03]])
    >>> round(s.variance, 6), s.df
    (0.000267, 3)
    """
    squares, df = 0.0, 0
    for values in groups:
        if len(values) >= 2:
            centre = stats.mean(values)
            squares += math.fsum((v - centre) ** 2 for v in values)
            df += len(values) - 1
    return Spread(squares / df, df, source) if df else Spread(source=source)


def shrink(own: Spread, prior: Spread) -> Spread:
    """``own`` shrunk towards ``prior``, which counts as its own df of evidence.

    >>> s = shrink(Spread(0.04, 1, "case"), Spread(0.0001, 4, "op"))
    >>> round(s.variance, 5), s.df
    (0.00808, 5)
    """
    if own.df + prior.df == 0:
        return Spread(source="none")
    variance = (prior.df * prior.variance + own.df * own.variance) / (prior.df + own.df)
    return Spread(variance, own.df + prior.df, own.source if own.df >= prior.df else prior.source)


def fit_prior(spreads: Sequence[Spread], source: str) -> Spread | None:
    """The distribution the spreads of related cases are drawn from, as a prior: its typical
    variance and how many df it is worth (Smyth 2004, the empirical Bayes of limma: the
    log-variances' mean and excess scatter over what their own df explain). Close spreads
    make a strong prior, scattered ones a weak one. None with fewer than 3 usable spreads.

    >>> alike = fit_prior([Spread(1e-4, 2), Spread(1.1e-4, 2), Spread(0.9e-4, 2), Spread(1e-4, 2)], "op")
    >>> alike.df, round(alike.sigma, 4)  # no more scatter than chance: one spread, worth all 8 df
    (8.0, 0.0133)
    >>> fit_prior([Spread(1e-6, 2), Spread(1e-2, 2), Spread(1e-4, 2), Spread(4e-3, 2)], "op").df < 2
    True
    """
    usable = [s for s in spreads if s.df > 0 and s.variance > 0]
    if len(usable) < 3:
        return None
    logs = [math.log(s.variance) - stats.digamma(s.df / 2) + math.log(s.df / 2) for s in usable]
    centre = stats.mean(logs)
    scatter = math.fsum((v - centre) ** 2 for v in logs) / (len(logs) - 1)
    excess = scatter - stats.mean([stats.trigamma(s.df / 2) for s in usable])
    total_df = math.fsum(s.df for s in usable)
    if excess <= 0:  # no more scatter than chance: the spreads are one spread
        return Spread(math.exp(centre), total_df, source)
    d0 = min(2 * stats.trigamma_inverse(excess), total_df)
    return Spread(math.exp(centre + stats.digamma(d0 / 2) - math.log(d0 / 2)), d0, source)


class Kind(str, Enum):
    LOWEST = "lowest"  # the case's lowest own level (SAME is judged against it)
    HIGHER = "higher"  # another level the case's own runs show
    BORROWED = "borrowed"  # a level its op shows, not yet seen in the case's few runs


@dataclass(frozen=True)
class Comparison:
    """The change of the runs now against one level: ``change`` (log now / level), its standard
    error and df; ``level`` names the level for the reason line, ``base_s`` is it in seconds;
    ``chance``, of a borrowed level: how likely the runs now are on it (:func:`unseen_chance`)."""

    change: float
    se: float
    df: float
    kind: Kind = Kind.LOWEST
    level: str = ""
    base_s: float | None = None
    chance: float = 1.0

    @classmethod
    def unpaired(cls, then: Sequence[float], now: Sequence[float], spread: Spread, **level) -> Comparison:
        """Log run values now against those of a level, with the case's run-to-run ``spread``.

        >>> c = Comparison.unpaired([0.0, 0.0], [0.1], Spread(0.0001, 30))
        >>> round(c.change, 3), round(c.se, 5), c.df
        (0.1, 0.01225, 30)
        """
        se = spread.sigma * math.sqrt(1 / len(now) + 1 / len(then))
        return cls(stats.mean(now) - stats.mean(then), se, spread.df, **level)

    @classmethod
    def paired(cls, differences: Sequence[float], spread: Spread, **level) -> Comparison:
        """The mean of paired differences (B - A per process pair, log scale).

        >>> c = Comparison.paired([0.05, 0.06, 0.04], Spread(0.0001, 10))
        >>> round(c.change, 3), round(c.se, 5)
        (0.05, 0.00577)
        """
        return cls(stats.mean(differences), spread.sigma / math.sqrt(len(differences)), spread.df, **level)

    @property
    def ratio(self) -> float:
        return math.exp(self.change)

    def tail(self, x: float) -> float:
        """``S(x / se)``: the chance, with no change, of an estimate ``x`` or more above the truth."""
        if self.df <= 0:
            return 1.0
        if self.se <= 0:  # runs that agree exactly: the estimate is the change
            return 0.0 if x > 0 else 1.0
        return stats.student_t_survival(x / self.se, self.df)

    def interval(self, alpha: float) -> tuple[float, float]:
        """``change -+ q * se``, ``q`` the Student-t quantile at ``1 - alpha`` (log scale)."""
        if self.df <= 0:
            return -math.inf, math.inf
        q = stats.student_t_quantile(1 - alpha, self.df)
        return self.change - q * self.se, self.change + q * self.se


@dataclass(frozen=True)
class Evidence:
    """One case's evidence: its comparisons (own levels, lowest first, then borrowed ones), the
    spread they use, the runs then and now (pairs in A/B), and why its runs were contended."""

    comparisons: tuple[Comparison, ...]
    spread: Spread
    runs: tuple[int, int]
    paired: bool = False
    contention: str | None = None

    @property
    def own(self) -> tuple[Comparison, ...]:
        return tuple(c for c in self.comparisons if c.kind is not Kind.BORROWED)

    def detectable(self, threshold: float, alpha: float) -> float | None:
        """The smallest slowdown (relative) these runs would call SLOWER at ``alpha``: beyond the
        threshold and ``q`` standard errors from none. None without a spread.

        >>> round(Evidence((Comparison(0.0, 0.01, 20),), Spread(), (5, 1)).detectable(0.03, 2.5e-4), 3)  # q = 4.15
        0.042
        """
        lowest = self.own[0]
        if lowest.df <= 0:
            return None
        q = stats.student_t_quantile(1 - alpha, lowest.df)
        return math.expm1(max(math.log1p(threshold), q * lowest.se))


@dataclass(frozen=True)
class PValues:
    slower: float
    faster: float
    same: float


def p_values(evidence: Evidence, threshold: float) -> PValues:
    """The case's three p-values (module docstring).

    >>> e = Evidence((Comparison(math.log(1.05), 0.01, 20),), Spread(), (5, 1))
    >>> p = p_values(e, 0.03)
    >>> p.slower < 1e-4, p.faster, p.same > 0.5
    (True, 1.0, True)
    """
    limit = math.log1p(threshold)
    own = evidence.own
    slower = max(c.tail(c.change) if c.change > limit else 1.0 for c in own)
    borrowed = [c for c in evidence.comparisons if c.kind is Kind.BORROWED]
    unseen = math.fsum(c.chance for c in borrowed)
    slower = (1 - unseen) * slower + math.fsum(c.chance * c.tail(c.change) for c in borrowed)
    faster = max(c.tail(-c.change) if c.change < -limit else 1.0 for c in own)
    lowest = own[0]
    same = max(lowest.tail(limit - lowest.change), lowest.tail(limit + lowest.change))
    return PValues(slower, faster, same)


def unseen_chance(split: float, upper: float, runs: int) -> float:
    """How likely a run lands on a level its case has not shown in ``runs`` runs on one level, where
    a share ``split`` of the op's cases show two levels and their runs are above the lowest in a
    share ``upper``: the chance the case has such a level though its runs all missed it (Bayes),
    times the chance a run lands on it. It falls with every run the case shows on one level.

    >>> [round(unseen_chance(0.5, 0.4, n), 3) for n in (1, 3, 5, 10)]  # half the cases split, 40 % of runs up
    [0.15, 0.071, 0.029, 0.002]
    """
    missed = split * (1 - upper) ** runs
    return upper * missed / (missed + 1 - split) if missed + 1 - split > 0 else upper


def per_test_alpha(policy: Policy, cases: int) -> float:
    """Bonferroni's level for one case's test: ``(1 - confidence) / cases``.

    >>> round(per_test_alpha(Policy(confidence=0.95), 200), 10)
    0.00025
    """
    return (1 - policy.confidence) / max(1, cases)


def family(slower: Sequence[float], confidence: float) -> float:
    """The level a case's ``p_slower`` must reach to be SLOWER: Bonferroni's ``q / m`` while no
    case reaches it (the session passes), else Benjamini–Hochberg's ``k q / m``.

    >>> round(family([0.3, 0.02, 0.03], 0.95), 4)  # none within 0.05 / 3: Bonferroni
    0.0167
    >>> round(family([0.01, 0.02, 0.9, 1e-5], 0.95), 4)  # one is; then the step-up calls two more
    0.0375
    """
    q, m = 1 - confidence, max(1, len(slower))
    ranked = sorted(slower)
    if not ranked or ranked[0] > q / m:
        return q / m
    k = max(rank for rank, p in enumerate(ranked, 1) if p <= rank * q / m)
    return k * q / m


def decide(evidence: Evidence, p: PValues, slower_level: float, alpha: float) -> Verdict:
    """The verdict on one case from its p-values: SLOWER at the family's ``slower_level``, FASTER
    and SAME at Bonferroni's ``alpha``, never SLOWER or FASTER on contended runs.

    >>> e = Evidence((Comparison(math.log(1.10), 0.005, 20),), Spread(), (5, 1))
    >>> [decide(e, p_values(e, t), 1e-4, 1e-4).value for t in (0.05, 0.2, 0.105)]
    ['slower', 'same', 'undecided']
    >>> busy = Evidence(e.comparisons, Spread(), (5, 1), contention="load 13.1 on 2 CPUs")
    >>> decide(busy, p_values(busy, 0.05), 1e-4, 1e-4).value
    'undecided'
    """
    if evidence.contention is None and p.slower <= slower_level:
        return Verdict.SLOWER
    if evidence.contention is None and p.faster <= alpha:
        return Verdict.FASTER
    if p.same <= alpha:
        return Verdict.SAME
    return Verdict.UNDECIDED


def stays_open(verdict: Verdict) -> bool:
    """Whether a case takes the next re-measure round (the last-look rule): every verdict but
    SAME and INCOMPARABLE, so a SLOWER or FASTER stands only on the runs of its last look.

    >>> [stays_open(v) for v in (Verdict.SAME, Verdict.SLOWER, Verdict.UNDECIDED, Verdict.INCOMPARABLE)]
    [False, True, True, False]
    """
    return verdict in (Verdict.UNDECIDED, Verdict.SLOWER, Verdict.FASTER)


def judge_step(step: Comparison, threshold: float, confidence: float, steps: int) -> Verdict:
    """The step gate: one predicted step's change judged as a case of its own, Bonferroni over
    the session's ``steps`` token counts (it looks once, after the cases are settled).

    >>> judge_step(Comparison(math.log(1.02), 0.002, 8), 0.01, 0.95, 3).value
    'slower'
    """
    alpha = (1 - confidence) / max(1, steps)
    evidence = Evidence((step,), Spread(), (0, 0))
    return decide(evidence, p_values(evidence, threshold), alpha, alpha)
