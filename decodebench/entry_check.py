"""Whether a result entry can be read: times that can be times, fields of the type their readers need.

One check for every reader of a pytest-benchmark entry, stored or live (docs/stored-results.md):
:func:`entry_problem` gives the first reason an entry cannot be used (``sample 3 is NaN``), or None,
so that an impossible number never reaches a statistic.

A **time** (a sample, a median, seconds per call) is a finite number from :data:`SHORTEST_S`
to :data:`LONGEST_S`: nothing a computer calls runs in less than a picosecond (a clock cycle
is 200 ps at 5 GHz), and a per-call time beyond a day is a damaged file, not a measurement.
The bounds also keep the model's logs and ratios finite (``exp`` of a log ratio of two times
in range cannot overflow). Samples are counted from 1 in messages.

A field a reader can do without (no ``stats.data``: no runs; no ``shape``: not a kernel
result) may be absent; present, it must have the type its readers use. What the entry says
about itself (``extra_info.invalid``) is the gate's business, not this check's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

__all__ = ["LONGEST_S", "NO_SAMPLES", "SHORTEST_S", "ImpossibleResult", "check_recordable", "entry_label",
           "entry_problem", "time_problem", "times_problem", "usable_entries"]

SHORTEST_S = 1e-12  # a picosecond
LONGEST_S = 86400.0  # a day

# stats a reader takes as a time per call (pytest-benchmark's comparison table, the prediction's median)
_STATS_TIMES = ("min", "max", "mean", "median", "q1", "q3", "ld15iqr", "hd15iqr")
_STATS_SPREADS = ("stddev", "iqr")  # zero or more
# shape fields that count something and that readers divide by or take the log of
_SHAPE_COUNTS = ("tokens", "M", "m", "batch", "context_max", "context_total", "N", "K", "n", "k", "experts",
                 "heads", "width")
_TELEMETRY = ("telemetry_before", "telemetry_after")


def _kind(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:39] + "…"


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def time_problem(value) -> str | None:
    """Why ``value`` cannot be a time in seconds, or None.

    >>> time_problem(2e-6), time_problem(float("nan")), time_problem(-1e-6), time_problem("3")
    (None, 'is NaN', 'is -1e-06, not above 0', "is '3', not a number")
    >>> time_problem(1e300)
    'is 1e+300 s, longer than a day'
    """
    if not _number(value):
        return f"is {_kind(value)}, not a number"
    try:
        value = float(value)
    except OverflowError:  # an integer beyond any float
        return f"is {_kind(value)}, too large to be a time"
    if math.isnan(value):
        return "is NaN"
    if math.isinf(value):
        return f"is {'-' if value < 0 else ''}infinite"
    if value <= 0:
        return f"is {value:g}, not above 0"
    if value > LONGEST_S:
        return f"is {value:g} s, longer than a day"
    if value < SHORTEST_S:
        return f"is {value:g} s, shorter than a picosecond"
    return None


def times_problem(values, what: str = "") -> str | None:
    """Why ``values`` is not a list of times (naming the first bad one, counted from 1), or None.

    >>> times_problem([1e-6, 2e-6, float("nan")])
    'sample 3 is NaN'
    >>> times_problem("1e-6", "re-measure 1")
    "re-measure 1: samples are '1e-6', not a list"
    """
    head = f"{what}: " if what else ""
    if not isinstance(values, list):
        return f"{head}samples are {_kind(values)}, not a list"
    for index, value in enumerate(values, 1):
        problem = time_problem(value)
        if problem:
            return f"{head}sample {index} {problem}"
    return None


def _runs_problem(runs, what: str) -> str | None:
    if not isinstance(runs, list):
        return f"{what} is {_kind(runs)}, not a list of runs"
    return next(filter(None, (times_problem(r, f"{what} {i}") for i, r in enumerate(runs, 1))), None)


def _finite(value) -> bool:
    """A number that is a finite float (an integer beyond any float is not)."""
    try:
        return _number(value) and math.isfinite(float(value))
    except OverflowError:
        return False


def _finite_at_least_0(value) -> bool:
    return _finite(value) and value >= 0


def _mapping_or_none(value, what: str) -> str | None:
    return None if value is None or isinstance(value, Mapping) else f"{what} is {_kind(value)}, not an object"


def _text_or_none(value, what: str) -> str | None:
    return None if value is None or isinstance(value, str) else f"{what} is {_kind(value)}, not a string"


def _stats(entry: Mapping) -> str | None:
    stats = entry.get("stats")
    if not isinstance(stats, Mapping):
        return f"stats is {_kind(stats)}, not an object"
    if stats.get("data") is not None:
        problem = times_problem(stats["data"])
        if problem:
            return problem
    for key in _STATS_TIMES:
        if stats.get(key) is not None and time_problem(stats[key]):
            return f"stats.{key} {time_problem(stats[key])}"
    for key in _STATS_SPREADS:
        value = stats.get(key)
        if value is not None and not _finite_at_least_0(value):
            return f"stats.{key} is {_kind(value)}, not a finite number of 0 or more"
    return None


def _kernels(kernels, what: str) -> str | None:
    if kernels is None:
        return None
    if not isinstance(kernels, Mapping):
        return f"{what} is {_kind(kernels)}, not an object"
    for name, record in kernels.items():
        if record is not None and not isinstance(record, Mapping):
            return f"{what}[{name!r}] is {_kind(record)}, not an object"
        calls = (record or {}).get("calls")
        if calls is not None and not _finite_at_least_0(calls):
            return f"{what}[{name!r}].calls is {_kind(calls)}, not a finite number of 0 or more"
    return None


def _resamples(info: Mapping) -> str | None:
    if info.get("resamples") is not None:
        problem = _runs_problem(info["resamples"], "re-measure")
        if problem:
            return problem
    recorded = info.get("resample_kernels")
    if recorded is None:
        return None
    if not isinstance(recorded, list):
        return f"resample_kernels is {_kind(recorded)}, not a list"
    return next(filter(None, (_kernels(k, f"resample_kernels {i}") for i, k in enumerate(recorded, 1))), None)


def _ab(info: Mapping) -> str | None:
    ab = info.get("ab")
    if ab is None:
        return None
    if not isinstance(ab, Mapping):
        return f"ab is {_kind(ab)}, not an object"
    if "runs_a" not in ab and "runs_b" not in ab:
        return None
    for side in "ab":
        problem = _runs_problem(ab.get(f"runs_{side}"), f"A/B side {side.upper()} round")
        if problem:
            return problem
    if len(ab["runs_a"]) != len(ab["runs_b"]):
        return f"A/B has {len(ab['runs_a'])} rounds of side A and {len(ab['runs_b'])} of side B"
    pairs = ab.get("pairs")
    if pairs is not None and (not isinstance(pairs, list) or len(pairs) != len(ab["runs_a"])
                              or not all(isinstance(p, (int, str)) and not isinstance(p, bool) for p in pairs)):
        return f"A/B pairs is {_kind(pairs)}, not one process-pair label per round"
    return None


def _shape(info: Mapping) -> str | None:
    shape = info.get("shape")
    if shape is None:
        return None
    if not isinstance(shape, Mapping):
        return f"shape is {_kind(shape)}, not an object"
    for key, value in shape.items():
        if key in _SHAPE_COUNTS and value is not None and not (isinstance(value, int) and _finite(value) and value > 0):
            return f"shape.{key} is {_kind(value)}, not a count above 0"
        if _number(value) and not _finite(value):
            return f"shape.{key} is {_kind(value)}, not a finite number"
    return None


def _telemetry(info: Mapping) -> str | None:
    for key in _TELEMETRY:
        reading = info.get(key)
        if reading is None:
            continue
        if not isinstance(reading, Mapping):
            return f"{key} is {_kind(reading)}, not an object"
        load, cpus = reading.get("loadavg_1m"), reading.get("cpus")
        if load is not None and not _finite_at_least_0(load):
            return f"{key}.loadavg_1m is {_kind(load)}, not a load average"
        if cpus is not None and not (isinstance(cpus, int) and _finite(cpus) and cpus > 0):
            return f"{key}.cpus is {_kind(cpus)}, not a count above 0"
    return None


def _facts(info: Mapping) -> str | None:
    """Fields the gate, the prediction and the history read by name."""
    problem = next(filter(None, [*(_text_or_none(info.get(k), k) for k in ("timer", "component", "backend")),
                                 *(_mapping_or_none(info.get(k), k) for k in ("server", "topology", "link"))]), None)
    if problem:
        return problem
    others = info.get("other_sessions")
    if others is not None and not (isinstance(others, list) and all(isinstance(o, str) for o in others)):
        return f"other_sessions is {_kind(others)}, not a list of strings"
    world = info.get("world_size")
    if world is not None and not (isinstance(world, int) and _finite(world) and world > 0):
        return f"world_size is {_kind(world)}, not a count above 0"
    gpus = (info.get("topology") or {}).get("gpus")
    if gpus is not None and not (isinstance(gpus, list) and all(isinstance(g, Mapping) for g in gpus)):
        return f"topology.gpus is {_kind(gpus)}, not a list of objects"
    routing = (info.get("server") or {}).get("routing")
    return _mapping_or_none(routing, "server.routing") or _kernels(info.get("kernels"), "kernels")


def _info(entry: Mapping) -> str | None:
    info = entry.get("extra_info")
    if info is None:
        return None
    if not isinstance(info, Mapping):
        return f"extra_info is {_kind(info)}, not an object"
    checks: tuple[Callable[[Mapping], str | None], ...] = (_resamples, _ab, _shape, _telemetry, _facts)
    return next(filter(None, (check(info) for check in checks)), None)


def entry_problem(entry) -> str | None:
    """Why a benchmark entry cannot be used by the gate, the history or the prediction, or None
    (a stored result's entries also need a ``fullname``: :func:`usable_entries`).

    >>> good = {"fullname": "t[a]", "stats": {"data": [1e-6, 2e-6]}, "extra_info": {"resamples": [[1e-6]]}}
    >>> entry_problem(good) is None
    True
    >>> entry_problem({**good, "extra_info": {"resamples": [[1e-6], [2e-6, 0.0]]}})
    're-measure 2: sample 2 is 0, not above 0'
    >>> entry_problem({"fullname": "t[a]", "stats": "fast"})
    "stats is 'fast', not an object"
    """
    if not isinstance(entry, Mapping):
        return f"is {_kind(entry)}, not a benchmark record"
    return (_text_or_none(entry.get("fullname"), "fullname") or _text_or_none(entry.get("name"), "name")
            or _stats(entry) or _info(entry))


def entry_label(entry, index: int) -> str:
    """How a line about entry ``index`` (from 1) of a file names it: ``case <test id>``, else its number."""
    name = (entry.get("fullname") or entry.get("name")) if isinstance(entry, Mapping) else None
    return f"case {name}" if isinstance(name, str) and name else f"entry {index}"


NO_SAMPLES = "no samples (stats.data is missing or empty): nothing measured to judge or compare"


def _stored_problem(entry: Mapping) -> str | None:
    """What a stored result's entry needs beyond :func:`entry_problem`: its test id and its samples."""
    if not entry.get("fullname"):  # a file's entries are known by their test id
        return "no fullname (test id)"
    return None if (entry.get("stats") or {}).get("data") else NO_SAMPLES


def _repeated(benchmarks: list) -> dict[str, list[int]]:
    """Test ids that name more than one entry of a file, with their entry numbers (from 1)."""
    seen: dict[str, list[int]] = {}
    for index, entry in enumerate(benchmarks, 1):
        name = entry.get("fullname") if isinstance(entry, Mapping) else None
        if isinstance(name, str) and name:
            seen.setdefault(name, []).append(index)
    return {name: where for name, where in seen.items() if len(where) > 1}


def usable_entries(benchmarks: Iterable, source: Path | str) -> tuple[dict[str, Mapping], list[str]]:
    """The usable entries of a result's ``benchmarks`` list by test id, and one line per entry
    left out, naming ``source`` and the case. Beyond :func:`entry_problem`, a stored entry needs
    its test id and its samples (one without is no run), and a test id twice in one file is
    refused in both places: which of them is this run's is unknown.

    >>> ok = {"fullname": "t[a]", "stats": {"data": [1e-6]}}
    >>> bad = {"fullname": "t[b]", "stats": {"data": [1e-6, 1e-6, float("nan")]}}
    >>> usable_entries([ok, bad, 7], "0001_x.json")
    ({'t[a]': {'fullname': 't[a]', 'stats': {'data': [1e-06]}}}, ['0001_x.json: case t[b]: sample 3 is NaN', \
'0001_x.json: entry 3: is 7, not a benchmark record'])
    >>> usable_entries([ok, ok], "0001_x.json")[1]
    ['0001_x.json: case t[a]: named by entries 1 and 2 of one file: which is this run is unknown']
    """
    benchmarks = list(benchmarks)
    repeated = _repeated(benchmarks)
    usable, skipped, refused = {}, [], set()
    for index, entry in enumerate(benchmarks, 1):
        problem = entry_problem(entry) or _stored_problem(entry)
        name = None if problem else entry["fullname"]
        if name in repeated:
            if name in refused:
                continue  # named once, at its first usable entry
            refused.add(name)
            where = repeated[name]
            numbers = ", ".join(map(str, where[:-1])) + f" and {where[-1]}"
            problem = f"named by entries {numbers} of one file: which is this run is unknown"
        if problem:
            skipped.append(f"{source}: {entry_label(entry, index)}: {problem}")
        else:
            usable[name] = entry
    return usable, skipped


class ImpossibleResult(ValueError):
    """A measurement that cannot be stored: a sample that cannot be a time, a field of the wrong type."""


def check_recordable(what: str, samples, extra_info: Mapping | None = None) -> None:
    """Raise :class:`ImpossibleResult` naming ``what`` unless ``samples`` with ``extra_info`` make a
    usable entry: what a measurement yields is checked before it is stored, never after.

    >>> try:
    ...     check_recordable("t[a]", [1e-6, 0.0])
    ... except ImpossibleResult as exc:
    ...     print(exc)
    t[a]: sample 2 is 0, not above 0: a measurement that cannot be a time is not recorded
    """
    data = list(samples) if isinstance(samples, (list, tuple)) else samples
    if isinstance(data, list) and not data:
        raise ImpossibleResult(f"{what}: no samples: a measurement that timed nothing is not recorded")
    problem = entry_problem({"fullname": what or "?", "stats": {"data": data}, "extra_info": extra_info})
    if problem:
        raise ImpossibleResult(f"{what}: {problem}: a measurement that cannot be a time is not recorded")
