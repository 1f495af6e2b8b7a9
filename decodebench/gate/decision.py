"""The verdict model: one interval test on the change between run levels.

Unit: the **run**, one process's measurement of a case (a session, a re-measure in a fresh
process, one A/B round), summarised by one statistic of its samples, the log of its floor
(10th percentile: interference only adds time, so the floor moves least between runs).
Samples within a run are not independent draws of the case's cost and are never pooled.

Change: ``d = mean(log floor now) - mean(log floor then)``; ``exp(d) - 1`` is the relative
change. Its standard error comes from the run-to-run spread ``sigma`` of the case,
``se = sigma * sqrt(1/n_now + 1/n_then)`` (unpaired, stored history) or from the spread of
paired round differences (A/B: rounds of A and B ran next to each other).

Spread: estimated from the runs themselves (deviations from their side's mean, pooled over
both sides) and shrunk towards a pooled estimate over related cases — the same op at other
shapes, then every case of the fingerprint and timer (:func:`shrink`). How much the op's
spread is worth to one case is how alike the cases of an op are: in the committed H200
sessions one case's spread strays from its op's by up to 2.4 times, and limma's fit of that
scatter (:func:`fit_prior`) makes the op's spread worth :data:`CASE_PRIOR_DF` (4) runs of the
case's own (``validation/gate/case_spreads.py``, docs/validation.md). The interval's
Student-t quantile takes the case's own df plus those 4: with a short history it is wide
(at the session's level over 211 cases, 4 df give ``q`` = 10.4 where 20 gave 4.2), and each run of the case's
own narrows it. One stored session is no special case: its single run brings no spread of its
own. The same weight bounds what a case borrows of its op's *levels* (runs that land 12–14 %
apart from one process to the next on one kernel, :mod:`decodebench.gate.series`): while it has
no more than 4 runs, a SLOWER its runs cannot tell from a move by such a gap is UNDECIDED
(:mod:`decodebench.gate.verdict`). Paired A/B differences keep their own prior (:data:`PRIOR_DF` runs' worth): they are
another quantity, and their weight was not refitted.

Decision (:func:`decide`), with ``t = log(1 + threshold)`` and one interval, ``d +- q * se``
(``q``: the Student-t quantile at ``1 - alpha``, ``alpha`` the session's error split over its
cases):

* SLOWER when the change is beyond ``t`` **and** the interval lies above 0. FASTER mirrors it.
* SAME when the interval lies inside ``+-t``.
* UNDECIDED otherwise: more runs decide.

Error rates. *False alarm*: on an unchanged build (every change 0) a case is SLOWER only if
its change is significant at ``alpha``, so the chance that *any* case of a session is SLOWER
is at most ``N * alpha = 1 - confidence`` (Bonferroni over the N cases). The session looks at
a case more than once (:mod:`decodebench.runner.settle`), but SLOWER and FASTER are only ever
called at a case's last look, on its first run and every re-measure; earlier looks may only
stop a case as SAME, which can remove a false alarm and never add one, so the looks cost no
error budget. *Miss*: a case whose change lies beyond the threshold is called SAME at one look
with chance at most ``alpha``: a SAME says the change lies within the threshold at the
session's confidence, the interval it prints. *Near the threshold*: a change of exactly
``threshold`` is called SLOWER about half the time once it is significant (its estimate lies
beyond ``t`` half the time); the gate answers "slower, and by more than the threshold as far as
the runs tell", not "certainly by more". ``docs/validation.md`` has the arithmetic and the
power it buys.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum

from .. import stats

__all__ = [
    "CASE_PRIOR_DF",
    "MIN_SAMPLES",
    "PRIOR_DF",
    "Estimate",
    "Policy",
    "Spread",
    "Verdict",
    "decide",
    "fit_prior",
    "paired_estimate",
    "per_test_alpha",
    "pooled",
    "run_value",
    "shrink",
    "unpaired_estimate",
]

MIN_SAMPLES = 3  # a run with fewer samples says nothing about its floor
PRIOR_DF = 20  # the most runs' worth of evidence a pooled spread lends an op, or a paired A/B case
CASE_PRIOR_DF = 4  # what the op's spread is worth to one of its cases: limma's fit on the H200 sessions
MIN_SPREAD = 5e-4  # no two runs agree better than this (log scale): timer resolution, clock steps


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
    the kernel is; ``step_threshold``: fail when the predicted decode step is slower by more."""

    threshold: float = 0.05
    confidence: float = 0.95
    resamples: int = 2
    history: int = 5
    max_load_per_cpu: float = 1.5
    step_threshold: float | None = None


def per_test_alpha(policy: Policy, cases: int) -> float:
    """One-sided level of one case's SLOWER test (Bonferroni over the cases; a SLOWER is only
    called at a case's last look, so the looks take no share).

    >>> round(per_test_alpha(Policy(confidence=0.95, resamples=2), 200), 10)
    0.00025
    """
    return (1 - policy.confidence) / max(1, cases)


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


def shrink(own: Spread, prior: Spread, weight: float = PRIOR_DF) -> Spread:
    """``own`` shrunk towards ``prior``, which counts as ``min(weight, prior.df)`` df of evidence.

    >>> s = shrink(Spread(0.04, 1, "case"), Spread(0.0001, 100, "op"))
    >>> round(s.variance, 5), s.df
    (0.002, 21)
    """
    w = min(weight, prior.df)
    if own.df + w == 0:
        return Spread(source="none")
    variance = (w * prior.variance + own.df * own.variance) / (w + own.df)
    source = own.source if own.df >= w else prior.source
    return Spread(variance, own.df + w, source)


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


@dataclass(frozen=True)
class Estimate:
    """The change on the log scale, its standard error and degrees of freedom."""

    change: float
    se: float
    df: float
    spread: Spread

    def interval(self, alpha: float) -> tuple[float, float]:
        """``change -+ q * se`` with ``q`` the Student-t quantile at ``1 - alpha`` (log scale)."""
        if self.df <= 0:
            return -math.inf, math.inf
        q = min(stats.student_t_quantile(1 - alpha, self.df), 1e3)  # beyond, the bounds say nothing more
        return self.change - q * self.se, self.change + q * self.se

    @property
    def ratio(self) -> float:
        return math.exp(self.change)


def unpaired_estimate(then: Sequence[float], now: Sequence[float], spread: Spread) -> Estimate:
    """The change between two sets of log run values, with the case's run-to-run ``spread``.

    >>> e = unpaired_estimate([0.0, 0.0], [0.1], Spread(0.0001, 30))
    >>> round(e.change, 3), round(e.se, 5), e.df
    (0.1, 0.01225, 30)
    """
    sigma = max(spread.sigma, MIN_SPREAD)
    se = sigma * math.sqrt(1 / len(now) + 1 / len(then))
    return Estimate(stats.mean(now) - stats.mean(then), se, spread.df, spread)


def paired_estimate(differences: Sequence[float], spread: Spread) -> Estimate:
    """The mean of paired differences (B - A per round, log scale) with the spread of a difference.

    >>> e = paired_estimate([0.05, 0.06, 0.04], Spread(0.0001, 10))
    >>> round(e.change, 3), round(e.se, 5)
    (0.05, 0.00577)
    """
    sigma = max(spread.sigma, MIN_SPREAD)
    return Estimate(stats.mean(differences), sigma / math.sqrt(len(differences)), spread.df, spread)


def decide(estimate: Estimate, threshold: float, alpha: float) -> Verdict:
    """SLOWER / FASTER when the change lies beyond ``threshold`` and its interval at ``alpha``
    excludes no change, SAME when that interval lies within ``threshold``, UNDECIDED otherwise.

    >>> e = Estimate(math.log(1.10), 0.005, 20, Spread())
    >>> decide(e, 0.05, 1e-4), decide(e, 0.2, 1e-4), decide(e, 0.105, 1e-4)
    (<Verdict.SLOWER: 'slower'>, <Verdict.SAME: 'same'>, <Verdict.UNDECIDED: 'undecided'>)
    >>> decide(Estimate(math.log(1.04), 0.009, 20, Spread()), 0.03, 2.5e-4).value  # 4 %, 4.4 se from 0
    'slower'
    >>> decide(Estimate(math.log(1.04), 0.012, 20, Spread()), 0.03, 2.5e-4).value  # 3.3 se: not significant
    'undecided'
    >>> decide(Estimate(0.004, 0.009, 20, Spread()), 0.03, 2.5e-4).value  # interval -3.4 % to +4.2 %
    'undecided'
    """
    limit = math.log1p(threshold)
    low, high = estimate.interval(alpha)
    if estimate.change > limit and low > 0:
        return Verdict.SLOWER
    if estimate.change < -limit and high < 0:
        return Verdict.FASTER
    if -limit <= low and high <= limit:
        return Verdict.SAME
    return Verdict.UNDECIDED
