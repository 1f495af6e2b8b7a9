"""Run one component case: correctness check, measurement, pytest-benchmark record.

This is the only place that strings the pipeline together for a kernel; benchmark
modules hand it a case and a backend through the ``kernel_bench`` fixture.
"""

from __future__ import annotations

import functools
import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from . import stats
from .bridge import record_samples
from .errors import BackendUnavailable
from .hardware import nvml_telemetry
from .kernels.backends import kernel_for
from .kernels.base import KernelCase, check_case
from .roofline import Peaks, roofline
from .timing import Budget, Measurement, TimerMode, measure

__all__ = ["RunContext", "device_telemetry", "remeasure_case", "run_kernel_case"]


@dataclass(frozen=True)
class RunContext:
    """Where and how the cases of a session are measured."""

    device: object  # torch.device
    timer: TimerMode
    budget: Budget
    peaks: Peaks | None
    # test node id -> a closure that measures the case again (samples in seconds); the
    # gate calls it at session end for cases its verdict cannot settle yet
    remeasurers: dict[str, Callable[[], tuple[float, ...]]] = field(default_factory=dict, compare=False)


def device_telemetry(device) -> dict[str, object]:
    """NVML readings for a GPU; the load average for the CPU."""
    if device.type == "cuda":
        return nvml_telemetry(device.index if device.index is not None else 0)
    return {"available": False, "loadavg_1m": os.getloadavg()[0], "cpus": len(os.sched_getaffinity(0))}


def run_kernel_case(benchmark, case: KernelCase, backend: str, ctx: RunContext) -> Measurement:
    """Check ``case`` on ``backend`` against its reference, then time it into ``benchmark``.

    Raises :class:`~decodebench.errors.BackendUnavailable` (the caller skips) and
    :class:`~decodebench.errors.KernelMismatch` (the caller fails, nothing is timed).
    A case that is one part of another call (``case.timed_part(backend)``, e.g. one GEMM
    of a fused MoE call) checks and times that whole call and records its part's kernels.
    """
    rng = random.SystemRandom()
    part = _timed_part(case, backend, ctx.timer)
    run = part.whole if part is not None else case
    kernel = kernel_for(run, backend, ctx.device)
    check_seed, timing_seed = rng.randrange(2**31), rng.randrange(2**31)
    check = check_case(run, kernel, ctx.device, check_seed)
    variant_errors = {v.id: check_case(v, kernel, ctx.device, check_seed).error for v in run.check_variants()}
    inputs = run.make_inputs(ctx.device, timing_seed)
    before = device_telemetry(ctx.device)
    measurement = measure(lambda: kernel(inputs), mode=ctx.timer, device=ctx.device, budget=ctx.budget)
    after = device_telemetry(ctx.device)
    samples, part_info = (measurement.samples, {}) if part is None else part.attribute(measurement.kernels)
    extra = {
        "component": case.component,
        "backend": backend,
        "case": case.id,
        "shape": case.shape(),
        "device": str(ctx.device),
        **measurement.summary(),
        **part_info,
        **roofline(case.traffic(), stats.median(samples), ctx.peaks),
        "reference_error": check.error,
        "variant_errors": variant_errors,
        "reference_metric": check.metric,
        "tolerance": check.tolerance,
        "check_seed": check_seed,
        "timing_seed": timing_seed,
        "telemetry_before": before,
        "telemetry_after": after,
    }
    if after.get("throttled"):
        extra["notes"] = [*extra["notes"], f"GPU reported clock throttling ({after.get('throttle_reasons')})"]
    record_samples(benchmark, samples, extra)
    if getattr(benchmark, "fullname", None):
        ctx.remeasurers[benchmark.fullname] = functools.partial(remeasure_case, case, backend, ctx)
    return measurement


def remeasure_case(case: KernelCase, backend: str, ctx: RunContext) -> tuple[float, ...]:
    """Check and time ``case`` again, on fresh inputs: one more independent run's samples.

    Only the case and context are kept between runs, never its tensors, so waiting
    closures hold no device memory.
    """
    rng = random.SystemRandom()
    part = _timed_part(case, backend, ctx.timer)
    run = part.whole if part is not None else case
    kernel = kernel_for(run, backend, ctx.device)
    check_case(run, kernel, ctx.device, rng.randrange(2**31))
    inputs = run.make_inputs(ctx.device, rng.randrange(2**31))
    measurement = measure(lambda: kernel(inputs), mode=ctx.timer, device=ctx.device, budget=ctx.budget)
    return tuple(measurement.samples if part is None else part.attribute(measurement.kernels)[0])


def _timed_part(case: KernelCase, backend: str, timer: TimerMode):
    """The case's part of a traced call, if it is one; only the kernel timers trace kernels."""
    part = case.timed_part(backend)
    if part is not None and timer not in (TimerMode.KERNEL, TimerMode.COLD):
        raise BackendUnavailable(f"{backend} {case.id} is one part ({part.part}) of the kernel trace of "
                                 f"{part.whole.id}; timer {timer.value!r} records no per-kernel times "
                                 "(use --timer kernel or cold on CUDA)")
    return part
