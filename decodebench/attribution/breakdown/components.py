"""Per step and per component: where the time of a profiled decode step went, on each rank.

Step wall, busy and idle, overlapping kernels' shares and the slowest rank are as
docs/attribution.md ("Steps, kernels, busy and idle") defines them: the components add up to
busy exactly. Steps whose annotation shows a prefill (context requests) are counted and left out.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from ...kernel_rules import Component, classify, in_launch_order, parts
from .trace import Kernel, RankTrace, StepMark

__all__ = ["RankBreakdown", "StepBreakdown", "attribute", "break_down", "complete_steps", "previous_names", "slowest",
           "union_us"]

Classifier = Callable[[str, str], "str | None"]  # (kernel name, the name launched before it)


@dataclass(frozen=True)
class StepBreakdown:
    """One decode step on one rank (µs)."""

    wall_us: float
    busy_us: float
    components_us: dict[str, float]
    unmatched_us: dict[str, float]
    batch: int
    kernels_us: dict[str, float] = field(default_factory=dict)  # every kernel name's share of busy

    @property
    def idle_us(self) -> float:
        return self.wall_us - self.busy_us


@dataclass(frozen=True)
class RankBreakdown:
    """The decode steps of one rank's trace, and the steps left out as prefill."""

    rank: int
    on_device: bool
    steps: tuple[StepBreakdown, ...]
    prefill_steps: int

    def mean(self, field: str) -> float:
        return statistics.fmean(getattr(s, field) for s in self.steps)

    def mean_components_us(self) -> dict[str, float]:
        """Mean µs per step of every component (all components, zeros included, in display order)."""
        return {part: statistics.fmean(s.components_us.get(part, 0.0) for s in self.steps) for part in parts()}

    def mean_unmatched_us(self) -> dict[str, float]:
        """Kernels no rule matched: mean µs per step by name, largest first."""
        return self._mean_by_name("unmatched_us")

    def mean_kernels_us(self) -> dict[str, float]:
        """Every kernel: mean µs per step (its share of busy) by name, largest first."""
        return self._mean_by_name("kernels_us")

    def _mean_by_name(self, field_name: str) -> dict[str, float]:
        totals: dict[str, float] = defaultdict(float)
        for step in self.steps:
            for name, us in getattr(step, field_name).items():
                totals[name] += us / len(self.steps)
        return dict(sorted(totals.items(), key=lambda item: -item[1]))


def union_us(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by ``(start, end)`` intervals.

    >>> union_us([(0, 10), (5, 15), (20, 25)])
    20
    """
    total, reach = 0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def attribute(kernels: Sequence[Kernel], classify_name: Classifier = classify) -> tuple[dict, dict, dict]:
    """Split the union of ``kernels``' intervals among components; overlaps are shared equally.

    Returns ``(µs per component, µs per unmatched kernel name, µs per kernel name)``;
    unmatched time also counts under ``other``, so the first dict sums to the union. Each kernel is
    classified with the name of the kernel launched just before it (:func:`previous_names`).

    >>> a = Kernel("nvjet_x", 0, 10, 0); b = Kernel("rms_norm_kernel", 5, 10, 0)
    >>> attribute([a, b])[0]
    {'dense_gemm': 7.5, 'rmsnorm': 7.5}
    """
    cuts = sorted({t for k in kernels for t in (k.start_us, k.end_us)})
    share: dict[int, float] = defaultdict(float)
    for left, right in zip(cuts, cuts[1:], strict=False):
        active = [i for i, k in enumerate(kernels) if k.start_us <= left and k.end_us >= right]
        for i in active:
            share[i] += (right - left) / len(active)
    components: dict[str, float] = defaultdict(float)
    unmatched: dict[str, float] = defaultdict(float)
    by_name: dict[str, float] = defaultdict(float)
    previous = previous_names(kernels)
    for i, us in share.items():
        component = classify_name(kernels[i].name, previous[i])
        components[component or Component.OTHER.value] += us
        by_name[kernels[i].name] += us
        if component is None:
            unmatched[kernels[i].name] += us
    return dict(components), dict(unmatched), dict(by_name)


def previous_names(kernels: Sequence[Kernel]) -> list[str]:
    """For each kernel, the name of the kernel launched just before it ("" for the first).

    >>> previous_names([Kernel("b", 5, 1, 2), Kernel("a", 0, 1, 1)])
    ['a', '']
    """
    order = sorted(range(len(kernels)), key=lambda i: kernels[i].launch_us)
    out = [""] * len(kernels)
    for i, (_, previous) in zip(order, in_launch_order(kernels[i].name for i in order), strict=True):
        out[i] = previous
    return out


def break_down(trace: RankTrace, classify_name: Classifier = classify) -> RankBreakdown:
    """The decode steps of ``trace``; raises ValueError when the window holds no complete decode step.

    Example::

        rank = break_down(load_trace(path))
        rank.mean("wall_us"), rank.mean_components_us()["moe_gemm"]
    """
    steps, prefill = [], 0
    for mark, kernels, end_us in complete_steps(trace):
        if not mark.is_decode:
            prefill += 1
            continue
        steps.append(_step(kernels, end_us, mark.generation_requests, classify_name))
    if not steps:
        raise ValueError(f"{trace.path}: no complete decode step in the window ({len(trace.steps)} step marks, "
                         f"{prefill} with prefill); profile at least 3 steps while every request decodes")
    return RankBreakdown(trace.rank, trace.on_device, tuple(steps), prefill)


def complete_steps(trace: RankTrace) -> Iterator[tuple[StepMark, list[Kernel], float]]:
    """Each step of ``trace`` that ran kernels and is closed by a next step that ran kernels:
    ``(its mark, its kernels, the next step's first kernel start)`` (the last mark only closes the
    step before it); prefill and decode steps alike."""
    groups = _kernels_by_step(trace)
    for index in range(len(trace.steps) - 1):
        kernels, following = groups[index], groups[index + 1]
        if kernels and following:
            yield trace.steps[index], kernels, following[0].start_us


def _kernels_by_step(trace: RankTrace) -> list[list[Kernel]]:
    """Kernels grouped by the step mark whose CPU range holds their launch (before the first: dropped)."""
    starts = [mark.start_us for mark in trace.steps]
    groups: list[list[Kernel]] = [[] for _ in starts]
    for kernel in trace.kernels:
        index = _last_at_or_before(starts, kernel.launch_us)
        if index is not None:
            groups[index].append(kernel)
    return groups


def _last_at_or_before(starts: Sequence[float], t: float) -> int | None:
    import bisect

    index = bisect.bisect_right(starts, t) - 1
    return index if index >= 0 else None


def _step(kernels: list[Kernel], end_us: float, batch: int, classify_name: Classifier) -> StepBreakdown:
    start = min(k.start_us for k in kernels)
    clipped = [Kernel(k.name, k.start_us, min(k.end_us, end_us) - k.start_us, k.launch_us)
               for k in kernels if k.start_us < end_us]
    busy = union_us((k.start_us, k.end_us) for k in clipped)
    components, unmatched, by_name = attribute(clipped, classify_name)
    total = sum(components.values())
    if abs(total - busy) > 1e-6 * max(1.0, busy):
        raise AssertionError(f"components sum to {total} µs but the kernels cover {busy} µs")
    return StepBreakdown(end_us - start, busy, components, unmatched, batch, by_name)


def slowest(ranks: Sequence[RankBreakdown]) -> RankBreakdown:
    """The rank with the most kernel time per step: the one the others wait for at each all-reduce."""
    return max(ranks, key=lambda r: r.mean("busy_us"))
