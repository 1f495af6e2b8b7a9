"""Validation mode: a known slowdown added to the timed region of a kernel case.

To measure whether the gate catches a regression of a given size, the case's timed
callable is followed by a spin that costs a chosen fraction of the case's floor (the 10th
percentile of its samples, the statistic the gate judges a run by), measured just before with
the same timer. (A median inflates the spin on a loaded CPU, where medians spread 2-5x while
floors hold: +100 % asked for came out 2.1-4.2x on the 2-core CI machine.) On CUDA the spin is
``torch.cuda._sleep`` on the current stream (the kernel's stream): a GPU kernel, so the kernel-only timer
(CUPTI activity sum), CUDA-graph replay and the wall clock all count it as part of the
call. Its cycles-to-seconds rate is calibrated once per device with the kernel timer.
On the CPU the spin is a busy-wait on ``time.perf_counter`` (the clock the wall timer
reads, so it needs no other calibration).

A case that is one part of another call's kernels (a GEMM of the fused MoE call,
:class:`~decodebench.kernel_parts.TimedPart`) is slowed down by a fraction of *its part's*
floor, and its part counts the spin kernel as its own (``TimedPart.carrying_spin``): without
that, a spin after the call would fall outside every part and the case would be reported as
injected while its samples never moved.

Results measured with an injection carry ``extra_info["injected_slowdown"]`` and are
never stored as a baseline: the pytest options refuse ``--benchmark-save`` and
``--benchmark-autosave`` together with an injection.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

from typing import TYPE_CHECKING

from . import stats
from .timing import Budget, TimerMode, measure

if TYPE_CHECKING:
    from .kernel_parts import TimedPart

__all__ = ["Injected", "Injection", "slow_down", "spinner"]

# Cycles of the calibration spin: long enough (tens of µs on any GPU clock) that the
# launch gap and the timer's resolution stay far below 1 % of it.
_CALIBRATION_CYCLES = 200_000
_PILOT_SHARE = 0.25  # share of the case's budget spent on the floor that sizes the spin
_cycles_per_second: dict[str, float] = {}


@dataclass(frozen=True)
class Injection:
    """Add ``fraction`` of a case's floor to every call of the cases ``only`` selects.

    ``only`` holds substrings of the test id (pytest's node id); empty selects every case.

    >>> inj = Injection(0.05, only=("add-w7168",))
    >>> inj.applies_to("test_rmsnorm[add-w7168-m1-torch]"), inj.applies_to("test_rmsnorm[plain-w512-m1-torch]")
    (True, False)
    """

    fraction: float
    only: tuple[str, ...] = ()

    def applies_to(self, test_id: str) -> bool:
        return not self.only or any(part in test_id for part in self.only)


@dataclass(frozen=True)
class Injected:
    """What one case was slowed down by; stored as ``extra_info['injected_slowdown']``."""

    fraction: float
    base_floor_s: float  # the pilot's 10th percentile, seconds per call
    extra_s: float
    method: str

    def info(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def slow_down(fn: Callable[[], object], fraction: float, *, mode: TimerMode, device,
              budget: Budget, part: TimedPart | None = None) -> tuple[Callable[[], object], Injected]:
    """``fn`` followed by a spin of ``fraction`` × its floor (measured now, with ``mode``);
    with ``part``, × the floor of that part of ``fn``'s kernels.

    >>> import torch
    >>> slow, injected = slow_down(lambda: torch.ones(256).sum(), 0.5, mode=TimerMode.WALL,
    ...                            device=torch.device("cpu"), budget=Budget(budget_ms=20, min_samples=5))
    >>> injected.extra_s > 0 and injected.extra_s == 0.5 * injected.base_floor_s
    True
    """
    pilot_budget = dataclasses.replace(budget, budget_ms=budget.budget_ms * _PILOT_SHARE)
    pilot = measure(fn, mode=mode, device=device, budget=pilot_budget)
    base = stats.floor(part.attribute(pilot.kernels)[0] if part is not None else pilot.samples)
    extra_s = fraction * base
    spin, method = spinner(device, extra_s)

    def slowed() -> object:
        result = fn()
        spin()
        return result

    return slowed, Injected(fraction, base, extra_s, method)


def spinner(device, seconds: float) -> tuple[Callable[[], None], str]:
    """A callable that costs ``seconds`` on ``device``, and how it does so."""
    if device.type == "cuda":
        import torch

        cycles = max(1, round(seconds * _device_cycles_per_second(device)))
        return (lambda: torch.cuda._sleep(cycles)), f"torch.cuda._sleep({cycles} cycles) on the kernel's stream"
    return (lambda: _busy_wait(seconds)), "busy-wait on time.perf_counter"


def _busy_wait(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _device_cycles_per_second(device) -> float:
    """Spin cycles per second of ``device``, timed once per process with the kernel timer."""
    key = str(device)
    if key not in _cycles_per_second:
        import torch

        with torch.cuda.device(device):
            spin = measure(lambda: torch.cuda._sleep(_CALIBRATION_CYCLES), mode=TimerMode.KERNEL,
                           device=device, budget=Budget(warmup_ms=5, budget_ms=200, min_samples=10))
        _cycles_per_second[key] = _CALIBRATION_CYCLES / spin.median
    return _cycles_per_second[key]
