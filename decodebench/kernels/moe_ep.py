"""The routed experts of one expert-parallel rank: whole experts, the step's tokens, vLLM's expert map.

Under expert parallelism (``--ep N``) each of N ranks holds ``experts / N`` whole experts in
vLLM's default linear placement (:class:`~decodebench.shapes.ExpertParallel`) and, with attention
tensor-parallel and no data parallelism, every token of the step: vLLM calls
``fused_marlin_moe`` on all M tokens with their global ids, an ``expert_map`` (global id -> local
id, -1 elsewhere) and ``global_num_experts`` (docs/benchmarks.md, ``test_moe.py`` with ``--ep N``).

A case (:class:`EPMoECase`) times the busiest rank of its fixed routing pattern (the most
distinct local experts, then the most slots): a step waits for its slowest rank. Seeds relabel
the rank's experts among themselves and the others among themselves, so every seed gives the
rank the same slots and distinct experts (and the exact traffic) on fresh experts. Checked like
every MoE case, first on a variant with fewer experts per rank, then at the full shape.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import ShapeError
from ..moe_routing import RoutingDistribution, profile_from_env
from ..roofline import Traffic
from ..shapes import BF16_BYTES, FP32_BYTES, ID_BYTES, DecodeShapes, Sweep
from .base import Inputs
from .experts import ExpertGroups, MoEStage, group_by_expert, run_experts
from .int4 import ExpertLayout, expert_weights
from .moe import MoECase, expert_layout, moe_cases, routing_pattern, synthetic_routings

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["EPMoECase", "busiest_rank", "ep_moe_cases", "local_groups", "moe_benchmark_cases"]



def local_groups(topk_ids: Tensor, expert_map: Tensor) -> ExpertGroups:
    """The (token, slot) pairs of the rank's experts, grouped by local expert id; the slots of
    other ranks' experts (local id -1) are left out.

    >>> import torch
    >>> g = local_groups(torch.tensor([[0, 3], [2, 1]]), torch.tensor([-1, -1, 0, 1]))
    >>> g.index.tolist(), [s.tolist() for s in g.slots], [t.tolist() for t in g.tokens]
    ([0, 1], [[2], [1]], [[1], [0]])
    """
    local = expert_map.to(topk_ids.device).long()[topk_ids.long()]
    every = group_by_expert(local)
    keep = [i for i, expert in enumerate(every.index.tolist()) if expert >= 0]
    return ExpertGroups(every.index[keep], tuple(every.slots[i] for i in keep), tuple(every.tokens[i] for i in keep))


@functools.lru_cache(maxsize=256)
def busiest_rank(pattern_key: tuple, ep: int, local: int) -> int:
    """The rank with the most distinct experts (then slots) in a routing pattern, linear placement."""
    pattern = routing_pattern(*pattern_key)
    ranks = pattern // local
    load = [((pattern[ranks == r]).unique().numel(), int((ranks == r).sum())) for r in range(ep)]
    return max(range(ep), key=lambda r: (load[r], -r))


@dataclass(frozen=True)
class EPMoECase(MoECase):
    """One EP rank's fused MoE call: ``tokens`` tokens, each to ``top_k`` of ``global_experts``;
    ``layout`` holds the rank's ``global_experts / ep`` whole experts."""

    ep: int = 1
    global_experts: int = 0

    def _check_experts(self) -> int:
        if MoEStage(self.stage) is not MoEStage.FUSED:
            raise ShapeError("an expert-parallel MoE case times the fused layer only")
        if self.ep < 1 or self.layout.experts * self.ep != self.global_experts:
            raise ShapeError(f"{self.layout.experts} local experts x ep {self.ep} is not the "
                             f"{self.global_experts} experts of the model")
        if not self.top_k <= self.global_experts:
            raise ShapeError(f"top_k ({self.top_k}) exceeds the experts ({self.global_experts})")
        return self.global_experts

    @property
    def model_experts(self) -> int:
        return self.global_experts

    @property
    def id(self) -> str:
        gemms = "-".join(f"n{g.n}k{g.k}" for g in self._gemms())
        routing = self.routing.value + (f"-l{self.profile.layer}" if self.profile is not None else "")
        return (f"fused-ep{self.ep}-e{self.layout.experts}of{self.global_experts}-top{self.top_k}-"
                f"g{self.layout.group_size}-{gemms}-{routing}-m{self.tokens}")

    @property
    def rank(self) -> int:
        """The rank this case times: the busiest of its pattern."""
        return busiest_rank(self._key(), self.ep, self.layout.experts)

    @property
    def local_ids(self) -> range:
        return range(self.rank * self.layout.experts, (self.rank + 1) * self.layout.experts)

    def _mine(self) -> Tensor:

        pattern = self._pattern()
        return (pattern >= self.local_ids.start) & (pattern < self.local_ids.stop)

    @property
    def distinct_experts(self) -> int:
        """The rank's experts one call reads (the same for every seed)."""
        return self._pattern()[self._mine()].unique().numel()

    @property
    def rank_slots(self) -> int:
        return int(self._mine().sum())

    @property
    def rank_tokens(self) -> int:
        return int(self._mine().any(dim=1).sum())

    def shape(self) -> dict[str, object]:
        mean = self.tokens * self.top_k / self.ep
        return {**super().shape(), "ep": self.ep, "global_experts": self.global_experts,
                "local_experts": self.layout.experts, "placement": "linear", "rank": self.rank,
                "rank_slots": self.rank_slots, "rank_tokens": self.rank_tokens,
                "rank_imbalance": self.rank_slots / mean}

    def traffic(self) -> Traffic:
        """The rank's distinct experts x (packed weights + scales); every token in, with its global ids,
        router weights and the expert map; every token's partial sum out."""
        m, k, hidden = self.tokens, self.top_k, self.layout.hidden
        weights = self.distinct_experts * sum(self.layout.gemm_bytes(g) for g in self._gemms())
        inputs = m * hidden * BF16_BYTES + m * k * (ID_BYTES + FP32_BYTES) + self.global_experts * ID_BYTES
        flops = 2 * self.rank_slots * sum(g.n * g.k for g in self._gemms())
        return Traffic(weights + inputs, m * hidden * BF16_BYTES, flops)

    def expert_map(self) -> Tensor:
        """vLLM's expert map of the rank: global id -> local id, -1 for the other ranks' experts."""
        import torch

        table = torch.full((self.global_experts,), -1, dtype=torch.int32)
        table[self.local_ids.start:self.local_ids.stop] = torch.arange(self.layout.experts, dtype=torch.int32)
        return table

    def route(self, seed: int) -> tuple[Tensor, Tensor]:
        """Global ``topk_ids`` (int32) and ``topk_weights`` (fp32) for ``seed``: the pattern with the
        rank's experts relabeled among themselves and the others among themselves (not for a profile)."""
        import torch

        gen = torch.Generator().manual_seed(seed)
        pattern = self._pattern()
        if self.profile is None:
            labels = torch.arange(self.global_experts)
            mine = torch.tensor(self.local_ids)
            others = torch.tensor([e for e in range(self.global_experts) if e not in self.local_ids],
                                  dtype=torch.long)
            labels[mine] = mine[torch.randperm(mine.numel(), generator=gen)]
            if others.numel():
                labels[others] = others[torch.randperm(others.numel(), generator=gen)]
            pattern = labels[pattern]
        router = torch.rand(self.tokens, self.top_k, generator=gen) + 0.5
        return pattern.to(torch.int32), router / router.sum(dim=1, keepdim=True)

    def make_inputs(self, device, seed: int) -> Inputs:
        import torch

        gen = torch.Generator(device=device).manual_seed(seed)
        ids, router = self.route(seed)
        ids, table = ids.to(device), self.expert_map().to(device)
        x = torch.randn((self.tokens, self.layout.hidden), generator=gen, device=device).to(torch.bfloat16)
        return {"x": x, "topk_ids": ids, "topk_weights": router.to(device), "expert_map": table,
                "weights": expert_weights(self.layout, str(device)), "groups": local_groups(ids, table)}

    def reference(self, inputs: Inputs) -> Tensor:
        """The rank's experts in float32 on their slots; tokens with none of them give 0."""
        import torch

        return run_experts(MoEStage.FUSED, inputs, local_groups(inputs["topk_ids"], inputs["expert_map"]),
                           torch.float32)

    def check_variant(self) -> EPMoECase:
        """This case with fewer experts per rank (``ceil(check_experts / ep)``), same K/N, tokens, routing.

        A replayed profile describes all the model's experts, so its variant routes uniformly.
        """
        local = max(1, min(self.layout.experts, math.ceil(self.check_experts / self.ep)))
        local = max(local, math.ceil(self.top_k / self.ep))
        layout = dataclasses.replace(self.layout, experts=local)
        routing = RoutingDistribution.UNIFORM if self.profile is not None else self.routing
        if routing is RoutingDistribution.SKEWED and synthetic_routings(self.top_k, local * self.ep)[1]:
            routing = RoutingDistribution.UNIFORM  # the skewed hot set does not fit so few experts
        return dataclasses.replace(self, layout=layout, global_experts=local * self.ep, routing=routing,
                                   profile=None, profile_source="")

    def timed_part(self, backend: str):
        return None

    def _vllm_kernel(self, device):
        from .marlin import marlin_fused_kernel

        return marlin_fused_kernel(self.layout, device, expert_parallel=True)


def moe_benchmark_cases(shapes: DecodeShapes, sweep: Sweep) -> list:
    """The MoE benchmark's cases: the TP cases (:func:`~decodebench.kernels.moe.moe_cases`) and, with
    ``--ep N``, one EP rank's (:func:`ep_moe_cases`). Joined here, as this module builds on ``moe``."""
    return moe_cases(shapes, sweep) + ep_moe_cases(shapes, sweep)


def ep_moe_cases(shapes: DecodeShapes, sweep: Sweep) -> list[EPMoECase]:
    """One EP rank's fused layer at every token count of ``sweep``, uniform and skewed (and per layer of
    a ``--routing-profile``); none without ``--ep`` or for experts that are not INT4.

    >>> from decodebench.model import load_model_spec
    >>> from decodebench.shapes import sweep_for
    >>> cases = ep_moe_cases(DecodeShapes.for_deployment(load_model_spec("kimi-k2.5"), 8, ep=8), sweep_for("smoke"))
    >>> cases[0].id, cases[0].rank_slots
    ('fused-ep8-e48of384-top8-g32-n4096k7168-n7168k2048-uniform-m1', 2)
    """
    tp_layout = expert_layout(shapes)
    if shapes.ep == 1 or tp_layout is None:
        return []
    ep = shapes.expert_parallel
    layout = ExpertLayout(ep.local_experts, ep.gate_up, ep.down, tp_layout.group_size)
    check = min(ep.experts, 4 * shapes.top_k)  # as the TP cases: several tokens per checked expert
    routings, skipped = synthetic_routings(shapes.top_k, check)
    cases = [EPMoECase(MoEStage.FUSED, m, layout, shapes.top_k, routing, check, ep=ep.ep, global_experts=ep.experts)
             for routing in routings for m in sweep.tokens]
    cases += [dataclasses.replace(case, label=f"ep{ep.ep}-{case.label}") for case in skipped]
    found = profile_from_env()
    if found is not None:
        profile, path = found
        profile.check_fits(shapes.experts, shapes.top_k, shapes.spec.name, path)
        cases += [EPMoECase(MoEStage.FUSED, m, layout, shapes.top_k, RoutingDistribution.PROFILE, check,
                            profile=layer, profile_source=str(path), ep=ep.ep, global_experts=ep.experts)
                  for layer in profile.layers for m in sweep.tokens]
    return cases
