"""The step's types, a leaf of the prediction: what a kernel result is, the step predicted from
results (:class:`Prediction`, term by term), the same step as :class:`Step` (parts joined to their
results, which what-ifs and projections change), and the error every question about it raises.

Every other module of :mod:`decodebench.attribution.predict` builds on these; this one imports
none of them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from ...registry import group_parts
from ...results import Result as KernelResult  # a stored kernel benchmark, read once (decodebench.results)

__all__ = ["KernelResult", "Part", "Prediction", "Step", "Term", "WhatIfError", "part_of", "roofline_us"]

class WhatIfError(Exception):
    """A what-if or projection that cannot be answered; the message is one line naming the value."""


@dataclass(frozen=True)
class Term:
    """One benchmark's share of the predicted step."""

    group: str
    benchmark: str
    per_call_us: float
    calls: int

    @property
    def us(self) -> float:
        return self.per_call_us * self.calls


@dataclass(frozen=True)
class Prediction:
    """The predicted kernel time of one decode step, term by term.

    ``missing``: groups the results could not cover, with why; ``assumptions``: what a term
    rests on that the profile may not share (the MoE routing).
    """

    batch: int
    context: int
    terms: tuple[Term, ...]
    missing: tuple[str, ...]
    assumptions: tuple[str, ...] = ()

    def groups_us(self) -> dict[str, float]:
        out = {group: 0.0 for group in group_parts()}
        for term in self.terms:
            out[term.group] += term.us
        return out

    @property
    def total_us(self) -> float:
        return sum(term.us for term in self.terms)

    def to_info(self) -> dict:
        return {"batch": self.batch, "context": self.context, "total_us": self.total_us,
                "groups_us": self.groups_us(), "missing": list(self.missing),
                "assumptions": list(self.assumptions),
                "terms": [{"group": t.group, "benchmark": t.benchmark, "per_call_us": t.per_call_us,
                           "calls": t.calls} for t in self.terms]}


@dataclass(frozen=True)
class Part:
    """One term of a decode step: ``per_call_us`` times ``calls``, and what it would take at its roofline."""

    group: str
    benchmark: str
    per_call_us: float
    calls: int
    roofline_per_call_us: float | None  # at 100 % of its roofline bound; None without bytes/FLOPs
    how: str = "as measured"
    result: KernelResult | None = field(default=None, compare=False, repr=False)

    @property
    def us(self) -> float:
        return self.per_call_us * self.calls

    @property
    def roofline_us(self) -> float | None:
        return None if self.roofline_per_call_us is None else self.roofline_per_call_us * self.calls

    def to_info(self) -> dict:
        return {"group": self.group, "benchmark": self.benchmark, "per_call_us": self.per_call_us,
                "calls": self.calls, "us": self.us, "roofline_per_call_us": self.roofline_per_call_us,
                "how": self.how}


@dataclass(frozen=True)
class Step:
    """The predicted kernel time of one decode step (batch M, context L), part by part."""

    label: str
    batch: int
    context: int
    parts: tuple[Part, ...]
    assumptions: tuple[str, ...] = ()

    @property
    def total_us(self) -> float:
        return sum(p.us for p in self.parts)

    def groups_us(self) -> dict[str, float]:
        out = {group: 0.0 for group in group_parts()}
        for part in self.parts:
            out[part.group] = out.get(part.group, 0.0) + part.us
        return out

    def group_roofline_us(self, group: str) -> float | None:
        """The group's µs per step at 100 % of every part's roofline; None if a part has no roofline."""
        bounds = [p.roofline_us for p in self.parts if p.group == group]
        return None if any(b is None for b in bounds) else sum(bounds)

    def with_parts(self, parts: Iterable[Part], label: str, assumptions: Sequence[str] = ()) -> Step:
        return replace(self, label=label, parts=tuple(parts), assumptions=self.assumptions + tuple(assumptions))


def roofline_us(result: KernelResult) -> float | None:
    """µs per call of ``result`` at 100 % of its roofline on the device it ran on, from its stored
    fractions of peak (None when it stores none: a collective, a result without bytes/FLOPs).

    >>> r = KernelResult("g", "dense_gemm", "vllm", {}, 10e-6, {"frac_peak_bw": 0.6, "frac_peak_flops": 0.01})
    >>> round(roofline_us(r), 6)
    6.0
    """
    bw, flops = result.info.get("frac_peak_bw"), result.info.get("frac_peak_flops")
    if bw is None and flops is None:
        return None
    return result.median_s * 1e6 * max(bw or 0.0, flops or 0.0)


def part_of(group: str, result: KernelResult, calls: int, how: str = "as measured") -> Part:
    return Part(group, result.name, result.median_s * 1e6, calls, roofline_us(result), how, result)


