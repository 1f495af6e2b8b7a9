"""Injection: a known slowdown added to the timed region of a kernel case (``--inject-slowdown``).

To measure whether the gate catches a regression of a given size, the case's timed callable is
followed by a spin that costs a chosen fraction of the case's floor (the 10th percentile of its
samples, the statistic the gate judges a run by; a median spreads too much on a loaded CPU),
measured just before with the same timer. On CUDA the spin is ``torch.cuda._sleep`` on the
kernel's stream, a GPU kernel that every timer counts as part of the call; it has a shortest run
and is not linear near it (the stored-power report of docs/validation.md), so its length is read
off a curve timed once per device and timer (:class:`SpinModel`), and a slowdown shorter than the
curve's floor is paid as one longer spin every ``every`` calls, with every sample a whole number
of ``every`` calls (``Budget.calls_multiple_of``). On the CPU the spin is a busy-wait on
``time.perf_counter``, the wall timer's clock.

A case that is one part of another call's kernels (:class:`~decodebench.kernel_parts.TimedPart`)
is slowed down by a fraction of *its part's* floor, and its part counts the spin kernel as its
own; where that needs a spin in every call and it is out of reach, the case is refused by name
(:class:`InjectionOutOfReach`, a skip). Results measured with an injection carry
``extra_info["injected_slowdown"]`` and are never stored as a baseline.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import stats
from .errors import BackendUnavailable
from .timing import Budget, TimerMode, measure

if TYPE_CHECKING:
    from .kernel_parts import TimedPart

__all__ = ["Injected", "Injection", "InjectionOutOfReach", "Spin", "SpinModel", "slow_down", "spinner"]

# The calibration ladder: 1 cycle times the floor, the rungs up to 400 the bend out of it (on the
# H200, 1-100 cycles all ran 0.68 µs, 200 ran 0.74 µs), the long ones the rate (200 000 cycles: about
# 100 µs, where the timer's resolution is far below 1 %).
_CALIBRATION_CYCLES = (1, 50, 100, 150, 200, 300, 400, 800, 1600, 3200, 10_000, 50_000, 200_000)
_MAX_EVERY = 100  # at most one spin per this many calls (a sample's calls are rounded up to a multiple)
_PILOT_SHARE = 0.25  # share of the case's budget spent on the floor that sizes the spin
_spin_models: dict[tuple[str, TimerMode], SpinModel] = {}


class InjectionOutOfReach(BackendUnavailable):
    """The slowdown asked of a case is shorter than the spin's shortest run on this device;
    the benchmarks turn it into a skip that names the case."""


@dataclass(frozen=True)
class Spin:
    """One GPU spin of ``cycles`` every ``every`` calls: ``seconds`` per spin, by the model."""

    cycles: int
    every: int
    seconds: float


@dataclass(frozen=True)
class SpinModel:
    """How long a GPU spin of ``n`` cycles runs, from spins timed at a ladder of cycle counts
    (``cycles`` ascending from 1, ``seconds`` their floors made non-decreasing), linear between
    rungs and past the last at the last rung's rate."""

    cycles: tuple[int, ...]
    seconds: tuple[float, ...]

    @property
    def floor_s(self) -> float:
        return self.seconds[0]

    def seconds_for(self, cycles: int) -> float:
        """The modelled run time of a spin of ``cycles``.

        >>> SpinModel((1, 100, 200, 1200), (0.68e-6, 0.68e-6, 0.74e-6, 1.24e-6)).seconds_for(700) * 1e9
        990.0
        """
        i = min(max(bisect.bisect_right(self.cycles, cycles) - 1, 0), len(self.cycles) - 2)
        (c0, c1), (s0, s1) = self.cycles[i:i + 2], self.seconds[i:i + 2]
        return s0 + (cycles - c0) * (s1 - s0) / (c1 - c0)

    def cycles_for(self, seconds: float) -> int:
        """The fewest cycles whose spin runs ``seconds``; :class:`InjectionOutOfReach` below the floor.

        >>> model = SpinModel((1, 100, 200, 1200), (0.68e-6, 0.68e-6, 0.74e-6, 1.24e-6))
        >>> model.cycles_for(0.68e-6), model.cycles_for(0.99e-6), model.cycles_for(2.24e-6)
        (1, 700, 3200)
        >>> model.cycles_for(0.07e-6)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        decodebench.inject.InjectionOutOfReach: the spin kernel runs at least 0.680 µs here, ...0.070 µs asked
        """
        if seconds < self.floor_s:
            raise InjectionOutOfReach(f"the spin kernel runs at least {self.floor_s * 1e6:.3f} µs here, "
                                      f"more than the {seconds * 1e6:.3f} µs asked")
        i = min(bisect.bisect_left(self.seconds, seconds), len(self.seconds) - 1)
        i = max(i, 1)
        (c0, c1), (s0, s1) = self.cycles[i - 1:i + 1], self.seconds[i - 1:i + 1]
        if s1 <= s0:  # a flat stretch at the floor: its first rung already runs that long
            return c0
        return max(1, round(c0 + (seconds - s0) * (c1 - c0) / (s1 - s0)))

    def plan(self, seconds: float, *, max_every: int = _MAX_EVERY) -> Spin:
        """``seconds`` per call, as one spin per call or, below the floor, one longer spin every
        ``every`` calls.

        >>> model = SpinModel((1, 100, 200, 1200), (0.68e-6, 0.68e-6, 0.74e-6, 1.24e-6))
        >>> model.plan(0.99e-6)
        Spin(cycles=700, every=1, seconds=9.9e-07)
        >>> spin = model.plan(0.07e-6)  # +5 % of a 1.4 µs kernel: a 0.70 µs spin every 10 calls
        >>> spin.every, spin.cycles, round(spin.seconds / spin.every * 1e9, 1)
        (10, 133, 70.0)
        """
        if seconds <= 0:
            raise ValueError(f"a spin of {seconds} s per call")
        every = 1 if seconds >= self.floor_s else math.ceil(self.floor_s / seconds)
        if every > max_every:
            raise InjectionOutOfReach(f"{seconds * 1e9:.1f} ns per call would take one spin (at least "
                                      f"{self.floor_s * 1e6:.3f} µs) every {every} calls, more than {max_every}")
        cycles = self.cycles_for(seconds * every)
        return Spin(cycles, every, self.seconds_for(cycles))

    @classmethod
    def from_runs(cls, runs: dict[int, float]) -> SpinModel:
        """From ``{cycles: seconds}`` of timed spins, one of them of 1 cycle; the seconds are made
        non-decreasing (near the floor they jitter by a few ns).

        >>> SpinModel.from_runs({200: 0.74e-6, 1: 0.68e-6, 100: 0.675e-6}).seconds
        (6.8e-07, 6.8e-07, 7.4e-07)
        """
        cycles = tuple(sorted(runs))
        if cycles[0] != 1 or len(cycles) < 2:
            raise ValueError(f"a spin model needs a run of 1 cycle and one longer, got cycles {cycles}")
        seconds = tuple(itertools.accumulate((runs[c] for c in cycles), max))
        if seconds[-1] <= seconds[0]:
            raise ValueError(f"a spin of {cycles[-1]} cycles ({seconds[-1]:.3g} s) ran no longer than one of "
                             f"1 cycle ({seconds[0]:.3g} s): the device clock is not what the spin counts")
        return cls(cycles, seconds)


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
    extra_s: float  # seconds per call
    method: str
    every: int = 1  # one spin every this many calls (its samples are whole multiples of them)

    def aligned(self, budget: Budget) -> Budget:
        """``budget`` with every sample a whole number of spin periods, so each carries the same share.

        >>> Injected(0.05, 1.4e-6, 0.07e-6, "spin", every=10).aligned(Budget()).calls_multiple_of
        10
        """
        return dataclasses.replace(budget, calls_multiple_of=self.every)

    def info(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def slow_down(fn: Callable[[], object], fraction: float, *, mode: TimerMode, device,
              budget: Budget, part: TimedPart | None = None,
              activations: tuple = ()) -> tuple[Callable[[], object], Injected]:
    """``fn`` followed by a spin of ``fraction`` × its floor per call (measured now, with ``mode``);
    with ``part``, × the floor of that part of ``fn``'s kernels, spun in every call. Time the
    result with ``Injected.aligned(budget)`` (and the same ``activations``, for the step timer).

    >>> import torch
    >>> slow, injected = slow_down(lambda: torch.ones(256).sum(), 0.5, mode=TimerMode.WALL,
    ...                            device=torch.device("cpu"), budget=Budget(budget_ms=20, min_samples=5))
    >>> injected.extra_s > 0 and injected.extra_s == 0.5 * injected.base_floor_s, injected.every
    (True, 1)
    """
    pilot_budget = dataclasses.replace(budget, budget_ms=budget.budget_ms * _PILOT_SHARE)
    pilot = measure(fn, mode=mode, device=device, budget=pilot_budget, activations=activations)
    base = stats.floor(part.attribute(pilot.kernels)[0] if part is not None else pilot.samples)
    extra_s = fraction * base
    try:
        # a part's spin must be in every call: the kernel trace keeps only calls that launched the same kernels
        spin, every, method = spinner(device, extra_s, mode=mode, max_every=1 if part is not None else _MAX_EVERY)
    except InjectionOutOfReach as exc:
        raise InjectionOutOfReach(f"{fraction:.1%} of its {base * 1e6:.3f} µs floor is out of reach: {exc}") from None
    return _followed_by(fn, spin, every), Injected(fraction, base, extra_s, method, every)


def _followed_by(fn: Callable[[], object], spin: Callable[[], None], every: int) -> Callable[[], object]:
    """``fn``, with ``spin`` after every ``every``-th call.

    >>> calls = []
    >>> slowed = _followed_by(lambda: calls.append("fn"), lambda: calls.append("spin"), 2)
    >>> for _ in range(4): _ = slowed()
    >>> calls
    ['fn', 'fn', 'spin', 'fn', 'fn', 'spin']
    """
    count = itertools.count(1)

    def slowed() -> object:
        result = fn()
        if every == 1 or next(count) % every == 0:
            spin()
        return result

    return slowed


def spinner(device, seconds: float, *, mode: TimerMode = TimerMode.KERNEL,
            max_every: int = _MAX_EVERY) -> tuple[Callable[[], None], int, str]:
    """A callable that costs ``seconds`` per call on ``device`` when run after every ``every``-th
    call: ``(spin, every, how)``; on a GPU the spin's curve is timed with ``mode``."""
    if device.type == "cuda":
        import torch

        plan = _device_spin_model(device, mode).plan(seconds, max_every=max_every)
        how = "after every call" if plan.every == 1 else f"after every {plan.every}th call"
        return ((lambda: torch.cuda._sleep(plan.cycles)), plan.every,
                f"torch.cuda._sleep({plan.cycles} cycles, {plan.seconds * 1e6:.3f} µs by the {mode.value} timer) "
                f"{how} on the kernel's stream")
    return (lambda: _busy_wait(seconds)), 1, "busy-wait on time.perf_counter"


def _busy_wait(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _device_spin_model(device, mode: TimerMode) -> SpinModel:
    """The spin's curve on ``device`` by ``mode``'s timer (each rung's floor), timed once per process."""
    key = (str(device), TimerMode(mode))
    if key not in _spin_models:
        import torch

        budget = Budget(warmup_ms=2, budget_ms=100, min_samples=10)
        with torch.cuda.device(device):
            runs = {n: stats.floor(measure(lambda n=n: torch.cuda._sleep(n), mode=mode, device=device,
                                           budget=budget).samples) for n in _CALIBRATION_CYCLES}
        _spin_models[key] = SpinModel.from_runs(runs)
    return _spin_models[key]
