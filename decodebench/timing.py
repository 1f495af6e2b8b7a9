"""Every way decodebench times a callable, behind one recipe (:func:`measure`): call once, estimate,
warm up (``Budget.warmup_ms``), size a sample to ``Budget.sample_ms`` of work, then take samples with the
mode's timer until the median is known to ``Budget.target_precision`` (95 % interval half-width over the
median), or the budget or the sample cap runs out (the :class:`StopReason` is kept). What each
:class:`TimerMode` measures: docs/benchmarks.md, Timers. Collectives run the recipe in every rank, kept in
step by a :class:`Lockstep`. Samples are seconds per call; other units appear only in names (``budget_ms``).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from . import stats
from .cupti import KernelTrace, cold_sampler, kernel_sampler, step_sampler

__all__ = [
    "Budget",
    "KernelTrace",
    "Lockstep",
    "Measurement",
    "PROFILER_MODES",
    "StopReason",
    "TimerMode",
    "estimate_call_seconds",
    "events_sampler",
    "graph_sampler",
    "measure",
    "modes_for_device",
    "synchronizer",
    "wall_sampler",
]


class TimerMode(str, Enum):
    WALL = "wall"
    STEP = "step"
    KERNEL = "kernel"
    GRAPH = "graph"
    COLD = "cold"
    EVENTS = "events"


# the timers that read CUPTI's kernel records: kernel-only figures, per-kernel traces
PROFILER_MODES = frozenset({TimerMode.STEP, TimerMode.KERNEL, TimerMode.COLD})


class StopReason(str, Enum):
    CONVERGED = "converged"  # median known to the target precision
    BUDGET = "budget"  # the time budget ran out first
    MAX_SAMPLES = "max_samples"  # the sample cap was reached first


@dataclass(frozen=True)
class Budget:
    """How long to measure and how precisely; times in the unit their name says."""

    warmup_ms: float = 25.0
    budget_ms: float = 2000.0
    sample_ms: float = 0.2
    min_samples: int = 10
    max_samples: int = 500
    target_precision: float = 0.005
    max_calls_per_sample: int = 1000
    min_calls_per_sample: int = 1
    calls_multiple_of: int = 1  # every sample a whole number of this many calls (an injected spin's period)


@dataclass(frozen=True)
class Measurement:
    """Per-call samples (seconds) of one callable and how they were taken."""

    samples: tuple[float, ...]
    mode: TimerMode
    calls_per_sample: int
    stop_reason: StopReason
    wall_s: float
    notes: tuple[str, ...] = field(default=())
    kernels: KernelTrace | None = None  # per-kernel times of one call (kernel and cold timers)
    # every kernel name the timed calls launched -> {"calls": per timed call, "s": seconds per timed
    # call} (kernel and cold timers; also when the calls launched different kernels)
    kernels_by_name: dict[str, dict[str, float]] | None = None
    own_samples: tuple[float, ...] = ()  # under a Lockstep: this rank's samples (``samples`` are the slowest rank's)

    @property
    def median(self) -> float:
        return stats.median(self.samples)

    @property
    def precision(self) -> float:
        return stats.median_precision(self.samples)

    def summary(self) -> dict[str, object]:
        return {
            "timer": self.mode.value,
            "samples": len(self.samples),
            "calls_per_sample": self.calls_per_sample,
            "stop_reason": self.stop_reason.value,
            "median_precision": self.precision,
            "dispersion_iqr": stats.dispersion(self.samples),
            "measure_wall_s": self.wall_s,
            "notes": list(self.notes),
            **({"kernels": self.kernels_by_name} if self.kernels_by_name is not None else {}),
        }


def modes_for_device(device) -> tuple[TimerMode, ...]:
    """Timer modes that can run on ``device`` (a ``torch.device``); the first is the default."""
    if device.type == "cuda":
        return (TimerMode.STEP, TimerMode.KERNEL, TimerMode.GRAPH, TimerMode.COLD, TimerMode.WALL, TimerMode.EVENTS)
    return (TimerMode.WALL,)


@dataclass(frozen=True)
class Lockstep:
    """Hooks that keep the rank processes of one collective in step through :func:`measure`.

    ``barrier`` runs untimed before the estimate and before every sample; ``slowest`` takes
    a list of floats and returns, on every rank, their element-wise maximum over the ranks.
    ``capture`` is the context a CUDA graph of the calls is captured in (a communicator
    with registered buffers, such as vLLM's custom all-reduce, needs its own).

    >>> alone = Lockstep(barrier=lambda: None, slowest=list)  # one process: the identity
    >>> alone.slowest([1e-6, 0.0])
    [1e-06, 0.0]
    """

    barrier: Callable[[], None]
    slowest: Callable[[list[float]], list[float]]
    capture: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext


def measure(fn: Callable[[], object], *, mode: TimerMode, device, budget: Budget = Budget(),
            lockstep: Lockstep | None = None, activations: Sequence[tuple[str, object]] = ()) -> Measurement:
    """Time ``fn`` (zero arguments) on ``device`` with ``mode``; samples are seconds per call.

    ``activations``: the (name, tensor) pairs ``fn`` reads that a decode step has just written;
    the ``step`` timer keeps them in L2 and everything else out (other timers ignore them).

    >>> import torch
    >>> m = measure(lambda: torch.ones(64).sum(), mode=TimerMode.WALL, device=torch.device("cpu"),
    ...             budget=Budget(budget_ms=50, min_samples=5))
    >>> len(m.samples) >= 5 and m.median > 0
    True
    """
    mode = TimerMode(mode)
    if mode not in modes_for_device(device):
        raise ValueError(f"timer {mode.value!r} cannot run on {device}; use one of "
                         f"{', '.join(m.value for m in modes_for_device(device))}")
    sync = synchronizer(device)
    fn()
    sync()
    step = lockstep or _ALONE
    step.barrier()
    per_call_s = step.slowest([estimate_call_seconds(fn, sync)])[0]
    for _ in range(max(1, int(budget.warmup_ms / 1e3 / per_call_s))):  # warm up
        fn()
    sync()
    calls = _calls_per_sample(budget, per_call_s)
    hooks = _sampler_hooks(mode, lockstep)
    if mode is TimerMode.STEP:
        hooks["activations"] = activations
    sampler = _SAMPLERS[mode](fn, device, calls, sync, **hooks)
    return _sample(sampler, mode, calls, budget, lockstep)


def _sampler_hooks(mode: TimerMode, lockstep: Lockstep | None) -> dict:
    if lockstep is None:
        return {}
    if mode in PROFILER_MODES:
        raise ValueError(f"timer {mode.value!r} cannot time a collective (its kernel waits for the other "
                         "ranks); use events, graph or wall")
    hooks = {"before": lockstep.barrier}
    if mode is TimerMode.GRAPH:
        hooks["capture"] = lockstep.capture
    return hooks


def synchronizer(device) -> Callable[[], None]:
    """A callable that waits for ``device``'s queued work (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        import torch

        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def estimate_call_seconds(fn, sync, calls: int = 5) -> float:
    """Rough host-timed cost of one call, for sizing warm-up and samples (never reported)."""
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return max((time.perf_counter() - start) / calls, 1e-7)


def _calls_per_sample(budget: Budget, per_call_s: float) -> int:
    """Calls per sample: ``sample_ms`` of work within the bounds, rounded up to ``calls_multiple_of``.

    >>> _calls_per_sample(Budget(sample_ms=0.2), 7e-6)
    29
    >>> _calls_per_sample(Budget(sample_ms=0.2, calls_multiple_of=10), 7e-6)
    30
    """
    calls = math.ceil(budget.sample_ms / 1e3 / per_call_s)
    calls = max(1, budget.min_calls_per_sample, min(calls, budget.max_calls_per_sample))
    return math.ceil(calls / budget.calls_multiple_of) * budget.calls_multiple_of


_ALONE = Lockstep(barrier=lambda: None, slowest=list)


def _sample(sampler: Callable[[], float], mode: TimerMode, calls: int, budget: Budget,
            lockstep: Lockstep | None = None) -> Measurement:
    samples: list[float] = []
    own: list[float] = []
    start = time.perf_counter()
    deadline = start + budget.budget_ms / 1e3
    while True:
        own.append(sampler())
        # one agreement per sample: the slowest rank's sample, and "any rank past its deadline"
        slowest, late = (lockstep or _ALONE).slowest([own[-1], float(time.perf_counter() >= deadline)])
        samples.append(slowest)
        if len(samples) >= budget.min_samples:
            if stats.median_precision(samples) <= budget.target_precision:
                reason = StopReason.CONVERGED
                break
            if len(samples) >= budget.max_samples:
                reason = StopReason.MAX_SAMPLES
                break
            if late:
                reason = StopReason.BUDGET
                break
    notes = getattr(sampler, "notes", ())
    kernels = getattr(sampler, "kernel_trace", None)
    return Measurement(tuple(samples), mode, calls, reason, time.perf_counter() - start, tuple(notes), kernels,
                       getattr(sampler, "kernels_by_name", None), own_samples=tuple(own) if lockstep else ())


# --- samplers: each returns seconds per call for one sample of `calls` calls ---------
# ``before`` runs untimed ahead of every sample; collectives pass a barrier there.


def wall_sampler(fn, device, calls, sync, before: Callable[[], None] = lambda: None):
    """Host clock around ``calls`` calls and a synchronize."""
    def sample() -> float:
        before()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        return (time.perf_counter() - start) / calls

    return sample


def events_sampler(fn, device, calls, sync, before: Callable[[], None] = lambda: None):
    """CUDA events around ``calls`` eager calls (launch gaps included)."""
    def eager() -> None:
        for _ in range(calls):
            fn()

    return _between_events(eager, calls, before)


def graph_sampler(fn, device, calls, sync, before: Callable[[], None] = lambda: None,
                  capture: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext):
    """``calls`` calls captured in one CUDA graph (inside ``capture()``); each sample times one
    replay with events."""
    import torch

    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm the side stream: allocator pools, lazy inits
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    sync()
    graph = torch.cuda.CUDAGraph()
    with capture(), torch.cuda.graph(graph, stream=stream):
        for _ in range(calls):
            fn()
    graph.replay()
    sync()
    return _between_events(graph.replay, calls, before)


def _between_events(run: Callable[[], object], calls: int, before: Callable[[], None]) -> Callable[[], float]:
    """A sampler: ``before()`` untimed, then ``run()`` (``calls`` calls) between two CUDA events."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def sample() -> float:
        before()
        start.record()
        run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / calls

    return sample


_SAMPLERS = {
    TimerMode.WALL: wall_sampler,
    TimerMode.GRAPH: graph_sampler,
    TimerMode.KERNEL: kernel_sampler,
    TimerMode.COLD: cold_sampler,
    TimerMode.STEP: step_sampler,
    TimerMode.EVENTS: events_sampler,
}
