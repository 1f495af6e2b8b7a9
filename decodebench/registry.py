"""The component registry: every benchmarked component declared once, beside its kernel case.

A component module declares a module-level :class:`ComponentSpec` with every fact the package
needs of it; :func:`registered` finds those records by walking :data:`PACKAGES`, and every table
the prediction, the gate, the projection and the breakdown use is derived here from them, so
adding a component touches its own module only (docs/development.md, "Adding a component"). A
fact is never assumed: a component that lacks one is refused when declared, and a question about
a component that is not registered, or a shape that lacks what a fact needs, raises
:class:`RegistryError` naming the component and the fact.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from enum import Enum
from functools import cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .shapes import DecodeShapes

__all__ = ["PACKAGES", "Component", "ComponentSpec", "Per", "RegistryError", "Rule", "StepCase", "calls_per_step",
           "discover", "get", "group_components", "group_parts", "identity", "not_benchmarked", "own_rules",
           "part_scaling", "parts", "projected_groups", "registered", "tokens_of"]

# The packages whose modules declare components (one module-level ComponentSpec or more each).
PACKAGES = ("decodebench.kernels", "decodebench.distributed")


class Component(str, Enum):
    """The general parts of a decode step, in display order; a registered component may bring a part of
    its own (:attr:`decodebench.registry.ComponentSpec.rules`), shown before ``copies_casts``."""

    MOE_GEMM = "moe_gemm"
    MOE_GLUE = "moe_glue"
    ROUTING = "routing"
    ATTENTION = "mla_attention"
    DENSE_GEMM = "dense_gemm"
    ALLREDUCE = "allreduce"
    RMSNORM = "rmsnorm"
    ROTARY = "rotary"
    SAMPLING = "sampling"
    COPIES = "copies_casts"
    OTHER = "other"


@dataclass(frozen=True)
class Rule:
    """Kernels whose name matches ``pattern`` belong to the part ``component``; ``kind`` names the kernel
    family (the fused Marlin call's parts are kinds, :data:`decodebench.kernels.marlin.FUSED_MARLIN_PARTS`);
    ``why`` names the kernels meant. With ``after``, only a kernel launched right after one whose name
    matches it: a generic kernel (a fill, a copy) that a layer launches at a fixed place."""

    component: str
    pattern: str
    why: str
    kind: str = ""
    after: str = ""


@cache
def parts() -> tuple[str, ...]:
    """Every part of a decode step in display order: the general ones, with the components' own before
    ``copies_casts``.

    >>> parts()[:3]
    ('moe_gemm', 'moe_glue', 'routing')
    """
    general = [c.value for c in Component]
    own = [p for p in dict.fromkeys(str(getattr(r.component, 'value', r.component)) for r in own_rules())
           if p not in general]
    at = general.index(Component.COPIES.value)
    return tuple(general[:at] + own + general[at:])


class RegistryError(LookupError):
    """A component that is not registered, or a fact it lacks; the message names both."""


class Per(str, Enum):
    """What a component's calls per step scale with."""

    LAYER = "layer"  # every decoder layer
    MOE_LAYER = "moe_layer"  # every MoE layer (the first dense layers have none)
    STEP = "step"  # once a step
    OP = "op"  # each op of its shape its own (the dense GEMMs: projections per layer, lm_head per step)


Shape = Mapping[str, object]


@dataclass(frozen=True)
class StepCase:
    """One case of a component that a decode step runs: the identity values a result must have
    (``key``; a stored shape without one of them stands for its ``absent`` value); for messages, what
    it is (``what``, else the component) and its shape (``detail``), and whether it is measured at a
    context (``at_context``: the step's L is part of what a missing result lacks).

    >>> StepCase({"role": "hidden", "fused_add": True}, absent={"role": "hidden"}).matches({"fused_add": True})
    True
    """

    key: Mapping[str, object]
    what: str = ""
    detail: str = ""
    absent: Mapping[str, object] = field(default_factory=dict)
    at_context: bool = False

    def matches(self, shape: Shape) -> bool:
        return all(shape.get(k, self.absent.get(k)) == v for k, v in self.key.items())


class _Unsaid:
    """The default of every fact: a fact left out (``state_bytes=None`` is said, not left out)."""

    def __repr__(self) -> str:
        return "<not declared>"


UNSAID = _Unsaid()


@dataclass(frozen=True, kw_only=True)
class ComponentSpec:
    """Every fact the package needs of one benchmarked component (each field's meaning:
    docs/development.md, "Adding a component").

    ``calls``, ``state_bytes``, ``tokens`` and ``fits`` take a result's ``shape`` record (and its
    ``info``); ``state_bytes`` is None for a collective, whose time the traffic rule does not model;
    ``step_cases`` may be empty where the prediction reads the component its own way (the MoE, by
    the routing the server ran); ``rules`` are matched above every general rule.
    """

    name: str = UNSAID
    group: str = UNSAID
    case: type = UNSAID
    identity: tuple[str, ...] = UNSAID
    per: Per = UNSAID
    parts: tuple[str, ...] = UNSAID
    calls: Callable[[DecodeShapes, Shape], int] = UNSAID
    state_bytes: Callable[[Shape, Shape], int] | None = UNSAID
    tokens: Callable[[Shape], float | None] = UNSAID
    fits: Callable[[DecodeShapes, Shape, Shape], bool] = UNSAID
    launches: int = UNSAID
    step_cases: Callable[[DecodeShapes], tuple[StepCase, ...]] = UNSAID
    rules: tuple[Rule, ...] = ()

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            empty = value is UNSAID or (value is None and f.name != "state_bytes") or value == ""
            if empty or (f.name == "parts" and not value):
                raise RegistryError(f"component {self.name if isinstance(self.name, str) else '?'}: no {f.name}")
        if not isinstance(self.launches, int) or self.launches < 1:
            raise RegistryError(f"component {self.name}: launches is {self.launches!r}, not a positive count")
        if not isinstance(self.per, Per):
            raise RegistryError(f"component {self.name}: per is {self.per!r}, not one of {[p.value for p in Per]}")
        if getattr(self.case, "component", None) != self.name:
            raise RegistryError(f"component {self.name}: its case {self.case.__name__} stores component "
                                f"{getattr(self.case, 'component', None)!r}")
        if "activation_inputs" not in dir(self.case):
            raise RegistryError(f"component {self.name}: its case {self.case.__name__} names no activation_inputs")
        own = {rule.component for rule in self.rules}
        if not own <= set(self.parts):
            raise RegistryError(f"component {self.name}: rules for parts {sorted(own - set(self.parts))} it does not "
                                "own")

    def calls_per_step(self, shapes: DecodeShapes, shape: Shape) -> int:
        """How often one decode step of ``shapes`` runs this component at ``shape`` (a result's shape record)."""
        return self._ask("calls per step", self.calls, shapes, shape)

    def state(self, shape: Shape, info: Shape) -> int:
        """Bytes of one call a decode step reads from memory (RegistryError for a collective)."""
        if self.state_bytes is None:
            raise RegistryError(f"component {self.name}: no state bytes (a collective: the traffic rule does not "
                                "model it)")
        return self._ask("state bytes", self.state_bytes, shape, info)

    def tokens_at(self, shape: Shape) -> float | None:
        return self._ask("token rows", self.tokens, shape)

    def fits_at(self, shapes: DecodeShapes, shape: Shape, info: Shape) -> bool:
        return self._ask("fit", self.fits, shapes, shape, info)

    def _ask(self, fact: str, how: Callable, *args):
        try:
            return how(*args)
        except (KeyError, TypeError) as exc:
            raise RegistryError(f"component {self.name}: {fact}: its shape has no usable {exc}") from None


def tokens_of(shape: Shape) -> float | None:
    """The token count a result was measured at (the dense benchmark stores it as ``M``).

    >>> tokens_of({"M": 4}), tokens_of({"tokens": 2, "M": 4}), tokens_of({})
    (4, 2, None)
    """
    return shape.get("tokens", shape.get("M", shape.get("m")))


@cache
def registered() -> tuple[ComponentSpec, ...]:
    """Every component the modules of :data:`PACKAGES` declare (:func:`discover`)."""
    return discover(PACKAGES)


def discover(packages: tuple[str, ...]) -> tuple[ComponentSpec, ...]:
    """Every module-level :class:`ComponentSpec` of the modules of ``packages``, in module order;
    RegistryError when two declarations share a name."""
    found: dict[str, ComponentSpec] = {}
    for package_name in packages:
        package = importlib.import_module(package_name)
        for module_info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
            module = importlib.import_module(f"{package_name}.{module_info.name}")
            for value in vars(module).values():
                if not isinstance(value, ComponentSpec):
                    continue
                have = found.setdefault(value.name, value)
                if have is not value:
                    raise RegistryError(f"component {value.name} is declared twice (in {module.__name__} and "
                                        "another module)")
    return tuple(found.values())


def get(name: str) -> ComponentSpec:
    """The registered component whose results store ``name``; RegistryError naming it when none does.

    >>> get("rmsnorm").group
    'rmsnorm'
    """
    for spec in registered():
        if spec.name == name:
            return spec
    raise RegistryError(f"component {name!r} is not registered (registered: "
                        f"{', '.join(s.name for s in registered())})")


def calls_per_step(shapes: DecodeShapes, component: str, shape: Shape) -> int:
    """How often one decode step runs ``component`` at ``shape``.

    >>> from decodebench.model import load_model_spec
    >>> from decodebench.shapes import DecodeShapes
    >>> s = DecodeShapes.for_deployment(load_model_spec("kimi-k2.5"), 8)
    >>> calls_per_step(s, "moe", {"stage": "fused"}), calls_per_step(s, "dense_gemm", {"op": "lm_head"})
    (60, 1)
    >>> calls_per_step(s, "rmsnorm", {"role": "hidden", "fused_add": True}), calls_per_step(s, "allreduce", {})
    (122, 123)
    """
    return get(component).calls_per_step(shapes, shape)


def identity(component: str) -> tuple[str, ...]:
    """The shape keys that name ``component``'s case apart from its shape point."""
    return get(component).identity


@cache
def group_parts() -> dict[str, tuple[str, ...]]:
    """Step group -> the profile parts it is compared with, in the breakdown's display order.

    >>> group_parts()["moe"]
    ('moe_gemm', 'moe_glue')
    """
    order = parts()
    groups: dict[str, set[str]] = {}
    for spec in registered():
        groups.setdefault(spec.group, set()).update(spec.parts)
    ordered = sorted(groups.items(), key=lambda item: min(order.index(p) for p in item[1]))
    return {group: tuple(sorted(names, key=order.index)) for group, names in ordered}


@cache
def group_components() -> dict[str, tuple[str, ...]]:
    """Step group -> the components (result ids) it is made of.

    >>> group_components()["dense_gemm"]
    ('dense_gemm', 'router_gemm')
    """
    return {group: tuple(s.name for s in registered() if s.group == group) for group in group_parts()}


def projected_groups() -> tuple[str, ...]:
    """The step groups the traffic rule projects (those with a component that states its state bytes)."""
    return tuple(g for g, names in group_components().items()
                 if any(get(n).state_bytes is not None for n in names))


def part_scaling() -> dict[str, Per]:
    """Profile part -> what its time scales with, for the parts whose components all agree on it.

    >>> part_scaling()["moe_glue"].value, "dense_gemm" in part_scaling()
    ('moe_layer', False)
    """
    pers: dict[str, set[Per]] = {}
    for spec in registered():
        for part in spec.parts:
            pers.setdefault(part, set()).add(spec.per)
    return {part: next(iter(per)) for part, per in pers.items() if len(per) == 1}


def not_benchmarked() -> tuple[str, ...]:
    """The profile parts no registered component's kernels land in, in display order."""
    covered = {p for spec in registered() for p in spec.parts}
    return tuple(p for p in parts() if p not in covered)


def own_rules() -> tuple[Rule, ...]:
    """The kernel-name rules the components bring for parts of their own."""
    return tuple(rule for spec in registered() for rule in spec.rules)
