"""Traffic a kernel must move and the roofline figures derived from it, in one place."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Peaks", "Traffic", "roofline"]


@dataclass(frozen=True)
class Traffic:
    """The least a kernel must do: each input read once, each output written once."""

    bytes_read: int
    bytes_written: int
    flops: int = 0

    @property
    def bytes(self) -> int:
        return self.bytes_read + self.bytes_written

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(
            self.bytes_read + other.bytes_read,
            self.bytes_written + other.bytes_written,
            self.flops + other.flops,
        )


@dataclass(frozen=True)
class Peaks:
    """Ceilings of one device: memory bandwidth in bytes/s and dense bf16 tensor FLOP/s."""

    bytes_per_s: float
    flops_per_s: float
    source: str


def roofline(traffic: Traffic, seconds: float, peaks: Peaks | None) -> dict[str, float | str | None]:
    """Achieved rates and fractions of peak for one call that took ``seconds``.

    >>> r = roofline(Traffic(4_000, 4_000, 0), 1e-6, Peaks(8e9, 1e12, "test"))
    >>> r["achieved_gbps"], r["frac_peak_bw"]
    (8.0, 1.0)
    """
    gbps = traffic.bytes / seconds / 1e9 if seconds > 0 else 0.0
    tflops = traffic.flops / seconds / 1e12 if seconds > 0 else 0.0
    result: dict[str, float | str | None] = {
        "bytes_read": traffic.bytes_read,
        "bytes_written": traffic.bytes_written,
        "flops": traffic.flops,
        "arithmetic_intensity": traffic.flops / traffic.bytes if traffic.bytes else None,
        "achieved_gbps": gbps,
        "achieved_tflops": tflops,
        "frac_peak_bw": None,
        "frac_peak_flops": None,
        "bound": None,
        "peaks_source": None,
    }
    if peaks is not None:
        result["frac_peak_bw"] = gbps * 1e9 / peaks.bytes_per_s
        result["frac_peak_flops"] = tflops * 1e12 / peaks.flops_per_s if peaks.flops_per_s else None
        ridge = peaks.flops_per_s / peaks.bytes_per_s
        intensity = result["arithmetic_intensity"] or 0.0
        result["bound"] = "compute" if intensity > ridge else "memory"
        result["peaks_source"] = peaks.source
    return result
