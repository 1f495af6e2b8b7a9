"""Noise-aware comparison of a benchmark against its baseline: one verdict each.

A change is SLOWER (or FASTER) only when it is both larger than a practical
threshold and statistically clear: a Mann-Whitney U test on the raw samples
rejects "same distribution" at ``alpha``, and the 95 % intervals of the two
medians do not overlap. A change inside the threshold is SAME. Anything else is
UNDECIDED (a re-run decides), and a baseline that cannot be compared — other
hardware, another timer mode, no raw samples — is INCOMPARABLE. Only SLOWER fails
a gate; FASTER never does.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from . import stats

__all__ = [
    "Comparison",
    "GateThresholds",
    "Verdict",
    "compare_benchmark",
    "compare_samples",
    "format_comparisons",
    "parse_threshold",
]


class Verdict(str, Enum):
    SAME = "same"
    FASTER = "faster"
    SLOWER = "slower"
    UNDECIDED = "undecided"
    INCOMPARABLE = "incomparable"


@dataclass(frozen=True)
class GateThresholds:
    """``threshold``: smallest relative change that matters; ``alpha``: test level."""

    threshold: float = 0.05
    alpha: float = 0.01


@dataclass(frozen=True)
class Comparison:
    name: str
    verdict: Verdict
    ratio: float | None  # median now / median baseline
    p_value: float | None
    reason: str


def parse_threshold(text: str) -> float:
    """``'5%'`` or ``'0.05'`` -> 0.05; rejects anything outside (0, 10).

    >>> parse_threshold("5%"), parse_threshold("0.1")
    (0.05, 0.1)
    """
    raw = text.strip()
    try:
        value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    except ValueError:
        raise ValueError(f"threshold {text!r} is not a number or a percentage like '5%'") from None
    if not 0 < value < 10:
        raise ValueError(f"threshold {text!r} must be above 0 and below 1000%")
    return value


def compare_samples(
    name: str, current: Sequence[float], baseline: Sequence[float], thresholds: GateThresholds = GateThresholds()
) -> Comparison:
    """The verdict for two sets of per-call samples (seconds).

    >>> base = [10.0, 10.1, 9.9, 10.0, 10.2, 9.8, 10.0, 10.1, 9.9, 10.0]
    >>> compare_samples("x", [v * 1.2 for v in base], base).verdict
    <Verdict.SLOWER: 'slower'>
    >>> compare_samples("x", [v * 1.01 for v in base], base).verdict
    <Verdict.SAME: 'same'>
    """
    if len(current) < 3 or len(baseline) < 3:
        return Comparison(name, Verdict.UNDECIDED, None, None, "fewer than 3 samples on a side")
    ratio = stats.median(current) / stats.median(baseline)
    p_value = stats.mann_whitney_p(current, baseline)
    change = ratio - 1
    if abs(change) <= thresholds.threshold:
        return Comparison(name, Verdict.SAME, ratio, p_value, f"within ±{thresholds.threshold:.1%}")
    cur_lo, cur_hi = stats.median_ci(current)
    base_lo, base_hi = stats.median_ci(baseline)
    separated = cur_lo > base_hi if change > 0 else cur_hi < base_lo
    if p_value < thresholds.alpha and separated:
        verdict = Verdict.SLOWER if change > 0 else Verdict.FASTER
        return Comparison(name, verdict, ratio, p_value, f"{change:+.1%}, p={p_value:.2g}")
    return Comparison(name, Verdict.UNDECIDED, ratio, p_value,
                      f"{change:+.1%} but not clear of the noise (p={p_value:.2g}); re-run to decide")


def compare_benchmark(
    current: Mapping, baseline: Mapping, thresholds: GateThresholds, fingerprint_match: bool = True
) -> Comparison:
    """Compare two pytest-benchmark JSON entries (``{'stats': {'data': [...]}, 'extra_info': {...}}``)."""
    name = current.get("fullname") or current.get("name", "?")
    if not fingerprint_match:
        return Comparison(name, Verdict.INCOMPARABLE, None, None, "baseline is from other hardware or software")
    timer_now = current.get("extra_info", {}).get("timer")
    timer_then = baseline.get("extra_info", {}).get("timer")
    if timer_now != timer_then:
        return Comparison(name, Verdict.INCOMPARABLE, None, None,
                          f"timer {timer_now!r} now, {timer_then!r} in the baseline")
    data_now = current.get("stats", {}).get("data")
    data_then = baseline.get("stats", {}).get("data")
    if not data_then:
        return Comparison(name, Verdict.UNDECIDED, None, None, "baseline has no raw samples (saved without data)")
    return compare_samples(name, data_now or [], data_then, thresholds)


def format_comparisons(comparisons: Iterable[Comparison]) -> list[str]:
    """One line per comparison, slowest first, for the terminal summary."""
    order = {Verdict.SLOWER: 0, Verdict.UNDECIDED: 1, Verdict.INCOMPARABLE: 2, Verdict.FASTER: 3, Verdict.SAME: 4}
    lines = []
    for c in sorted(comparisons, key=lambda c: (order[c.verdict], -(c.ratio or 0))):
        ratio = f"{c.ratio:7.3f}x" if c.ratio is not None else "      -"
        lines.append(f"{c.verdict.value.upper():<12} {ratio}  {c.name}  ({c.reason})")
    return lines
