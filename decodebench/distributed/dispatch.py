"""The collectives expert parallelism moves tokens with: dispatch to the experts' ranks, combine back.

vLLM's EP all-to-all backends (``--all2all-backend``, used only when the EP group spans
data-parallel ranks; docs/projection.md lists them) move each token to the ranks holding its
experts and the results back. Two shapes of that traffic are benchmarked here, at EP message
sizes from :class:`~decodebench.shapes.ExpertParallel`, through ``torch.distributed``:

* ``all_to_all``: every rank sends every rank ``pair_tokens x hidden`` bf16 (the expected tokens
  of the step one rank sends one other): an all-to-all backend's dispatch, and its combine;
* ``all_gather`` + ``reduce_scatter``: vLLM's default ``allgather_reducescatter`` backend (NCCL
  only, so it runs over PCIe): dispatch gathers every rank's ``ceil(M / ep)`` tokens to every
  rank, combine sums the ranks' partial outputs and gives each rank its own tokens.

Every chunk carries its source rank, so a chunk sent to or from the wrong rank fails the check;
measured as the all-reduce is (:mod:`.allreduce`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from typing import ClassVar

from ..errors import KernelMismatch, ShapeError
from ..moe_routing import RoutingDistribution
from ..shapes import BF16_BYTES, DecodeShapes, Sweep
from ..timing import Budget, TimerMode
from .agree import from_rank0
from .allreduce import RankMeasurement, collective_info, graphed, measured_on_ranks, nonzero_ints, single_rank_note

__all__ = ["Collective", "DispatchCase", "DispatchJob", "DispatchNotApplicable", "dispatch_cases",
           "dispatch_extra_info", "dispatch_rank", "ep_size_of", "expected_chunks"]

class Collective(str, Enum):
    ALL_TO_ALL = "all_to_all"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"


@dataclass(frozen=True)
class DispatchCase:
    """One EP collective at the step's ``tokens``: ``chunk_tokens`` rows of ``hidden`` bf16 per rank pair
    (all-to-all) or per rank (all-gather in, reduce-scatter out)."""

    component: ClassVar[str] = "ep_dispatch"

    collective: Collective
    tokens: int
    chunk_tokens: int
    hidden: int
    ep: int

    @property
    def id(self) -> str:
        short = {Collective.ALL_TO_ALL: "a2a", Collective.ALL_GATHER: "allgather",
                 Collective.REDUCE_SCATTER: "reducescatter"}[self.collective]
        return f"{short}-ep{self.ep}-m{self.tokens}-c{self.chunk_tokens}x{self.hidden}"

    @property
    def chunk_bytes(self) -> int:
        return self.chunk_tokens * self.hidden * BF16_BYTES

    def message_bytes(self, world: int) -> int:
        """Bytes one rank sends (all-to-all, reduce-scatter) or receives (all-gather) in one call."""
        return self.chunk_bytes * world

    def shape(self) -> dict[str, object]:
        return {"collective": self.collective.value, "tokens": self.tokens, "chunk_tokens": self.chunk_tokens,
                "hidden": self.hidden, "ep": self.ep, "chunk_bytes": self.chunk_bytes, "dtype": "bfloat16"}


def ep_size_of(shapes: DecodeShapes) -> int:
    """The EP size the messages are sized for: ``--ep``, else the TP size EP would replace."""
    return shapes.ep if shapes.ep > 1 else shapes.tp


@dataclass(frozen=True)
class DispatchNotApplicable:
    """The one case of a model whose experts cannot be split over the EP size the messages would be
    sized for: collected, and skipped with ``not_applicable`` before any rank starts."""

    component: ClassVar[str] = "ep_dispatch"

    not_applicable: str

    @property
    def id(self) -> str:
        return "not-applicable"


def dispatch_cases(shapes: DecodeShapes, sweep: Sweep) -> list[DispatchCase | DispatchNotApplicable]:
    """All-to-all, all-gather and reduce-scatter at every token count of ``sweep``, EP message sizes.

    >>> from decodebench.model import load_model_spec
    >>> from decodebench.shapes import sweep_for
    >>> s = DecodeShapes.for_deployment(load_model_spec("kimi-k2.5"), 8, ep=8)
    >>> [c.id for c in dispatch_cases(s, sweep_for("smoke"))][:3]
    ['a2a-ep8-m1-c1x7168', 'allgather-ep8-m1-c1x7168', 'reducescatter-ep8-m1-c1x7168']
    """
    ep = ep_size_of(shapes)
    layout = dataclasses.replace(shapes, ep=ep).expert_parallel
    try:
        layout.validate()
    except ShapeError as exc:
        if shapes.ep > 1:  # --ep was checked when the session started; this is the TP size standing in
            raise
        return [DispatchNotApplicable(f"EP message sizes for ep = tp = {ep} (no --ep given): {exc}")]
    cases = []
    for m in sweep.tokens:
        pair = layout.dispatch_pair_tokens(RoutingDistribution.UNIFORM, m)
        gather = layout.gather_tokens(m)
        cases += [DispatchCase(Collective.ALL_TO_ALL, m, pair, shapes.hidden, ep),
                  DispatchCase(Collective.ALL_GATHER, m, gather, shapes.hidden, ep),
                  DispatchCase(Collective.REDUCE_SCATTER, m, gather, shapes.hidden, ep)]
    return cases


# --- what runs on the ranks ---------------------------------------------------------------------


@dataclass(frozen=True)
class DispatchJob:
    case: DispatchCase
    timer: TimerMode
    budget: Budget
    seed: int


def _base(case: DispatchCase, chunk: int, seed: int, device):
    """Integers in ±1..±4 for chunk ``chunk`` (the same on every rank), never 0."""
    return nonzero_ints((case.chunk_tokens, case.hidden), seed * 1009 + chunk, device)


def make_input(case: DispatchCase, rank: int, world: int, seed: int, device):
    """This rank's input: chunk *j* is ``base_j * (rank + 1)`` (one chunk for an all-gather)."""
    import torch

    chunks = 1 if case.collective is Collective.ALL_GATHER else world
    first = rank if case.collective is Collective.ALL_GATHER else 0
    return torch.cat([_base(case, first + j, seed, device) * (rank + 1) for j in range(chunks)]).to(torch.bfloat16)


def expected_chunks(case: DispatchCase, rank: int, world: int, seed: int, device):
    """What ``rank`` must hold after the collective, in float32.

    >>> import torch
    >>> c = DispatchCase(Collective.REDUCE_SCATTER, 1, 1, 2, 2)
    >>> bool((expected_chunks(c, 0, 2, 0, torch.device("cpu")) == 3 * _base(c, 0, 0, torch.device("cpu"))).all())
    True
    """
    import torch

    if case.collective is Collective.REDUCE_SCATTER:
        return _base(case, rank, seed, device) * (world * (world + 1) / 2)
    if case.collective is Collective.ALL_GATHER:
        return torch.cat([_base(case, r, seed, device) * (r + 1) for r in range(world)])
    return torch.cat([_base(case, rank, seed, device) * (r + 1) for r in range(world)])


def _call(case: DispatchCase, world: int, message):
    """The collective as a zero-argument callable on ``message``, and its output tensor."""
    import torch
    import torch.distributed as dist

    rows = case.chunk_tokens
    if case.collective is Collective.ALL_TO_ALL:
        out = torch.empty_like(message)
        return (lambda: dist.all_to_all_single(out, message)), out
    if case.collective is Collective.ALL_GATHER:
        out = message.new_empty((world * rows, case.hidden))
        return (lambda: dist.all_gather_into_tensor(out, message)), out
    out = message.new_empty((rows, case.hidden))
    return (lambda: dist.reduce_scatter_tensor(out, message)), out


def _check(case: DispatchCase, out, rank: int, world: int, seed: int) -> tuple[float, float]:
    import torch

    expected = expected_chunks(case, rank, world, seed, out.device)
    error = ((out.float() - expected).abs().max() / expected.abs().max()).item()
    tolerance = (world - 1) * 2.0**-8 if case.collective is Collective.REDUCE_SCATTER else 0.0
    if not error <= tolerance or not torch.isfinite(out).all():
        raise KernelMismatch(f"rank {rank}: {case.collective.value} over {world} ranks is off by {error:.3g} "
                             f"relative (tolerance {tolerance:.3g}): a chunk went to or came from the wrong rank; "
                             "the case is not timed")
    return error, tolerance


def dispatch_rank(ctx, job: DispatchJob) -> RankMeasurement:
    """Check the collective, then time it on this rank (a :class:`~decodebench.distributed.procgroup.Job` fn)."""
    with ctx.collective(f"{job.case.collective.value} {job.case.id}"):
        return _check_and_time(ctx, job)


def _check_and_time(ctx, job: DispatchJob) -> RankMeasurement:
    seed = int(from_rank0(ctx, float(job.seed)))
    rank, world, case = ctx.info.rank, ctx.info.world_size, job.case
    message = make_input(case, rank, world, seed, ctx.device)
    run, out = _call(case, world, message)
    run()
    error, tolerance = _check(case, out, rank, world, seed)
    if job.timer is TimerMode.GRAPH:  # the captured call runs on another stream: check its output too
        out.zero_()
        graphed(run)()
        error = max(error, _check(case, out, rank, world, seed)[0])
    return measured_on_ranks(ctx, run, job, (error, tolerance, seed), f"torch.distributed {ctx.backend}")


# --- what the parent records --------------------------------------------------------------------


def dispatch_extra_info(case: DispatchCase, m: RankMeasurement, *, world_size: int, nnodes: int, topology: dict,
                        notes: tuple[str, ...] = ()) -> dict[str, object]:
    """``extra_info`` of one EP collective: the fields of every collective's, and the chunk it moves."""
    nbytes = case.message_bytes(world_size)
    extra_notes = single_rank_note(world_size, "a dispatch")
    if world_size != case.ep:
        extra_notes.append(f"{world_size} ranks measured; the message sizes are those of EP {case.ep}")
    info = collective_info(case, "torch", m, nbytes, world_size=world_size, nnodes=nnodes, topology=topology,
                           timing_seed=m.seed, notes=[*notes, *extra_notes])
    return {**info, "collective": case.collective.value, "chunk_bytes": case.chunk_bytes}
