"""A result entry as the gate reads it: parsed once into a typed record, at the reading boundary.

An entry is one benchmark of a pytest-benchmark result, stored (JSON) or live (``as_dict``).
:func:`read_entry` checks it (:func:`decodebench.entry_check.entry_problem`: an impossible number, a
field of the wrong type) and reads what the gate uses into an :class:`Entry`: its runs (the first
is ``stats.data``, re-measures add ``extra_info.resamples`` and ``resample_kernels``), an A/B
entry's rounds of both sides (``extra_info.ab``: ``runs_a``, ``runs_b`` paired by position, the
process ``pairs``), the timer, the op it measures, its decode batch, whether it is marked invalid,
what it was measured beside (load, other sessions) and the facts of its setup. An entry that
cannot be used is a record too, carrying only its ``problem``. Files written by earlier versions
(no kernels, no A/B record) read the same way. The functions of :mod:`.runs` judge records.

The stored-file rules that need the whole file or folder (a test id twice, no samples, a copy of
another run) are :func:`decodebench.entry_check.usable_entries`' and
:class:`decodebench.gate.reference.Baseline`'s; a baseline's entries are records from there on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..entry_check import entry_problem

__all__ = ["SETUP_FACTS", "SWEEP_KEYS", "Entry", "Paired", "kernel_signature", "read_entry", "record_of"]

# Shape fields that vary along a sweep; the rest name the op (its group of related cases).
SWEEP_KEYS = frozenset({"tokens", "M", "m", "batch", "distinct_experts", "context_total", "context_max",
                        "context_lengths", "elements", "message_bytes", "check_experts"})

# Facts outside the test id that set a result's time: (what to call it, path into extra_info).
# An end-to-end TPOT of a server that routed as the weights do is another quantity than one of a
# server whose routing vLLM's simulator drew uniformly (on a dummy-weight H200 server, MoE +338 %).
SETUP_FACTS = (("server routing", ("server", "routing", "mode")),)

Runs = tuple[tuple[float, ...], ...]


@dataclass(frozen=True)
class Paired:
    """An A/B entry's rounds: round i of side A ran next to round i of side B, in process pair ``pairs[i]``."""

    runs_a: Runs
    runs_b: Runs
    pairs: tuple


@dataclass(frozen=True)
class Entry:
    """What the gate reads of one result entry (:func:`read_entry`); ``document`` is the entry as
    given, for the writers, the pricing and pytest-benchmark."""

    document: Mapping
    problem: str | None = None  # why it cannot be used at all; then nothing below is read
    runs: Runs = ()  # seconds per call, first run first; empty runs left out
    kernels: tuple[frozenset | None, ...] = ()  # per run: {(kernel, calls per timed call)}, None if unrecorded
    paired: Paired | None = None
    timer: str | None = None
    group: str = ""  # the op: component, backend and the shape fields a sweep does not vary
    tokens: int | None = None  # decode batch of its shape point
    invalid: str | None = None  # why it says it must not be judged
    loads: tuple[tuple[float, int], ...] = ()  # (1-minute load average, CPUs) read before and after
    other_sessions: tuple[str, ...] = ()  # measuring sessions beside it on its device
    setup: tuple[tuple[str, object], ...] = ()  # (fact, value) of SETUP_FACTS it records

    @property
    def samples(self) -> tuple[float, ...]:
        """Its first run's samples (``stats.data``): what tells this run from any other."""
        data = (self.document.get("stats") or {}).get("data") if isinstance(self.document, Mapping) else None
        return tuple(data or ())


def read_entry(document) -> Entry:
    """``document`` (one benchmark of a result) as a record; an unusable one carries its problem.

    >>> entry = read_entry({"stats": {"data": [1e-6, 2e-6]}, "extra_info": {"timer": "wall",
    ...                     "resamples": [[3e-6]], "shape": {"op": "q_a", "M": 8}}})
    >>> entry.runs, entry.timer, entry.tokens, entry.group
    (((1e-06, 2e-06), (3e-06,)), 'wall', 8, "?|?|op='q_a'")
    >>> read_entry({"stats": {"data": [float("nan")]}}).problem
    'sample 1 is NaN'
    """
    problem = entry_problem(document)
    return Entry(document, problem=problem) if problem else _fields(document)


def record_of(entry: Entry | Mapping) -> Entry:
    """``entry`` as a record: itself, or a document's fields read now, unchecked (for readers outside
    the gate's boundary, which hold entries :func:`decodebench.entry_check.usable_entries` let through).

    >>> record_of({"extra_info": {"ab": {"runs_a": [[1.0]], "runs_b": [[2.0]]}}}).paired.runs_b
    ((2.0,),)
    """
    return entry if isinstance(entry, Entry) else _fields(entry)


def _fields(document: Mapping) -> Entry:
    info = document.get("extra_info") or {}
    runs = _runs(document, info)
    return Entry(document, runs=runs, kernels=_kernels(info, len(runs)), paired=_paired(info),
                 timer=info.get("timer"), group=_group(info), tokens=_tokens(info),
                 invalid=str(info["invalid"]) if info.get("invalid") else None, loads=_loads(info),
                 other_sessions=tuple(info.get("other_sessions") or ()), setup=_setup(info))


def kernel_signature(kernels: Mapping | None) -> frozenset | None:
    """What a run launched, as ``{(name, calls per timed call)}``; None where it was not recorded.

    >>> sorted(kernel_signature({"gemv": {"calls": 1, "s": 2e-6}}))
    [('gemv', 1.0)]
    """
    if not kernels:
        return None
    return frozenset((name, round(float((k or {}).get("calls", 1)), 3)) for name, k in kernels.items())


def _runs(document: Mapping, info: Mapping) -> Runs:
    data = (document.get("stats") or {}).get("data") or []
    return tuple(tuple(r) for r in [data, *(info.get("resamples") or [])] if r)


def _kernels(info: Mapping, count: int) -> tuple[frozenset | None, ...]:
    recorded = [info.get("kernels"), *(info.get("resample_kernels") or [])]
    return tuple(kernel_signature(k) for k in (recorded + [None] * count)[:count])


def _paired(info: Mapping) -> Paired | None:
    ab = info.get("ab")
    if not isinstance(ab, Mapping) or "runs_a" not in ab:
        return None
    runs_a = tuple(tuple(r) for r in ab["runs_a"])
    return Paired(runs_a, tuple(tuple(r) for r in ab["runs_b"]), tuple(ab.get("pairs") or [0] * len(runs_a)))


def _group(info: Mapping) -> str:
    shape = info.get("shape") if isinstance(info.get("shape"), Mapping) else {}
    fixed = "|".join(f"{k}={shape[k]!r}" for k in sorted(shape) if k not in SWEEP_KEYS)
    return f"{info.get('component', '?')}|{info.get('backend', '?')}|{fixed}"


def _tokens(info: Mapping) -> int | None:
    shape = info.get("shape")
    if not isinstance(shape, Mapping):
        return None
    for key in ("tokens", "M", "batch"):
        if isinstance(shape.get(key), int):
            return shape[key]
    return None


def _loads(info: Mapping) -> tuple[tuple[float, int], ...]:
    readings = [info.get(k) or {} for k in ("telemetry_before", "telemetry_after")]
    return tuple((r["loadavg_1m"], r["cpus"]) for r in readings if r.get("loadavg_1m") is not None and r.get("cpus"))


def _setup(info: Mapping) -> tuple[tuple[str, object], ...]:
    facts = []
    for name, path in SETUP_FACTS:
        value = info
        for key in path:
            value = value.get(key) if isinstance(value, Mapping) else None
        if value is not None:
            facts.append((name, value))
    return tuple(facts)
