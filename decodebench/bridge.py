"""Feed device-measured samples into pytest-benchmark's own statistics.

pytest-benchmark reads a timer before and after each round. Benchmarks here set
that timer to :data:`DEVICE_CLOCK`, a clock that only moves when a measured sample
is replayed into it, and run ``benchmark.pedantic`` with one round per sample: the
stored rounds are then exactly the measured samples, and pytest-benchmark's stats,
storage, ``--benchmark-compare`` and histograms work on them unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

from .results import record_facts

__all__ = ["DEVICE_CLOCK", "DeviceClock", "record_samples"]


class DeviceClock:
    """A clock (seconds) that advances by the sample being replayed, and otherwise stands still."""

    __name__ = "device_clock"

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def reset(self) -> None:
        """Back to zero, so a round reads exactly ``0`` then ``seconds`` (no rounding drift)."""
        self.now = 0.0


DEVICE_CLOCK = DeviceClock()


def record_samples(benchmark, samples: Sequence[float], extra_info: dict | None = None) -> None:
    """Store ``samples`` (seconds per call) as the rounds of a pytest-benchmark ``benchmark``.

    Raises :class:`~decodebench.entry_check.ImpossibleResult` (nothing is recorded) when a sample
    cannot be a time (NaN, infinite, zero or negative) or ``extra_info`` holds a field no reader
    of stored results could use.

    The test must run with ``@pytest.mark.benchmark(timer=DEVICE_CLOCK)``; the
    decodebench plugin adds that marker to every benchmark under ``benchmarks/``.

    Example::

        def test_allreduce(benchmark):
            record_samples(benchmark, [12.1e-6, 12.0e-6, 12.3e-6], {"busbw_gbps": 40.2})
    """
    if not samples:
        raise ValueError("no samples to record")
    timer = getattr(benchmark, "_timer", None)
    if timer is not None and timer is not DEVICE_CLOCK:
        raise RuntimeError(
            "this benchmark's timer is not decodebench's device clock; "
            "mark it with @pytest.mark.benchmark(timer=decodebench.bridge.DEVICE_CLOCK)"
        )
    # a NaN, zero or negative time fails the case here, before pytest-benchmark keeps it
    record_facts(benchmark, samples, extra_info)
    pending = iter(samples)

    def replay() -> None:
        DEVICE_CLOCK.now += next(pending)

    benchmark.pedantic(replay, setup=DEVICE_CLOCK.reset, rounds=len(samples), iterations=1, warmup_rounds=0)
