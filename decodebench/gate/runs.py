"""What the gate makes of a result entry's record (:mod:`decodebench.results`): its runs' values, an A/B entry's
pair differences, what makes it unusable, and what sets it apart from a stored one.

Each function takes a :class:`~decodebench.results.Result`; a plain entry (a dict, as readers outside
the gate hold) is read into one first (:func:`~decodebench.results.record_of`).
"""

from __future__ import annotations

from collections.abc import Mapping

from ..results import SETUP_FACTS, SWEEP_KEYS, Result, kernel_signature, record_of
from .decision import run_value

__all__ = [
    "MIN_SAMPLES",
    "SETUP_FACTS",
    "SWEEP_KEYS",
    "contention",
    "invalid_reason",
    "kernel_signature",
    "pair_differences",
    "paired_runs",
    "run_values",
    "runs_of",
    "setup_change",
    "timer_of",
    "tokens_of",
]

MIN_SAMPLES = 3  # a run with fewer samples says nothing about its floor (10th percentile)


def runs_of(entry: Result | Mapping) -> list[list[float]]:
    """The runs an entry holds: its samples, then any re-measured runs (seconds per call).

    >>> runs_of({"stats": {"data": [1.0, 2.0]}, "extra_info": {"resamples": [[3.0]]}})
    [[1.0, 2.0], [3.0]]
    """
    return [list(r) for r in record_of(entry).runs]


def run_values(entry: Result | Mapping) -> tuple[list[float], list[frozenset | None]]:
    """Log run values (:func:`~decodebench.gate.decision.run_value`) of the runs with enough
    samples, and their kernel signatures."""
    record = record_of(entry)
    pairs = [(run_value(r), k) for r, k in zip(record.runs, record.kernels, strict=True) if len(r) >= MIN_SAMPLES]
    return [v for v, _ in pairs], [k for _, k in pairs]


def paired_runs(entry: Result | Mapping) -> tuple[list[list[float]], list[list[float]]] | None:
    """An A/B entry's rounds of side A and side B (round i of each ran next to each other), or None.

    >>> paired_runs({"extra_info": {"ab": {"runs_a": [[1.0]], "runs_b": [[2.0]]}}})
    ([[1.0]], [[2.0]])
    """
    paired = record_of(entry).paired
    if paired is None:
        return None
    return [list(r) for r in paired.runs_a], [list(r) for r in paired.runs_b]


def pair_differences(entry: Result | Mapping) -> tuple[list[float], int]:
    """An A/B entry's units: per process pair, the mean of its rounds' differences B - A of log
    floors (rounds with too few samples left out), and how many rounds they rest on. Entries
    without pair labels (earlier files) count as one pair.

    >>> info = {"ab": {"runs_a": [[1.0] * 3] * 4, "runs_b": [[1.1] * 3, [1.1] * 3, [1.2] * 3, [1.2] * 3],
    ...                "pairs": [0, 0, 1, 1]}}
    >>> [round(d, 4) for d in pair_differences({"extra_info": info})[0]]
    [0.0953, 0.1823]
    """
    paired = record_of(entry).paired
    by_pair: dict = {}
    rounds = 0
    for a, b, label in zip(paired.runs_a, paired.runs_b, paired.pairs, strict=False):
        if min(len(a), len(b)) >= MIN_SAMPLES:
            by_pair.setdefault(label, []).append(run_value(b) - run_value(a))
            rounds += 1
    return [sum(d) / len(d) for d in by_pair.values()], rounds


def invalid_reason(entry: Result | Mapping) -> str | None:
    """Why an entry must not be judged or used as a baseline, or None.

    >>> invalid_reason({"extra_info": {"invalid": "client TPOT 0.01 ms vs server 3.9 ms"}})
    'client TPOT 0.01 ms vs server 3.9 ms'
    """
    return record_of(entry).invalid


def contention(entry: Result | Mapping, max_load_per_cpu: float) -> str | None:
    """Why a result was measured beside other work, or None: another measuring session on its
    device (:mod:`decodebench.neighbours`), or a CPU load average above ``max_load_per_cpu``.

    >>> contention({"extra_info": {"telemetry_after": {"loadavg_1m": 13.1, "cpus": 2}}}, 1.5)
    'the CPU was oversubscribed while measuring (load average 13.1 on 2 CPUs)'
    >>> contention({"extra_info": {"other_sessions": ["pid 7 (running)"]}}, 1.5)
    'another session measured on this device at the same time (pid 7 (running))'
    """
    record = record_of(entry)
    if record.other_sessions:
        return f"another session measured on this device at the same time ({', '.join(record.other_sessions)})"
    busy = [(load, cpus) for load, cpus in record.loads if load > max_load_per_cpu * cpus]
    if not busy:
        return None
    load, cpus = max(busy)
    return f"the CPU was oversubscribed while measuring (load average {load:.1f} on {cpus} CPUs)"


def tokens_of(entry: Result | Mapping) -> int | None:
    """The decode batch (tokens per step) a kernel result was measured at, or None."""
    return record_of(entry).tokens


def timer_of(entry: Result | Mapping) -> str | None:
    return record_of(entry).timer


def setup_change(entry: Result | Mapping, stored: Result | Mapping) -> str | None:
    """How ``entry`` was set up other than ``stored`` in a fact its time depends on, or None.

    A fact a result does not record (one stored by an earlier version) is not a difference.

    >>> now = {"extra_info": {"server": {"routing": {"mode": "model"}}}}
    >>> setup_change(now, {"extra_info": {"server": {"routing": {"mode": "uniform"}}}})
    "server routing 'model' now, 'uniform' in the baseline"
    >>> setup_change(now, {"extra_info": {"server": {}}}) is None
    True
    """
    there = dict(record_of(stored).setup)
    for name, here in record_of(entry).setup:
        if name in there and here != there[name]:
            return f"{name} {here!r} now, {there[name]!r} in the baseline"
    return None
