"""What the gate reads from a result entry: its runs, their kernels, and what makes it unusable.

An entry is one benchmark of a pytest-benchmark result, stored (JSON) or live (``as_dict``).
Its first run is ``stats.data``; re-measures add ``extra_info.resamples`` (one list of seconds
per run) and ``extra_info.resample_kernels``; an A/B entry holds both sides' rounds in
``extra_info.ab`` (``runs_a``, ``runs_b``, paired by position). Files written by earlier
versions (no kernels, no A/B record) read the same way.
"""

from __future__ import annotations

from collections.abc import Mapping

from .decision import MIN_SAMPLES, run_value

__all__ = [
    "SWEEP_KEYS",
    "contention",
    "group_key",
    "invalid_reason",
    "kernel_signature",
    "pair_differences",
    "paired_runs",
    "run_kernels",
    "run_values",
    "runs_of",
    "setup_change",
    "timer_of",
    "tokens_of",
]

# Shape fields that vary along a sweep; the rest name the op (its group of related cases).
SWEEP_KEYS = frozenset({"tokens", "M", "m", "batch", "distinct_experts", "context_total", "context_max",
                        "context_lengths", "elements", "message_bytes", "check_experts"})


def _info(entry: Mapping) -> Mapping:
    return entry.get("extra_info") or {}


def runs_of(entry: Mapping) -> list[list[float]]:
    """The runs an entry holds: its samples, then any re-measured runs (seconds per call).

    >>> runs_of({"stats": {"data": [1.0, 2.0]}, "extra_info": {"resamples": [[3.0]]}})
    [[1.0, 2.0], [3.0]]
    """
    data = (entry.get("stats") or {}).get("data") or []
    return [list(r) for r in [data, *(_info(entry).get("resamples") or [])] if r]


def kernel_signature(kernels: Mapping | None) -> frozenset | None:
    """What a run launched, as ``{(name, calls per timed call)}``; None where it was not recorded.

    >>> sorted(kernel_signature({"gemv": {"calls": 1, "s": 2e-6}}))
    [('gemv', 1.0)]
    """
    if not kernels:
        return None
    return frozenset((name, round(float((k or {}).get("calls", 1)), 3)) for name, k in kernels.items())


def run_kernels(entry: Mapping) -> list[frozenset | None]:
    """The kernel signature of each run of :func:`runs_of` (None where unknown)."""
    info = _info(entry)
    recorded = [info.get("kernels"), *(info.get("resample_kernels") or [])]
    count = len(runs_of(entry))
    return [kernel_signature(k) for k in (recorded + [None] * count)[:count]]


def run_values(entry: Mapping) -> tuple[list[float], list[frozenset | None]]:
    """Log run values (:func:`~decodebench.gate.decision.run_value`) of the runs with enough
    samples, and their kernel signatures."""
    pairs = [(run_value(r), k) for r, k in zip(runs_of(entry), run_kernels(entry), strict=True)
             if len(r) >= MIN_SAMPLES]
    return [v for v, _ in pairs], [k for _, k in pairs]


def paired_runs(entry: Mapping) -> tuple[list[list[float]], list[list[float]]] | None:
    """An A/B entry's rounds of side A and side B (round i of each ran next to each other), or None.

    >>> paired_runs({"extra_info": {"ab": {"runs_a": [[1.0]], "runs_b": [[2.0]]}}})
    ([[1.0]], [[2.0]])
    """
    ab = _info(entry).get("ab")
    if not isinstance(ab, Mapping) or "runs_a" not in ab:
        return None
    return [list(r) for r in ab["runs_a"]], [list(r) for r in ab["runs_b"]]


def pair_differences(entry: Mapping) -> tuple[list[float], int]:
    """An A/B entry's units: per process pair, the mean of its rounds' differences B - A of log
    floors (rounds with too few samples left out), and how many rounds they rest on. Entries
    without pair labels (earlier files) count as one pair.

    >>> info = {"ab": {"runs_a": [[1.0] * 3] * 4, "runs_b": [[1.1] * 3, [1.1] * 3, [1.2] * 3, [1.2] * 3],
    ...                "pairs": [0, 0, 1, 1]}}
    >>> [round(d, 4) for d in pair_differences({"extra_info": info})[0]]
    [0.0953, 0.1823]
    """
    runs_a, runs_b = paired_runs(entry)
    labels = _info(entry)["ab"].get("pairs") or [0] * len(runs_a)
    by_pair: dict = {}
    rounds = 0
    for a, b, label in zip(runs_a, runs_b, labels, strict=False):
        if min(len(a), len(b)) >= MIN_SAMPLES:
            by_pair.setdefault(label, []).append(run_value(b) - run_value(a))
            rounds += 1
    return [sum(d) / len(d) for d in by_pair.values()], rounds


def invalid_reason(entry: Mapping) -> str | None:
    """Why an entry must not be judged or used as a baseline, or None.

    >>> invalid_reason({"extra_info": {"invalid": "client TPOT 0.01 ms vs server 3.9 ms"}})
    'client TPOT 0.01 ms vs server 3.9 ms'
    """
    reason = _info(entry).get("invalid")
    return str(reason) if reason else None


def contention(entry: Mapping, max_load_per_cpu: float) -> str | None:
    """Why a result was measured beside other work, or None: another measuring session on its
    device (:mod:`decodebench.neighbours`), or a CPU load average above ``max_load_per_cpu``.

    >>> contention({"extra_info": {"telemetry_after": {"loadavg_1m": 13.1, "cpus": 2}}}, 1.5)
    'the CPU was oversubscribed while measuring (load average 13.1 on 2 CPUs)'
    >>> contention({"extra_info": {"other_sessions": ["pid 7 (running)"]}}, 1.5)
    'another session measured on this device at the same time (pid 7 (running))'
    """
    others = _info(entry).get("other_sessions")
    if others:
        return f"another session measured on this device at the same time ({', '.join(others)})"
    readings = [_info(entry).get(k) or {} for k in ("telemetry_before", "telemetry_after")]
    loads = [(r["loadavg_1m"], r["cpus"]) for r in readings if r.get("loadavg_1m") is not None and r.get("cpus")]
    busy = [(load, cpus) for load, cpus in loads if load > max_load_per_cpu * cpus]
    if not busy:
        return None
    load, cpus = max(busy)
    return f"the CPU was oversubscribed while measuring (load average {load:.1f} on {cpus} CPUs)"


def group_key(entry: Mapping) -> str:
    """The op a case measures, whatever its shape point: component, backend and the shape
    fields that do not vary along the sweep. Cases of one group share a pooled spread.

    >>> a = {"extra_info": {"component": "dense_gemm", "backend": "vllm", "shape": {"op": "q_a", "M": 1, "N": 2112}}}
    >>> b = {"extra_info": {"component": "dense_gemm", "backend": "vllm", "shape": {"op": "q_a", "M": 32, "N": 2112}}}
    >>> group_key(a) == group_key(b), group_key(a)
    (True, "dense_gemm|vllm|N=2112|op='q_a'")
    """
    info = _info(entry)
    shape = info.get("shape") if isinstance(info.get("shape"), Mapping) else {}
    fixed = "|".join(f"{k}={shape[k]!r}" for k in sorted(shape) if k not in SWEEP_KEYS)
    return f"{info.get('component', '?')}|{info.get('backend', '?')}|{fixed}"


def tokens_of(entry: Mapping) -> int | None:
    """The decode batch (tokens per step) a kernel result was measured at, or None."""
    shape = _info(entry).get("shape")
    if not isinstance(shape, Mapping):
        return None
    for key in ("tokens", "M", "batch"):
        if isinstance(shape.get(key), int):
            return shape[key]
    return None


def timer_of(entry: Mapping) -> str | None:
    return _info(entry).get("timer")


# Facts outside the test id that set a result's time: (what to call it, path into extra_info).
# An end-to-end TPOT of a server that routed as the weights do is another quantity than one of a
# server whose routing vLLM's simulator drew uniformly (on a dummy-weight H200 server, MoE +338 %).
SETUP_FACTS = (("server routing", ("server", "routing", "mode")),)


def _fact(entry: Mapping, path: tuple[str, ...]):
    value = _info(entry)
    for key in path:
        if not isinstance(value, Mapping) or key not in value:
            return None
        value = value[key]
    return value


def setup_change(entry: Mapping, stored: Mapping) -> str | None:
    """How ``entry`` was set up other than ``stored`` in a fact its time depends on, or None.

    A fact a result does not record (one stored by an earlier version) is not a difference.

    >>> now = {"extra_info": {"server": {"routing": {"mode": "model"}}}}
    >>> setup_change(now, {"extra_info": {"server": {"routing": {"mode": "uniform"}}}})
    "server routing 'model' now, 'uniform' in the baseline"
    >>> setup_change(now, {"extra_info": {"server": {}}}) is None
    True
    """
    for name, path in SETUP_FACTS:
        here, there = _fact(entry, path), _fact(stored, path)
        if here is not None and there is not None and here != there:
            return f"{name} {here!r} now, {there!r} in the baseline"
    return None
