"""DecodeShapes: the per-rank shape of every decode bottleneck for one deployment.

One mapping from :class:`~decodebench.model.ModelSpec` fields to per-rank shapes,
with a divisibility check for every split tensor parallelism makes. Benchmarks take
their N, K, heads and message sizes from here and never type them by hand.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from .errors import ShapeError
from .model import ModelSpec

__all__ = ["BF16_BYTES", "DecodeShapes", "DenseGemm", "ExpertParallel", "FP32_BYTES", "GemmShape", "ID_BYTES",
           "KV_CACHE_DTYPES", "KV_DTYPE_BYTES", "KVCacheDtype", "MLAShape", "RankLoad", "Sweep", "SweepLevel",
           "per_request_shape", "sweep_for", "token_label", "yarn_mscale"]

BF16_BYTES, FP32_BYTES, ID_BYTES = 2, 4, 4  # bf16, fp32, and an int32 expert id as vLLM's routers return it
# vLLM's --kv-cache-dtype spellings decodebench runs (CacheDType): "auto" is the model's dtype (bf16 for
# every model here); "fp8" is e4m3 on CUDA, as vLLM reads it there. What each spelling stores, its bytes and
# the rounding of one stored value relative to it (half the spacing of its mantissa; 0: copied as is).
KV_CACHE_DTYPES: dict[str, tuple[str, int, float]] = {
    "auto": ("bfloat16", 2, 0.0),
    "bfloat16": ("bfloat16", 2, 0.0),
    "fp8": ("float8_e4m3fn", 1, 2.0**-4),
    "fp8_e4m3": ("float8_e4m3fn", 1, 2.0**-4),
    "fp8_e5m2": ("float8_e5m2", 1, 2.0**-3),
}

KV_DTYPE_BYTES = {name: size for name, size, _ in KV_CACHE_DTYPES.values()}  # a stored shape's kv_dtype -> bytes


@dataclass(frozen=True)
class KVCacheDtype:
    """The latent KV cache's dtype as the deployment serves it, spelled as vLLM's ``--kv-cache-dtype``.

    >>> fp8 = KVCacheDtype("fp8")
    >>> fp8.torch_name, fp8.bytes, fp8.quantized, fp8.roundoff, fp8.id_suffix
    ('float8_e4m3fn', 1, True, 0.0625, '-kvfp8')
    >>> KVCacheDtype("auto").id_suffix
    ''
    """

    spelling: str = "auto"

    def __post_init__(self) -> None:
        if self.spelling not in KV_CACHE_DTYPES:
            raise ShapeError(f"KV-cache dtype {self.spelling!r} is not one decodebench runs; use one of "
                             f"{', '.join(KV_CACHE_DTYPES)} (vLLM's --kv-cache-dtype spellings)")

    @property
    def torch_name(self) -> str:
        """The torch dtype of one stored value (vLLM allocates fp8 caches as uint8 and views them so)."""
        return KV_CACHE_DTYPES[self.spelling][0]

    @property
    def bytes(self) -> int:
        return KV_CACHE_DTYPES[self.spelling][1]

    @property
    def roundoff(self) -> float:
        """Largest relative error of storing one normal value: 2^-4 for e4m3, 2^-3 for e5m2, 0 for bf16."""
        return KV_CACHE_DTYPES[self.spelling][2]

    @property
    def quantized(self) -> bool:
        return self.roundoff > 0

    @property
    def id_suffix(self) -> str:
        """What a case id adds: nothing for ``auto`` (the ids stored before the option existed)."""
        return "" if self.spelling == "auto" else f"-kv{self.spelling}"

    def torch_dtype(self):
        import torch

        return getattr(torch, self.torch_name)


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
    ep: int = 1  # expert-parallel size (--ep); 1: the experts are split by TP only
    kv_cache_dtypes: tuple[KVCacheDtype, ...] = (KVCacheDtype(),)  # --kv-cache-dtype: the cache's dtypes run

    @classmethod
    def for_deployment(cls, spec: ModelSpec, tp: int, page_size: int = 16, ep: int = 1,
                       kv_cache_dtypes: tuple[str, ...] = ("auto",)) -> DecodeShapes:
        shapes = cls(spec, tp, page_size, ep, tuple(KVCacheDtype(d) for d in kv_cache_dtypes))
        shapes.validate()
        if ep != 1:
            shapes.expert_parallel.validate()
        return shapes

    @property
    def expert_parallel(self) -> ExpertParallel:
        """The routed experts split whole over ``ep`` ranks (:class:`ExpertParallel`).

        >>> from decodebench.model import load_model_spec
        >>> e = DecodeShapes.for_deployment(load_model_spec("kimi-k2.5"), 8, ep=8).expert_parallel
        >>> e.local_experts, e.gate_up, e.down
        (48, GemmShape(n=4096, k=7168), GemmShape(n=7168, k=2048))
        """
        spec = self.spec
        return ExpertParallel(self.ep, spec.num_experts, spec.top_k, spec.hidden_size, spec.moe_intermediate_size,
                              spec.quant.group_size)

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


@dataclass(frozen=True)
class RankLoad:
    """What one expert-parallel rank computes in one MoE call of ``tokens`` tokens (expected values):
    the tokens with at least one of its experts, the (token, expert) slots and its distinct experts."""

    rank: int
    tokens: float
    slots: float
    experts: float


@dataclass(frozen=True)
class ExpertParallel:
    """The routed experts split whole over ``ep`` ranks, as vLLM's ``--enable-expert-parallel`` splits them.

    Placement is vLLM's default (``linear``): rank *r* holds experts ``r*L .. (r+1)*L - 1`` with
    ``L = experts / ep`` local experts, each whole (gate_up N = 2I, K = hidden; down N = hidden,
    K = I). A rank runs its local experts on the slots routed to them; the step waits for the
    busiest rank (:meth:`busiest`).

    >>> e = ExpertParallel(ep=8, experts=384, top_k=8, hidden=7168, intermediate=2048)
    >>> e.local_experts, [round(x, 2) for x in (e.busiest("uniform", 64).slots, e.busiest("skewed", 64).slots)]
    (48, [64.0, 395.13])
    """

    ep: int
    experts: int
    top_k: int
    hidden: int
    intermediate: int
    group_size: int | None = None

    def validate(self) -> None:
        """Raise :class:`ShapeError` naming what ``ep`` does not divide."""
        if not isinstance(self.ep, int) or isinstance(self.ep, bool) or self.ep < 1:
            raise ShapeError(f"expert parallel size must be a positive integer, got {self.ep!r}")
        if self.ep > self.experts:
            raise ShapeError(f"ep = {self.ep} ranks cannot each hold a whole expert of n_routed_experts = "
                             f"{self.experts}")
        _require_divisible("n_routed_experts", self.experts, "ep", self.ep)
        if self.group_size:
            _require_divisible("moe_intermediate_size", self.intermediate, "group_size", self.group_size)

    @property
    def local_experts(self) -> int:
        return self.experts // self.ep

    @property
    def gate_up(self) -> GemmShape:
        return GemmShape(n=2 * self.intermediate, k=self.hidden)

    @property
    def down(self) -> GemmShape:
        return GemmShape(n=self.hidden, k=self.intermediate)

    def local_range(self, rank: int) -> range:
        """The global ids of the experts ``rank`` holds (linear placement)."""
        if not 0 <= rank < self.ep:
            raise ShapeError(f"rank {rank} is outside 0 .. {self.ep - 1}")
        return range(rank * self.local_experts, (rank + 1) * self.local_experts)

    def expected_loads(self, routing, tokens: int, counts: tuple[int, ...] | None = None) -> tuple[RankLoad, ...]:
        """Every rank's expected :class:`RankLoad` for one call of ``tokens`` tokens under ``routing``
        (uniform, skewed; ``counts``: a captured layer's slots per expert, for a replayed profile).

        Slots and distinct experts are exact expectations; the tokens that reach a rank are exact
        for the synthetic pools and, for a profile, take the experts of one token as independent.
        """
        return tuple(self._load(rank, routing, tokens, counts) for rank in range(self.ep))

    def busiest(self, routing, tokens: int, counts: tuple[int, ...] | None = None) -> RankLoad:
        """The rank the step waits for: the most distinct experts to read, then the most slots."""
        return max(self.expected_loads(routing, tokens, counts), key=lambda r: (round(r.experts, 9), r.slots))

    def imbalance(self, routing, tokens: int, counts: tuple[int, ...] | None = None) -> float:
        """The busiest rank's slots over the mean rank's (1.0: balanced).

        >>> e = ExpertParallel(ep=8, experts=384, top_k=8, hidden=7168, intermediate=2048)
        >>> round(e.imbalance("uniform", 64), 3), round(e.imbalance("skewed", 64), 2)
        (1.0, 6.17)
        """
        return self.busiest(routing, tokens, counts).slots / (tokens * self.top_k / self.ep)

    def _load(self, rank: int, routing, tokens: int, counts) -> RankLoad:
        local = self.local_range(rank)
        if counts is not None:
            if len(counts) != self.experts:
                raise ShapeError(f"the routing profile has {len(counts)} experts, the model {self.experts}")
            total = sum(counts)
            chances = [min(1.0, self.top_k * counts[e] / total) for e in local]
            missed = math.prod(1 - p for p in chances)
        else:
            from .moe_routing import slot_pools

            chances, missed = [], 1.0
            for pool in slot_pools(routing, self.experts, self.top_k):
                mine = len(range(max(pool.first, local.start), min(pool.first + pool.count, local.stop)))
                chances += [pool.chance()] * mine
                missed *= math.comb(pool.count - mine, pool.draws) / math.comb(pool.count, pool.draws)
        slots = tokens * math.fsum(chances)
        experts = math.fsum(1 - (1 - p) ** tokens for p in chances)
        return RankLoad(rank, tokens * (1 - missed), slots, experts)

    def dispatch_pair_tokens(self, routing, tokens: int) -> int:
        """Tokens one rank sends one other rank in an all-to-all dispatch (the ``tokens`` of a step
        spread evenly over the ranks, each sent to every rank holding one of its experts), rounded up,
        at least 1: the message of an EP all-to-all per rank pair is this times hidden times 2 bytes.

        >>> kimi = ExpertParallel(ep=8, experts=384, top_k=8, hidden=7168, intermediate=2048)
        >>> kimi.dispatch_pair_tokens("uniform", 256)
        22
        """
        return max(1, math.ceil(self.busiest(routing, tokens).tokens / self.ep))

    def gather_tokens(self, tokens: int) -> int:
        """Tokens each rank contributes to an all-gather dispatch (vLLM's allgather_reducescatter)."""
        return max(1, math.ceil(tokens / self.ep))


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
