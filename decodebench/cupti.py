"""Kernel-only time on CUDA: the GPU activity CUPTI records (through torch.profiler), read as events.

The ``kernel`` and ``cold`` timer modes of :mod:`decodebench.timing` sample with these;
the recipe around them (estimate, warm-up, sample sizing, stopping) stays in timing.py.
Each sample is one short profiler session over ``calls`` calls; its device events are
summed per call, and, while every call launches the same kernels, kept per kernel
(:class:`KernelTrace`), so that one part of a fused call can be timed on its own
(:mod:`decodebench.trace`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["KernelTrace", "ProfilerSampler", "cold_sampler", "device_events", "kernel_sampler"]

# The L2 flush runs this op, whose kernel name no benchmarked kernel shares; the
# kernel and cold timers drop activity whose name contains the marker.
_FLUSH_KERNEL_MARKER = "bitwise_not"


@dataclass(frozen=True)
class KernelTrace:
    """The kernels of one timed call as the kernel timer saw them.

    ``names``: the GPU activities of one call in launch order; ``samples``: per sample,
    each one's seconds per call (averaged over the sample's calls). Only recorded when
    every call of every sample launched the same kernels (see :mod:`decodebench.trace`).
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
    or the L2 flush."""
    from torch.autograd import DeviceType

    events = []
    for event in prof.profiler.kineto_results.events():
        if event.device_type() != DeviceType.CUDA or event.is_user_annotation():
            continue
        if _FLUSH_KERNEL_MARKER in event.name().lower():
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

    def add(self, events: list[tuple[int, str, int]]) -> None:
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


def kernel_sampler(fn, device, calls, sync):
    return ProfilerSampler(fn, device, calls, sync)


def cold_sampler(fn, device, calls, sync):
    import torch

    l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size
    scratch = torch.empty(max(2 * l2_bytes, 64 << 20), dtype=torch.uint8, device=device)

    def flush() -> None:
        torch.bitwise_not(scratch, out=scratch)

    sampler = ProfilerSampler(fn, device, calls, sync, flush=flush)
    sampler.notes.append(f"L2 flushed before each call ({scratch.numel() >> 20} MiB read and written)")
    return sampler
