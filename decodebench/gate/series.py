"""The stored series of a case: a persistent step, and the levels a case lands on.

**Step.** Each stored result of the fingerprint is one point (the mean of its runs' log
values), oldest first, and this session is the last. A step is a change that holds over the
last two or more stored results *and* this one: every one of them lies beyond the level of
the results before by more than the threshold, and the two segments differ under the
model's own interval test (the PyTorch regression policy's "two violating points in a row",
with the gate's statistics). The split with the clearest difference is reported, naming the
result it started at; a single odd stored result is never a step, and a change that shows
only in this session is the ordinary verdict's business. After a step the baseline is the
stored results from the step on: the level the case has held since.

**Levels.** Some cases land on one of two levels per process (a cuBLAS GEMM that picks one
of two kernels: two stored H200 sessions moved ``q_a`` by 11–14 %). Where every run
recorded its kernels, the runs are grouped by kernel signature. Otherwise the widest gap of
the sorted runs splits them into two levels when it is wider than the threshold, leaves two
runs or more on each side, *and* is wider, against the spread within the two sides, than one
level of that many normal runs shows in 95 % of baselines (:func:`split_critical`). The last
condition keeps a wide single level from being cut at its widest gap: five H200 runs of
``dense_gate_up`` M=32 (20.85–22.27 µs, one kernel) had a 3.2 % gap, 2.8 times the spread
within their sides, and as two levels they took a 5 % slowdown for the upper one
(docs/validation.md). A current run that matches the lowest level is SAME; one that matches a
higher level is UNDECIDED, since a slowdown from the lowest by about their gap would look the
same (:mod:`decodebench.gate.verdict`). A case with few runs of its own may have a level they
have not shown: the H200's ``q_a`` shapes and ``q_b`` M=4 move 12–14 % between processes on one
and the same kernel. While its own runs show one level, the verdict borrows the gaps of its op's
levels (:func:`level_gaps`, :meth:`Level.moved`), each weighed by the chance that a run lands on
a level the case has not shown (:func:`~decodebench.gate.decision.unseen_chance`).
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from .. import stats
from .decision import Comparison, Evidence, Spread, p_values

__all__ = ["Level", "LevelShift", "Point", "find_step", "level_gaps", "levels_of", "split_critical"]


@dataclass(frozen=True)
class Point:
    """One stored result of a case: its label (``0007``), log run values and kernel signatures."""

    label: str
    values: tuple[float, ...]
    kernels: tuple[frozenset | None, ...] = ()


@dataclass(frozen=True)
class LevelShift:
    """A persistent step of a series: the level moved at ``since`` and held (not a decode step)."""

    since: str  # the first stored result at the new level
    change: float  # relative change of the level (+0.12 = 12 % slower)
    held: int  # stored results at the new level, this session not counted
    index: int  # position of ``since`` in the series

    def describe(self) -> str:
        direction = "slower" if self.change > 0 else "faster"
        return (f"step {self.change:+.1%} ({direction}) since {self.since}, held over {self.held} stored results "
                "and this one")


def find_step(series: Sequence[Point], current: Sequence[float], spread: Spread, threshold: float,
              alpha: float) -> LevelShift | None:
    """The clearest persistent step of ``series`` (oldest first) followed by ``current``, or None.

    >>> pts = [Point(f"000{i}", (v,)) for i, v in enumerate([0.0, 0.01, 0.0, 0.2, 0.21], 1)]
    >>> find_step(pts, [0.2], Spread(0.0001, 30), 0.05, 0.001).since
    '0004'
    >>> find_step(pts[:3] + [Point("0004", (0.2,)), Point("0005", (0.0,))], [0.0], Spread(0.0001, 30), 0.05, 0.001)
    """
    limit = math.log1p(threshold)
    best: tuple[float, LevelShift] | None = None
    for k in range(1, len(series) - 1):  # two stored results at least after the split
        before = [v for p in series[:k] for v in p.values]
        after = [v for p in series[k:] for v in p.values] + list(current)
        if not before or not current:
            continue
        level = stats.median([stats.mean(p.values) for p in series[:k] if p.values])  # one odd result moves no median
        shifts = [stats.mean(p.values) - level for p in series[k:] if p.values] + [stats.mean(current) - level]
        if not (all(s > limit for s in shifts) or all(s < -limit for s in shifts)):
            continue
        split = Comparison.unpaired(before, after, spread)
        p = p_values(Evidence((split,), spread, (len(before), len(after))), threshold)
        if min(p.slower, p.faster) > alpha:  # the segments differ under the gate's own test, or no step
            continue
        clarity = abs(split.change) / split.se if split.se > 0 else math.inf
        step = LevelShift(series[k].label, math.expm1(split.change), len(series) - k, k)
        if best is None or clarity > best[0]:
            best = (clarity, step)
    return best[1] if best else None


@dataclass(frozen=True)
class Level:
    """Runs of the baseline that belong together: one kernel signature, or one value cluster."""

    values: tuple[float, ...]
    kernels: frozenset | None = None  # the signature shared by its runs, if recorded
    origin: str | None = None  # a borrowed level: whose level gap moved the case's runs here

    def describe(self) -> str:
        level = f"{math.exp(stats.mean(self.values)) * 1e6:.4g} µs"
        if self.origin:
            return f"{level} (a level gap {self.origin} show, not seen in this case's {_runs(len(self.values))})"
        return f"{level} ({len(self.values)} runs)"

    def moved(self, gap: float, origin: str) -> Level:
        """This level's runs moved up by ``gap`` (log scale): a level the case may have, borrowed.

        >>> Level((math.log(1e-5),)).moved(math.log(1.12), "q_a's cases").describe()
        "11.2 µs (a level gap q_a's cases show, not seen in this case's one run)"
        """
        return Level(tuple(v + gap for v in self.values), self.kernels, origin)


# A value split must be wider than one normal level's widest split is in this share of baselines
# (split_critical). Not higher: a real two-kernel case merged into one level can raise a false
# alarm, where a false split only costs power, and at 0.99 two of the H200's five-run q_a
# cases (10 % gaps, 8.6 spreads wide) would lose their levels.
SPLIT_NULL_QUANTILE = 0.95
_SPLIT_DRAWS = 10_000  # simulated baselines per run count (deterministic: seeded by the count)


def _widest_split(ordered: Sequence[float]) -> tuple[float, int, float]:
    """The widest gap of sorted values, where it splits them (index of the upper side's first
    value), and the gap over the pooled spread within the two sides (0 when the split would
    leave a side of one run; inf when both sides are exact)."""
    n = len(ordered)
    gap, at = max((ordered[i + 1] - ordered[i], i + 1) for i in range(n - 1))
    if not 2 <= at <= n - 2:
        return gap, at, 0.0
    within = sum((v - m) ** 2 for side in (ordered[:at], ordered[at:]) for m in [stats.mean(side)] for v in side)
    sd = math.sqrt(within / (n - 2))
    return gap, at, gap / sd if sd > 0 else math.inf


@functools.cache
def split_critical(runs: int) -> float:
    """How wide (gap over within-side spread, :func:`_widest_split`) the widest split of ``runs``
    normal values of one level is in :data:`SPLIT_NULL_QUANTILE` of baselines, by a seeded
    simulation (the statistic is scale-free, so one spread serves every case).

    >>> round(split_critical(5), 1), round(split_critical(10), 1)  # 2 + 3 runs need a gap ~5 spreads wide
    (5.2, 2.6)
    """
    rng = random.Random(runs)
    ratios = sorted(_widest_split(sorted(rng.gauss(0.0, 1.0) for _ in range(runs)))[2] for _ in range(_SPLIT_DRAWS))
    return stats.quantile(ratios, SPLIT_NULL_QUANTILE)


def _runs(n: int) -> str:
    return "one run" if n == 1 else f"{n} runs"


def level_gaps(levels: Sequence[Level]) -> list[float]:
    """How far each level lies above the lowest (log scale); none for a single level.

    >>> [round(g, 2) for g in level_gaps([Level((0.0, 0.02)), Level((0.13, 0.11))])]
    [0.11]
    >>> level_gaps([Level(())])
    []
    """
    means = sorted(stats.mean(lv.values) for lv in levels if lv.values)  # a level of no runs has no place
    return [m - means[0] for m in means[1:]]


def levels_of(values: Sequence[float], kernels: Sequence[frozenset | None], threshold: float) -> list[Level]:
    """The baseline's levels: one per kernel signature where every run has one, else at most two
    value clusters (a gap beyond ``threshold`` and beyond what one level's spread makes, two runs
    or more each), else one level.

    >>> [len(l.values) for l in levels_of([0.0, 0.01, 0.12, 0.13], [None] * 4, 0.05)]
    [2, 2]
    >>> [len(l.values) for l in levels_of([0.0, 0.01, 0.12], [None] * 3, 0.05)]
    [3]
    >>> # dense_gate_up M=32 on the H200: a 3.2 % gap, but only 2.8 times the spread within its sides
    >>> [len(l.values) for l in levels_of([math.log(v) for v in (20.848, 21.238, 21.452, 22.145, 22.265)],
    ...                                   [None] * 5, 0.03)]
    [5]
    """
    if kernels and all(k is not None for k in kernels) and len(set(kernels)) > 1:
        groups: dict[frozenset, list[float]] = {}
        for v, k in zip(values, kernels, strict=True):
            groups.setdefault(k, []).append(v)
        return [Level(tuple(vs), k) for k, vs in groups.items()]
    ordered = sorted(values)
    if len(ordered) >= 4:
        gap, at, width = _widest_split(ordered)
        if gap > math.log1p(threshold) and width > split_critical(len(ordered)):
            return [Level(tuple(ordered[:at])), Level(tuple(ordered[at:]))]
    shared = kernels[0] if kernels and len(set(kernels)) == 1 else None
    return [Level(tuple(values), shared)]
