"""Tensor-parallel all-reduce of the decode step: ``[M, hidden]`` bf16, summed on every rank.

At TP 8 every decode step runs ``DecodeShapes.allreduces_per_step`` (123 for Kimi-K2.5) of
these; over PCIe they are latency-bound at decode sizes (14 KiB per token). The cases are
the decode messages for every token count of the sweep plus a power-of-two size sweep; the
backends are in :mod:`~decodebench.distributed.communicators`. Measured as nccl-tests does,
through :func:`decodebench.timing.measure` in lock step (docs/multigpu.md, "What is measured,
and how"): the sum checked first, the slowest rank's sample recorded. The EP collectives
(:mod:`.dispatch`) share the measuring and the record.

:func:`allreduce_rank` and everything it calls run inside the rank processes of a
:class:`~decodebench.distributed.procgroup.ProcessGroupPool`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from .. import stats
from ..errors import KernelMismatch
from ..harness import device_telemetry
from ..kernels.base import has_module
from ..registry import ComponentSpec, Per, StepCase, tokens_of
from ..shapes import BF16_BYTES, DecodeShapes, Sweep, SweepLevel
from ..timing import PROFILER_MODES, Budget, Measurement, TimerMode, measure
from .agree import from_rank0, gathered, lockstep
from .communicators import BACKENDS, build_communicator
from .links import LinkMode, link_summary, vllm_would_use

__all__ = ["BACKENDS", "COMPONENT", "AllReduceCase", "AllReduceJob", "RankMeasurement", "allreduce_cases",
           "allreduce_extra_info", "allreduce_rank", "bandwidths", "bus_factor", "check_sum", "collective_timers",
           "graphed", "make_message", "nonzero_ints", "preflight", "timer_note"]

# nccl-tests times 20 calls per sample by default; at least that many amortise the launch
# skew between ranks that a barrier leaves (tens of microseconds).
MIN_CALLS_PER_SAMPLE = 20

# Power-of-two message sizes per sweep level, in bytes (decode sizes come from DecodeShapes).
POW2_BYTES = {
    SweepLevel.SMOKE: (1 << 12, 1 << 20),
    SweepLevel.NIGHTLY: tuple(1 << e for e in range(10, 29, 2)),
    SweepLevel.FULL: tuple(1 << e for e in range(8, 31)),
}


# --- the cases ------------------------------------------------------------------------------


@dataclass(frozen=True)
class AllReduceCase:
    """One message: ``[tokens, hidden]`` bf16 for decode, or ``nbytes`` flat for the size sweep."""

    component: ClassVar[str] = "allreduce"
    activation_inputs: ClassVar[tuple[str, ...]] = ("message",)  # the layer's output, just written

    nbytes: int
    tokens: int | None = None  # None: a point of the power-of-two sweep
    hidden: int | None = None

    @property
    def id(self) -> str:
        if self.tokens is not None:
            return f"m{self.tokens}x{self.hidden}"
        return f"pow2-{_size_name(self.nbytes)}"

    @property
    def elements(self) -> int:
        return self.nbytes // BF16_BYTES

    @property
    def dims(self) -> tuple[int, ...]:
        return (self.tokens, self.hidden) if self.tokens is not None else (self.elements,)

    def shape(self) -> dict[str, object]:
        return {"tokens": self.tokens, "hidden": self.hidden, "elements": self.elements,
                "message_bytes": self.nbytes, "dtype": "bfloat16"}


def _size_name(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift}{unit}"
    return f"{nbytes}B"


def allreduce_cases(shapes: DecodeShapes, sweep: Sweep) -> list[AllReduceCase]:
    """The decode messages at every token count of ``sweep``, then the power-of-two sizes.

    >>> from decodebench.model import load_model_spec
    >>> from decodebench.shapes import sweep_for
    >>> shapes = DecodeShapes.for_deployment(load_model_spec("kimi-k2.5"), 8)
    >>> [(c.id, c.nbytes) for c in allreduce_cases(shapes, sweep_for("smoke"))]
    [('m1x7168', 14336), ('m8x7168', 114688), ('pow2-4KiB', 4096), ('pow2-1MiB', 1048576)]
    """
    decode = [AllReduceCase(shapes.allreduce_bytes(m), m, shapes.hidden) for m in sweep.tokens]
    return decode + [AllReduceCase(nbytes) for nbytes in POW2_BYTES[sweep.level]]


# --- traffic: the nccl-tests formulas -----------------------------------------------------------


def bus_factor(world_size: int) -> float:
    """How much more than the message each rank's busiest link carries: ``2(n-1)/n``.

    >>> bus_factor(8)
    1.75
    """
    return 2 * (world_size - 1) / world_size


def bandwidths(nbytes: int, seconds: float, world_size: int) -> dict[str, float]:
    """nccl-tests' ``algbw = bytes / time`` and ``busbw = algbw * 2(n-1)/n``, in GB/s (1e9).

    >>> bandwidths(1_000_000, 1e-4, 8)
    {'algbw_gbps': 10.0, 'busbw_gbps': 17.5}
    """
    algbw = nbytes / seconds / 1e9 if seconds > 0 else 0.0
    return {"algbw_gbps": algbw, "busbw_gbps": algbw * bus_factor(world_size)}


# --- decisions the parent takes before starting ranks --------------------------------------------


def preflight(backend: str, device_type: str, world_size: int, link_mode: LinkMode = LinkMode.NATIVE) -> str | None:
    """Why ``backend`` cannot run here, known without starting a rank; None if it may.

    >>> preflight("torch", "cpu", 2) is None
    True
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown all-reduce backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "torch":
        return None
    what = "PyNcclCommunicator" if backend == "vllm_pynccl" else "custom all-reduce"
    if not has_module("vllm"):
        return "vLLM is not installed in this environment"
    if device_type != "cuda":
        return f"vLLM's {what} runs on CUDA GPUs; this run is on {device_type}"
    if backend == "vllm_custom" and link_mode is LinkMode.PCIE_ONLY:
        return ("--pcie-only: vLLM's custom all-reduce reads its peers' buffers through CUDA IPC, which "
                "takes NVLink whatever NCCL is told, so it cannot stand in for a PCIe-only box")
    if world_size == 1:
        return f"vLLM does not use its {what} for a single rank (world size 1)"
    return None


def collective_timers(session: TimerMode, device_type: str) -> tuple[TimerMode, ...]:
    """The timers a collective is measured with under the session's ``--timer``.

    On CUDA the default gives two figures: CUDA events around eager calls, and the replay of
    a CUDA graph of the calls (what a decode step captured in a graph pays, as vLLM runs it).

    >>> [t.value for t in collective_timers(TimerMode.KERNEL, "cuda")]
    ['events', 'graph']
    """
    if device_type != "cuda":
        return (TimerMode.WALL,)
    if session in PROFILER_MODES:
        return (TimerMode.EVENTS, TimerMode.GRAPH)
    return (session,)


def timer_note(session: TimerMode, timer: TimerMode) -> str | None:
    """A note for the result when the collective's timer is not the session's.

    >>> timer_note(TimerMode.GRAPH, TimerMode.GRAPH) is None
    True
    """
    if session is timer or session is TimerMode.WALL:
        return None
    return (f"--timer {session.value}: a collective's kernel waits for its peers, so kernel-only time does "
            f"not apply; timed with {timer.value}")


# --- what runs on the ranks -------------------------------------------------------------------


@dataclass(frozen=True)
class AllReduceJob:
    """Everything a rank needs to check and time one case; the same on every rank."""

    case: AllReduceCase
    backend: str
    timer: TimerMode
    budget: Budget
    seed: int


@dataclass(frozen=True)
class RankMeasurement:
    """One rank's answer. The measurement's samples and everything gathered are agreed by
    collectives, so they are the same on every rank; ``own_samples`` are this rank's."""

    measurement: Measurement
    rank_medians: tuple[float, ...]
    check_error: float
    tolerance: float
    seed: int
    library: str
    device: str
    nccl_env: dict
    notes: tuple[str, ...]
    telemetry_before: dict
    telemetry_after: dict
    throttled_ranks: tuple[int, ...]


def allreduce_rank(ctx, job: AllReduceJob) -> RankMeasurement:
    """Check the sum, then time the backend on this rank (a :class:`~decodebench.distributed.procgroup.Job` fn).

    Every step is a collective, so a rank that hangs in here is reported as waiting.
    """
    with ctx.collective(f"{job.backend} all-reduce {job.case.id}"):
        return _check_and_time(ctx, job)


def _check_and_time(ctx, job: AllReduceJob) -> RankMeasurement:
    seed = int(from_rank0(ctx, float(job.seed)))  # one seed everywhere, also across hosts
    rank, world = ctx.info.rank, ctx.info.world_size
    probe = make_message(job.case, rank, seed, ctx.device)
    comm = build_communicator(job.backend, ctx, probe)
    error, tolerance = check_sum(comm.reduce, probe, rank, world)
    if job.timer is TimerMode.GRAPH:  # the graph runs another path (registered buffers): check it too
        again = make_message(job.case, rank, seed, ctx.device)
        replay = graphed(lambda: comm.reduce(again), comm.capture, lambda: comm.reduce(again.clone()))
        error = max(error, check_sum(replay, again, rank, world)[0])
    message = make_message(job.case, rank, seed + 1, ctx.device)
    return measured_on_ranks(ctx, lambda: comm.reduce(message), job, (error, tolerance, seed), comm.library,
                             comm.notes, comm.capture)


def measured_on_ranks(ctx, run: Callable, job, checked: tuple[float, float, int], library: str,
                      notes: tuple[str, ...] = (), capture: Callable = contextlib.nullcontext) -> RankMeasurement:
    """Time a collective checked as ``checked`` (error, tolerance, seed) in lock step with the other ranks
    (samples of at least ``MIN_CALLS_PER_SAMPLE`` calls), with each rank's median and its telemetry."""
    budget = dataclasses.replace(job.budget, min_calls_per_sample=max(MIN_CALLS_PER_SAMPLE,
                                                                      job.budget.min_calls_per_sample))
    before = device_telemetry(ctx.device)
    m = measure(run, mode=job.timer, device=ctx.device, budget=budget, lockstep=lockstep(ctx, capture))
    after = device_telemetry(ctx.device)
    medians = gathered(ctx, stats.median(m.own_samples))
    throttled = gathered(ctx, float(bool(after.get("throttled"))))
    nccl_env = {k: v for k, v in sorted(os.environ.items()) if k.startswith(("NCCL_", "VLLM_ALLREDUCE", "GLOO_"))}
    return RankMeasurement(m, tuple(medians), *checked, library, str(ctx.device), nccl_env, notes, before, after,
                           tuple(r for r, t in enumerate(throttled) if t))


def nonzero_ints(shape: tuple[int, ...], seed: int, device):
    """Integers in ±1..±4, never 0, in float32: sums of up to 10 ranks' multiples stay exact in bf16."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    base = torch.randint(-4, 4, shape, generator=gen, device=device, dtype=torch.int8)
    base[base == 0] = 4
    return base.to(torch.float32)


def make_message(case: AllReduceCase, rank: int, seed: int, device):
    """``(rank + 1) * base`` in bf16, ``base`` the same on every rank: integers in ±1..±4, never 0.

    Integers keep the sum exact in bf16 while every partial sum stays within 256, i.e. up
    to 10 ranks; a reduction that drops, repeats or misplaces any rank's chunk is caught.

    >>> import torch
    >>> make_message(AllReduceCase(8), rank=1, seed=0, device=torch.device("cpu")).abs().min().item() >= 2
    True
    """
    import torch

    return (nonzero_ints(case.dims, seed, device) * (rank + 1)).to(torch.bfloat16)


def check_sum(reduce: Callable, message, rank: int, world_size: int) -> tuple[float, float]:
    """Run ``reduce`` on ``message`` (from :func:`make_message`) and compare with the exact sum.

    Returns ``(relative max error, tolerance)``; raises KernelMismatch when over tolerance.
    The tolerance allows one bf16 rounding per addition; with up to 10 ranks the error is 0.

    >>> import torch
    >>> x = make_message(AllReduceCase(64), rank=0, seed=1, device=torch.device("cpu"))
    >>> check_sum(lambda t: t.mul_(3), x, rank=0, world_size=2)  # 2 ranks: 1x + 2x = 3x
    (0.0, 0.00390625)
    """
    import torch

    expected = message.float() / (rank + 1) * (world_size * (world_size + 1) / 2)
    out = reduce(message)
    if out is None:
        raise KernelMismatch(f"rank {rank}: the all-reduce returned nothing; the case is not timed")
    error = ((out.float() - expected).abs().max() / expected.abs().max()).item()
    tolerance = (world_size - 1) * 2.0**-8
    if not error <= tolerance or not torch.isfinite(out).all():
        raise KernelMismatch(f"rank {rank}: all-reduce sum of {world_size} ranks is off by {error:.3g} relative "
                             f"(tolerance {tolerance:.3g}); the case is not timed")
    return error, tolerance


def graphed(run: Callable, capture: Callable = contextlib.nullcontext, warm: Callable | None = None) -> Callable:
    """``run`` captured in a CUDA graph inside ``capture`` (a communicator's, the way vLLM captures it),
    after ``warm`` (default: ``run``) on the capture's kind of stream, as torch advises; the callable
    returned replays it and returns what ``run`` returned.
    """
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        (warm or run)()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with capture(), torch.cuda.graph(graph, stream=side):
        out = run()

    def replay(*_):
        graph.replay()
        return out

    return replay


# --- what the parent records --------------------------------------------------------------------


def allreduce_extra_info(case: AllReduceCase, backend: str, m: RankMeasurement, *, world_size: int,
                         nnodes: int, shapes: DecodeShapes, topology: dict, link_mode: LinkMode = LinkMode.NATIVE,
                         notes: tuple[str, ...] = ()) -> dict[str, object]:
    """``extra_info`` of one all-reduce benchmark: :func:`collective_info`'s fields, then per-step cost
    and the all-reduce vLLM would use over the link."""
    info = collective_info(case, backend, m, case.nbytes, world_size=world_size, nnodes=nnodes, topology=topology,
                           timing_seed=m.seed + 1, notes=[*notes, *m.notes, *_notes(case, m, world_size, shapes)])
    return {**info, **_per_step(case, shapes, m.measurement.median), "link_mode": link_mode.value,
            "vllm_would_use": vllm_would_use(world_size, case.nbytes, link=info["link"]["link"], mode=link_mode,
                                             nnodes=nnodes).as_dict()}


def collective_info(case, backend: str, m: RankMeasurement, nbytes: int, *, world_size: int, nnodes: int,
                    topology: dict, timing_seed: int, notes: list[str]) -> dict[str, object]:
    """The fields of every collective's ``extra_info``: the core fields every result carries (timer,
    samples, stop reason, precision, reference error, telemetry), traffic, bandwidths, skew and the link."""
    summary = m.measurement.summary()
    median = m.measurement.median
    return {
        "component": case.component, "backend": backend, "case": case.id, "shape": case.shape(), "device": m.device,
        **summary, "reference_error": m.check_error, "tolerance": m.tolerance, "check_seed": m.seed,
        "timing_seed": timing_seed, "telemetry_before": m.telemetry_before, "telemetry_after": m.telemetry_after,
        "message_bytes": nbytes, "tokens": case.tokens, "world_size": world_size, "nnodes": nnodes,
        "library": m.library, "median_s": median, **bandwidths(nbytes, median, world_size),
        **_rank_spread(m.rank_medians), "nccl_env": m.nccl_env, "link": link_summary(topology),
        "topology": topology, "notes": summary["notes"] + notes,
    }


def single_rank_note(world_size: int, figure: str) -> list[str]:
    """The note of a run on one rank: ``figure`` (``an all-reduce``) it is not."""
    return [f"world size 1: nothing crosses a link; a code-path check, not {figure} figure"] if world_size == 1 else []


def _rank_spread(medians: tuple[float, ...]) -> dict[str, object]:
    """Each rank's median, the slowest rank and the largest median over the smallest.

    >>> _rank_spread((2e-5, 3e-5))["slowest_rank"]
    1
    """
    return {"rank_median_s": list(medians), "slowest_rank": max(range(len(medians)), key=medians.__getitem__),
            "rank_skew": max(medians) / min(medians) if min(medians) > 0 else None}


def _per_step(case: AllReduceCase, shapes: DecodeShapes, median: float) -> dict[str, object]:
    per_step = shapes.allreduces_per_step if case.tokens is not None else None
    return {"allreduces_per_step": per_step, "step_allreduce_s": median * per_step if per_step else None}


def _notes(case: AllReduceCase, m: RankMeasurement, world_size: int, shapes: DecodeShapes) -> list[str]:
    notes = single_rank_note(world_size, "an all-reduce")
    if case.tokens is not None and world_size != shapes.tp:
        notes.append(f"{world_size} ranks measured; allreduces_per_step is for TP {shapes.tp}")
    if m.throttled_ranks:
        notes.append(f"GPU clock throttling reported after the measurement on ranks {list(m.throttled_ranks)}")
    return notes


COMPONENT = ComponentSpec(
    name="allreduce", group="allreduce", case=AllReduceCase, identity=("hidden",), per=Per.LAYER,
    parts=("allreduce",),
    calls=lambda shapes, s: shapes.allreduces_per_step,
    state_bytes=None,  # a collective: its time is the link's, which the traffic rule does not model
    tokens=tokens_of,
    # over another number of ranks (a 1-GPU code-path check): not this TP's
    fits=lambda shapes, s, info: info.get("world_size", shapes.tp) == shapes.tp,
    launches=1,
    step_cases=lambda shapes: (StepCase({}),),
)
