"""Values made the same on every rank, so that every rank takes the same decisions.

Run inside the rank processes of a :class:`~decodebench.distributed.procgroup.ProcessGroupPool`,
over its default group (NCCL tensors on the rank's GPU, gloo on CPU). Every rank must call
each of these in the same order: they are collectives.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from ..timing import Lockstep

__all__ = ["from_rank0", "gathered", "lockstep", "slowest"]


def _tensor(ctx, values: list[float]):
    import torch

    return torch.tensor(values, dtype=torch.float64, device=ctx.device)


def slowest(ctx, values: list[float]) -> list[float]:
    """Element-wise maximum over ranks: sample i of the slowest rank, as nccl-tests' ``-a 3``."""
    import torch.distributed as dist

    tensor = _tensor(ctx, values)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def from_rank0(ctx, value: float) -> float:
    """Rank 0's ``value`` on every rank (seeds, over several hosts too)."""
    import torch.distributed as dist

    tensor = _tensor(ctx, [value])
    dist.broadcast(tensor, src=0)
    return tensor.item()


def gathered(ctx, value: float) -> list[float]:
    """Every rank's ``value``, by rank."""
    import torch.distributed as dist

    mine = _tensor(ctx, [value])
    everyone = [mine.clone() for _ in range(ctx.info.world_size)]
    dist.all_gather(everyone, mine)
    return [t.item() for t in everyone]


def lockstep(ctx, capture: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> Lockstep:
    """The :class:`~decodebench.timing.Lockstep` of this rank: a barrier and the maximum over ranks."""
    import torch.distributed as dist

    return Lockstep(barrier=dist.barrier, slowest=lambda values: slowest(ctx, values), capture=capture)
