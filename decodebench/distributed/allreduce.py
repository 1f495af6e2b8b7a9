"""Tensor-parallel all-reduce of the decode step: ``[M, hidden]`` bf16, summed in place on every rank.

At TP 8 every decode step runs ``DecodeShapes.allreduces_per_step`` (123 for Kimi-K2.5) of
these; over PCIe they are latency-bound at decode sizes (14 KiB per token). The cases are
the decode messages for every token count of the sweep plus a power-of-two size sweep.

Backends:

* ``torch``: ``torch.distributed.all_reduce`` (NCCL on GPUs, gloo on CPU), in place, sum;
* ``vllm_pynccl``: vLLM's ``PyNcclCommunicator`` over a gloo group, in place (what vLLM
  serves TP 8 on PCIe-only GPUs with);
* ``vllm_custom``: vLLM's ``CustomAllreduce``, out of place. vLLM turns it off on more than
  two PCIe-only GPUs; the reason vLLM logs becomes the skip reason.

Measured as nccl-tests does: correctness of the sum first, on data that is never zero;
then samples of many calls each, every sample started by a barrier, timed on the device
(CUDA events or a CUDA graph; the host clock on CPU); the per-sample maximum over ranks
(the slowest rank) is the recorded sample; ``algbw = bytes / time`` and
``busbw = algbw * 2(n-1)/n`` are derived from the median.

The functions named ``*_rank`` and everything they call run inside the rank processes of a
:class:`~decodebench.distributed.procgroup.ProcessGroupPool`; every rank takes the same decisions from
values agreed by a collective, so no rank can loop a different number of times.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import ClassVar

from .. import stats
from ..errors import BackendUnavailable, KernelMismatch
from ..hardware import vllm_version
from ..kernels.base import has_module, require_vllm_module
from ..shapes import BF16_BYTES, DecodeShapes, Sweep, SweepLevel
from ..timing import (
    Budget,
    TimerMode,
    estimate_call_seconds,
    events_sampler,
    graph_sampler,
    synchronizer,
    wall_sampler,
)

__all__ = [
    "BACKENDS",
    "AllReduceCase",
    "AllReduceJob",
    "CollectiveTimer",
    "RankMeasurement",
    "allreduce_cases",
    "allreduce_extra_info",
    "allreduce_rank",
    "bandwidths",
    "bus_factor",
    "check_sum",
    "collective_timer",
    "link_summary",
    "make_message",
    "preflight",
]

BACKENDS = ("torch", "vllm_pynccl", "vllm_custom")

# nccl-tests times 20 calls per sample by default; at least that many amortise the launch
# skew between ranks that a barrier leaves (tens of microseconds).
MIN_CALLS_PER_SAMPLE = 20

# Power-of-two message sizes per sweep level, in bytes (decode sizes come from DecodeShapes).
POW2_BYTES = {
    SweepLevel.SMOKE: (1 << 12, 1 << 20),
    SweepLevel.NIGHTLY: tuple(1 << e for e in range(10, 29, 2)),
    SweepLevel.FULL: tuple(1 << e for e in range(8, 31)),
}

_VLLM_CUSTOM_LOGGER = "vllm.distributed.device_communicators.custom_all_reduce"


# --- the cases ------------------------------------------------------------------------------


@dataclass(frozen=True)
class AllReduceCase:
    """One message: ``[tokens, hidden]`` bf16 for decode, or ``nbytes`` flat for the size sweep."""

    component: ClassVar[str] = "allreduce"

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


def preflight(backend: str, device_type: str, world_size: int) -> str | None:
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
    if world_size == 1:
        return f"vLLM does not use its {what} for a single rank (world size 1)"
    return None


class CollectiveTimer(str, Enum):
    WALL = "wall"  # host clock around the calls, after a synchronize on CUDA
    EVENTS = "events"  # CUDA events around an eager loop of calls
    GRAPH = "graph"  # CUDA events around the replay of a graph of calls


def collective_timer(mode: TimerMode, device_type: str, backend: str) -> tuple[CollectiveTimer, str | None]:
    """How the session's ``--timer`` maps onto a collective, and a note when it differs.

    >>> collective_timer(TimerMode.GRAPH, "cuda", "torch")
    (<CollectiveTimer.GRAPH: 'graph'>, None)
    """
    if device_type != "cuda" or mode is TimerMode.WALL:
        return CollectiveTimer.WALL, None
    if mode is TimerMode.GRAPH and backend != "vllm_custom":
        return CollectiveTimer.GRAPH, None
    if mode is TimerMode.GRAPH:
        return CollectiveTimer.EVENTS, ("vllm_custom is timed eagerly with CUDA events: graph capture "
                                        "with its registered buffers is not implemented here")
    return CollectiveTimer.EVENTS, (f"--timer {mode.value}: collectives are timed with CUDA events around "
                                    "many calls; kernel-only time does not apply (the kernel waits for peers)")


# --- what runs on the ranks -------------------------------------------------------------------


@dataclass(frozen=True)
class AllReduceJob:
    """Everything a rank needs to check and time one case; the same on every rank."""

    case: AllReduceCase
    backend: str
    timer: CollectiveTimer
    budget: Budget
    seed: int


@dataclass(frozen=True)
class RankMeasurement:
    """One rank's answer. ``slowest`` and ``rank_medians`` are agreed by collectives, so they
    are the same on every rank: the per-sample maximum over ranks and each rank's median."""

    slowest: tuple[float, ...]
    rank_medians: tuple[float, ...]
    calls_per_sample: int
    timer: str
    check_error: float
    tolerance: float
    seed: int
    library: str
    nccl_env: dict
    notes: tuple[str, ...]


def allreduce_rank(ctx, job: AllReduceJob) -> RankMeasurement:
    """Check the sum, then time the backend on this rank (a :class:`~decodebench.distributed.procgroup.Job` fn)."""
    seed = int(_agree(ctx, float(job.seed), "broadcast"))  # one seed everywhere, also across hosts
    rank, world = ctx.info.rank, ctx.info.world_size
    probe = make_message(job.case, rank, seed, ctx.device)
    comm = _COMMUNICATORS[job.backend](ctx, probe)
    error, tolerance = check_sum(comm.reduce, probe, rank, world)
    message = make_message(job.case, rank, seed + 1, ctx.device)
    samples, calls = time_collective(lambda: comm.reduce(message), ctx, job.budget, job.timer)
    slowest = _max_over_ranks(ctx, samples)
    medians = _all_gather_float(ctx, stats.median(samples))
    nccl_env = {k: v for k, v in sorted(os.environ.items()) if k.startswith(("NCCL_", "VLLM_ALLREDUCE", "GLOO_"))}
    return RankMeasurement(tuple(slowest), tuple(medians), calls, job.timer.value, error, tolerance, seed,
                           comm.library, nccl_env, comm.notes)


def make_message(case: AllReduceCase, rank: int, seed: int, device):
    """``(rank + 1) * base`` in bf16, ``base`` the same on every rank: integers in ±1..±4, never 0.

    Integers keep the sum exact in bf16 while every partial sum stays within 256, i.e. up
    to 10 ranks; a reduction that drops, repeats or misplaces any rank's chunk is caught.

    >>> import torch
    >>> make_message(AllReduceCase(8), rank=1, seed=0, device=torch.device("cpu")).abs().min().item() >= 2
    True
    """
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    base = torch.randint(-4, 4, case.dims, generator=gen, device=device, dtype=torch.int8)
    base[base == 0] = 4
    return (base.to(torch.float32) * (rank + 1)).to(torch.bfloat16)


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


# --- the distributed measurement recipe -----------------------------------------------------------


def time_collective(op: Callable[[], object], ctx, budget: Budget, timer: CollectiveTimer) -> tuple[list[float], int]:
    """Samples (seconds per call) of ``op`` on this rank, in lock step with every other rank.

    The recipe of :func:`decodebench.timing.measure`, with every count agreed across ranks:
    one call, an estimate (the slowest rank's), warm-up, calls per sample (at least
    ``MIN_CALLS_PER_SAMPLE``) and a sample count sized from ``budget``; each sample starts
    at a barrier. The buffer is summed in place over and over, so its values grow (to inf
    in bf16 after a few dozen calls); sum kernels take the same time whatever the values.
    """
    sync = synchronizer(ctx.device)
    op()
    sync()
    per_call_s = _agree(ctx, _estimate(op, ctx, sync), "max")
    for _ in range(max(1, int(budget.warmup_ms / 1e3 / per_call_s))):
        op()
    sync()
    calls = min(max(math.ceil(budget.sample_ms / 1e3 / per_call_s), MIN_CALLS_PER_SAMPLE),
                max(budget.max_calls_per_sample, MIN_CALLS_PER_SAMPLE))
    count = min(max(int(budget.budget_ms / 1e3 / (calls * per_call_s)), budget.min_samples), budget.max_samples)
    sample = _SAMPLERS[timer](op, ctx.device, calls, sync, before=lambda: _barrier(ctx))
    return [sample() for _ in range(count)], calls


def _barrier(ctx) -> None:
    import torch.distributed as dist

    dist.barrier()


def _estimate(op, ctx, sync) -> float:
    _barrier(ctx)
    return estimate_call_seconds(op, sync)


_SAMPLERS = {
    CollectiveTimer.WALL: wall_sampler,
    CollectiveTimer.EVENTS: events_sampler,
    CollectiveTimer.GRAPH: graph_sampler,
}


def _agree(ctx, value: float, how: str) -> float:
    """``value`` made the same on every rank: the maximum, or rank 0's (``"broadcast"``)."""
    import torch
    import torch.distributed as dist

    tensor = torch.tensor([value], dtype=torch.float64, device=ctx.device)
    if how == "broadcast":
        dist.broadcast(tensor, src=0)
    else:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.item()


def _max_over_ranks(ctx, values: list[float]) -> list[float]:
    """Element-wise maximum over ranks: sample i of the slowest rank, as nccl-tests' ``-a 3``."""
    import torch
    import torch.distributed as dist

    tensor = torch.tensor(values, dtype=torch.float64, device=ctx.device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def _all_gather_float(ctx, value: float) -> list[float]:
    import torch
    import torch.distributed as dist

    mine = torch.tensor([value], dtype=torch.float64, device=ctx.device)
    everyone = [torch.empty_like(mine) for _ in range(ctx.info.world_size)]
    dist.all_gather(everyone, mine)
    return [t.item() for t in everyone]


# --- backends: build once per rank process, then reduce ---------------------------------------


@dataclass(frozen=True)
class _Communicator:
    reduce: Callable  # tensor -> the reduced tensor (the same one where the backend is in place)
    library: str
    notes: tuple[str, ...] = ()


def _torch_communicator(ctx, message) -> _Communicator:
    import torch.distributed as dist

    def reduce(x):
        dist.all_reduce(x)
        return x

    return _Communicator(reduce, f"torch.distributed {ctx.backend}{_nccl_version(ctx)}")


def _nccl_version(ctx) -> str:
    if ctx.backend != "nccl":
        return ""
    import torch

    version = torch.cuda.nccl.version()
    return " " + (".".join(map(str, version)) if isinstance(version, tuple) else str(version))


def _pynccl_communicator(ctx, message) -> _Communicator:
    import torch

    _require_cuda(ctx, "PyNcclCommunicator")
    if "vllm_pynccl" not in ctx.cache:
        module = require_vllm_module("vllm.distributed.device_communicators.pynccl")
        ctx.cache["vllm_pynccl"] = module.PyNcclCommunicator(ctx.cpu_group(), device=ctx.device)
    comm = ctx.cache["vllm_pynccl"]
    if comm.disabled:
        raise BackendUnavailable("vLLM's PyNcclCommunicator disabled itself (world size 1, "
                                 "VLLM_DISABLE_PYNCCL=1, or libnccl could not be loaded)")

    def reduce(x):
        comm.all_reduce(x, out_tensor=x, stream=torch.cuda.current_stream(x.device))
        return x

    return _Communicator(reduce, f"vLLM {vllm_version()} PyNcclCommunicator")


def _custom_communicator(ctx, message) -> _Communicator:
    _require_cuda(ctx, "custom all-reduce")
    if "vllm_custom" not in ctx.cache:
        module = require_vllm_module(_VLLM_CUSTOM_LOGGER)
        with _logged(_VLLM_CUSTOM_LOGGER) as said:
            ctx.cache["vllm_custom"] = module.CustomAllreduce(ctx.cpu_group(), ctx.device)
        ctx.cache["vllm_custom_reason"] = _disable_reason(said)
    custom = ctx.cache["vllm_custom"]
    if custom.disabled:
        raise BackendUnavailable(f"vLLM disabled its custom all-reduce: {ctx.cache['vllm_custom_reason']}")
    if not custom.should_custom_ar(message):
        nbytes = message.numel() * message.element_size()
        raise BackendUnavailable(
            f"vLLM would not use its custom all-reduce for a {nbytes}-byte message (should_custom_ar is "
            f"False: it takes messages under max_size={custom.max_size} bytes, on more than two ranks only "
            "over NVLink); vLLM falls back to PyNccl")
    note = "eager custom all-reduce: each call copies the input into vLLM's registered IPC buffer first"
    return _Communicator(custom.custom_all_reduce, f"vLLM {vllm_version()} CustomAllreduce", (note,))


_COMMUNICATORS = {
    "torch": _torch_communicator,
    "vllm_pynccl": _pynccl_communicator,
    "vllm_custom": _custom_communicator,
}


def _require_cuda(ctx, what: str) -> None:
    if ctx.device.type != "cuda":
        raise BackendUnavailable(f"vLLM's {what} runs on CUDA GPUs; this rank runs on {ctx.device.type}")


@contextlib.contextmanager
def _logged(name: str):
    """The messages ``logging.getLogger(name)`` emits meanwhile: vLLM only logs why it turns
    its custom all-reduce off, and that reason is what a user needs in the skip."""
    messages: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger(name)
    level = logger.level
    if not logger.isEnabledFor(logging.INFO):  # some reasons are logged at INFO only
        logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _disable_reason(messages: list[str]) -> str:
    said = [m for m in messages if "disabled" in m.lower()]
    return (said or messages or ["vLLM logged no reason"])[-1]


# --- what the parent records --------------------------------------------------------------------


def link_summary(topology: dict) -> dict[str, object]:
    """The facts of :func:`decodebench.hardware.nvml_topology` that decide an all-reduce's route.

    >>> link_summary({"available": False, "reason": "nvidia-ml-py is not installed"})["link"]
    'unknown'
    """
    if not topology.get("available"):
        return {"link": "unknown", "reason": topology.get("reason")}
    pairs, gpus = topology.get("pairs", []), topology.get("gpus", [])
    return {
        "link": topology.get("link"),
        "gpus": topology.get("count"),
        "p2p_all_pairs": all(p.get("p2p_read") for p in pairs) if pairs else None,
        "nvlink_pairs": sum(bool(p.get("nvlink")) for p in pairs),
        "pcie": sorted({f"gen{g.get('pcie_gen')} x{g.get('pcie_width')}" for g in gpus}),
    }


def allreduce_extra_info(case: AllReduceCase, backend: str, m: RankMeasurement, *, world_size: int,
                         nnodes: int, shapes: DecodeShapes, topology: dict,
                         notes: tuple[str, ...] = ()) -> dict[str, object]:
    """``extra_info`` of one all-reduce benchmark: traffic, bandwidths, skew, per-step cost, topology."""
    median = stats.median(m.slowest)
    per_step = shapes.allreduces_per_step if case.tokens is not None else None
    notes = list(notes) + list(m.notes)
    if world_size == 1:
        notes.append("world size 1: nothing crosses a link; a code-path check, not an all-reduce figure")
    if per_step is not None and world_size != shapes.tp:
        notes.append(f"{world_size} ranks measured; allreduces_per_step is for TP {shapes.tp}")
    return {
        "component": case.component,
        "backend": backend,
        "case": case.id,
        "shape": case.shape(),
        "message_bytes": case.nbytes,
        "tokens": case.tokens,
        "world_size": world_size,
        "nnodes": nnodes,
        "library": m.library,
        "timer": m.timer,
        "samples": len(m.slowest),
        "calls_per_sample": m.calls_per_sample,
        "median_s": median,
        "median_precision": stats.median_precision(m.slowest),
        "dispersion_iqr": stats.dispersion(m.slowest),
        **bandwidths(case.nbytes, median, world_size),
        "rank_median_s": list(m.rank_medians),
        "rank_skew": max(m.rank_medians) / min(m.rank_medians) if min(m.rank_medians) > 0 else None,
        "allreduces_per_step": per_step,
        "step_allreduce_s": median * per_step if per_step else None,
        "check_error": m.check_error,
        "tolerance": m.tolerance,
        "seed": m.seed,
        "nccl_env": m.nccl_env,
        "link": link_summary(topology),
        "topology": topology,
        "notes": notes,
    }
