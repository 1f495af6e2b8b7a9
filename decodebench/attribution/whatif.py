"""What a change would buy: the predicted decode step under a what-if, and Amdahl's bounds.

The prediction (:mod:`.predict`) is a sum of terms, each a benchmark's time per call times
its calls per step. A what-if names one of the prediction's groups (``moe``, ``routing``,
``mla_attention``, ``dense_gemm``, ``allreduce``, ``rmsnorm``) and what it becomes:

* a factor, ``allreduce=0.5x``: every term of the group takes that many times its time;
* a backend id, ``mla_attention=vllm-triton_mla`` or ``moe=my_plugin``: every term of the
  group is taken from that backend's result of the same benchmark (same op, role, routing...)
  at the shape point nearest the step, as the prediction picks its own; ``BACKEND@FILE``
  takes that backend's results from a stored result file instead of the session's;
* ``roofline``: every term at 100 % of its roofline bound, its time times the larger of its
  fractions of peak bandwidth and peak FLOP/s — ``max(bytes / peak bandwidth, FLOPs / peak
  FLOP/s)`` on the device it was measured on, from the bytes and FLOPs every result carries.

* ``ep`` (``moe=ep``, ``moe=epN``, ``ep=N``, ``moe=epN:agrs|a2a``): the MoE at expert-parallel
  shapes from the EP-rank MoE results, its all-reduces swapped for EP dispatch and combine
  (:mod:`.ep`).

Comma-separated changes make one scenario (``moe=my_plugin,allreduce=0.5x``).

A what-if moves kernel time only; :mod:`.scenarios` moves the profiled step and TPOT by the
same microseconds and says so. :func:`amdahl` gives, per group, the kernel time with the
group at zero and at its roofline: the most any change to that group can buy.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path

from .predict import GROUPS, KernelResult, Prediction, backend_rank, load_results

__all__ = ["RESULT_COMPONENTS", "Change", "ChangeKind", "Part", "Step", "WhatIf", "WhatIfError", "amdahl",
           "apply_what_if", "parse_what_if", "roofline_us", "step_of"]

ROOFLINE = "roofline"
_FACTOR = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)x$")
_BACKEND = re.compile(r"^[A-Za-z0-9_.+-]+$")
# The benchmarks (extra_info["component"]) each group of the prediction is made of.
RESULT_COMPONENTS = {"moe": ("moe",), "routing": ("routing_topk",), "mla_attention": ("mla_decode",),
                     "dense_gemm": ("dense_gemm", "router_gemm"), "allreduce": ("allreduce",), "rmsnorm": ("rmsnorm",)}
# Shape keys that name a benchmark apart from its shape point (tokens, batch, context): another
# backend's result of the same benchmark agrees on them. A component not listed matches on none.
IDENTITY = {
    "rmsnorm": ("role", "fused_add", "width"),
    "moe": ("stage", "routing", "experts", "top_k", "layer"),
    "routing_topk": ("experts", "top_k"),
    "router_gemm": ("n", "k"),
    "mla_decode": ("heads", "mixed", "q_len"),
    "dense_gemm": ("op",),
    "allreduce": ("hidden",),
}


class WhatIfError(Exception):
    """A what-if or projection that cannot be answered; the message is one line naming the value."""


class ChangeKind(str, Enum):
    FACTOR = "factor"
    BACKEND = "backend"
    ROOFLINE = "roofline"
    EXPERT_PARALLEL = "expert_parallel"


@dataclass(frozen=True)
class Change:
    """One group of the step and what it becomes."""

    group: str
    kind: ChangeKind
    factor: float | None = None
    backend: str | None = None
    source: Path | None = None  # BACKEND@FILE: where that backend's results are stored
    ep: int | None = None  # EXPERT_PARALLEL: the EP size (None: the results' own)
    ep_mode: str = "vllm"  # EXPERT_PARALLEL: how dispatch and combine run (.ep.EPMode)

    @property
    def label(self) -> str:
        if self.kind is ChangeKind.EXPERT_PARALLEL:
            return f"{self.group}=ep{self.ep or ''}" + (f":{self.ep_mode}" if self.ep_mode != "vllm" else "")
        if self.kind is ChangeKind.FACTOR:
            return f"{self.group}={self.factor:g}x"
        if self.kind is ChangeKind.ROOFLINE:
            return f"{self.group}={ROOFLINE}"
        return f"{self.group}={self.backend}" + (f"@{self.source}" if self.source else "")


@dataclass(frozen=True)
class WhatIf:
    """One scenario: one change per group named."""

    changes: tuple[Change, ...]

    @property
    def label(self) -> str:
        return ",".join(c.label for c in self.changes)


def parse_what_if(text: str) -> WhatIf:
    """``COMPONENT=VALUE[,COMPONENT=VALUE...]`` -> a :class:`WhatIf`; ValueError naming what is wrong.

    >>> parse_what_if("allreduce=0.5x,mla_attention=vllm-triton_mla").label
    'allreduce=0.5x,mla_attention=vllm-triton_mla'
    >>> parse_what_if("moe_gemm=0.5x")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: moe_gemm=0.5x: unknown component 'moe_gemm'; choose one of moe, routing, ...
    """
    changes = [_parse_change(text, item) for item in text.split(",")]
    groups = [c.group for c in changes]
    if len(set(groups)) != len(groups):
        raise ValueError(f"{text}: a component is named twice")
    return WhatIf(tuple(changes))


def _parse_change(text: str, item: str) -> Change:
    group, sep, value = item.strip().partition("=")
    if not sep or not group or not value:
        raise ValueError(f"{text}: {item!r} is not COMPONENT=VALUE (VALUE: a factor such as 0.5x, "
                         f"a backend id, or {ROOFLINE})")
    if group == "ep" or (group == "moe" and value.startswith("ep")):
        return _parse_ep(text, group, value)
    if group not in GROUPS:
        raise ValueError(f"{text}: unknown component {group!r}; choose one of {', '.join(GROUPS)}")
    if value == ROOFLINE:
        return Change(group, ChangeKind.ROOFLINE)
    factor = _FACTOR.match(value)
    if factor:
        return Change(group, ChangeKind.FACTOR, factor=float(factor.group(1)))
    if re.match(r"^[\d.]+$", value):
        raise ValueError(f"{text}: {value!r} is no factor: write {value}x")
    backend, at, source = value.partition("@")
    if not _BACKEND.match(backend) or (at and not source):
        raise ValueError(f"{text}: {value!r} is neither a factor (0.5x), {ROOFLINE}, nor a backend id "
                         "(BACKEND or BACKEND@FILE)")
    return Change(group, ChangeKind.BACKEND, backend=backend, source=Path(source) if source else None)


def _parse_ep(text: str, group: str, value: str) -> Change:
    """``ep=N`` (same as ``moe=epN``) or ``moe=ep[N][:MODE]``."""
    from .ep import parse_ep_value

    if group == "ep":
        if not value.isdigit():
            raise ValueError(f"{text}: ep={value!r}: give the expert-parallel size, e.g. ep=8")
        value = f"ep{value}"
    try:
        parsed = parse_ep_value(value)
    except ValueError as exc:
        raise ValueError(f"{text}: {exc}") from None
    if parsed is None:
        raise ValueError(f"{text}: {value!r} is not ep, epN or epN:MODE (MODE: vllm, agrs, a2a)")
    return Change("moe", ChangeKind.EXPERT_PARALLEL, ep=parsed[0], ep_mode=parsed[1].value)


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
        out = {group: 0.0 for group in GROUPS}
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


def _part(group: str, result: KernelResult, calls: int, how: str = "as measured") -> Part:
    return Part(group, result.name, result.median_s * 1e6, calls, roofline_us(result), how, result)


def step_of(prediction: Prediction, results: Sequence[KernelResult], label: str = "today") -> Step:
    """The prediction as a :class:`Step`, each term joined to the result it was read from.

    >>> from decodebench.attribution.predict import Term
    >>> r = KernelResult("norm", "rmsnorm", "vllm", {"tokens": 1}, 2e-6, {"frac_peak_bw": 0.5})
    >>> step = step_of(Prediction(1, 64, (Term("rmsnorm", "norm", 2.0, 4),), ()), [r])
    >>> step.total_us, step.group_roofline_us("rmsnorm")
    (8.0, 4.0)
    """
    by_name: dict[str, list[KernelResult]] = {}
    for r in results:
        by_name.setdefault(r.name, []).append(r)
    parts = []
    for term in prediction.terms:
        # the result the prediction chose: its name, and its median to the bit (files may repeat a name)
        chosen = next((r for r in by_name.get(term.benchmark, []) if r.median_s * 1e6 == term.per_call_us), None)
        parts.append(_part(term.group, chosen, term.calls) if chosen else
                     Part(term.group, term.benchmark, term.per_call_us, term.calls, None))
    return Step(label, prediction.batch, prediction.context, tuple(parts), prediction.assumptions)


def apply_what_if(step: Step, what_if: WhatIf, results: Sequence[KernelResult], *, strict: bool = True,
                  label: str | None = None) -> Step:
    """``step`` with every change of ``what_if`` made; backend changes draw on ``results``.

    ``strict``: a backend with no result for the group is an error (a user's what-if); otherwise
    the group stays as it was and the step says so (a projection target's usual backend).

    >>> r = KernelResult("ar", "allreduce", "torch", {"tokens": 1}, 20e-6)
    >>> step = Step("today", 1, 64, (_part("allreduce", r, 5),))
    >>> apply_what_if(step, parse_what_if("allreduce=0.5x"), [r]).groups_us()["allreduce"]
    50.0
    """
    for change in what_if.changes:
        step = _apply(step, change, results, strict)
    return replace(step, label=label or what_if.label)


def _apply(step: Step, change: Change, results: Sequence[KernelResult], strict: bool) -> Step:
    if not any(p.group == change.group for p in step.parts):
        return step.with_parts(step.parts, step.label, [f"{change.label} changes nothing: the step predicted here "
                                                        f"has no {change.group} term"])
    if change.kind is ChangeKind.FACTOR:
        parts = [replace(p, per_call_us=p.per_call_us * change.factor, how=f"{p.how}, x {change.factor:g}")
                 if p.group == change.group else p for p in step.parts]
        return step.with_parts(parts, step.label)
    if change.kind is ChangeKind.ROOFLINE:
        return step.with_parts([_at_roofline(p, change) if p.group == change.group else p for p in step.parts],
                               step.label)
    if change.kind is ChangeKind.EXPERT_PARALLEL:
        from .ep import EPMode, apply_expert_parallel

        return apply_expert_parallel(step, change.label, change.ep, EPMode(change.ep_mode), results)
    return _swap_backend(step, change, results, strict)


def _at_roofline(part: Part, change: Change) -> Part:
    if part.roofline_per_call_us is None:
        raise WhatIfError(f"--what-if {change.label}: {part.benchmark} carries no roofline (no bytes/FLOPs "
                          "fractions of peak in its result)")
    return replace(part, per_call_us=part.roofline_per_call_us, how=f"{part.how}, at its roofline")


def _swap_backend(step: Step, change: Change, results: Sequence[KernelResult], strict: bool) -> Step:
    results = _stored(change.source) if change.source else results
    mine = [p for p in step.parts if p.group == change.group]
    components = {p.result.component for p in mine if p.result is not None}
    offered = [r for r in results if r.backend == change.backend and r.component in components]
    if not offered:
        have = sorted({r.backend for r in results if r.component in components})
        why = (f"--what-if {change.label}: no {change.group} results of backend {change.backend!r}"
               f"{f' in {change.source}' if change.source else ''} (have: {', '.join(have) or 'none'})")
        if strict:
            raise WhatIfError(why)
        return step.with_parts(step.parts, step.label, [f"{why}: {change.group} kept as measured"])
    parts, kept = [], []
    for part in step.parts:
        other = _same_benchmark(part, offered, step.batch, step.context) if part.group == change.group else None
        if part.group == change.group and other is None:
            kept.append(part.benchmark)
        parts.append(_part(part.group, other, part.calls, f"{change.backend} in place of {part.result.backend}")
                     if other is not None else part)
    notes = [f"{change.label}: no {change.backend} result for {', '.join(kept)}: kept as measured"] if kept else []
    return step.with_parts(parts, step.label, notes)


@functools.lru_cache(maxsize=16)
def _stored(path: Path) -> tuple[KernelResult, ...]:
    try:
        return tuple(load_results(path)[0])
    except ValueError as exc:
        raise WhatIfError(str(exc)) from None


def _same_benchmark(part: Part, offered: Sequence[KernelResult], batch: int, context: int) -> KernelResult | None:
    """Among ``offered``, the result of ``part``'s benchmark nearest the step's batch and context."""
    if part.result is None:
        return None
    keys = IDENTITY.get(part.result.component, ())
    same = [r for r in offered if r.component == part.result.component
            and all(r.shape.get(k) == part.result.shape.get(k) for k in keys)]
    return min(same, key=lambda r: (_distance(r, batch, context), backend_rank(r)), default=None)


def _distance(r: KernelResult, batch: int, context: int) -> float:
    shape = r.shape
    if r.component == "mla_decode":  # its query rows (requests x query tokens each) against the step's tokens
        rows = shape.get("batch", 0) * shape.get("q_len", 1)
        return _log_gap(rows, batch) + _log_gap(shape.get("context_max"), context)
    return _log_gap(shape.get("tokens", shape.get("M", shape.get("m"))), batch)


def _log_gap(value, target: int) -> float:
    return abs(math.log(value / target)) if value else math.inf


def amdahl(step: Step) -> dict[str, dict[str, float | None]]:
    """Per group with time in ``step``: the kernel time per step with that group at zero and at its
    roofline (None where a part has no roofline), the most a change to that group alone can give.

    >>> r = KernelResult("norm", "rmsnorm", "vllm", {"tokens": 1}, 2e-6, {"frac_peak_bw": 0.5})
    >>> a = KernelResult("ar", "allreduce", "torch", {"tokens": 1}, 20e-6)
    >>> bounds = amdahl(Step("today", 1, 64, (_part("rmsnorm", r, 4), _part("allreduce", a, 5))))
    >>> bounds["rmsnorm"]
    {'group_us': 8.0, 'zero_us': 100.0, 'roofline_us': 104.0}
    >>> bounds["allreduce"]
    {'group_us': 100.0, 'zero_us': 8.0, 'roofline_us': None}
    """
    total, out = step.total_us, {}
    for group, us in step.groups_us().items():
        if us:
            bound = step.group_roofline_us(group)
            out[group] = {"group_us": us, "zero_us": total - us,
                          "roofline_us": None if bound is None else total - us + bound}
    return out
