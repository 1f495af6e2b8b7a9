"""The checkpoint's INT4 expert format: packing, unpacking, dequantizing, random weights.

Kimi-K2.5's routed experts are compressed-tensors ``pack-quantized`` INT4, symmetric
(stored as ``q + 8``, 8 nibbles per int32, low nibble first, packed along K, N-first),
with bf16 scales per group of K. This module holds that format and nothing else: the
random experts every MoE backend reads are generated here, on the device, once per
(layout, device) and cached for the session (:func:`expert_weights`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import ShapeError
from ..shapes import BF16_BYTES, GemmShape

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["BITS", "PACK", "ExpertLayout", "ExpertWeights", "dequantize", "expert_weights", "random_expert_weights",
           "unpack_int4"]

BITS = 4  # the only width this module packs, dequantizes and hands to Marlin
PACK = 32 // BITS  # values per int32
_BIAS = 1 << (BITS - 1)  # symmetric int4 is stored as q + 8 (vLLM's uint4b8)
_INT4_STD = math.sqrt((16**2 - 1) / 12)  # std of q uniform on -8..7
_WEIGHT_SEED = 20250131  # weights are the same in every session on a device

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
            if gemm.k % self.group_size or gemm.k % PACK:
                raise ShapeError(f"{name} K = {gemm.k} is not divisible by the group size {self.group_size} "
                                 f"and the pack factor {PACK}")

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
        return gemm.n * gemm.k * BITS // 8 + gemm.n * (gemm.k // self.group_size) * BF16_BYTES


@dataclass(frozen=True, eq=False)
class ExpertWeights:
    """Routed experts in the checkpoint's format (compressed-tensors pack-quantized, N-first)."""

    layout: ExpertLayout
    w13_packed: Tensor  # [E, 2I, hidden / 8] int32; rows [0, I) gate, [I, 2I) up
    w13_scale: Tensor  # [E, 2I, hidden / group] bf16
    w2_packed: Tensor  # [E, hidden, I / 8] int32
    w2_scale: Tensor  # [E, hidden, I / group] bf16


def random_expert_weights(layout: ExpertLayout, device, seed: int) -> ExpertWeights:
    """Random INT4 experts of ``layout`` generated on ``device``.

    Every int32 holds 8 random nibbles. Scales are positive and sized so that a
    unit-variance input gives roughly unit-variance GEMM outputs (never zeros).

    >>> w = random_expert_weights(ExpertLayout(2, GemmShape(64, 32), GemmShape(32, 32), 16), "cpu", 0)
    >>> tuple(w.w13_packed.shape), tuple(w.w2_scale.shape)
    ((2, 64, 4), (2, 32, 2))
    """
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    w13, s13 = _random_quantized(layout.experts, layout.gate_up, layout.group_size, gen, device)
    w2, s2 = _random_quantized(layout.experts, layout.down, layout.group_size, gen, device)
    return ExpertWeights(layout, w13, s13, w2, s2)


def _random_quantized(experts: int, gemm: GemmShape, group: int, gen, device):
    import torch

    packed = torch.randint(-(2**31), 2**31, (experts, gemm.n, gemm.k // PACK),
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
    import torch

    return random_expert_weights(layout, torch.device(device), _WEIGHT_SEED)


@functools.cache
def _nibble_pairs(device: str) -> Tensor:
    """For each byte value, its two nibbles as bf16 ``q - 8`` (low first), viewed as one int32."""
    import torch

    byte = torch.arange(256)
    pairs = torch.stack(((byte & 15) - _BIAS, (byte >> 4) - _BIAS), dim=-1).to(torch.bfloat16)
    return pairs.view(torch.int32).flatten().to(device)


def unpack_int4(packed: Tensor) -> Tensor:
    """``[..., n, k/8]`` int32 -> ``[..., n, k]`` bf16 signed values ``q`` in -8..7 (exact in bf16).

    One table lookup per byte: a byte holds two consecutive K positions, low nibble first
    (little-endian, as on every CPU and GPU torch runs on).

    >>> import torch
    >>> unpack_int4(torch.tensor([[0x76543210]], dtype=torch.int32)).tolist()
    [[-8.0, -7.0, -6.0, -5.0, -4.0, -3.0, -2.0, -1.0]]
    """
    import torch

    index = packed.contiguous().view(torch.uint8).flatten().to(torch.int32)
    values = _nibble_pairs(str(packed.device)).index_select(0, index).view(torch.bfloat16)
    return values.view(*packed.shape[:-1], packed.shape[-1] * PACK)


def dequantize(packed: Tensor, scales: Tensor, group_size: int, dtype=None) -> Tensor:
    """``q * scale`` per group of K: ``[..., n, k/8]`` int32 + ``[..., n, k/group]`` -> ``[..., n, k]``
    (in ``dtype``, bf16 unless given).

    >>> import torch
    >>> packed = torch.tensor([[0x76543210]], dtype=torch.int32)
    >>> dequantize(packed, torch.tensor([[0.5, 2.0]]), 4, torch.float32).tolist()
    [[-4.0, -3.5, -3.0, -2.5, -8.0, -6.0, -4.0, -2.0]]
    """
    import torch

    dtype = torch.bfloat16 if dtype is None else dtype
    q = unpack_int4(packed).to(dtype)  # a fresh tensor: scaled in place, saving an allocation per expert
    grouped = q.unflatten(-1, (scales.shape[-1], group_size)).mul_(scales.to(dtype).unsqueeze(-1))
    return grouped.flatten(-2)

