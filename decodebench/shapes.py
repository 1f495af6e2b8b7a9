"""DecodeShapes: the per-rank shape of every decode bottleneck for one deployment.

One mapping from :class:`~decodebench.model.ModelSpec` fields to per-rank shapes,
with a divisibility check for every split tensor parallelism makes. Benchmarks take
their N, K, heads and message sizes from here and never type them by hand.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

from .errors import ShapeError
from .model import ModelSpec

__all__ = [
    "DecodeShapes",
    "DenseGemm",
    "GemmShape",
    "MLAShape",
    "Sweep",
    "SweepLevel",
    "per_request_shape",
    "sweep_for",
    "token_label",
    "yarn_mscale",
]

BF16_BYTES = 2


@dataclass(frozen=True)
class GemmShape:
    """``out[M, n] = x[M, k] @ W[k, n]`` with the weight split as TP splits it."""

    n: int
    k: int


@dataclass(frozen=True)
class DenseGemm:
    """One bf16 linear of a decode step on one rank: ``out[M, n] = x[M, k] @ W[k, n]``, ``batch`` times
    (per-head batched GEMMs), run ``per_step`` times a step; ``module`` is the checkpoint name it stands for."""

    op: str
    n: int
    k: int
    per_step: int
    module: str
    batch: int = 1


@dataclass(frozen=True)
class MLAShape:
    """Absorbed-MLA decode on one rank: queries and values live in the latent space."""

    heads: int
    kv_lora_rank: int
    rope_dim: int
    nope_dim: int
    v_head_dim: int
    page_size: int
    mscale: float = 1.0  # yarn's attention factor (1 without yarn); the softmax scale carries its square

    @property
    def head_dim(self) -> int:
        """Width of a query/key row in the latent cache (512 + 64 = 576 for Kimi)."""
        return self.kv_lora_rank + self.rope_dim

    @property
    def softmax_scale(self) -> float:
        """``1/sqrt(nope + rope) * mscale**2``, the scale vLLM's DeepSeek-V2 attention uses."""
        return (self.nope_dim + self.rope_dim) ** -0.5 * self.mscale**2


@dataclass(frozen=True)
class DecodeShapes:
    """Per-rank decode shapes of ``spec`` served at tensor parallelism ``tp``.

    >>> from decodebench.model import load_model_spec
    >>> s = DecodeShapes.for_deployment(load_model_spec("kimi-k2.5"), tp=8)
    >>> s.moe_gate_up, s.moe_down
    (GemmShape(n=512, k=7168), GemmShape(n=7168, k=256))
    """

    spec: ModelSpec
    tp: int
    page_size: int = 16

    @classmethod
    def for_deployment(cls, spec: ModelSpec, tp: int, page_size: int = 16) -> DecodeShapes:
        shapes = cls(spec, tp, page_size)
        shapes.validate()
        return shapes

    def validate(self) -> None:
        """Raise :class:`ShapeError` naming the first dimension ``tp`` does not divide."""
        if not isinstance(self.tp, int) or self.tp < 1:
            raise ShapeError(f"tensor parallel size must be a positive integer, got {self.tp!r}")
        spec = self.spec
        _require_divisible("num_attention_heads", spec.num_heads, "tp", self.tp)
        _require_divisible("moe_intermediate_size", spec.moe_intermediate_size, "tp", self.tp)
        _require_divisible("intermediate_size", spec.dense_intermediate_size, "tp", self.tp)
        _require_divisible("vocab_size", spec.vocab_size, "tp", self.tp)
        if spec.quant.group_size:
            group = spec.quant.group_size
            _require_divisible("moe_intermediate_size/tp", self.expert_intermediate, "group_size", group)
            _require_divisible("hidden_size", spec.hidden_size, "group_size", spec.quant.group_size)
        if self.page_size < 1:
            raise ShapeError(f"page size must be positive, got {self.page_size}")

    @property
    def hidden(self) -> int:
        return self.spec.hidden_size

    @property
    def expert_intermediate(self) -> int:
        """Each rank holds every expert with 1/tp of its intermediate width (no EP)."""
        return self.spec.moe_intermediate_size // self.tp

    @property
    def moe_gate_up(self) -> GemmShape:
        return GemmShape(n=2 * self.expert_intermediate, k=self.hidden)

    @property
    def moe_down(self) -> GemmShape:
        return GemmShape(n=self.hidden, k=self.expert_intermediate)

    @property
    def router(self) -> GemmShape:
        """The router GEMM is replicated, not split: hidden -> one logit per expert."""
        return GemmShape(n=self.spec.num_experts, k=self.hidden)

    @property
    def experts(self) -> int:
        return self.spec.num_experts

    @property
    def top_k(self) -> int:
        return self.spec.top_k

    @property
    def mla(self) -> MLAShape:
        spec = self.spec
        return MLAShape(
            heads=spec.num_heads // self.tp,
            kv_lora_rank=spec.kv_lora_rank,
            rope_dim=spec.qk_rope_head_dim,
            nope_dim=spec.qk_nope_head_dim,
            v_head_dim=spec.v_head_dim,
            page_size=self.page_size,
            mscale=yarn_mscale(spec.rope_scaling),
        )

    @property
    def norm_widths(self) -> dict[str, int]:
        """RMSNorm widths of one layer: residual stream, q latent, kv latent."""
        return {
            "hidden": self.hidden,
            "q_lora": self.spec.q_lora_rank,
            "kv_lora": self.spec.kv_lora_rank,
        }

    @property
    def norms_per_step(self) -> dict[tuple[str, bool], int]:
        """RMSNorm calls of one decode step by (role, fused with the residual add).

        Per layer the input and post-attention norms of the residual stream (the very first has
        no residual to add; the final norm has), and the q and kv latent norms.

        >>> from decodebench.model import load_model_spec
        >>> DecodeShapes.for_deployment(load_model_spec("tiny-kimi"), 1).norms_per_step[("hidden", True)]
        4
        """
        layers = self.spec.num_layers
        return {("hidden", True): 2 * layers, ("hidden", False): 1, ("q_lora", False): layers,
                ("kv_lora", False): layers}

    def allreduce_bytes(self, tokens: int) -> int:
        """Bytes of one TP all-reduce message: ``[tokens, hidden]`` in bf16."""
        return tokens * self.hidden * BF16_BYTES

    @property
    def allreduces_per_step(self) -> int:
        """Embedding, then attention output and MLP/MoE output of every layer."""
        return 1 + 2 * self.spec.num_layers if self.tp > 1 else 0

    @property
    def dense_gemms(self) -> tuple[DenseGemm, ...]:
        """The dense linears of one decode step, per rank (MLA absorbed, no EP).

        ``q_a`` is vLLM's ``fused_qkv_a_proj`` (q_a and kv_a in one replicated GEMM); ``uk`` and
        ``uv`` are the absorbed per-head ``W_UK``/``W_UV`` bmm's; the shared expert runs in every
        MoE layer, the dense MLP in the first ``first_k_dense_replace`` layers.

        >>> from decodebench.model import load_model_spec
        >>> [(g.op, g.n, g.k) for g in DecodeShapes.for_deployment(load_model_spec("kimi-k2.5"), 8).dense_gemms][:3]
        [('q_a', 2112, 7168), ('q_b', 1536, 1536), ('o_proj', 7168, 1024)]
        """
        spec, tp, heads = self.spec, self.tp, self.spec.num_heads // self.tp
        shared = spec.moe_intermediate_size * spec.num_shared_experts
        _require_divisible("moe_intermediate_size * n_shared_experts", shared, "tp", tp)
        layers, moe, dense = spec.num_layers, spec.num_moe_layers, spec.first_dense_layers
        attn, mlp, shared_mlp = "model.layers.0.self_attn.", "model.layers.0.mlp.", f"model.layers.{dense}.mlp."
        gemms = [
            DenseGemm("q_a", spec.q_lora_rank + spec.kv_lora_rank + spec.qk_rope_head_dim, self.hidden, layers,
                      attn + "q_a_proj"),
            DenseGemm("q_b", heads * spec.qk_head_dim, spec.q_lora_rank, layers, attn + "q_b_proj"),
            DenseGemm("o_proj", self.hidden, heads * spec.v_head_dim, layers, attn + "o_proj"),
            DenseGemm("uk", spec.kv_lora_rank, spec.qk_nope_head_dim, layers, attn + "kv_b_proj", batch=heads),
            DenseGemm("uv", spec.v_head_dim, spec.kv_lora_rank, layers, attn + "kv_b_proj", batch=heads),
            DenseGemm("shared_gate_up", 2 * shared // tp, self.hidden, moe, shared_mlp + "shared_experts.gate_proj"),
            DenseGemm("shared_down", self.hidden, shared // tp, moe, shared_mlp + "shared_experts.down_proj"),
            DenseGemm("dense_gate_up", 2 * spec.dense_intermediate_size // tp, self.hidden, dense,
                      mlp + "gate_proj"),
            DenseGemm("dense_down", self.hidden, spec.dense_intermediate_size // tp, dense, mlp + "down_proj"),
            DenseGemm("lm_head", spec.vocab_size // tp, self.hidden, 1, "lm_head"),
        ]
        return tuple(g for g in gemms if g.per_step and g.n)  # no shared expert / no dense layer: absent

    def calls_per_step(self, component: str, shape: Mapping) -> int:
        """How often one decode step runs a benchmarked op: ``component`` and the ``shape`` record
        of its result (``extra_info["shape"]``); 0 for what a step does not run.

        >>> from decodebench.model import load_model_spec
        >>> s = DecodeShapes.for_deployment(load_model_spec("kimi-k2.5"), 8)
        >>> s.calls_per_step("moe", {"stage": "fused"}), s.calls_per_step("dense_gemm", {"op": "lm_head"})
        (60, 1)
        >>> s.calls_per_step("rmsnorm", {"role": "hidden", "fused_add": True}), s.calls_per_step("allreduce", {})
        (122, 123)
        """
        moe = self.spec.num_moe_layers
        if component == "rmsnorm":
            return self.norms_per_step.get((shape.get("role", "hidden"), bool(shape.get("fused_add"))), 0)
        if component in ("moe", "routing_topk", "router_gemm"):
            return moe
        if component == "mla_decode":
            return self.spec.num_layers
        if component == "dense_gemm":
            return next((g.per_step for g in self.dense_gemms if g.op == shape.get("op")), 0)
        if component == "allreduce":
            return self.allreduces_per_step
        return 0

    def kv_cache_bytes_per_token(self, dtype_bytes: int = BF16_BYTES) -> int:
        """Latent KV cache of one token in one layer (replicated on every rank without DCP)."""
        return self.mla.head_dim * dtype_bytes


def yarn_mscale(rope_scaling: dict | None) -> float:
    """YaRN's attention-magnitude factor ``0.1 * mscale_all_dim * ln(factor) + 1`` (1 without yarn).

    >>> round(yarn_mscale({"type": "yarn", "factor": 64.0, "mscale_all_dim": 1.0}), 4)
    1.4159
    """
    if not rope_scaling or rope_scaling.get("rope_type", rope_scaling.get("type")) not in ("yarn", "deepseek_yarn"):
        return 1.0
    factor = float(rope_scaling["factor"])
    if factor <= 1:
        return 1.0
    return 0.1 * float(rope_scaling.get("mscale_all_dim") or 0.0) * math.log(factor) + 1.0


def _require_divisible(what: str, value: int, by_name: str, by: int) -> None:
    if value % by:
        raise ShapeError(f"{what} = {value} is not divisible by {by_name} = {by}")


class SweepLevel(str, Enum):
    SMOKE = "smoke"
    NIGHTLY = "nightly"
    FULL = "full"


@dataclass(frozen=True)
class Sweep:
    """The shape points a sweep level visits: decode tokens M and context lengths L.

    ``per_request`` > 1 (``--verify-tokens``, K + 1) makes it a sweep of speculative verification
    steps: ``tokens`` are then requests, each with ``per_request`` query tokens, so a token-wise
    op runs at ``step_tokens`` = requests x (K + 1) and MLA at ``per_request`` queries per request.

    >>> sweep_for("smoke", per_request=3).step_tokens
    (3, 24)
    """

    level: SweepLevel
    tokens: tuple[int, ...]
    contexts: tuple[int, ...]
    per_request: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.per_request, int) or self.per_request < 1:
            raise ShapeError(f"tokens per request must be a positive integer, got {self.per_request!r}")

    @property
    def step_tokens(self) -> tuple[int, ...]:
        """Tokens of one step at each point: requests x tokens per request."""
        return tuple(m * self.per_request for m in self.tokens)


def per_request_shape(per_request: int) -> dict[str, int]:
    """What a verification-step case adds to its stored shape (nothing for a decode step).

    >>> per_request_shape(1), per_request_shape(3)
    ({}, {'per_request': 3})
    """
    return {} if per_request == 1 else {"per_request": per_request}


def token_label(tokens: int, per_request: int = 1) -> str:
    """A case id's token part: ``m192`` for a decode step, ``m64x3`` for 64 requests of 3 tokens each
    (a verification step of 192 tokens, its own id and baseline).

    >>> token_label(8), token_label(192, 3)
    ('m8', 'm64x3')
    """
    if per_request == 1:
        return f"m{tokens}"
    if tokens % per_request:
        raise ShapeError(f"{tokens} tokens are not a whole number of requests of {per_request} tokens")
    return f"m{tokens // per_request}x{per_request}"


_SWEEPS = {
    SweepLevel.SMOKE: Sweep(SweepLevel.SMOKE, tokens=(1, 8), contexts=(256,)),
    SweepLevel.NIGHTLY: Sweep(
        SweepLevel.NIGHTLY,
        tokens=(1, 2, 4, 8, 16, 32, 64, 128, 256),
        contexts=(1024, 8192, 32768, 131072),
    ),
    SweepLevel.FULL: Sweep(
        SweepLevel.FULL,
        tokens=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256),
        contexts=(1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144),
    ),
}


def sweep_for(level: SweepLevel | str, per_request: int = 1) -> Sweep:
    """The :class:`Sweep` of a level name (of verification steps with ``per_request`` > 1).

    >>> sweep_for("smoke").tokens
    (1, 8)
    """
    sweep = _SWEEPS[SweepLevel(level)]
    return sweep if per_request == 1 else Sweep(sweep.level, sweep.tokens, sweep.contexts, per_request)
