"""Kernel-only time on CUDA: the GPU activity CUPTI records (through torch.profiler), read as events.

The ``kernel`` and ``cold`` timer modes of :mod:`decodebench.timing` sample with these;
the recipe around them (estimate, warm-up, sample sizing, stopping) stays in timing.py.
Each sample is one short profiler session over ``calls`` calls; its device events are
summed per call, and, while every call launches the same kernels, kept per kernel
(:class:`KernelTrace`), so that one part of a fused call can be timed on its own
(:mod:`decodebench.kernel_parts`). Whether or not the calls agree, every kernel name the timed
calls launched is kept with its calls and seconds per timed call (:meth:`CallTrace.by_name`):
the benchmark stores it as ``extra_info["kernels"]``, so a different kernel choice (cuBLAS
picking another GEMM) is seen in the results, and the decode-step attribution's rules are
checked against the very names the benchmark launched.
"""

from __future__ import annotations

import statistics
import warnings
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["KernelTrace", "ProfilerSampler", "cold_sampler", "device_events", "kernel_sampler", "kernels_by_name",
           "step_sampler"]

from .cache_state import PREPARE_KERNEL_MARKERS, flusher, step_preparer


@dataclass(frozen=True)
class KernelTrace:
    """The kernels of one timed call as the kernel timer saw them.

    ``names``: the GPU activities of one call in launch order; ``samples``: per sample,
    each one's seconds per call (averaged over the sample's calls). Only recorded when
    every call of every sample launched the same kernels (see :mod:`decodebench.kernel_parts`).
    """

    names: tuple[str, ...]
    samples: tuple[tuple[float, ...], ...]


class ProfilerSampler:
    """Kernel-only time: sum of CUPTI-recorded GPU activity per call, read as events."""

    _cupti_started = False

    def __init__(self, fn, device, calls, sync, flush: Callable[[], None] | None = None):
        self.fn, self.calls, self.sync, self.flush = fn, calls, sync, flush
        self.notes: list[str] = []
        self._trace: CallTrace | None = CallTrace(calls)
        if not ProfilerSampler._cupti_started:
            # CUPTI's first session costs seconds; pay it once per process, untimed.
            self._profile_device_seconds()
            ProfilerSampler._cupti_started = True

    @property
    def kernel_trace(self) -> KernelTrace | None:
        return self._trace.result() if self._trace is not None else None

    @property
    def kernels_by_name(self) -> dict[str, dict[str, float]] | None:
        return self._trace.by_name() if self._trace is not None else None

    def __call__(self) -> float:
        seconds = self._profile_device_seconds(record=True)
        if seconds <= 0:
            raise RuntimeError("the profiler recorded no GPU activity for the timed calls; "
                               "is the callable running on the GPU?")
        return seconds / self.calls

    def _profile_device_seconds(self, record: bool = False) -> float:
        from torch.profiler import ProfilerActivity, profile

        with warnings.catch_warnings():
            # each session is read on its own; torch warns that sessions do not accumulate
            warnings.filterwarnings("ignore", message="Profiler clears events")
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(self.calls):
                    if self.flush is not None:
                        self.flush()
                    self.fn()
                self.sync()
        events = device_events(prof)
        if record and self._trace is not None:
            self._trace.add(events)
        return sum(duration for _, _, duration in events) / 1e9


def device_events(prof) -> list[tuple[int, str, int]]:
    """(start ns, name, duration ns) of the GPU activities, in start order, without annotations
    or the untimed L2 preparation of the cold and step timers."""
    from torch.autograd import DeviceType

    events = []
    for event in prof.profiler.kineto_results.events():
        if event.device_type() != DeviceType.CUDA or event.is_user_annotation():
            continue
        name = event.name().lower()
        if any(marker in name for marker in PREPARE_KERNEL_MARKERS):  # the cold and step timers' preparation
            continue
        events.append((event.start_ns(), event.name(), event.duration_ns()))
    return sorted(events)


class CallTrace:
    """Per-kernel seconds per call, sample by sample, while every call launches the same kernels."""

    def __init__(self, calls: int):
        self.calls = calls
        self.names: tuple[str, ...] | None = None
        self.samples: list[tuple[float, ...]] = []
        self.broken = False
        self.per_name: list[dict[str, tuple[int, int]]] = []  # per sample: name -> (launches, ns)

    def add(self, events: list[tuple[int, str, int]]) -> None:
        totals: dict[str, tuple[int, int]] = {}
        for _, name, ns in events:
            launches, total = totals.get(name, (0, 0))
            totals[name] = (launches + 1, total + ns)
        self.per_name.append(totals)
        per_call, extra = divmod(len(events), self.calls)
        names = tuple(name for _, name, _ in events[:per_call])
        calls = [events[i * per_call:(i + 1) * per_call] for i in range(self.calls)]
        same = not extra and all(tuple(n for _, n, _ in call) == names for call in calls)
        if not same or (self.names is not None and names != self.names):
            self.broken = True
            return
        self.names = names
        self.samples.append(tuple(sum(call[i][2] for call in calls) / self.calls / 1e9 for i in range(per_call)))

    def result(self) -> KernelTrace | None:
        if self.broken or not self.names:
            return None
        return KernelTrace(self.names, tuple(self.samples))

    def by_name(self) -> dict[str, dict[str, float]] | None:
        """Every kernel name the samples launched: ``{"calls": launches per timed call, "s": seconds per
        timed call}``, each the median over the samples (a sample without the name counts as 0)."""
        return kernels_by_name(self.per_name, self.calls) if self.per_name else None


def kernels_by_name(samples: list[dict[str, tuple[int, int]]], calls: int) -> dict[str, dict[str, float]]:
    """Per kernel name, launches and seconds per call (medians over samples of ``name -> (launches, ns)``).

    >>> kernels_by_name([{"gemm": (4, 20_000)}, {"gemm": (4, 24_000)}, {"gemm": (4, 22_000)}], calls=2)
    {'gemm': {'calls': 2.0, 's': 1.1e-05}}
    """
    names = sorted({name for sample in samples for name in sample})
    out = {}
    for name in names:
        launches = [sample.get(name, (0, 0))[0] / calls for sample in samples]
        seconds = [sample.get(name, (0, 0))[1] / calls / 1e9 for sample in samples]
        out[name] = {"calls": statistics.median(launches), "s": statistics.median(seconds)}
    return dict(sorted(out.items(), key=lambda item: -item[1]["s"]))


def kernel_sampler(fn, device, calls, sync):
    return ProfilerSampler(fn, device, calls, sync)


def cold_sampler(fn, device, calls, sync):
    return _prepared_sampler(fn, device, calls, sync, *flusher(device))


def step_sampler(fn, device, calls, sync, activations=()):
    """Kernel-only time with the decode step's cache state before every call: the case's state
    (weights, scales, KV cache) from memory, its ``activations`` ((name, tensor) pairs) in L2."""
    return _prepared_sampler(fn, device, calls, sync, *step_preparer(device, activations))


def _prepared_sampler(fn, device, calls, sync, prepare, note: str) -> ProfilerSampler:
    """Kernel-only time with ``prepare`` run untimed before every call, and its ``note`` on the result."""
    sampler = ProfilerSampler(fn, device, calls, sync, flush=prepare)
    sampler.notes.append(note)
    return sampler
