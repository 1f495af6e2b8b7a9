"""Run one component case: correctness check, measurement, pytest-benchmark record.

This is the only place that strings the pipeline together for a kernel; benchmark
modules hand it a case and a backend through the ``kernel_bench`` fixture.
"""

from __future__ import annotations

import dataclasses
import os
import random
from collections.abc import Callable
from dataclasses import dataclass

from .bridge import record_samples
from .hardware import nvml_telemetry
from .inject import Injection, slow_down
from .kernels.base import KernelCase, check_case
from .roofline import Peaks, roofline
from .timing import Budget, Measurement, TimerMode, measure

__all__ = ["PreparedCase", "RunContext", "device_telemetry", "measure_prepared", "prepare_kernel_case",
           "run_kernel_case"]


@dataclass(frozen=True)
class RunContext:
    """Where and how the cases of a session are measured."""

    device: object  # torch.device
    timer: TimerMode
    budget: Budget
    peaks: Peaks | None
    injection: Injection | None = None  # validation mode: a known slowdown (inject.py)


@dataclass(frozen=True)
class PreparedCase:
    """A case checked against its reference, with inputs built and the timed callable ready."""

    timed: Callable[[], object]
    extra: dict[str, object]  # what is known before timing: the check, the seeds, an injection


def device_telemetry(device) -> dict[str, object]:
    """NVML readings for a GPU; the load average for the CPU."""
    if device.type == "cuda":
        return nvml_telemetry(device.index if device.index is not None else 0)
    return {"available": False, "loadavg_1m": os.getloadavg()[0]}


def prepare_kernel_case(case: KernelCase, backend: str, ctx: RunContext, test_id: str = "") -> PreparedCase:
    """Check ``case`` on ``backend`` against its reference and build the callable to time.

    Raises :class:`~decodebench.errors.BackendUnavailable` (the caller skips) and
    :class:`~decodebench.errors.KernelMismatch` (the caller fails, nothing is timed).
    With ``ctx.injection`` selecting ``test_id``, the callable carries the injected slowdown.
    """
    rng = random.SystemRandom()
    kernel = case.kernel(backend, ctx.device)
    check_seed, timing_seed = rng.randrange(2**31), rng.randrange(2**31)
    check = check_case(case, kernel, ctx.device, check_seed)
    variant_errors = {v.id: check_case(v, kernel, ctx.device, check_seed).error for v in case.check_variants()}
    inputs = case.make_inputs(ctx.device, timing_seed)
    extra = {
        "component": case.component,
        "backend": backend,
        "case": case.id,
        "shape": case.shape(),
        "device": str(ctx.device),
        "reference_error": check.error,
        "variant_errors": variant_errors,
        "reference_metric": check.metric,
        "tolerance": check.tolerance,
        "check_seed": check_seed,
        "timing_seed": timing_seed,
    }
    timed = lambda: kernel(inputs)  # noqa: E731 - the one callable every timer takes
    if ctx.injection is not None and ctx.injection.applies_to(test_id or case.id):
        timed, injected = slow_down(timed, ctx.injection.fraction, mode=ctx.timer, device=ctx.device,
                                    budget=ctx.budget)
        extra["injected_slowdown"] = injected.info()
    return PreparedCase(timed, extra)


def measure_prepared(prepared: PreparedCase, traffic, ctx: RunContext,
                     budget_ms: float | None = None) -> tuple[Measurement, dict[str, object]]:
    """Time a prepared case with the session's recipe; returns the measurement and its extra_info."""
    budget = ctx.budget if budget_ms is None else dataclasses.replace(ctx.budget, budget_ms=budget_ms)
    before = device_telemetry(ctx.device)
    measurement = measure(prepared.timed, mode=ctx.timer, device=ctx.device, budget=budget)
    after = device_telemetry(ctx.device)
    extra = {
        **prepared.extra,
        **measurement.summary(),
        **roofline(traffic, measurement.median, ctx.peaks),
        "telemetry_before": before,
        "telemetry_after": after,
    }
    if after.get("throttled"):
        extra["notes"] = [*extra["notes"], f"GPU reported clock throttling ({after.get('throttle_reasons')})"]
    return measurement, extra


def run_kernel_case(benchmark, case: KernelCase, backend: str, ctx: RunContext) -> Measurement:
    """Check ``case`` on ``backend`` against its reference, then time it into ``benchmark``.

    Raises :class:`~decodebench.errors.BackendUnavailable` (the caller skips) and
    :class:`~decodebench.errors.KernelMismatch` (the caller fails, nothing is timed).
    """
    prepared = prepare_kernel_case(case, backend, ctx, getattr(benchmark, "fullname", "") or case.id)
    measurement, extra = measure_prepared(prepared, case.traffic(), ctx)
    record_samples(benchmark, measurement.samples, extra)
    return measurement
