"""Noise-aware comparison of a benchmark against its baseline: one verdict each.

A benchmark is measured in *runs* (one pytest session, one re-measure, one A/B
round); each run is a list of per-call samples. Samples of one run are not
independent draws of the benchmark's cost: the whole run shares the machine's
state (clocks, caches, a neighbour process), so two runs of an unchanged kernel
can differ far more than their samples suggest. The verdict therefore rests on
runs:

* each run is summarised by its floor, the 10th percentile of its samples:
  interference (another process, a preempted thread) only ever adds time, so the
  floor of a run moves far less between runs than its median does;
* the *level* of a side is the median of its run floors; ``ratio`` = level now /
  level of the baseline;
* SAME when ``ratio`` is within ``threshold``;
* SLOWER (FASTER) only when, in addition, **every** current run floor is beyond
  **every** baseline run floor by more than ``threshold`` (the between-run test:
  no pairing of runs explains the change as drift), and the pooled samples differ
  clearly within runs (Mann-Whitney U at ``alpha``);
* UNDECIDED otherwise (more runs decide: the plugin re-measures such cases), and
  also where a CPU run was measured on an oversubscribed machine (load average above
  1.5 per CPU): contention, not evidence.

A baseline that cannot be compared — other hardware, another timer mode, no raw
samples, a result marked invalid — is INCOMPARABLE. Only SLOWER fails a gate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from . import probe, stats

__all__ = [
    "MIN_SAMPLES",
    "Comparison",
    "GateThresholds",
    "Run",
    "Verdict",
    "compare_benchmark",
    "compare_runs",
    "compare_samples",
    "contention",
    "format_comparisons",
    "invalid_reason",
    "parse_threshold",
    "run_floor",
    "run_probes",
    "runs_of",
    "settled_run",
]

MIN_SAMPLES = 3  # a run with fewer samples says nothing about its floor
RUN_QUANTILE = 0.1  # a run's floor: the quantile that summarises it


class Verdict(str, Enum):
    SAME = "same"
    FASTER = "faster"
    SLOWER = "slower"
    UNDECIDED = "undecided"
    INCOMPARABLE = "incomparable"


@dataclass(frozen=True)
class GateThresholds:
    """``threshold``: smallest relative change that matters; ``alpha``: test level;
    ``max_load_per_cpu``: above this 1-minute load average per CPU a CPU run shared its
    cores with other work, and its timings say how busy the machine was, not how fast
    the kernel is."""

    threshold: float = 0.05
    alpha: float = 0.01
    max_load_per_cpu: float = 1.5
    # With one stored session the session-to-session spread is unknown: a change must then
    # clear the threshold by this much too. Two identical H200 sessions moved cuBLAS GEMMs
    # by up to 12.6 % (a per-process effect that re-measuring in one session cannot see).
    single_session_margin: float = 0.10


@dataclass(frozen=True)
class Run:
    """One more run of a case: its samples (s) and, on the CPU, the speed probe before and after it (µs)."""

    samples: list[float]
    speed_probe_us: list[float] | None = None


@dataclass(frozen=True)
class Comparison:
    name: str
    verdict: Verdict
    ratio: float | None  # level now / level of the baseline
    p_value: float | None  # within-run Mann-Whitney U on the pooled samples
    reason: str
    runs: tuple[int, int] = (0, 0)  # (baseline runs, current runs) the verdict rests on

    @property
    def change(self) -> float | None:
        """Relative change of the level (+0.07 = 7 % slower)."""
        return None if self.ratio is None else self.ratio - 1


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


def compare_runs(
    baseline_runs: Sequence[Sequence[float]],
    current_runs: Sequence[Sequence[float]],
    thresholds: GateThresholds = GateThresholds(),
    name: str = "",
    apart_margin: float = 0.0,
) -> Comparison:
    """The verdict for runs of samples (seconds; one inner sequence per run, newest last).
    ``apart_margin``: how much further than the threshold every current run must lie from
    the baseline's level (against one stored session, its unknown session-to-session spread).

    >>> base = [[10.0, 10.1, 9.9, 10.0, 10.2, 9.8, 10.0, 10.1, 9.9, 10.0]]
    >>> compare_runs(base, [[v * 1.3 for v in base[0]]] * 2).verdict
    <Verdict.SLOWER: 'slower'>
    >>> compare_runs(base, [[v * 1.3 for v in base[0]], base[0]]).verdict  # one slow run: drift?
    <Verdict.UNDECIDED: 'undecided'>
    >>> compare_runs(base, [[v * 1.6 for v in base[0]], [v * 1.03 for v in base[0]]]).verdict  # one run near
    <Verdict.UNDECIDED: 'undecided'>
    """
    base = [list(r) for r in baseline_runs if len(r) >= MIN_SAMPLES]
    now = [list(r) for r in current_runs if len(r) >= MIN_SAMPLES]
    runs = (len(base), len(now))
    if not base or not now:
        return Comparison(name, Verdict.UNDECIDED, None, None, f"no run with {MIN_SAMPLES}+ samples on a side", runs)
    med_base, med_now = [run_floor(r) for r in base], [run_floor(r) for r in now]
    level_base = stats.median(med_base)
    ratio = stats.median(med_now) / level_base
    change = ratio - 1
    # With 3+ baseline runs the one farthest in the direction of the change is left out of the
    # tests below: on the 2-core CPU about 1 session in 12 had one case +25-60 % for its whole
    # run, and a stored run like that would otherwise hide any regression smaller than it.
    if len(base) >= 3:
        drop = med_base.index(max(med_base) if change > 0 else min(med_base))
        base, med_base = base[:drop] + base[drop + 1:], med_base[:drop] + med_base[drop + 1:]
    pooled_now, pooled_base = [v for r in now for v in r], [v for r in base for v in r]
    p_value = stats.mann_whitney_p(pooled_now, pooled_base)
    if abs(change) <= thresholds.threshold:
        return Comparison(name, Verdict.SAME, ratio, p_value, f"within ±{thresholds.threshold:.1%}", runs)
    # Between-run check: every current run's floor must lie beyond every baseline run's floor
    # and beyond the threshold from the baseline's level. Drift (a slow moment, a slow process)
    # moves single runs; a real change moves all, so one current run near the baseline leaves
    # the verdict open for more runs. With 4+ runs a side (interleaved A/B rounds, a long
    # history) a few inversions are allowed: then the run floors themselves must differ
    # clearly (Mann-Whitney on the floors).
    if change > 0:
        apart = min(med_now) > max(max(med_base), level_base * (1 + thresholds.threshold + apart_margin))
    else:
        apart = max(med_now) < min(min(med_base), level_base * (1 - thresholds.threshold - apart_margin))
    floors_differ = min(runs) >= 4 and stats.mann_whitney_p(med_now, med_base) < thresholds.alpha
    between = apart or floors_differ
    within = p_value < thresholds.alpha
    detail = f"{change:+.1%}, p={p_value:.2g}, runs {runs[0]} then {runs[1]}"
    if between and within:
        return Comparison(name, Verdict.SLOWER if change > 0 else Verdict.FASTER, ratio, p_value, detail, runs)
    why = ("a run lies within the threshold or among the other side's runs (drift?)" if not between
           else "not clear of the within-run noise")
    return Comparison(name, Verdict.UNDECIDED, ratio, p_value, f"{detail}; {why}: more runs decide", runs)


def run_floor(samples: Sequence[float]) -> float:
    """The summary of one run: the 10th percentile of its samples.

    >>> run_floor([10.0, 10.0, 11.0, 12.0, 30.0, 45.0, 50.0, 60.0, 61.0, 90.0, 95.0])
    10.0
    """
    return stats.quantile(samples, RUN_QUANTILE)


def compare_samples(
    name: str, current: Sequence[float], baseline: Sequence[float], thresholds: GateThresholds = GateThresholds()
) -> Comparison:
    """The verdict for one run on each side (see :func:`compare_runs`).

    >>> base = [10.0, 10.1, 9.9, 10.0, 10.2, 9.8, 10.0, 10.1, 9.9, 10.0]
    >>> compare_samples("x", [v * 1.2 for v in base], base).verdict
    <Verdict.SLOWER: 'slower'>
    >>> compare_samples("x", [v * 1.01 for v in base], base).verdict
    <Verdict.SAME: 'same'>
    """
    return compare_runs([baseline], [current], thresholds, name)


def invalid_reason(entry: Mapping) -> str | None:
    """Why a stored benchmark entry must not be judged or used as a baseline, or None.

    >>> invalid_reason({"extra_info": {"invalid": "client TPOT 0.01 ms vs server 3.9 ms"}})
    'client TPOT 0.01 ms vs server 3.9 ms'
    """
    reason = (entry.get("extra_info") or {}).get("invalid")
    return str(reason) if reason else None


def runs_of(entry: Mapping) -> list[list[float]]:
    """The runs a pytest-benchmark entry holds: its samples, then any re-measured runs.

    >>> runs_of({"stats": {"data": [1.0, 2.0]}, "extra_info": {"resamples": [[3.0]]}})
    [[1.0, 2.0], [3.0]]
    """
    data = (entry.get("stats") or {}).get("data") or []
    extra = (entry.get("extra_info") or {}).get("resamples") or []
    return [list(r) for r in [data, *extra] if r]


def run_probes(entry: Mapping) -> list[float | None]:
    """The speed probe of each run of :func:`runs_of` (mean of before and after, µs), None where
    a run has none (GPU results, results stored before the probe existed).

    >>> run_probes({"stats": {"data": [1.0]}, "extra_info": {"speed_probe_us": [10.0, 12.0],
    ...             "resamples": [[2.0]], "resample_probes_us": [None]}})
    [11.0, None]
    """
    info = entry.get("extra_info") or {}
    pairs = [info.get("speed_probe_us"), *(info.get("resample_probes_us") or [])]
    runs = len(runs_of(entry))
    pairs = (pairs + [None] * runs)[:runs]
    return [sum(p) / len(p) if p else None for p in pairs]


def settled_run(entry: Mapping) -> list[float]:
    """The run a stored session counts with: its fastest (lowest floor). A session re-measured
    a case because a run was slow or unclear; the slow run was a moment, not the build.

    >>> settled_run({"stats": {"data": [3.0, 3.1, 3.0]}, "extra_info": {"resamples": [[2.0, 2.1, 2.0]]}})
    [2.0, 2.1, 2.0]
    """
    return _settled(entry)[0]


def _settled(entry: Mapping) -> tuple[list[float], float | None]:
    """:func:`settled_run` and its speed probe."""
    runs = [(r, p) for r, p in zip(runs_of(entry), run_probes(entry), strict=True) if len(r) >= MIN_SAMPLES]
    return min(runs, key=lambda rp: run_floor(rp[0])) if runs else ([], None)


def contention(entry: Mapping, max_load_per_cpu: float = GateThresholds.max_load_per_cpu) -> str | None:
    """Why a CPU result was measured on an oversubscribed machine, or None.

    >>> contention({"extra_info": {"telemetry_after": {"loadavg_1m": 13.1, "cpus": 2}}})
    'the CPU was oversubscribed while measuring (load average 13.1 on 2 CPUs)'
    """
    info = entry.get("extra_info") or {}
    readings = [info.get(k) or {} for k in ("telemetry_before", "telemetry_after")]
    loads = [(r["loadavg_1m"], r["cpus"]) for r in readings if r.get("loadavg_1m") is not None and r.get("cpus")]
    busy = [(load, cpus) for load, cpus in loads if load > max_load_per_cpu * cpus]
    if not busy:
        return None
    load, cpus = max(busy)
    return f"the CPU was oversubscribed while measuring (load average {load:.1f} on {cpus} CPUs)"


def compare_benchmark(
    current: Mapping, baselines: Sequence[Mapping], thresholds: GateThresholds, fingerprint_match: bool = True
) -> Comparison:
    """Compare a pytest-benchmark JSON entry with its stored entries (oldest first).

    Entries look like ``{'stats': {'data': [...]}, 'extra_info': {...}}``; a mapping
    instead of a sequence is taken as one baseline entry.
    """
    name = current.get("fullname") or current.get("name", "?")
    if isinstance(baselines, Mapping):
        baselines = [baselines]
    refused = _refusal(current, baselines, fingerprint_match)
    if refused:
        return Comparison(name, Verdict.INCOMPARABLE, None, None, refused)
    timer = (current.get("extra_info") or {}).get("timer")
    usable = [b for b in baselines if not invalid_reason(b) and (b.get("extra_info") or {}).get("timer") == timer]
    settled = [(run, probe) for run, probe in map(_settled, usable) if run]
    base_runs = [run for run, _ in settled]
    if not base_runs:
        return Comparison(name, Verdict.UNDECIDED, None, None, "baseline has no raw samples (saved without data)")
    margin = thresholds.single_session_margin if len(usable) < 2 else 0.0
    kept, aside = _machine_speed_check(runs_of(current), run_probes(current), [p for _, p in settled])
    verdict = compare_runs(base_runs, kept or runs_of(current), thresholds, name, apart_margin=margin)
    verdict = _one_session_margin(verdict, len(usable), thresholds)
    # most runs off the baseline's speed: the baseline may be the odd one, so pick no run to
    # match it; not even a SAME (the two sides ran on a different machine, in effect)
    if aside and len(kept) <= len(runs_of(current)) - len(kept):
        return Comparison(name, Verdict.UNDECIDED, verdict.ratio, verdict.p_value,
                          f"{verdict.reason}; {aside}: the machine changed, not evidence", verdict.runs)
    if aside:
        verdict = dataclasses.replace(verdict, reason=f"{verdict.reason}; runs set aside: {aside}")
    limit = thresholds.max_load_per_cpu
    busy = next(filter(None, (contention(e, limit) for e in [current, *usable])), None)
    if busy and verdict.verdict in (Verdict.SLOWER, Verdict.FASTER):
        return Comparison(name, Verdict.UNDECIDED, verdict.ratio, verdict.p_value,
                          f"{verdict.reason}; {busy}: contention, not evidence", verdict.runs)
    return verdict


def _machine_speed_check(runs: list[list[float]], probes: list[float | None],
                         baseline_probes: list[float | None]) -> tuple[list[list[float]], str]:
    """The current runs whose speed probe agrees with the baseline's (within
    :data:`decodebench.probe.TOLERANCE`), and what was set aside; all runs when either
    side has no probe.

    >>> _machine_speed_check([[1.0], [2.0]], [100.0, 130.0], [100.0])
    ([[1.0]], '1 of 2 runs at machine speed probe +30%')
    """
    known = [p for p in baseline_probes if p is not None]
    if not known:
        return runs, ""
    level = stats.median(known)
    off = {i: p / level - 1 for i, p in enumerate(probes) if p is not None and abs(p / level - 1) > probe.TOLERANCE}
    if not off:
        return runs, ""
    worst = max(off.values(), key=abs)
    kept = [r for i, r in enumerate(runs) if i not in off]
    return kept, f"{len(off)} of {len(runs)} runs at machine speed probe {worst:+.0%}"


def _one_session_margin(verdict: Comparison, sessions: int, thresholds: GateThresholds) -> Comparison:
    """A SLOWER/FASTER against a single stored session must also clear ``single_session_margin``
    (an UNDECIDED inside it says so too).

    >>> c = Comparison("k", Verdict.SLOWER, 1.126, 1e-6, "+12.6%")
    >>> _one_session_margin(c, 1, GateThresholds()).verdict, _one_session_margin(c, 2, GateThresholds()).verdict
    (<Verdict.UNDECIDED: 'undecided'>, <Verdict.SLOWER: 'slower'>)
    """
    open_ = verdict.verdict in (Verdict.SLOWER, Verdict.FASTER, Verdict.UNDECIDED) and verdict.ratio is not None
    if not open_ or sessions >= 2 or abs(verdict.ratio - 1) > thresholds.threshold + thresholds.single_session_margin:
        return verdict
    return Comparison(verdict.name, Verdict.UNDECIDED, verdict.ratio, verdict.p_value,
                      f"{verdict.reason}; one stored session, so session-to-session spread is unknown: "
                      f"below {thresholds.threshold + thresholds.single_session_margin:.0%} it takes 2+ stored "
                      "sessions to decide", verdict.runs)


def _refusal(current: Mapping, baselines: Sequence[Mapping], fingerprint_match: bool) -> str | None:
    """Why ``current`` cannot be judged against ``baselines`` at all, or None."""
    if not fingerprint_match:
        return "baseline is from other hardware or software"
    if invalid_reason(current):
        return f"this result is marked invalid: {invalid_reason(current)}"
    valid = [b for b in baselines if not invalid_reason(b)]
    if not valid:
        reasons = "; ".join(filter(None, map(invalid_reason, baselines))) or "none stored"
        return f"no valid baseline ({reasons})"
    timer_now = (current.get("extra_info") or {}).get("timer")
    timer_then = (valid[-1].get("extra_info") or {}).get("timer")
    if timer_now != timer_then:
        return f"timer {timer_now!r} now, {timer_then!r} in the baseline"
    return None


ORDER = {Verdict.SLOWER: 0, Verdict.UNDECIDED: 1, Verdict.INCOMPARABLE: 2, Verdict.FASTER: 3, Verdict.SAME: 4}


def format_comparisons(comparisons: Iterable[Comparison]) -> list[str]:
    """One line per comparison, slowest first, for the terminal summary."""
    lines = []
    for c in sorted(comparisons, key=lambda c: (ORDER[c.verdict], -(c.ratio or 0))):
        ratio = f"{c.ratio:7.3f}x" if c.ratio is not None else "      -"
        lines.append(f"{c.verdict.value.upper():<12} {ratio}  {c.name}  ({c.reason})")
    return lines
