"""The routed experts in plain torch: the ``torch`` backend (bf16) and the reference (fp32).

Tokens are grouped by expert (:func:`group_by_expert`); only the experts the tokens route
to are dequantized, in chunks, and each runs its GEMMs on its own rows. The same code in
float32, grouping the tokens itself, is the reference every backend is checked against.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from .base import Inputs
from .int4 import ExpertWeights, dequantize

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["ExpertGroups", "MoEStage", "group_by_expert", "run_experts"]

# Experts dequantized per step: one keeps the temporaries in cache on a CPU; on a GPU a
# few dozen cut the kernel count, at ~11 MB of bf16 weights per Kimi expert.
_DEQUANT_CHUNK = {"cpu": 1}
_DEQUANT_CHUNK_DEFAULT = 32


class MoEStage(str, Enum):
    FUSED = "fused"  # gate_up -> SiLU-and-mul -> down -> weighted sum over top_k
    GATE_UP = "gate_up"  # the first grouped GEMM alone: [M, top_k, 2I]
    DOWN = "down"  # the second grouped GEMM alone: [M, top_k, hidden], unweighted


@dataclass(frozen=True, eq=False)
class ExpertGroups:
    """The rows each touched expert serves: slot ``t * top_k + s`` of token ``t``."""

    index: Tensor  # [touched] int64: the experts, ascending
    slots: tuple[Tensor, ...]  # per expert: its slot numbers (int64)
    tokens: tuple[Tensor, ...]  # per expert: the tokens of those slots

    def __len__(self) -> int:
        return len(self.slots)


def group_by_expert(topk_ids: Tensor) -> ExpertGroups:
    """Group the (token, slot) pairs of ``topk_ids [M, top_k]`` by expert (reads the ids on the host).

    >>> import torch
    >>> g = group_by_expert(torch.tensor([[3, 1], [1, 0]]))
    >>> g.index.tolist(), [s.tolist() for s in g.slots], [t.tolist() for t in g.tokens]
    ([0, 1, 3], [[3], [1, 2], [0]], [[1], [0, 1], [0]])
    """
    import torch

    flat = topk_ids.flatten().long()
    order = torch.argsort(flat, stable=True)
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    slots = order.split(counts.tolist())
    top_k = topk_ids.shape[1]
    return ExpertGroups(experts, tuple(slots), tuple(s // top_k for s in slots))


# --- the torch computation (the backend in bf16, the reference in float32) ------------


@dataclass(frozen=True)
class _ExpertBlock:
    slots: Tensor
    tokens: Tensor
    w13: Tensor | None  # [2I, hidden] dequantized
    w2: Tensor | None  # [hidden, I] dequantized


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


def run_experts(stage: MoEStage, inputs: Inputs, groups: ExpertGroups, dtype) -> Tensor:
    """The routed experts of ``stage`` in plain torch, computing in ``dtype``.

    Only the experts in ``groups`` are dequantized; each runs its GEMMs on its own rows.
    Fused: ``[M, hidden]``; gate_up: ``[M, top_k, 2I]``; down: ``[M, top_k, hidden]``.

    >>> from decodebench.kernels.moe import ExpertLayout, GemmShape, MoECase, RoutingDistribution
    >>> case = MoECase(MoEStage.FUSED, 2, ExpertLayout(4, GemmShape(64, 32), GemmShape(32, 32), 16), 2,
    ...                RoutingDistribution.UNIFORM, check_experts=4)
    >>> import torch
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


def _fused(inputs: Inputs, groups: ExpertGroups, dtype) -> Tensor:
    import torch
    import torch.nn.functional as F

    x = inputs["x"].to(dtype)
    router = inputs["topk_weights"].flatten().float()
    total = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # sum of top_k terms in fp32
    for block in _expert_blocks(MoEStage.FUSED, inputs["weights"], groups, dtype):
        gate, up = F.linear(x.index_select(0, block.tokens), block.w13).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, block.w2)
        total.index_add_(0, block.tokens, y.float() * router.index_select(0, block.slots).unsqueeze(1))
    return total.to(dtype)


def _gate_up(inputs: Inputs, groups: ExpertGroups, dtype) -> Tensor:
    import torch
    import torch.nn.functional as F

    x = inputs["x"].to(dtype)
    tokens, top_k = inputs["topk_ids"].shape
    width = inputs["weights"].layout.gate_up.n
    out = torch.empty(tokens * top_k, width, dtype=dtype, device=x.device)
    for block in _expert_blocks(MoEStage.GATE_UP, inputs["weights"], groups, dtype):
        out.index_copy_(0, block.slots, F.linear(x.index_select(0, block.tokens), block.w13))
    return out.view(tokens, top_k, width)


def _down(inputs: Inputs, groups: ExpertGroups, dtype) -> Tensor:
    import torch
    import torch.nn.functional as F

    a = inputs["a"].to(dtype)
    tokens, top_k, _ = a.shape
    rows = a.flatten(0, 1)
    out = torch.empty(tokens * top_k, inputs["weights"].layout.hidden, dtype=dtype, device=a.device)
    for block in _expert_blocks(MoEStage.DOWN, inputs["weights"], groups, dtype):
        out.index_copy_(0, block.slots, F.linear(rows.index_select(0, block.slots), block.w2))
    return out.view(tokens, top_k, -1)

