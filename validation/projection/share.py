"""How much of the fused Marlin MoE's SM time and memory time overlap, read from its times on fewer SMs.

The team's ``sm_count.py --out DIR`` (docs/projection.md; on a CUDA machine with vLLM) times the fused MoE of
Kimi-K2.5 at TP 8 (uniform routing) on the whole GPU and inside CUDA green contexts of fewer SMs, and
writes ``DIR/sm-count.json``. This module reads such a file; it needs no GPU. The product's rule takes
the share as a parameter with a stated default (``projection_rule.MOE_OVERLAP``), and the cross-GPU checks
apply the product's rule; ``overlap.py`` fits each GPU with the share its own runs read
(:func:`fit_with_share`) beside it.

On N SMs Marlin's blocks (one per SM of the whole GPU: its launcher reads the device's SM count, which a
green context does not change) run in ``ceil(SMs / N)`` waves. Where a case needs four or more waves, each
wave's share of the memory time is a quarter or less, so the SM time ``s`` of the whole GPU's call can be
read from those counts (:func:`two_stage`). With ``m``, the case's bytes over the GPU's achievable DRAM
bandwidth, the whole GPU's time above the floor ``a`` then gives the **overlap share**::

    a = s + m - k * min(s, m)        k = (s + m - a) / min(s, m)

0 adds the two times, 1 takes the larger. :func:`overlap_share` is the median ``k`` over the cases of one
GPU's files at M >= 64 (at M = 16 the whole GPU took the sum of the two or more in five of nine runs on two
GPU models: something the SM count does not change bounds it there).
"""

from __future__ import annotations

import math
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from decodebench.attribution.predict import projection_rule as rule  # noqa: E402
from decodebench.files import read_json  # noqa: E402
from decodebench.hardware import device_spec  # noqa: E402
from decodebench.registry import get  # noqa: E402

SCARCE_WAVES = 4  # counts with at least this many of Marlin's waves set the SM time (memory's share is small)
MIN_TOKENS = 64  # the fewest tokens of a case whose overlap share is read


def load(path: Path) -> dict:
    """An ``sm-count.json``, checked: ValueError naming the file and the field that is missing or wrong."""
    try:
        data = read_json(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not an sm-count.json ({exc})") from None
    problem = _problem(data)
    if problem:
        raise ValueError(f"{path}: not an sm-count.json that sm_count.py --out wrote: {problem}")
    return data


def _problem(data) -> str | None:
    if not isinstance(data, dict):
        return "not a JSON object"
    if not isinstance(data.get("gpu"), str) or not data["gpu"]:
        return "no 'gpu' name"
    if not isinstance(data.get("sms"), int) or data["sms"] < 1:
        return "'sms' is not a positive integer"
    if not isinstance(data.get("points"), list):
        return "no 'points' list"
    for i, q in enumerate(data["points"]):
        if not isinstance(q, dict) or not isinstance(q.get("case"), str):
            return f"point {i} has no 'case'"
        if not isinstance(q.get("tokens"), int) or not _positive(q.get("moe_bytes")):
            return f"point {i} ({q['case']}) needs a whole 'tokens' and a positive 'moe_bytes'"
        us = q.get("us")
        if not isinstance(us, dict) or "all" not in us or not all(_positive(t) for t in us.values()):
            return f"point {i} ({q['case']}): 'us' needs a positive time for 'all' and for each SM count"
        if not all(k == "all" or (k.isdigit() and 0 < int(k) <= data["sms"]) for k in us):
            return f"point {i} ({q['case']}): 'us' keys must be 'all' or SM counts up to {data['sms']}"
    return None


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _bisect(f: Callable[[float], float], lo: float, hi: float, steps: int = 100) -> float:
    """The root of ``f`` between ``lo`` and ``hi`` (``f`` changes sign once there), by bisection; ValueError
    where it does not change sign."""
    f_lo = f(lo)
    if (f_lo > 0) == (f(hi) > 0):
        raise ValueError(f"no root between {lo:g} and {hi:g}: the times do not fit the wave model")
    for _ in range(steps):
        mid = (lo + hi) / 2
        if (f(mid) > 0) == (f_lo > 0):
            lo, f_lo = mid, f(mid)
        else:
            hi = mid
    return (lo + hi) / 2


def wave_times(s: float, m: float, sms: int, n: int, p: float) -> float:
    """Marlin's ``sms`` blocks on ``n`` SMs, wave by wave: each wave's blocks take the SM time ``s`` combined
    by ``p`` with their share of the memory time ``m`` (the whole GPU's blocks read it all in one wave).

    >>> round(wave_times(100.0, 80.0, 132, 66, 1.0), 1)  # two waves, each the sum of s and half of m
    280.0
    """
    full, rest = divmod(sms, n)
    return sum((s ** p + (m * k / sms) ** p) ** (1 / p) for k in [n] * full + ([rest] if rest else []))


def two_stage(above: dict[int, float], m: float, sms: int) -> tuple[float, float | None, list[int]]:
    """The SM time ``s`` and the exponent ``p`` of one case, from its times above the floor per SM count
    (``sms`` for the whole GPU). ``s``: the median, over the counts that need at least ``SCARCE_WAVES`` of
    Marlin's waves, of the per-block SM time that makes :func:`wave_times` equal the time there (there
    each wave's memory share is a quarter of ``m`` or less, so ``s`` barely depends on ``p``). ``p``: the
    one that makes the whole GPU's time ``(s^p + m^p)^(1/p)``. Alternated from p = 2 until ``p`` settles.
    ``p`` is None where the whole GPU's time is no more than the larger of ``s`` and ``m`` (any p: the
    larger), and 1.0 where it is the sum or more. Also returns the counts that set ``s``."""
    scarce = sorted(n for n in above if n != sms and math.ceil(sms / n) >= SCARCE_WAVES)
    if not scarce:
        raise ValueError(f"no SM count with {SCARCE_WAVES} or more waves of {sms} blocks to set the SM time")
    p: float | None = 2.0
    for _ in range(50):
        q = p or 64.0
        s = statistics.median(_bisect(lambda x, n=n, q=q: wave_times(x, m, sms, n, q) - above[n], 1e-6, above[n])
                              for n in scarce)
        whole = above[sms]
        if whole <= max(s, m):
            new = None
        elif whole >= s + m:
            new = 1.0
        else:
            new = _bisect(lambda x, s=s, whole=whole: (s ** x + m ** x) ** (1 / x) - whole, 1.0, 64.0)
        if new == p or (new and p and abs(new - p) < 1e-8):
            return s, new, scarce
        p = new
    return s, p, scarce


class Estimate(NamedTuple):
    """One case's two-stage reading: its times above the floor per SM count, its memory time, and
    :func:`two_stage`'s SM time, p and the counts that set the SM time; ``summed``: the whole GPU took
    the sum of the two or more (``p`` is then 1.0)."""

    above: dict[int, float]
    m: float
    s: float
    p: float | None
    scarce: list[int]
    summed: bool

    @property
    def overlap(self) -> float:
        """``k`` of ``a = s + m - k min(s, m)``, ``a`` the whole GPU's time above the floor."""
        return (self.s + self.m - self.above[max(self.above)]) / min(self.s, self.m)


def estimate(point: dict, sms: int, floor_us: float, dram_bytes_per_s: float) -> Estimate:
    """:func:`two_stage` on one point of an ``sm-count.json`` (``sms``: the whole GPU's SM count)."""
    above = {(sms if k == "all" else int(k)): t - floor_us for k, t in point["us"].items()}
    m = point["moe_bytes"] / dram_bytes_per_s * 1e6
    s, p, scarce = two_stage(above, m, sms)
    return Estimate(above, m, s, p, scarce, above[sms] >= s + m)


def result_name(case: str) -> str:
    """The benchmark result of an ``sm-count.json`` case id: ``benchmarks/test_moe.py``'s vLLM case."""
    return f"test_moe[{case}-vllm]"


def readings(path: Path, gpu: str, floor_us: Callable[[str], float], dram_bytes_per_s: float,
             measured_us: Callable[[str], float | None] = lambda case: None) -> list[tuple[dict, Estimate, bool]]:
    """Each point of one run measured on a ``gpu`` (the device table's name, such as ``H100 SXM``), read at
    that GPU's fitted floor (``floor_us(case id)``: the floor per launch times the case's launches) and
    achievable DRAM bandwidth: (the point, its :class:`Estimate`, whether its whole-GPU time is the results').

    The whole GPU's time of a case is the rule's own measured time of it (``measured_us(case id)``: the
    results' kernel timer, the profiler's kernel time per call) where the results hold the case, since the
    rule carries that time to the other GPU: the run's own whole-GPU time is a loop timed by CUDA events,
    which adds the host's launch gaps (on the lent GPUs −5 to +39 µs at M >= 64, and at small M, where the
    loop is host-bound, up to twice the kernel time). At 4+ waves the GPU work per call is long enough that
    the gaps hide. ValueError naming the file when it is not an sm-count.json of that GPU."""
    data = load(path)
    spec = device_spec(data["gpu"])
    if spec is None or spec.name != gpu:
        raise ValueError(f"{path}: measured on {data['gpu']}, not on an {gpu}")
    out = []
    for q in data["points"]:
        whole = measured_us(q["case"])
        point = q if whole is None else {**q, "us": {**q["us"], "all": whole}}
        out.append((q, estimate(point, data["sms"], floor_us(q["case"]), dram_bytes_per_s), whole is not None))
    return out


def overlap_share(paths: Sequence[Path], gpu: str, floor_us: Callable[[str], float], dram_bytes_per_s: float,
                  measured_us: Callable[[str], float | None] = lambda case: None) -> tuple[float, str]:
    """The median overlap share of the fused MoE over the cases at M >= ``MIN_TOKENS`` of ``paths``, each
    read by :func:`readings`; and how it was obtained. ValueError naming the file whose GPU is another, or
    the files where none holds such a case."""
    read = [(e.overlap, own) for path in paths for q, e, own in readings(path, gpu, floor_us, dram_bytes_per_s,
                                                                        measured_us) if q["tokens"] >= MIN_TOKENS]
    files = ", ".join(map(str, paths))
    if not read:
        raise ValueError(f"{files}: no fused MoE case at M >= {MIN_TOKENS} to read the overlap share from")
    ks = [k for k, _ in read]
    own = sum(o for _, o in read)
    k = statistics.median(ks)
    whole = ("the results' kernel-timer time" if own == len(ks) else
             f"the results' kernel-timer time for {own} of them, the run's own CUDA-event time for the rest")
    return k, (f"{k:.3f}: the median over {len(ks)} fused MoE cases at M >= {MIN_TOKENS} of {files} "
               f"(sm_count.py: the SM time from the counts of {SCARCE_WAVES}+ of Marlin's waves, the memory time at "
               f"this fit's DRAM rate, the whole GPU's time {whole}; spread {min(ks):.3f}-{max(ks):.3f})")


def moe_timing(cases, floor_us: float) -> tuple[Callable[[str], float], Callable[[str], float | None]]:
    """How an ``sm-count.json`` case is read against a GPU's ``cases``: its floor (``floor_us`` per launch times
    the case's launches; a fused MoE's declared launches where the results lack it), and its time timed warm in
    the results (None where they lack it)."""
    launches = {c.name: c.kernels for c in cases}
    timed = {c.name: c.median_us for c in cases if rule.CACHE_STATES[c.timer] == "warm" and rule.is_fused_moe(c)}
    return (lambda case: launches.get(result_name(case), get("moe").launches) * floor_us,
            lambda case: timed.get(result_name(case)))


def fit_with_share(cases, facts, fitted_on: str, sm_counts: Sequence[Path]) -> rule.RuleParams:
    """The product's fit of one GPU, its fused MoE's overlap share read from that GPU's runs (none: the
    product's default); ValueError where the runs are another GPU's or read a share outside [0, 1)."""
    params = rule.fit(cases, facts, fitted_on)
    if not sm_counts:
        return params
    floor_us, measured_us = moe_timing(cases, params.floor_us)
    k, how = overlap_share(sm_counts, facts.name, floor_us, rule.DeviceModel(facts, params).dram_bytes_per_s,
                           measured_us)
    return rule.fit(cases, facts, fitted_on, moe_overlap=(k, how))
