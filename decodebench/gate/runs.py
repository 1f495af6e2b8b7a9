"""What the gate makes of a case's record (:class:`~decodebench.results.Result`): its runs' values, an A/B
entry's pair differences, the contention it was measured under, and what sets it apart from a stored one.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..results import Result, record_of
from .decision import run_value

__all__ = ["MIN_SAMPLES", "contention", "pair_differences", "run_values", "setup_change"]

MIN_SAMPLES = 3  # a run with fewer samples says nothing about its floor (10th percentile)


def run_values(entry: Result | Mapping) -> tuple[list[float], list[frozenset | None]]:
    """Log run values (:func:`~decodebench.gate.decision.run_value`) of the runs with enough
    samples, and their kernel signatures (an entry given as a document is read first,
    :func:`~decodebench.results.record_of`).

    >>> values, kernels = run_values({"stats": {"data": [1.0] * 3}, "extra_info": {"resamples": [[2.0]]}})
    >>> values, kernels
    ([0.0], [None])
    """
    record = record_of(entry)
    pairs = [(run_value(r), k) for r, k in zip(record.runs, record.kernels, strict=True) if len(r) >= MIN_SAMPLES]
    return [v for v, _ in pairs], [k for _, k in pairs]


def pair_differences(record: Result) -> tuple[list[float], int]:
    """An A/B record's units: per process pair, the mean of its rounds' differences B - A of log
    floors (rounds with too few samples left out), and how many rounds they rest on. Records
    without pair labels (earlier files) count as one pair.

    >>> from decodebench.results import Paired
    >>> paired = Paired(((1.0,) * 3,) * 4, ((1.1,) * 3, (1.1,) * 3, (1.2,) * 3, (1.2,) * 3), (0, 0, 1, 1))
    >>> [round(d, 4) for d in pair_differences(Result("t", None, "?", {}, None, paired=paired))[0]]
    [0.0953, 0.1823]
    """
    paired = record.paired
    by_pair: dict = {}
    rounds = 0
    for a, b, label in zip(paired.runs_a, paired.runs_b, paired.pairs, strict=False):
        if min(len(a), len(b)) >= MIN_SAMPLES:
            by_pair.setdefault(label, []).append(run_value(b) - run_value(a))
            rounds += 1
    return [sum(d) / len(d) for d in by_pair.values()], rounds


def contention(record: Result, max_load_per_cpu: float) -> str | None:
    """Why a result was measured beside other work, or None: another measuring session on its
    device (:mod:`decodebench.neighbours`), or a CPU load average above ``max_load_per_cpu``.

    >>> contention(Result("t", None, "?", {}, None, loads=((13.1, 2),)), 1.5)
    'the CPU was oversubscribed while measuring (load average 13.1 on 2 CPUs)'
    >>> contention(Result("t", None, "?", {}, None, other_sessions=("pid 7 (running)",)), 1.5)
    'another session measured on this device at the same time (pid 7 (running))'
    """
    if record.other_sessions:
        return f"another session measured on this device at the same time ({', '.join(record.other_sessions)})"
    busy = [(load, cpus) for load, cpus in record.loads if load > max_load_per_cpu * cpus]
    if not busy:
        return None
    load, cpus = max(busy)
    return f"the CPU was oversubscribed while measuring (load average {load:.1f} on {cpus} CPUs)"


def setup_change(record: Result, stored: Result) -> str | None:
    """How ``record`` was set up other than ``stored`` in a fact its time depends on, or None.

    A fact a result does not record (one stored by an earlier version) is not a difference.

    >>> now = Result("t", None, "?", {}, None, setup=(("server routing", "model"),))
    >>> setup_change(now, Result("t", None, "?", {}, None, setup=(("server routing", "uniform"),)))
    "server routing 'model' now, 'uniform' in the baseline"
    >>> setup_change(now, Result("t", None, "?", {}, None)) is None
    True
    """
    there = dict(stored.setup)
    for name, here in record.setup:
        if name in there and here != there[name]:
            return f"{name} {here!r} now, {there[name]!r} in the baseline"
    return None
