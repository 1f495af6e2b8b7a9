"""Run one component case: correctness check, measurement, pytest-benchmark record.

This is the only place that strings the pipeline together for a kernel; benchmark
modules hand it a case and a backend through the ``kernel_bench`` fixture, and the A/B
worker, the gate's re-measuring (:mod:`decodebench.runner`) and the gate-power trials call the
same two steps (:func:`prepare_kernel_case`, then :func:`measure_prepared`).
"""

from __future__ import annotations

import dataclasses
import os
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from .bridge import record_samples
from .errors import BackendUnavailable
from .hardware import nvml_telemetry
from .inject import Injected, Injection, InjectionOutOfReach, slow_down
from .kernel_parts import TimedPart
from .kernels import fallbacks
from .kernels.backends import kernel_for
from .kernels.base import KernelCase, activations_of, check_case
from .roofline import Peaks, roofline
from .timing import PROFILER_MODES, Budget, Measurement, TimerMode, measure

__all__ = ["PreparedCase", "Run", "RunContext", "device_telemetry", "measure_prepared", "prepare_kernel_case",
           "run_kernel_case"]


@dataclass(frozen=True)
class RunContext:
    """Where and how the cases of a session are measured."""

    device: object  # torch.device
    timer: TimerMode
    budget: Budget
    peaks: Peaks | None
    injection: Injection | None = None  # a known slowdown that the gate must find (inject.py)


@dataclass(frozen=True)
class Run:
    """One more run of a case, what a re-measure hands the gate: its samples (s) and the kernels
    it launched (name -> calls, s; None where the timer records none)."""

    samples: list[float]
    kernels: dict | None = None


@dataclass(frozen=True)
class PreparedCase:
    """A case checked against its reference, with inputs built and the timed callable ready."""

    timed: Callable[[], object]
    extra: dict[str, object]  # what is known before timing: the check, the seeds, an injection
    part: TimedPart | None = None  # the case is this part of the timed call's kernel trace
    injected: Injected | None = None  # the injection's slowdown; its samples are timed aligned to its spin
    activations: tuple = ()  # (name, tensor) the step has just written: the step timer keeps them in L2


def device_telemetry(device) -> dict[str, object]:
    """NVML readings for a GPU; the load average and usable CPUs for the CPU."""
    if device.type == "cuda":
        return nvml_telemetry(device.index if device.index is not None else 0)
    return {"available": False, "loadavg_1m": os.getloadavg()[0], "cpus": len(os.sched_getaffinity(0))}


def prepare_kernel_case(case: KernelCase, backend: str, ctx: RunContext, test_id: str = "") -> PreparedCase:
    """Check ``case`` on ``backend`` against its reference and build the callable to time.

    Raises :class:`~decodebench.errors.BackendUnavailable` (the caller skips) and
    :class:`~decodebench.errors.KernelMismatch` (the caller fails, nothing is timed).
    A case that is one part of another call (``case.timed_part(backend)``, e.g. one GEMM
    of a fused MoE call) checks and times that whole call and keeps its part's kernels.
    With ``ctx.injection`` selecting ``test_id``, the callable carries the injected slowdown.
    """
    rng = random.SystemRandom()
    with fallbacks.recording() as fell_back:  # values of ours where vLLM no longer says them
        case = case.for_backend(backend)
        part = _timed_part(case, backend, ctx.timer)
        run = part.whole if part is not None else case
        kernel = kernel_for(run, backend, ctx.device)
    check_seed, timing_seed = rng.randrange(2**31), rng.randrange(2**31)
    check = check_case(run, kernel, ctx.device, check_seed)
    variant_errors = {v.id: check_case(v, kernel, ctx.device, check_seed).error for v in run.check_variants()}
    inputs = run.make_inputs(ctx.device, timing_seed)
    activations = activations_of(run, inputs)
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
        "activation_inputs": [name for name, _ in activations],
        "fallbacks": fell_back,  # measure_prepared moves them into the result's notes
    }
    timed = lambda: kernel(inputs)  # noqa: E731 - the one callable every timer takes
    if ctx.injection is not None and ctx.injection.applies_to(test_id or case.id):
        try:
            timed, injected = slow_down(timed, ctx.injection.fraction, mode=ctx.timer, device=ctx.device,
                                        budget=ctx.budget, part=part, activations=activations)
        except InjectionOutOfReach as exc:  # a skip that names the case, never a result called injected
            raise InjectionOutOfReach(f"--inject-slowdown does not reach {test_id or case.id}: {exc}") from None
        extra["injected_slowdown"] = injected.info()
        if part is not None:  # the spin is one more kernel of the call: this part's, or no injection
            part = part.carrying_spin()
        return PreparedCase(timed, extra, part, injected, activations)
    return PreparedCase(timed, extra, part, activations=activations)


def measure_prepared(prepared: PreparedCase, traffic, ctx: RunContext,
                     budget_ms: float | None = None) -> tuple[Measurement, dict[str, object]]:
    """Time a prepared case with the session's recipe; returns the measurement and its extra_info.

    For a part of a traced call the measurement's samples are that part's per-call times.
    """
    budget = ctx.budget if budget_ms is None else dataclasses.replace(ctx.budget, budget_ms=budget_ms)
    if prepared.injected is not None:
        budget = prepared.injected.aligned(budget)
    before = device_telemetry(ctx.device)
    measurement = measure(prepared.timed, mode=ctx.timer, device=ctx.device, budget=budget,
                          activations=prepared.activations)
    after = device_telemetry(ctx.device)
    part_info: dict[str, object] = {}
    if prepared.part is not None:
        samples, part_info = prepared.part.attribute(measurement.kernels)
        measurement = dataclasses.replace(measurement, samples=tuple(samples))
    extra = {
        **prepared.extra,
        **measurement.summary(),
        **part_info,
        **roofline(traffic, measurement.median, ctx.peaks),
        "telemetry_before": before,
        "telemetry_after": after,
    }
    extra["notes"] = [*extra["notes"], *(f"fallback: {text}" for text in extra.pop("fallbacks", ()))]
    if after.get("throttled"):
        extra["notes"] = [*extra["notes"], f"GPU reported clock throttling ({after.get('throttle_reasons')})"]
    return measurement, extra


def run_kernel_case(benchmark, case: KernelCase, backend: str, ctx: RunContext,
                    facts: Mapping | None = None) -> Measurement:
    """Check ``case`` on ``backend`` against its reference, then time it into ``benchmark``, with the
    test's own ``facts`` (e.g. which MLA backend vLLM's selector picks) beside the measurement's;
    raises as :func:`prepare_kernel_case` does."""
    case = case.for_backend(backend)  # its traffic and re-measures too
    test_id = getattr(benchmark, "fullname", "") or case.id
    prepared = prepare_kernel_case(case, backend, ctx, test_id)
    measurement, extra = measure_prepared(prepared, case.traffic(), ctx)
    record_samples(benchmark, measurement.samples, {**extra, **(facts or {})})
    return measurement


def _timed_part(case: KernelCase, backend: str, timer: TimerMode) -> TimedPart | None:
    """The case's part of a traced call, if it is one; only the kernel timers trace kernels."""
    part = case.timed_part(backend)
    if part is not None and timer not in PROFILER_MODES:
        raise BackendUnavailable(f"{backend} {case.id} is one part ({part.part}) of the kernel trace of "
                                 f"{part.whole.id}; timer {timer.value!r} records no per-kernel times "
                                 "(use --timer step, kernel or cold on CUDA)")
    return part
