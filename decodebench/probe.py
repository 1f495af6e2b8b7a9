"""The machine's speed at a moment: a fixed CPU workload timed before and after each CPU run.

On a shared CPU the machine itself slows down for seconds at a time (on the 2-core CI
machine: every case +20 %, then +30 %, while another process worked on the other core),
and a run caught in such a period looks like a regression. The probe is the same small
torch workload every time (an RMSNorm of 16×7168 and a 16×1024×1024 matmul, fixed inputs,
one thread as the session runs): its floor moved ±2 % (5–95 %) over quiet minutes and
+9 … +29 % in those periods. The gate sets aside a run whose probe differs from the
baseline's by more than :data:`TOLERANCE` (see :func:`decodebench.compare.compare_benchmark`).
"""

from __future__ import annotations

import functools
import time

__all__ = ["TOLERANCE", "speed_probe_us"]

TOLERANCE = 0.05  # a run whose probe is off the baseline's by more than this is set aside
_REPEATS = 20
_QUANTILE = 0.1


@functools.cache
def _inputs():
    import torch

    g = torch.Generator().manual_seed(0)
    return (torch.randn(16, 7168, generator=g), torch.randn(16, 1024, generator=g),
            torch.randn(1024, 1024, generator=g))


def _workload() -> None:
    import torch

    x, a, w = _inputs()
    (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)).sum()
    (a @ w).sum()


def speed_probe_us(repeats: int = _REPEATS) -> float:
    """The floor (10th percentile) of ``repeats`` timings of the fixed workload, in µs (~10 ms in all).

    >>> speed_probe_us(3) > 0
    True
    """
    _workload()  # first call: allocation, library dispatch
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        _workload()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[int(_QUANTILE * (len(times) - 1))] * 1e6
