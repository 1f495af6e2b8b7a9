"""Split one traced call into named parts by rules on its kernel names.

A call that launches several kernels, e.g. vLLM's ``fused_marlin_moe`` (align, gate_up GEMM,
activation, down GEMM, sum), is split into parts by an ordered list of :class:`PartRule`: the
first rule that matches a kernel (in :class:`~decodebench.cupti.KernelTrace`'s launch order) names
its part; a rule with ``nth`` takes only the nth kernel its pattern matches in the call, so two
launches of one GEMM kernel are told apart by order; what no rule matches is ``other``.

A :class:`TimedPart` says which part a result's samples are (docs/benchmarks.md, "MoE per GEMM on
vLLM"). Under ``--inject-slowdown`` a part that carries the spin
(:meth:`TimedPart.carrying_spin`) counts that kernel as its own, and refuses a trace in which the
spin is not exactly once per call, so a part is never reported as slowed down when its kernels
were not.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from . import stats
from .kernel_rules import in_launch_order, rule_for

if TYPE_CHECKING:
    from .timing import KernelTrace

__all__ = ["OTHER", "SPIN", "PartRule", "TimedPart", "TraceAttributionError", "part_seconds", "split_call"]

OTHER = "other"
SPIN = "injected spin"  # the part of the injection's spin kernel (torch.cuda._sleep: ATen's spin_kernel)
_SPIN_RULE_PATTERN = r"\bspin_kernel\b"


class TraceAttributionError(RuntimeError):
    """A traced call does not have the parts its rules promise (a kernel renamed, one more launch)."""


@dataclass(frozen=True)
class PartRule:
    """Kernels of ``kind`` (the attribution rules' kernel family), or else whose name matches
    ``pattern`` (a regex, searched), belong to ``part``; with ``nth``, only the nth such kernel
    of the call (0-based)."""

    part: str
    pattern: str = ""
    nth: int | None = None
    kind: str | None = None

    def __post_init__(self) -> None:
        if bool(self.pattern) == (self.kind is not None):
            raise ValueError(f"part rule {self.part!r} needs exactly one of pattern and kind")

    @property
    def key(self) -> str:
        return f"kind:{self.kind}" if self.kind is not None else self.pattern

    def matches(self, name: str, previous: str = "") -> bool:
        if self.kind is not None:
            rule = rule_for(name, previous)
            return rule is not None and rule.kind == self.kind
        return re.search(self.pattern, name) is not None


def split_call(names: Sequence[str], rules: Sequence[PartRule]) -> tuple[str, ...]:
    """The part of each kernel of one call, in launch order.

    >>> rules = (PartRule("gate_up", "Marlin", nth=0), PartRule("down", "Marlin", nth=1),
    ...          PartRule("activation", "silu"))
    >>> split_call(["moe_align", "Marlin<4>", "silu_and_mul", "Marlin<4>", "moe_sum"], rules)
    ('other', 'gate_up', 'activation', 'down', 'other')
    >>> split_call(["vllm::moe::moe_sum_kernel<float>"], (PartRule("sum", kind="moe_sum"),))
    ('sum',)
    """
    seen: dict[str, int] = {}
    parts = []
    for name, previous in in_launch_order(names):
        part = OTHER
        matched = [rule for rule in rules if rule.matches(name, previous)]
        for rule in matched:
            if rule.nth is None or rule.nth == seen.get(rule.key, 0):
                part = rule.part
                break
        for key in {rule.key for rule in matched}:
            seen[key] = seen.get(key, 0) + 1
        parts.append(part)
    return tuple(parts)


def part_seconds(trace: KernelTrace, parts: Sequence[str]) -> dict[str, tuple[float, ...]]:
    """Per part, its seconds per call in each sample (the sum of its kernels).

    >>> from decodebench.timing import KernelTrace
    >>> trace = KernelTrace(("a", "g", "b"), ((1.0, 5.0, 2.0), (1.5, 6.0, 2.0)))
    >>> part_seconds(trace, ("other", "gemm", "other"))
    {'other': (3.0, 3.5), 'gemm': (5.0, 6.0)}
    """
    out: dict[str, list[float]] = {part: [0.0] * len(trace.samples) for part in parts}
    for i, sample in enumerate(trace.samples):
        for part, seconds in zip(parts, sample, strict=True):
            out[part][i] += seconds
    return {part: tuple(values) for part, values in out.items()}


class TracedCall(Protocol):
    """What a part needs of the case whose call it is traced in (a :class:`~decodebench.kernels.base.KernelCase`):
    its id, to name it. Declared here so that this module, below the kernels, imports none of them."""

    id: str


@dataclass(frozen=True)
class TimedPart:
    """A result that is one part of another case's traced call.

    ``whole`` is the case whose call is checked, timed and traced (e.g. the fused MoE
    layer); ``part`` names the kernels whose time this result records; ``required``
    parts must each be exactly one kernel of the call, and ``forbidden`` parts none.
    """

    whole: TracedCall
    part: str
    rules: tuple[PartRule, ...]
    required: tuple[str, ...] = ()
    forbidden: tuple[str, ...] = ()

    def carrying_spin(self) -> TimedPart:
        """This part with the injection's spin kernel counted as its own (it must be in the call).

        >>> from decodebench.timing import KernelTrace
        >>> part = TimedPart(None, "gemm", (PartRule("gemm", "gemm"),), required=("gemm",)).carrying_spin()
        >>> part.attribute(KernelTrace(("gemm", "at::cuda::spin_kernel(long)"), ((4e-6, 2e-6),)))[0]
        (6e-06,)
        """
        return dataclasses.replace(self, rules=(PartRule(SPIN, _SPIN_RULE_PATTERN), *self.rules),
                                   required=(*self.required, SPIN))

    def attribute(self, trace: KernelTrace | None) -> tuple[tuple[float, ...], dict[str, object]]:
        """This part's samples (seconds per call) and what the other parts took, for ``extra_info``.

        >>> from decodebench.timing import KernelTrace
        >>> rule = (PartRule("gemm", "gemm"),)
        >>> samples, info = TimedPart(None, "gemm", rule, required=("gemm",)).attribute(
        ...     KernelTrace(("align", "gemm"), ((1e-6, 4e-6), (1e-6, 5e-6))))
        >>> samples, info["part_median_s"]
        ((4e-06, 5e-06), {'other': 1e-06, 'gemm': 4.5e-06})
        """
        if trace is None:
            raise TraceAttributionError(f"no per-kernel trace of {self._whole_id()} was recorded "
                                        "(the kernel counts differed between calls)")
        parts = split_call(trace.names, self.rules)
        self._check(trace.names, parts)
        seconds = part_seconds(trace, parts)
        info = {"timed_part": self.part, "traced_call": self._whole_id(),
                "part_median_s": {part: stats.median(values) for part, values in seconds.items()},
                "call_kernels": [{"name": name, "part": part} for name, part in zip(trace.names, parts, strict=True)]}
        own = seconds[self.part]
        if SPIN in self.required:  # carrying the spin (an injection)
            own = tuple(a + b for a, b in zip(own, seconds[SPIN], strict=True))
        return own, info

    def _check(self, names: Sequence[str], parts: Sequence[str]) -> None:
        problems = [f"{p!r} matched {parts.count(p)} kernels, expected 1" for p in self.required
                    if parts.count(p) != 1]
        problems += [f"{p!r} matched {parts.count(p)} kernels, expected none" for p in self.forbidden
                     if p in parts]
        if self.part not in self.required and self.part not in parts:
            problems.append(f"no kernel is {self.part!r}")
        if problems:
            raise TraceAttributionError(f"the kernel trace of {self._whole_id()} does not split as expected: "
                                        f"{'; '.join(problems)}. Kernels of one call: {list(names)}")

    def _whole_id(self) -> str:
        return getattr(self.whole, "id", "the call")
