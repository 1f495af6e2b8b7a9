"""The routed experts of a MoE layer with INT4 weights (W4A16), as Kimi decode runs them.

Each rank holds every routed expert with 1/tp of its intermediate width. One call takes
``M`` tokens, each routed to ``top_k`` distinct experts, through
``gate_up (N=2I, K=hidden) -> SiLU(gate) * up -> down (N=hidden, K=I)`` and sums the
``top_k`` results weighted by the router. Case kinds (:class:`MoEStage`): the fused
layer, and each grouped GEMM on its own. The weights are random experts in the
checkpoint's format (:mod:`.int4`).

Backends: ``torch`` (:mod:`.experts`, bf16; the same code in float32 is the reference) and
``vllm``: ``fused_marlin_moe`` after vLLM's Marlin repack (:mod:`.marlin`); its GEMM-only cases
are parts of the fused call's kernel trace (:meth:`MoECase.timed_part`; docs/benchmarks.md, "MoE
per GEMM on vLLM"). The CPU build has no W4A16 MoE kernel, so every ``vllm`` case skips there.

Routing (:func:`~decodebench.moe_routing.draw_experts`, as the server's ``skewed`` simulator
draws) sets how many distinct experts one call reads, which is most of its bytes: a case's
pattern is fixed, and each seed relabels its experts (:func:`routing_pattern`), so the traffic is
exact for every seed. ``--routing-profile FILE`` adds the fused layer once per captured layer.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from ..errors import BackendUnavailable, ShapeError
from ..kernel_parts import TimedPart
from ..model import QuantSpec
from ..moe_routing import LayerRouting, RoutingDistribution, draw_experts, profile_from_env, skew_split
from ..registry import ComponentSpec, Per, tokens_of
from ..roofline import Traffic
from ..shapes import BF16_BYTES, FP32_BYTES, ID_BYTES, DecodeShapes, GemmShape, Sweep, per_request_shape, token_label
from .base import Inputs, KernelCase
from .experts import MoEStage, group_by_expert, run_experts
from .int4 import BITS, ExpertLayout, expert_weights
from .marlin import FUSED_MARLIN_PARTS, marlin_fused_kernel

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["COMPONENT", "MoECase", "MoENotApplicable", "MoEStage", "RoutingDistribution", "expert_layout", "moe_cases",
           "routing_pattern"]

_PATTERN_SEED = 0  # the assignment pattern of a case is the same in every session


# --- routing --------------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def routing_pattern(tokens: int, experts: int, top_k: int, distribution: RoutingDistribution,
                    counts: tuple[int, ...] | None = None) -> Tensor:
    """The case's expert assignment ``[tokens, top_k]`` (int64, CPU) before relabeling.

    Fixed per case; :meth:`MoECase.make_inputs` relabels the experts per seed (not for a
    replayed profile). Skewed: experts ``0 .. 2*top_k - 1`` are hot and take 3/4 of every
    token's slots. Profile: drawn with the captured ``counts`` as weights.

    >>> routing_pattern(4, 384, 8, RoutingDistribution.SKEWED)[:, :6].max().item() < 16
    True
    """
    import torch

    gen = torch.Generator().manual_seed(_PATTERN_SEED)
    return draw_experts(tokens, experts, top_k, distribution, weights=counts, generator=gen)


# --- the case -------------------------------------------------------------------------


@dataclass(frozen=True)
class MoECase(KernelCase):
    """The routed experts at one shape point: ``tokens`` tokens, each to ``top_k`` of ``layout.experts``.

    ``check_experts`` is the expert count the vllm backend is also checked on, at the
    same K/N, before it is timed (see :meth:`check_variant`).
    """

    component: ClassVar[str] = "moe"
    # Relative L2 against the fp32 reference. bf16 rounds to 2^-8 relative (~1.5e-3 rms);
    # measured for the bf16 torch backend at Kimi TP 8: ~2.2e-3 per GEMM (weights and
    # output rounded), ~5e-3 fused (four roundings in a row). A real fault (scale layout,
    # nibble order, gate/up swapped, router weights dropped) is 1e-1 or more.
    tolerance: ClassVar[float] = 1e-2

    stage: MoEStage
    tokens: int
    layout: ExpertLayout
    top_k: int
    routing: RoutingDistribution
    check_experts: int
    profile: LayerRouting | None = None  # routing "profile": the captured layer replayed
    profile_source: str = ""  # the routing profile file it came from
    per_request: int = 1  # K + 1 in a speculative verification step (tokens = requests x per_request)

    @property
    def activation_inputs(self) -> tuple[str, ...]:
        """The hidden states (``a`` for the down GEMM alone) and the router's output: the step has
        just written them; the experts' weights and scales are state."""
        return ("a" if self.stage is MoEStage.DOWN else "x", "topk_ids", "topk_weights")

    def __post_init__(self):
        object.__setattr__(self, "stage", MoEStage(self.stage))  # accept the plain strings too
        object.__setattr__(self, "routing", RoutingDistribution(self.routing))
        if self.tokens < 1:
            raise ShapeError(f"tokens must be positive, got {self.tokens}")
        token_label(self.tokens, self.per_request)  # a whole number of requests
        skewed_over = self._check_experts()
        if self.routing is RoutingDistribution.SKEWED:
            skew_split(self.top_k, skewed_over)
        if (self.routing is RoutingDistribution.PROFILE) != (self.profile is not None):
            raise ShapeError("a replayed routing profile needs routing 'profile' and its layer, and only then")
        if self.profile is not None and len(self.profile.counts) != self.model_experts:
            raise ShapeError(f"the routing profile has {len(self.profile.counts)} experts, the model "
                             f"{self.model_experts}")

    def _check_experts(self) -> int:
        """ShapeError where the expert counts do not fit; the experts a skewed routing must fit in."""
        if not self.top_k <= self.check_experts <= self.layout.experts:
            raise ShapeError(f"need top_k ({self.top_k}) <= check_experts ({self.check_experts}) "
                             f"<= experts ({self.layout.experts})")
        return self.check_experts

    @property
    def model_experts(self) -> int:
        """The experts the routing draws from: every one of the layout's."""
        return self.layout.experts

    @property
    def id(self) -> str:
        gemms = "-".join(f"n{g.n}k{g.k}" for g in self._gemms())
        routing = self.routing.value + (f"-l{self.profile.layer}" if self.profile is not None else "")
        return (f"{self.stage.value}-e{self.layout.experts}-top{self.top_k}-g{self.layout.group_size}-"
                f"{gemms}-{routing}-{token_label(self.tokens, self.per_request)}")

    def _key(self) -> tuple:
        counts = self.profile.counts if self.profile is not None else None
        return (self.tokens, self.model_experts, self.top_k, self.routing, counts)

    def _pattern(self) -> Tensor:
        return routing_pattern(*self._key())

    def _gemms(self) -> tuple[GemmShape, ...]:
        layout = self.layout
        return {MoEStage.FUSED: (layout.gate_up, layout.down), MoEStage.GATE_UP: (layout.gate_up,),
                MoEStage.DOWN: (layout.down,)}[self.stage]

    @property
    def distinct_experts(self) -> int:
        """Experts one call reads: the same for every seed (seeds only relabel experts)."""
        return self._pattern().unique().numel()

    def shape(self) -> dict[str, object]:
        layout = self.layout
        return {"stage": self.stage.value, "tokens": self.tokens, "experts": layout.experts, "top_k": self.top_k,
                "routing": self.routing.value, "distinct_experts": self.distinct_experts,
                "gate_up_n": layout.gate_up.n, "gate_up_k": layout.gate_up.k,
                "down_n": layout.down.n, "down_k": layout.down.k, "group_size": layout.group_size,
                "weights": f"int{BITS} symmetric (uint4b8), bf16 group scales", "dtype": "bfloat16",
                "check_experts": self.check_experts,
                **({"layer": self.profile.layer, "profile": self.profile_source,
                    "profile_experts_seen": self.profile.experts_seen} if self.profile is not None else {}),
                **per_request_shape(self.per_request)}

    def traffic(self) -> Traffic:
        """Distinct experts x (packed weights + scales) + activations and routing in; the output out."""
        m, k, hidden = self.tokens, self.top_k, self.layout.hidden
        weights = self.distinct_experts * sum(self.layout.gemm_bytes(g) for g in self._gemms())
        ids = m * k * ID_BYTES
        flops = 2 * m * k * sum(g.n * g.k for g in self._gemms())
        if self.stage is MoEStage.FUSED:
            inputs = m * hidden * BF16_BYTES + ids + m * k * FP32_BYTES
            return Traffic(weights + inputs, m * hidden * BF16_BYTES, flops)
        gemm = self._gemms()[0]
        inputs = (m if self.stage is MoEStage.GATE_UP else m * k) * gemm.k * BF16_BYTES + ids
        return Traffic(weights + inputs, m * k * gemm.n * BF16_BYTES, flops)

    def route(self, seed: int) -> tuple[Tensor, Tensor]:
        """The router's output for ``seed`` on the CPU: ``topk_ids`` (int32) and ``topk_weights`` (fp32).

        The case's pattern with its experts relabeled at random: the same seed gives the
        same ids on every device, and every seed touches ``distinct_experts`` experts.
        The weights are positive and sum to 1 per token, as Kimi's renormalizing router gives.
        """
        import torch

        gen = torch.Generator().manual_seed(seed)
        pattern = self._pattern()
        labels = torch.randperm(self.layout.experts, generator=gen)
        ids = (pattern if self.profile is not None else labels[pattern]).to(torch.int32)
        router = torch.rand(self.tokens, self.top_k, generator=gen) + 0.5
        return ids, router / router.sum(dim=1, keepdim=True)

    def make_inputs(self, device, seed: int) -> Inputs:
        """Activations and router output (fresh per seed) and the session's weights."""
        import torch

        gen = torch.Generator(device=device).manual_seed(seed)
        ids, router = self.route(seed)
        ids = ids.to(device)
        inputs = {
            "topk_ids": ids,
            "topk_weights": router.to(device),
            "weights": expert_weights(self.layout, str(device)),
            "groups": group_by_expert(ids),  # the routing, grouped by expert ahead of the timed call
        }
        if self.stage is MoEStage.DOWN:
            shape = (self.tokens, self.top_k, self.layout.intermediate)
            inputs["a"] = torch.randn(shape, generator=gen, device=device).to(torch.bfloat16)
        else:
            shape = (self.tokens, self.layout.hidden)
            inputs["x"] = torch.randn(shape, generator=gen, device=device).to(torch.bfloat16)
        return inputs

    def reference(self, inputs: Inputs) -> Tensor:
        """The same experts in float32, grouping the tokens from ``topk_ids`` itself."""
        import torch

        return run_experts(self.stage, inputs, group_by_expert(inputs["topk_ids"]), torch.float32)

    def check_variant(self) -> MoECase:
        """This case over ``check_experts`` experts at the same K/N, tokens and routing.

        Fewer experts put several tokens on each, which exercises a kernel's multi-row
        paths; the weights are small enough to build quickly. A replayed profile describes all
        the experts, so its check variant routes uniformly (the check is of the numbers).
        """
        layout = dataclasses.replace(self.layout, experts=self.check_experts)
        if self.profile is not None:
            return dataclasses.replace(self, layout=layout, routing=RoutingDistribution.UNIFORM, profile=None,
                                       profile_source="")
        return dataclasses.replace(self, layout=layout)

    def check_variants(self) -> tuple[MoECase, ...]:
        return (self.check_variant(),)

    def kernel(self, backend: str, device):
        import torch

        if backend == "torch":
            stage = self.stage
            return lambda inp: run_experts(stage, inp, inp["groups"], torch.bfloat16)
        if backend == "vllm":
            return self._vllm_kernel(device)
        raise BackendUnavailable(f"moe has no backend {backend!r}")

    def _vllm_kernel(self, device):
        if self.stage is not MoEStage.FUSED:
            raise BackendUnavailable(
                f"vLLM has no per-GEMM Marlin MoE entry point: the {self.stage.value} figure is a part of the "
                "fused call's kernel trace, which the harness takes through timed_part()")
        return marlin_fused_kernel(self.layout, device)

    def timed_part(self, backend: str) -> TimedPart | None:
        """For vllm's GEMM-only cases: the fused call at this shape, and which of its kernels is this GEMM
        (vLLM has no public per-GEMM entry point: ``moe_wna16_marlin_gemm`` needs the ids sorted at a block
        size ``fused_marlin_moe`` picks inside; docs/benchmarks.md, "MoE per GEMM on vLLM")."""
        if backend != "vllm" or self.stage is MoEStage.FUSED:
            return None
        whole = dataclasses.replace(self, stage=MoEStage.FUSED)
        return TimedPart(whole, self.stage.value, FUSED_MARLIN_PARTS, required=("gate_up", "down"),
                         forbidden=("unexpected_gemm",))


# --- the cases of a deployment --------------------------------------------------------


def expert_layout(shapes: DecodeShapes) -> ExpertLayout | None:
    """One rank's routed experts, or None when the model's experts are not group-quantized INT4.

    >>> from decodebench.model import load_model_spec
    >>> expert_layout(DecodeShapes.for_deployment(load_model_spec("kimi-k2.5"), 8)).gate_up
    GemmShape(n=512, k=7168)
    """
    if not _int4_grouped_experts(shapes.spec.quant, shapes.spec.first_dense_layers):
        return None
    return ExpertLayout(shapes.experts, shapes.moe_gate_up, shapes.moe_down, shapes.spec.quant.group_size)


def _int4_grouped_experts(quant: QuantSpec, first_moe_layer: int) -> bool:
    expert = f"model.layers.{first_moe_layer}.mlp.experts.0.down_proj"
    return (quant.method == "compressed-tensors" and quant.bits == BITS and quant.symmetric
            and bool(quant.group_size) and quant.is_quantized(expert))


@dataclass(frozen=True)
class MoENotApplicable(KernelCase):
    """The one case of a model whose routed experts are not INT4: every backend skips with ``reason``."""

    component: ClassVar[str] = "moe"
    activation_inputs: ClassVar[tuple[str, ...]] = ()  # nothing runs

    reason: str
    label: str = "not-int4"  # the case id: what does not apply

    @property
    def id(self) -> str:
        return self.label

    @property
    def not_applicable(self) -> str:
        """Why the case skips (the plugin skips it before any fixture is set up)."""
        return self.reason

    def shape(self) -> dict[str, object]:
        return {"not_applicable": self.reason}

    def traffic(self) -> Traffic:
        return Traffic(0, 0, 0)

    def make_inputs(self, device, seed: int) -> Inputs:
        raise BackendUnavailable(self.reason)

    def reference(self, inputs: Inputs):
        raise BackendUnavailable(self.reason)

    def kernel(self, backend: str, device):
        raise BackendUnavailable(self.reason)


def moe_cases(shapes: DecodeShapes, sweep: Sweep) -> list[MoECase | MoENotApplicable]:
    """The routed experts (fused, and each GEMM) at every token count of ``sweep``, for both routings.

    A model whose routed experts are not symmetric group-quantized INT4 gets one
    :class:`MoENotApplicable` case, which skips with the reason.

    >>> from decodebench.model import load_model_spec
    >>> from decodebench.shapes import sweep_for
    >>> cases = moe_cases(DecodeShapes.for_deployment(load_model_spec("kimi-k2.5"), 8), sweep_for("smoke"))
    >>> cases[0].id
    'fused-e384-top8-g32-n512k7168-n7168k256-uniform-m1'
    """
    layout = expert_layout(shapes)
    if layout is None:
        quant = shapes.spec.quant
        return [MoENotApplicable(f"{shapes.spec.name}'s routed experts are {quant.method} ({quant.bits} bits), "
                                 "not symmetric group-quantized INT4: the W4A16 MoE benchmark does not apply")]
    # 4 * top_k experts: several tokens per expert and room for the skewed hot set
    check_experts = min(layout.experts, 4 * shapes.top_k)
    routings, skipped = synthetic_routings(shapes.top_k, check_experts)
    cases = [
        MoECase(stage, m, layout, shapes.top_k, routing, check_experts, per_request=sweep.per_request)
        for stage in MoEStage
        for routing in routings
        for m in sweep.step_tokens
    ]
    return cases + skipped + _replayed_cases(shapes, sweep, layout, check_experts)


def synthetic_routings(top_k: int, experts: int) -> tuple[list[RoutingDistribution], list[MoENotApplicable]]:
    """The synthetic routings a layout of ``experts`` can draw, and a skipping case for the one it cannot
    (skewed routing's hot set needs more experts than a small model has).

    >>> routings, skipped = synthetic_routings(7, 7)
    >>> [r.value for r in routings], skipped[0].id
    (['uniform'], 'skewed')
    """
    try:
        skew_split(top_k, experts)
    except ShapeError as exc:
        return [RoutingDistribution.UNIFORM], [MoENotApplicable(f"skewed routing does not apply: {exc}", "skewed")]
    return [RoutingDistribution.UNIFORM, RoutingDistribution.SKEWED], []


def _replayed_cases(shapes: DecodeShapes, sweep: Sweep, layout: ExpertLayout, check_experts: int) -> list[MoECase]:
    """The fused layer once per layer of the session's routing profile (``--routing-profile``), every M."""
    found = profile_from_env()
    if found is None:
        return []
    profile, path = found
    profile.check_fits(shapes.experts, shapes.top_k, shapes.spec.name, path)  # RoutingProfileError
    return [MoECase(MoEStage.FUSED, m, layout, shapes.top_k, RoutingDistribution.PROFILE, check_experts,
                    profile=layer, profile_source=str(path), per_request=sweep.per_request)
            for layer in profile.layers for m in sweep.step_tokens]


def _input_width(shape) -> int:
    """Elements of one token's input rows: the hidden state, or its top_k intermediate rows for the down GEMM."""
    return shape["top_k"] * shape["down_k"] if shape["stage"] == "down" else shape["gate_up_k"]


COMPONENT = ComponentSpec(
    name="moe", group="moe", case=MoECase, identity=("stage", "routing", "experts", "top_k", "layer"),
    per=Per.MOE_LAYER, parts=("moe_gemm", "moe_glue"),
    calls=lambda shapes, s: shapes.spec.num_moe_layers,
    # every byte read but the tokens' input rows: the experts' weights and scales, the routing's ids
    state_bytes=lambda s, info: int(info["bytes_read"]) - s["tokens"] * _input_width(s) * BF16_BYTES,
    tokens=tokens_of,
    fits=lambda shapes, s, info: (s.get("gate_up_n"), s.get("gate_up_k"), s.get("experts")) == (
        shapes.moe_gate_up.n, shapes.moe_gate_up.k, shapes.experts),
    launches=6,  # the fused MoE: 2 GEMMs and their glue
    step_cases=lambda shapes: (),  # the prediction takes the routing the server ran (prediction._moe_terms)
)
