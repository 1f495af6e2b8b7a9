"""The routed experts of a MoE layer with INT4 weights (W4A16), as Kimi decode runs them.

Each rank holds every routed expert with 1/tp of its intermediate width. One call takes
``M`` tokens, each routed to ``top_k`` distinct experts, through
``gate_up (N=2I, K=hidden) -> SiLU(gate) * up -> down (N=hidden, K=I)`` and sums the
``top_k`` results weighted by the router. Case kinds (:class:`MoEStage`): the fused
layer, and each grouped GEMM on its own.

Weights are random values in the checkpoint's own format: compressed-tensors
``pack-quantized`` INT4, symmetric (stored as ``q + 8``, 8 nibbles per int32, low nibble
first, packed along K, N-first), bf16 scales per group of K. They are generated on the
device once per (layout, device) and cached for the session (:func:`expert_weights`).

Backends:

* ``torch``: dequantize the experts the tokens route to, run each expert's GEMMs on
  its rows, SiLU-and-mul, weighted sum; in bf16. The same code in float32, grouping
  the tokens itself, is the reference.
* ``vllm``: the weights turned into Marlin layout the way vLLM's loader does
  (``gptq_marlin_moe_repack`` + ``marlin_moe_permute_scales``), then
  ``fused_marlin_moe``, the kernel vLLM 0.32 selects for this layer on SM120. Every vLLM
  function is bound to the installed signature once (:class:`Binding`); a parameter
  that moved is a :class:`VllmApiMismatch` naming it. Before timing it is also checked
  on ``check_experts`` experts, so several tokens share each expert. vLLM has no public
  per-GEMM entry point, so the GEMM-only cases skip for it; the CPU build has no
  W4A16 MoE kernel, so every ``vllm`` case skips there.

Routing (:class:`RoutingDistribution`) sets how many distinct experts one call reads,
which is most of its bytes. A case's assignment pattern is fixed; each seed relabels
the experts at random. So the experts touched are fresh per seed while their number,
hence :meth:`MoECase.traffic`, is exact for every seed.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from typing import ClassVar

import torch
import torch.nn.functional as F

from ..errors import BackendUnavailable, ShapeError
from ..hardware import vllm_version
from ..model import QuantSpec
from ..roofline import Traffic
from ..shapes import DecodeShapes, GemmShape, Sweep
from .base import Inputs, KernelCase, require_op, require_vllm_ops
from .binding import Binding, VllmApiMismatch

__all__ = [
    "Binding",
    "ExpertGroups",
    "ExpertLayout",
    "ExpertWeights",
    "MarlinApi",
    "MoECase",
    "MoENotApplicable",
    "MoEStage",
    "RoutingDistribution",
    "VllmApiMismatch",
    "dequantize",
    "expert_layout",
    "expert_weights",
    "group_by_expert",
    "marlin_api",
    "marlin_weights",
    "moe_cases",
    "random_expert_weights",
    "routing_pattern",
    "run_experts",
    "unpack_int4",
]

BITS = 4  # the only width this module packs, dequantizes and hands to Marlin
_PACK = 32 // BITS  # values per int32
_BIAS = 1 << (BITS - 1)  # symmetric int4 is stored as q + 8 (vLLM's uint4b8)
_BF16_BYTES = 2
_FP32_BYTES = 4
_ID_BYTES = 4  # int32 expert ids, as vLLM's routers return them
_INT4_STD = math.sqrt((16**2 - 1) / 12)  # std of q uniform on -8..7
_WEIGHT_SEED = 20250131  # weights are the same in every session on a device
_PATTERN_SEED = 0  # the assignment pattern of a case is the same in every session
# Skewed routing: a hot set of 2 * top_k experts takes 3/4 of each token's slots.
_HOT_EXPERTS_PER_SLOT = 2
_HOT_SLOT_SHARE = 0.75
# Experts dequantized per step: one keeps the temporaries in cache on a CPU; on a GPU a
# few dozen cut the kernel count, at ~11 MB of bf16 weights per Kimi expert.
_DEQUANT_CHUNK = {"cpu": 1}
_DEQUANT_CHUNK_DEFAULT = 32
_MARLIN_GROUP_SIZES = (32, 64, 128)


class MoEStage(str, Enum):
    FUSED = "fused"  # gate_up -> SiLU-and-mul -> down -> weighted sum over top_k
    GATE_UP = "gate_up"  # the first grouped GEMM alone: [M, top_k, 2I]
    DOWN = "down"  # the second grouped GEMM alone: [M, top_k, hidden], unweighted


class RoutingDistribution(str, Enum):
    UNIFORM = "uniform"  # each token: top_k distinct experts, uniformly at random
    SKEWED = "skewed"  # a few hot experts take most slots: fewer distinct experts read


# --- the weights ----------------------------------------------------------------------


@dataclass(frozen=True)
class ExpertLayout:
    """One rank's routed experts: how many, their two GEMMs, the quantization group."""

    experts: int
    gate_up: GemmShape  # n = 2 * intermediate, k = hidden
    down: GemmShape  # n = hidden, k = intermediate
    group_size: int

    def __post_init__(self):
        if self.experts < 1 or self.group_size < 1:
            raise ShapeError(f"experts ({self.experts}) and group size ({self.group_size}) must be positive")
        if self.gate_up.k != self.down.n or self.gate_up.n != 2 * self.down.k:
            raise ShapeError(f"gate_up {self.gate_up} and down {self.down} are not one gated MLP "
                             "(need gate_up.k == down.n and gate_up.n == 2 * down.k)")
        for name, gemm in (("gate_up", self.gate_up), ("down", self.down)):
            if gemm.k % self.group_size or gemm.k % _PACK:
                raise ShapeError(f"{name} K = {gemm.k} is not divisible by the group size {self.group_size} "
                                 f"and the pack factor {_PACK}")

    @property
    def hidden(self) -> int:
        return self.gate_up.k

    @property
    def intermediate(self) -> int:
        return self.down.k

    def gemm_bytes(self, gemm: GemmShape) -> int:
        """Stored bytes of one expert's weight for ``gemm``: packed INT4 plus bf16 group scales.

        >>> ExpertLayout(384, GemmShape(512, 7168), GemmShape(7168, 256), 32).gemm_bytes(GemmShape(512, 7168))
        2064384
        """
        return gemm.n * gemm.k * BITS // 8 + gemm.n * (gemm.k // self.group_size) * _BF16_BYTES


@dataclass(frozen=True, eq=False)
class ExpertWeights:
    """Routed experts in the checkpoint's format (compressed-tensors pack-quantized, N-first)."""

    layout: ExpertLayout
    w13_packed: torch.Tensor  # [E, 2I, hidden / 8] int32; rows [0, I) gate, [I, 2I) up
    w13_scale: torch.Tensor  # [E, 2I, hidden / group] bf16
    w2_packed: torch.Tensor  # [E, hidden, I / 8] int32
    w2_scale: torch.Tensor  # [E, hidden, I / group] bf16


def random_expert_weights(layout: ExpertLayout, device, seed: int) -> ExpertWeights:
    """Random INT4 experts of ``layout`` generated on ``device``.

    Every int32 holds 8 random nibbles. Scales are positive and sized so that a
    unit-variance input gives roughly unit-variance GEMM outputs (never zeros).

    >>> w = random_expert_weights(ExpertLayout(2, GemmShape(64, 32), GemmShape(32, 32), 16), "cpu", 0)
    >>> tuple(w.w13_packed.shape), tuple(w.w2_scale.shape)
    ((2, 64, 4), (2, 32, 2))
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    w13, s13 = _random_quantized(layout.experts, layout.gate_up, layout.group_size, gen, device)
    w2, s2 = _random_quantized(layout.experts, layout.down, layout.group_size, gen, device)
    return ExpertWeights(layout, w13, s13, w2, s2)


def _random_quantized(experts: int, gemm: GemmShape, group: int, gen, device):
    packed = torch.randint(-(2**31), 2**31, (experts, gemm.n, gemm.k // _PACK),
                           dtype=torch.int32, generator=gen, device=device)
    unit = 1.0 / (_INT4_STD * math.sqrt(gemm.k))
    scale = torch.rand(experts, gemm.n, gemm.k // group, generator=gen, device=device) + 0.5
    return packed, (scale * unit).to(torch.bfloat16)


@functools.lru_cache(maxsize=4)
def expert_weights(layout: ExpertLayout, device: str) -> ExpertWeights:
    """The session's random experts of ``layout`` on ``device`` (generated once: ~1 GB at Kimi TP 8).

    >>> layout = ExpertLayout(2, GemmShape(64, 32), GemmShape(32, 32), 16)
    >>> expert_weights(layout, "cpu") is expert_weights(layout, "cpu")
    True
    """
    return random_expert_weights(layout, torch.device(device), _WEIGHT_SEED)


@functools.cache
def _nibble_pairs(device: str) -> torch.Tensor:
    """For each byte value, its two nibbles as bf16 ``q - 8`` (low first), viewed as one int32."""
    byte = torch.arange(256)
    pairs = torch.stack(((byte & 15) - _BIAS, (byte >> 4) - _BIAS), dim=-1).to(torch.bfloat16)
    return pairs.view(torch.int32).flatten().to(device)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """``[..., n, k/8]`` int32 -> ``[..., n, k]`` bf16 signed values ``q`` in -8..7 (exact in bf16).

    One table lookup per byte: a byte holds two consecutive K positions, low nibble first
    (little-endian, as on every CPU and GPU torch runs on).

    >>> unpack_int4(torch.tensor([[0x76543210]], dtype=torch.int32)).tolist()
    [[-8.0, -7.0, -6.0, -5.0, -4.0, -3.0, -2.0, -1.0]]
    """
    index = packed.contiguous().view(torch.uint8).flatten().to(torch.int32)
    values = _nibble_pairs(str(packed.device)).index_select(0, index).view(torch.bfloat16)
    return values.view(*packed.shape[:-1], packed.shape[-1] * _PACK)


def dequantize(packed: torch.Tensor, scales: torch.Tensor, group_size: int, dtype=torch.bfloat16) -> torch.Tensor:
    """``q * scale`` per group of K: ``[..., n, k/8]`` int32 + ``[..., n, k/group]`` -> ``[..., n, k]``.

    >>> packed = torch.tensor([[0x76543210]], dtype=torch.int32)
    >>> dequantize(packed, torch.tensor([[0.5, 2.0]]), 4, torch.float32).tolist()
    [[-4.0, -3.5, -3.0, -2.5, -8.0, -6.0, -4.0, -2.0]]
    """
    q = unpack_int4(packed).to(dtype)  # a fresh tensor: scaled in place, saving an allocation per expert
    grouped = q.unflatten(-1, (scales.shape[-1], group_size)).mul_(scales.to(dtype).unsqueeze(-1))
    return grouped.flatten(-2)


# --- routing --------------------------------------------------------------------------


def _skew_split(top_k: int, experts: int) -> tuple[int, int]:
    """(hot experts, slots per token that go to them) of the skewed distribution."""
    hot, hot_slots = _HOT_EXPERTS_PER_SLOT * top_k, round(_HOT_SLOT_SHARE * top_k)
    if experts - hot < top_k - hot_slots:
        raise ShapeError(f"skewed routing needs at least {hot + top_k - hot_slots} experts "
                         f"for top_k = {top_k}, the layout has {experts}")
    return hot, hot_slots


def _distinct_draws(rows: int, population: int, count: int, gen) -> torch.Tensor:
    """``count`` distinct values of ``range(population)`` per row, uniformly at random."""
    return torch.rand(rows, population, generator=gen).argsort(dim=1)[:, :count]


@functools.lru_cache(maxsize=256)
def routing_pattern(tokens: int, experts: int, top_k: int, distribution: RoutingDistribution) -> torch.Tensor:
    """The case's expert assignment ``[tokens, top_k]`` (int64, CPU) before relabeling.

    Fixed per case; :meth:`MoECase.make_inputs` relabels the experts per seed. Skewed:
    experts ``0 .. 2*top_k - 1`` are hot and take 3/4 of every token's slots.

    >>> routing_pattern(4, 384, 8, RoutingDistribution.SKEWED)[:, :6].max().item() < 16
    True
    """
    gen = torch.Generator().manual_seed(_PATTERN_SEED)
    if RoutingDistribution(distribution) is RoutingDistribution.UNIFORM:
        return _distinct_draws(tokens, experts, top_k, gen)
    hot, hot_slots = _skew_split(top_k, experts)
    cold = hot + _distinct_draws(tokens, experts - hot, top_k - hot_slots, gen)
    return torch.cat([_distinct_draws(tokens, hot, hot_slots, gen), cold], dim=1)


@dataclass(frozen=True, eq=False)
class ExpertGroups:
    """The rows each touched expert serves: slot ``t * top_k + s`` of token ``t``."""

    index: torch.Tensor  # [touched] int64: the experts, ascending
    slots: tuple[torch.Tensor, ...]  # per expert: its slot numbers (int64)
    tokens: tuple[torch.Tensor, ...]  # per expert: the tokens of those slots

    def __len__(self) -> int:
        return len(self.slots)


def group_by_expert(topk_ids: torch.Tensor) -> ExpertGroups:
    """Group the (token, slot) pairs of ``topk_ids [M, top_k]`` by expert (reads the ids on the host).

    >>> g = group_by_expert(torch.tensor([[3, 1], [1, 0]]))
    >>> g.index.tolist(), [s.tolist() for s in g.slots], [t.tolist() for t in g.tokens]
    ([0, 1, 3], [[3], [1, 2], [0]], [[1], [0, 1], [0]])
    """
    flat = topk_ids.flatten().long()
    order = torch.argsort(flat, stable=True)
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    slots = order.split(counts.tolist())
    top_k = topk_ids.shape[1]
    return ExpertGroups(experts, tuple(slots), tuple(s // top_k for s in slots))


# --- the torch computation (the backend in bf16, the reference in float32) ------------


@dataclass(frozen=True)
class _ExpertBlock:
    slots: torch.Tensor
    tokens: torch.Tensor
    w13: torch.Tensor | None  # [2I, hidden] dequantized
    w2: torch.Tensor | None  # [hidden, I] dequantized


def _expert_blocks(stage: MoEStage, weights: ExpertWeights, groups: ExpertGroups, dtype) -> Iterator[_ExpertBlock]:
    """The touched experts with their rows, dequantized in chunks (only the GEMMs ``stage`` runs)."""
    group = weights.layout.group_size
    chunk = _DEQUANT_CHUNK.get(weights.w13_packed.device.type, _DEQUANT_CHUNK_DEFAULT)
    for start in range(0, len(groups), chunk):
        index = groups.index[start:start + chunk]
        w13 = w2 = None
        if stage is not MoEStage.DOWN:
            w13 = dequantize(weights.w13_packed.index_select(0, index), weights.w13_scale.index_select(0, index),
                             group, dtype)
        if stage is not MoEStage.GATE_UP:
            w2 = dequantize(weights.w2_packed.index_select(0, index), weights.w2_scale.index_select(0, index),
                            group, dtype)
        for j in range(index.numel()):
            yield _ExpertBlock(groups.slots[start + j], groups.tokens[start + j],
                               None if w13 is None else w13[j], None if w2 is None else w2[j])


def run_experts(stage: MoEStage, inputs: Inputs, groups: ExpertGroups, dtype) -> torch.Tensor:
    """The routed experts of ``stage`` in plain torch, computing in ``dtype``.

    Only the experts in ``groups`` are dequantized; each runs its GEMMs on its own rows.
    Fused: ``[M, hidden]``; gate_up: ``[M, top_k, 2I]``; down: ``[M, top_k, hidden]``.

    >>> case = MoECase(MoEStage.FUSED, 2, ExpertLayout(4, GemmShape(64, 32), GemmShape(32, 32), 16), 2,
    ...                RoutingDistribution.UNIFORM, check_experts=4)
    >>> inputs = case.make_inputs(torch.device("cpu"), seed=0)
    >>> run_experts(case.stage, inputs, inputs["groups"], torch.bfloat16).shape
    torch.Size([2, 32])
    """
    stage = MoEStage(stage)
    if stage is MoEStage.FUSED:
        return _fused(inputs, groups, dtype)
    if stage is MoEStage.GATE_UP:
        return _gate_up(inputs, groups, dtype)
    return _down(inputs, groups, dtype)


def _fused(inputs: Inputs, groups: ExpertGroups, dtype) -> torch.Tensor:
    x = inputs["x"].to(dtype)
    router = inputs["topk_weights"].flatten().float()
    total = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # sum of top_k terms in fp32
    for block in _expert_blocks(MoEStage.FUSED, inputs["weights"], groups, dtype):
        gate, up = F.linear(x.index_select(0, block.tokens), block.w13).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, block.w2)
        total.index_add_(0, block.tokens, y.float() * router.index_select(0, block.slots).unsqueeze(1))
    return total.to(dtype)


def _gate_up(inputs: Inputs, groups: ExpertGroups, dtype) -> torch.Tensor:
    x = inputs["x"].to(dtype)
    tokens, top_k = inputs["topk_ids"].shape
    width = inputs["weights"].layout.gate_up.n
    out = torch.empty(tokens * top_k, width, dtype=dtype, device=x.device)
    for block in _expert_blocks(MoEStage.GATE_UP, inputs["weights"], groups, dtype):
        out.index_copy_(0, block.slots, F.linear(x.index_select(0, block.tokens), block.w13))
    return out.view(tokens, top_k, width)


def _down(inputs: Inputs, groups: ExpertGroups, dtype) -> torch.Tensor:
    a = inputs["a"].to(dtype)
    tokens, top_k, _ = a.shape
    rows = a.flatten(0, 1)
    out = torch.empty(tokens * top_k, inputs["weights"].layout.hidden, dtype=dtype, device=a.device)
    for block in _expert_blocks(MoEStage.DOWN, inputs["weights"], groups, dtype):
        out.index_copy_(0, block.slots, F.linear(rows.index_select(0, block.slots), block.w2))
    return out.view(tokens, top_k, -1)


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

    def __post_init__(self):
        object.__setattr__(self, "stage", MoEStage(self.stage))  # accept the plain strings too
        object.__setattr__(self, "routing", RoutingDistribution(self.routing))
        if self.tokens < 1:
            raise ShapeError(f"tokens must be positive, got {self.tokens}")
        if not self.top_k <= self.check_experts <= self.layout.experts:
            raise ShapeError(f"need top_k ({self.top_k}) <= check_experts ({self.check_experts}) "
                             f"<= experts ({self.layout.experts})")
        if self.routing is RoutingDistribution.SKEWED:
            _skew_split(self.top_k, self.check_experts)

    @property
    def id(self) -> str:
        gemms = "-".join(f"n{g.n}k{g.k}" for g in self._gemms())
        return (f"{self.stage.value}-e{self.layout.experts}-top{self.top_k}-g{self.layout.group_size}-"
                f"{gemms}-{self.routing.value}-m{self.tokens}")

    def _gemms(self) -> tuple[GemmShape, ...]:
        layout = self.layout
        return {MoEStage.FUSED: (layout.gate_up, layout.down), MoEStage.GATE_UP: (layout.gate_up,),
                MoEStage.DOWN: (layout.down,)}[self.stage]

    @property
    def distinct_experts(self) -> int:
        """Experts one call reads: the same for every seed (seeds only relabel experts)."""
        return routing_pattern(self.tokens, self.layout.experts, self.top_k, self.routing).unique().numel()

    def shape(self) -> dict[str, object]:
        layout = self.layout
        return {"stage": self.stage.value, "tokens": self.tokens, "experts": layout.experts, "top_k": self.top_k,
                "routing": self.routing.value, "distinct_experts": self.distinct_experts,
                "gate_up_n": layout.gate_up.n, "gate_up_k": layout.gate_up.k,
                "down_n": layout.down.n, "down_k": layout.down.k, "group_size": layout.group_size,
                "weights": f"int{BITS} symmetric (uint4b8), bf16 group scales", "dtype": "bfloat16",
                "check_experts": self.check_experts}

    def traffic(self) -> Traffic:
        """Distinct experts x (packed weights + scales) + activations and routing in; the output out."""
        m, k, hidden = self.tokens, self.top_k, self.layout.hidden
        weights = self.distinct_experts * sum(self.layout.gemm_bytes(g) for g in self._gemms())
        ids = m * k * _ID_BYTES
        flops = 2 * m * k * sum(g.n * g.k for g in self._gemms())
        if self.stage is MoEStage.FUSED:
            inputs = m * hidden * _BF16_BYTES + ids + m * k * _FP32_BYTES
            return Traffic(weights + inputs, m * hidden * _BF16_BYTES, flops)
        gemm = self._gemms()[0]
        inputs = (m if self.stage is MoEStage.GATE_UP else m * k) * gemm.k * _BF16_BYTES + ids
        return Traffic(weights + inputs, m * k * gemm.n * _BF16_BYTES, flops)

    def route(self, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The router's output for ``seed`` on the CPU: ``topk_ids`` (int32) and ``topk_weights`` (fp32).

        The case's pattern with its experts relabeled at random: the same seed gives the
        same ids on every device, and every seed touches ``distinct_experts`` experts.
        The weights are positive and sum to 1 per token, as Kimi's renormalizing router gives.
        """
        gen = torch.Generator().manual_seed(seed)
        pattern = routing_pattern(self.tokens, self.layout.experts, self.top_k, self.routing)
        ids = torch.randperm(self.layout.experts, generator=gen)[pattern].to(torch.int32)
        router = torch.rand(self.tokens, self.top_k, generator=gen) + 0.5
        return ids, router / router.sum(dim=1, keepdim=True)

    def make_inputs(self, device, seed: int) -> Inputs:
        """Activations and router output (fresh per seed) and the session's weights."""
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

    def reference(self, inputs: Inputs) -> torch.Tensor:
        """The same experts in float32, grouping the tokens from ``topk_ids`` itself."""
        return run_experts(self.stage, inputs, group_by_expert(inputs["topk_ids"]), torch.float32)

    def check_variant(self) -> MoECase:
        """This case over ``check_experts`` experts at the same K/N, tokens and routing.

        Fewer experts put several tokens on each, which exercises a kernel's multi-row
        paths; the weights are small enough to build quickly.
        """
        return dataclasses.replace(self, layout=dataclasses.replace(self.layout, experts=self.check_experts))

    def check_variants(self) -> tuple[MoECase, ...]:
        return (self.check_variant(),)

    def kernel(self, backend: str, device):
        if backend == "torch":
            stage = self.stage
            return lambda inp: run_experts(stage, inp, inp["groups"], torch.bfloat16)
        if backend == "vllm":
            return self._vllm_kernel(device)
        raise BackendUnavailable(f"moe has no backend {backend!r}")

    def _vllm_kernel(self, device):
        if self.stage is not MoEStage.FUSED:
            raise BackendUnavailable(
                "vLLM has no public per-GEMM Marlin MoE entry point: ops.moe_wna16_marlin_gemm needs "
                "moe_align_block_size's sorted ids at a block size fused_marlin_moe chooses internally, "
                "which this adapter would have to copy; the fused case times both GEMMs")
        require_vllm_ops(device)
        _require_marlin_kernels(device)
        _require_marlin_shape(self.layout)
        api = marlin_api()
        workspace = api.workspace(device)

        def fused(inp):
            return api.run(inp, marlin_weights(inp["weights"]), workspace)

        return fused


# --- vLLM: bind once against the installed signatures, then call -----------------------


# Old releases take `gating_output` (passed as None) and repack with a `perm` argument
# (an empty [E, 0] tensor); 0.32 has neither, so they are offered but never needed.
FUSED_OFFERS = ("hidden_states", "w1", "w2", "bias1", "bias2", "w1_scale", "w2_scale", "gating_output",
                "topk_weights", "topk_ids", "quant_type_id", "global_num_experts", "workspace")
FUSED_NEEDS = ("hidden_states", "w1", "w2", "w1_scale", "w2_scale", "topk_weights", "topk_ids", "quant_type_id")
REPACK_OFFERS = ("b_q_weight", "perm", "size_k", "size_n", "num_bits")
REPACK_NEEDS = ("b_q_weight", "size_k", "size_n", "num_bits")
SCALES_NEEDS = ("s", "size_k", "size_n", "group_size")
WORKSPACE_OFFERS = ("device", "max_blocks_per_sm")


@dataclass(frozen=True)
class MarlinWeights:
    """Experts in Marlin layout, as vLLM's loader leaves them for ``fused_marlin_moe``."""

    w1: torch.Tensor  # [E, hidden / 16, 2 * 2I] int32
    w2: torch.Tensor  # [E, I / 16, 2 * hidden] int32
    w1_scale: torch.Tensor  # [E, hidden / group, 2I] bf16, permuted
    w2_scale: torch.Tensor  # [E, I / group, hidden] bf16, permuted


@dataclass(frozen=True)
class MarlinApi:
    """The vLLM functions the Marlin path calls, each bound to its installed signature."""

    fused_moe: Binding
    repack: Binding
    permute_scales: Binding
    make_workspace: Binding
    max_blocks_per_sm: int
    quant_type_id: int  # scalar_types.uint4b8: symmetric int4 stored with bias 8

    def workspace(self, device) -> torch.Tensor:
        """Marlin's lock buffer, allocated once (the kernel resets it after each call)."""
        return self.make_workspace(device=device, max_blocks_per_sm=self.max_blocks_per_sm)

    def to_marlin(self, weights: ExpertWeights) -> MarlinWeights:
        """vLLM's loader step: N-first -> K-first, repack the nibbles, permute the scales."""
        layout = weights.layout
        return MarlinWeights(
            self._repacked(weights.w13_packed, layout.gate_up),
            self._repacked(weights.w2_packed, layout.down),
            self._permuted(weights.w13_scale, layout.gate_up, layout.group_size),
            self._permuted(weights.w2_scale, layout.down, layout.group_size),
        )

    def _repacked(self, packed: torch.Tensor, gemm: GemmShape) -> torch.Tensor:
        k_first = packed.transpose(1, 2).contiguous()
        no_perm = torch.empty((packed.shape[0], 0), dtype=torch.int32, device=packed.device)
        return self.repack(b_q_weight=k_first, perm=no_perm, size_k=gemm.k, size_n=gemm.n, num_bits=BITS)

    def _permuted(self, scales: torch.Tensor, gemm: GemmShape, group: int) -> torch.Tensor:
        # vLLM passes size_k = I for w13; size_k only decides group < size_k, true for K too.
        k_first = scales.transpose(1, 2).contiguous()
        return self.permute_scales(s=k_first, size_k=gemm.k, size_n=gemm.n, group_size=group)

    def run(self, inputs: Inputs, marlin: MarlinWeights, workspace: torch.Tensor) -> torch.Tensor:
        """One fused MoE call on ``inputs`` (x, topk_weights, topk_ids) with Marlin weights."""
        return self.fused_moe(
            hidden_states=inputs["x"], w1=marlin.w1, w2=marlin.w2, bias1=None, bias2=None,
            w1_scale=marlin.w1_scale, w2_scale=marlin.w2_scale, gating_output=None,
            topk_weights=inputs["topk_weights"], topk_ids=inputs["topk_ids"],
            quant_type_id=self.quant_type_id, global_num_experts=marlin.w1.shape[0], workspace=workspace)


@functools.cache
def marlin_api() -> MarlinApi:
    """Import vLLM's Marlin MoE functions and bind each to its installed signature (calls none).

    Raises :class:`VllmApiMismatch` naming the parameter or module that moved.
    """
    import vllm._custom_ops as ops
    from vllm.model_executor.layers.quantization.utils import marlin_utils
    from vllm.scalar_type import scalar_types

    return MarlinApi(
        fused_moe=Binding.of(_import_fused_marlin_moe(), offers=FUSED_OFFERS, needs=FUSED_NEEDS,
                             name="fused_marlin_moe"),
        repack=Binding.of(ops.gptq_marlin_moe_repack, offers=REPACK_OFFERS, needs=REPACK_NEEDS),
        permute_scales=Binding.of(marlin_utils.marlin_moe_permute_scales, offers=SCALES_NEEDS, needs=SCALES_NEEDS),
        make_workspace=Binding.of(marlin_utils.marlin_make_workspace_new, offers=WORKSPACE_OFFERS,
                                  needs=("device",)),
        max_blocks_per_sm=getattr(marlin_utils, "MARLIN_MAX_BLOCKS_PER_SM", 4),
        quant_type_id=scalar_types.uint4b8.id,
    )


def _import_fused_marlin_moe() -> Callable:
    modules = ("vllm.model_executor.layers.fused_moe.experts.marlin_moe",  # 0.32
               "vllm.model_executor.layers.fused_moe.fused_marlin_moe")  # older releases
    import importlib

    for module in modules:
        try:
            return importlib.import_module(module).fused_marlin_moe
        except (ImportError, AttributeError):
            continue
    raise VllmApiMismatch(f"vLLM {vllm_version()} has no fused_marlin_moe in {' or '.join(modules)}; "
                          "update decodebench/kernels/moe.py")


@functools.lru_cache(maxsize=4)
def marlin_weights(weights: ExpertWeights) -> MarlinWeights:
    """``weights`` in Marlin layout, converted once per session (like vLLM's weight loading)."""
    return marlin_api().to_marlin(weights)


def _require_marlin_kernels(device) -> None:
    try:
        require_op("_C", "gptq_marlin_repack")
        require_op("_moe_C", "moe_wna16_marlin_gemm")
    except BackendUnavailable as exc:
        why = f"no Marlin W4A16 MoE kernel: {exc}"
        if device.type == "cpu":  # the CPU build's INT4 experts exist, but compute something else
            why += "; vLLM's CPU INT4 MoE quantizes activations to int8 (W4A8), a different computation"
        raise BackendUnavailable(why) from exc


def _require_marlin_shape(layout: ExpertLayout) -> None:
    """The shapes fused_marlin_moe takes without the tile padding vLLM's loader would add."""
    if layout.hidden % 128:
        raise BackendUnavailable(f"Marlin MoE needs hidden % 128 == 0, hidden is {layout.hidden}")
    if layout.intermediate % 64:
        raise BackendUnavailable(f"Marlin MoE needs the intermediate size per rank ({layout.intermediate}) "
                                 "padded to a multiple of 64, which this adapter does not do")
    if layout.group_size not in _MARLIN_GROUP_SIZES:
        raise BackendUnavailable(f"Marlin MoE takes group sizes {_MARLIN_GROUP_SIZES}, not {layout.group_size}")


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

    reason: str

    @property
    def id(self) -> str:
        return "not-int4"

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
    return [
        MoECase(stage, m, layout, shapes.top_k, routing, check_experts)
        for stage in MoEStage
        for routing in RoutingDistribution
        for m in sweep.tokens
    ]
