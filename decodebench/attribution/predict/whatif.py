"""What a change would buy: the predicted decode step under a what-if, and Amdahl's bounds.

A what-if names a group of the prediction (:mod:`.prediction`, a sum of terms) and what it becomes:
a factor (``allreduce=0.5x``), a backend id (``mla_attention=vllm-triton_mla``; ``BACKEND@FILE`` from a
stored result file), ``roofline``, ``ep`` (:mod:`.ep`) or ``spec`` (:mod:`.speculative`); comma-joined
changes make one scenario. Every kind is an entry of one registry, :data:`KINDS` (its syntax, what it
claims, its parser), which :func:`parse_what_if` and the option's help read. A what-if moves kernel
time only (:mod:`.scenarios` moves the step and TPOT by the same µs); :func:`amdahl` gives each group
at zero and at its roofline. What each kind means: docs/projection.md, "What-if, Amdahl, projection".
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path

from ...registry import get, group_parts, identity
from .ep import EPMode, apply_expert_parallel, parse_ep_value
from .prediction import backend_rank, distance, load_results
from .speculative import SpecWhatIf, parse_spec_what_if
from .step import KernelResult, Part, Step, WhatIfError, part_of

__all__ = ["KINDS", "Change", "ChangeKind", "WhatIf", "WhatIfKind", "amdahl", "apply_what_if",
           "parse_what_if", "what_if_syntax"]

ROOFLINE = "roofline"
_FACTOR = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)x$")
_BACKEND = re.compile(r"^[A-Za-z0-9_.+-]+$")

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


@dataclass(frozen=True)
class WhatIfKind:
    """One kind of what-if: the ``COMPONENT=VALUE`` changes it claims and how it reads them.

    ``alone``: the kind is a scenario of its own (speculative decoding changes the step's shape, not one
    group), never comma-joined with other changes; ``components``: its COMPONENT must be a group of the
    prediction.
    """

    name: str
    syntax: str
    claims: Callable[[str, str], bool]
    parse: Callable[[str, str, str], Change | SpecWhatIf]
    alone: bool = False
    components: bool = True


def _parse_roofline(text: str, group: str, value: str) -> Change:
    return Change(group, ChangeKind.ROOFLINE)


def _parse_factor(text: str, group: str, value: str) -> Change:
    if value.startswith("-"):
        raise ValueError(f"{text}: {value!r}: a factor is a time multiplier of 0 or more, e.g. 0.5x")
    factor = _FACTOR.match(value.removeprefix("+"))
    if not factor:
        raise ValueError(f"{text}: {value!r} is no factor: write {value}x")
    return Change(group, ChangeKind.FACTOR, factor=float(factor.group(1)))


def _parse_backend(text: str, group: str, value: str) -> Change:
    backend, at, source = value.partition("@")
    if not _BACKEND.match(backend) or (at and not source):
        raise ValueError(f"{text}: {value!r} is neither a factor (0.5x), {ROOFLINE}, nor a backend id "
                         "(BACKEND or BACKEND@FILE)")
    return Change(group, ChangeKind.BACKEND, backend=backend, source=Path(source) if source else None)


def _parse_ep(text: str, group: str, value: str) -> Change:
    """``ep=N`` (same as ``moe=epN``) or ``moe=ep[N][:MODE]``."""
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


def _parse_spec(text: str, group: str, value: str) -> SpecWhatIf:
    return parse_spec_what_if(text.strip())


# Every kind of what-if, asked in this order; the first that claims a change reads it. The option's help
# is made from the syntax column (:func:`what_if_syntax`).
KINDS: tuple[WhatIfKind, ...] = (
    WhatIfKind("speculative decoding", "spec=METHOD:K:ACCEPT[:DRAFT_US[:HOST_US]] (K drafts per step, each "
               "accepted with probability ACCEPT; DRAFT_US the draft's µs per step, HOST_US host µs per token a "
               "step emits beyond one per request)", lambda group, value: group == "spec", _parse_spec,
               alone=True, components=False),
    WhatIfKind("expert parallelism", "moe=ep, ep=N or moe=epN[:agrs|a2a] (the MoE from --ep results, its "
               "all-reduces swapped for dispatch and combine)",
               lambda group, value: group == "ep" or (group == "moe" and value.startswith("ep")),
               _parse_ep, components=False),
    WhatIfKind("roofline", f"COMPONENT={ROOFLINE} (every term of the group at 100 % of its roofline)",
               lambda group, value: value == ROOFLINE, _parse_roofline),
    WhatIfKind("factor", "COMPONENT=0.5x (every term of the group times the factor)",
               lambda group, value: bool(re.match(r"^[-+]?[\d.]+x?$", value)), _parse_factor),
    WhatIfKind("backend", "COMPONENT=BACKEND or BACKEND@FILE (the group from that backend's results, in the "
               "session or in FILE)", lambda group, value: True, _parse_backend),
)


def what_if_syntax() -> str:
    """What ``--what-if`` takes, from :data:`KINDS` (COMPONENT a group of the prediction; the help names a few, so
    that a component added later changes no page generated from it).

    >>> what_if_syntax().startswith("spec=METHOD:K:ACCEPT")
    True
    """
    return "; ".join(kind.syntax for kind in KINDS) + ("; COMPONENT a step group of the prediction, as the registered "
                                                       "components declare them (moe, mla_attention, dense_gemm, ...; "
                                                       "another is refused naming them all)")


def parse_what_if(text: str) -> WhatIf | SpecWhatIf:
    """``COMPONENT=VALUE[,COMPONENT=VALUE...]`` -> a :class:`WhatIf`, or the scenario of a kind that stands
    alone (``spec=...``: a :class:`~.speculative.SpecWhatIf`); ValueError naming what is wrong.

    >>> parse_what_if("allreduce=0.5x,mla_attention=vllm-triton_mla").label
    'allreduce=0.5x,mla_attention=vllm-triton_mla'
    >>> parse_what_if("spec=ngram:4:0.6").label
    'spec=ngram:4:0.6'
    >>> parse_what_if("moe_gemm=0.5x")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: moe_gemm=0.5x: unknown component 'moe_gemm'; choose one of moe, routing, ...
    """
    items = text.split(",")
    changes = []
    for item in items:
        group, sep, value = item.strip().partition("=")
        if not sep or not group or not value:
            raise ValueError(f"{text}: {item!r} is not COMPONENT=VALUE ({what_if_syntax()})")
        kind = next(k for k in KINDS if k.claims(group, value))
        if kind.components and group not in group_parts():
            raise ValueError(f"{text}: unknown component {group!r}; choose one of {', '.join(group_parts())}")
        if kind.alone:
            if len(items) > 1:
                raise ValueError(f"{text}: {kind.name} ({group}=...) is a scenario of its own: give it as its own "
                                 "--what-if, not joined with other changes")
            return kind.parse(text, group, value)
        changes.append(kind.parse(text, group, value))
    groups = [c.group for c in changes]
    if len(set(groups)) != len(groups):
        raise ValueError(f"{text}: a component is named twice")
    return WhatIf(tuple(changes))


def apply_what_if(step: Step, what_if: WhatIf, results: Sequence[KernelResult], *, strict: bool = True,
                  label: str | None = None) -> Step:
    """``step`` with every change of ``what_if`` made; backend changes draw on ``results``.

    ``strict``: a backend with no result for the group is an error (a user's what-if); otherwise
    the group stays as it was and the step says so (a projection target's usual backend).

    >>> r = KernelResult("ar", "allreduce", "torch", {"tokens": 1}, 20e-6)
    >>> step = Step("today", 1, 64, (part_of("allreduce", r, 5),))
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
        parts.append(part_of(part.group, other, part.calls, f"{change.backend} in place of {part.result.backend}")
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
    keys = identity(part.result.component)
    same = [r for r in offered if r.component == part.result.component
            and all(r.shape.get(k) == part.result.shape.get(k) for k in keys)]
    return min(same, key=lambda r: (distance(get(r.component), r.shape, batch, context), backend_rank(r)),
               default=None)


def amdahl(step: Step) -> dict[str, dict[str, float | None]]:
    """Per group with time in ``step``: the kernel time per step with that group at zero and at its
    roofline (None where a part has no roofline), the most a change to that group alone can give.

    >>> r = KernelResult("norm", "rmsnorm", "vllm", {"tokens": 1}, 2e-6, {"frac_peak_bw": 0.5})
    >>> a = KernelResult("ar", "allreduce", "torch", {"tokens": 1}, 20e-6)
    >>> bounds = amdahl(Step("today", 1, 64, (part_of("rmsnorm", r, 4), part_of("allreduce", a, 5))))
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
