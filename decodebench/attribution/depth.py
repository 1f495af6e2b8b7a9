"""From a reduced-depth server (``--server-layers N``) to the model's full depth, and whether it fits.

A server started with ``num_hidden_layers = N`` keeps the real per-layer shapes, so each part of
its step scales with the layers it runs in: a benchmarked part as its component declares
(:class:`decodebench.registry.Per`), rotary, copies and other with all layers, sampling not at
all, and the dense bf16 GEMMs (per-layer projections and the once-per-step lm_head) with the bf16
GEMM weight bytes a step reads (docs/attribution.md, "Reduced-layer runs").
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..kernel_rules import Component, parts
from ..model import ModelSpec
from ..registry import Per, part_scaling
from ..shapes import BF16_BYTES

__all__ = ["DepthScale", "dense_gemm_weight_bytes", "depth_scale", "weight_bytes_per_rank", "with_layers"]

# the parts no benchmark owns that run in every layer (the benchmarked ones scale as their components say)
_PER_LAYER = frozenset({Component.ROTARY.value, Component.COPIES.value, Component.OTHER.value})


def with_layers(spec: ModelSpec, layers: int) -> ModelSpec:
    """``spec`` with ``layers`` decoder layers (what ``--hf-overrides num_hidden_layers`` serves)."""
    if layers < 1:
        raise ValueError(f"a model needs at least 1 layer, got {layers}")
    return replace(spec, num_layers=layers)


def _moe_layers(spec: ModelSpec) -> int:
    return max(0, spec.num_layers - spec.first_dense_layers)


def _dense_layers(spec: ModelSpec) -> int:
    return min(spec.num_layers, spec.first_dense_layers)


def dense_gemm_weight_bytes(spec: ModelSpec, tp: int) -> int:
    """bf16 GEMM weight bytes one rank reads per decode step: projections, absorbed MLA
    up-projections, router, shared experts, dense MLPs and the lm_head.

    >>> from decodebench.model import load_model_spec
    >>> round(dense_gemm_weight_bytes(load_model_spec("kimi-k2.5"), 8) / 2**30, 2)
    4.23
    """
    s = spec
    heads = s.num_heads // tp
    attention = (s.hidden_size * s.q_lora_rank + s.q_lora_rank * heads * s.qk_head_dim
                 + s.hidden_size * (s.kv_lora_rank + s.qk_rope_head_dim)
                 + s.kv_lora_rank * heads * (s.qk_nope_head_dim + s.v_head_dim) + heads * s.v_head_dim * s.hidden_size)
    shared = 3 * s.hidden_size * s.moe_intermediate_size * s.num_shared_experts // tp + s.hidden_size * s.num_experts
    dense_mlp = 3 * s.hidden_size * s.dense_intermediate_size // tp
    lm_head = s.hidden_size * s.vocab_size // tp
    params = s.num_layers * attention + _moe_layers(s) * shared + _dense_layers(s) * dense_mlp + lm_head
    return params * BF16_BYTES


def weight_bytes_per_rank(spec: ModelSpec, tp: int) -> int:
    """All weights one rank holds: routed experts as stored (INT4 + scales), the rest bf16, embedding included.

    >>> from decodebench.model import load_model_spec
    >>> round(weight_bytes_per_rank(load_model_spec("kimi-k2.5"), 8) / 2**30)
    71
    """
    experts = 3 * spec.hidden_size * spec.moe_intermediate_size // tp * spec.num_experts * _moe_layers(spec)
    embedding = spec.hidden_size * spec.vocab_size // tp
    return int(experts * spec.quant.expert_weight_bytes_per_param) + dense_gemm_weight_bytes(spec, tp) \
        + embedding * BF16_BYTES


@dataclass(frozen=True)
class DepthScale:
    """Factors from a measured ``layers``-deep step to ``full_layers`` deep, per component."""

    layers: int
    full_layers: int
    factors: dict[str, float]

    def apply(self, components_us: dict[str, float]) -> dict[str, float]:
        """Component µs of the full-depth step estimated from the measured ones."""
        return {name: us * self.factors.get(name, 1.0) for name, us in components_us.items()}


def depth_scale(full: ModelSpec, layers: int, tp: int) -> DepthScale:
    """How each component of a ``layers``-deep step scales to ``full``'s depth.

    >>> from decodebench.model import load_model_spec
    >>> scale = depth_scale(load_model_spec("kimi-k2.5"), 4, tp=1)
    >>> scale.factors["moe_gemm"], scale.factors["mla_attention"], scale.factors["sampling"]
    (20.0, 15.25, 1.0)
    """
    measured = with_layers(full, layers)
    moe_ratio = _moe_layers(full) / _moe_layers(measured) if _moe_layers(measured) else 0.0
    ratio = {Per.LAYER: full.num_layers / layers, Per.MOE_LAYER: moe_ratio, Per.STEP: 1.0}
    scaling = {**{part: Per.LAYER for part in _PER_LAYER}, **part_scaling()}
    factors = {part: ratio[scaling[part]] if scaling.get(part) in ratio else 1.0 for part in parts()}
    factors[Component.DENSE_GEMM.value] = dense_gemm_weight_bytes(full, tp) / dense_gemm_weight_bytes(measured, tp)
    return DepthScale(layers, full.num_layers, factors)
