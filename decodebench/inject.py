"""Validation mode: a known slowdown added to the timed region of a kernel case.

To measure whether the gate catches a regression of a given size, the case's timed
callable is followed by a spin that costs a chosen fraction of the case's floor (the 10th
percentile of its samples, the statistic the gate judges a run by), measured just before with
the same timer. (A median inflates the spin on a loaded CPU, where medians spread 2-5x while
floors hold: +100 % asked for came out 2.1-4.2x on the 2-core CI machine.) On CUDA the spin is
``torch.cuda._sleep`` on the current stream (the kernel's stream): a GPU kernel, so the kernel-only timer
(CUPTI activity sum), CUDA-graph replay and the wall clock all count it as part of the
call. That kernel has a shortest run: on the H200 a sleep of 142 cycles (72 ns asked) ran
0.61 µs, and "+5 %" on a 1.4 µs RMSNorm came out 1.44x (docs/validation.md). So the spin is
modelled as a fixed floor plus cycles at a rate, both timed once per device with the kernel
timer (a sleep of one cycle, then a long one); the cycles pay for what is asked beyond the
floor, and a case whose asked time is below the floor is refused by name
(:class:`InjectionOutOfReach`, a skip) rather than slowed down by more than it says.
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
from .errors import BackendUnavailable
from .timing import Budget, TimerMode, measure

if TYPE_CHECKING:
    from .kernel_parts import TimedPart

__all__ = ["Injected", "Injection", "InjectionOutOfReach", "SpinModel", "slow_down", "spinner"]

# Cycles of the long calibration spin: long enough (tens of µs on any GPU clock) that the
# timer's resolution stays far below 1 % of it; the short one (1 cycle) times the kernel's floor.
_CALIBRATION_CYCLES = 200_000
_PILOT_SHARE = 0.25  # share of the case's budget spent on the floor that sizes the spin
_spin_models: dict[str, SpinModel] = {}


class InjectionOutOfReach(BackendUnavailable):
    """The slowdown asked of a case is shorter than the spin's shortest run on this device;
    the benchmarks turn it into a skip that names the case."""


@dataclass(frozen=True)
class SpinModel:
    """A GPU spin of ``n`` cycles runs ``floor_s + n / cycles_per_s`` seconds."""

    floor_s: float
    cycles_per_s: float

    def cycles_for(self, seconds: float) -> int:
        """The cycles that make the spin run ``seconds``; :class:`InjectionOutOfReach` below its floor.

        >>> SpinModel(floor_s=0.6e-6, cycles_per_s=1.98e9).cycles_for(1.6e-6)
        1980
        >>> SpinModel(floor_s=0.6e-6, cycles_per_s=1.98e9).cycles_for(0.07e-6)
        Traceback (most recent call last):
        ...
        decodebench.inject.InjectionOutOfReach: the spin kernel runs at least 0.600 µs here, more than the 0.070 µs asked
        """
        if seconds < self.floor_s:
            raise InjectionOutOfReach(f"the spin kernel runs at least {self.floor_s * 1e6:.3f} µs here, "
                                      f"more than the {seconds * 1e6:.3f} µs asked")
        return max(1, round((seconds - self.floor_s) * self.cycles_per_s))

    @classmethod
    def from_runs(cls, short_s: float, long_s: float, long_cycles: int) -> SpinModel:
        """From a spin of one cycle that ran ``short_s`` and one of ``long_cycles`` that ran ``long_s``.

        >>> m = SpinModel.from_runs(0.6e-6 + 1 / 2e9, 0.6e-6 + 200_000 / 2e9, 200_000)
        >>> round(m.floor_s * 1e9), round(m.cycles_per_s / 1e9, 6)
        (600, 2.0)
        """
        if long_s <= short_s:
            raise ValueError(f"a spin of {long_cycles} cycles ({long_s:.3g} s) ran no longer than one of "
                             f"1 cycle ({short_s:.3g} s): the device clock is not what the spin counts")
        rate = (long_cycles - 1) / (long_s - short_s)
        return cls(floor_s=max(0.0, short_s - 1 / rate), cycles_per_s=rate)


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
    try:
        spin, method = spinner(device, extra_s)
    except InjectionOutOfReach as exc:
        raise InjectionOutOfReach(f"{fraction:.1%} of its {base * 1e6:.3f} µs floor is out of reach: {exc}") from None

    def slowed() -> object:
        result = fn()
        spin()
        return result

    return slowed, Injected(fraction, base, extra_s, method)


def spinner(device, seconds: float) -> tuple[Callable[[], None], str]:
    """A callable that costs ``seconds`` on ``device``, and how it does so."""
    if device.type == "cuda":
        import torch

        model = _device_spin_model(device)
        cycles = model.cycles_for(seconds)
        return (lambda: torch.cuda._sleep(cycles)), (f"torch.cuda._sleep({cycles} cycles, after its "
                                                     f"{model.floor_s * 1e6:.3f} µs floor) on the kernel's stream")
    return (lambda: _busy_wait(seconds)), "busy-wait on time.perf_counter"


def _busy_wait(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _device_spin_model(device) -> SpinModel:
    """The spin's floor and rate on ``device``, timed once per process with the kernel timer."""
    key = str(device)
    if key not in _spin_models:
        import torch

        budget = Budget(warmup_ms=5, budget_ms=200, min_samples=10)
        with torch.cuda.device(device):
            short, long = (measure(lambda n=n: torch.cuda._sleep(n), mode=TimerMode.KERNEL, device=device,
                                   budget=budget) for n in (1, _CALIBRATION_CYCLES))
        _spin_models[key] = SpinModel.from_runs(stats.floor(short.samples), long.median, _CALIBRATION_CYCLES)
    return _spin_models[key]
