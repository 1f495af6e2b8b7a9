"""Result files: the one reader of pytest-benchmark result files, and the one writer of ``extra_info``
(docs/stored-results.md). :func:`read_result` reads a file's document or refuses it, naming the file;
:func:`read_file` reads its kernel results, each entry once, into a frozen :class:`Result` and names
every entry it leaves out. No other reader parses a result file or reads ``extra_info`` by key.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from .entry_check import check_recordable, entry_label, entry_problem
from .files import read_json

__all__ = ["Paired", "Result", "ResultFile", "SETUP_FACTS", "SWEEP_KEYS", "ab_record", "check_run", "interrupted_by",
           "kernel_result", "kernel_signature", "not_a_baseline", "read_entry", "read_file",
           "read_result", "record_facts", "record_of", "results_of", "stored_entries", "stored_entry",
           "stored_fingerprint", "with_rounds", "with_run"]

# extra_info facts a kernel result keeps beside its median: its traffic and roofline (what-if,
# projection), whether vLLM's selector dispatches it here (MLA), where a collective ran, what it launched.
FACTS = ("bytes_read", "bytes_written", "flops", "frac_peak_bw", "frac_peak_flops", "bound", "peaks_source",
         "dispatched", "timer", "world_size", "message_bytes", "link_mode", "kernels")


Runs = tuple[tuple[float, ...], ...]

# Shape fields that vary along a sweep; the rest name the op (its group of related cases).
SWEEP_KEYS = frozenset({"tokens", "M", "m", "batch", "distinct_experts", "context_total", "context_max",
                        "context_lengths", "elements", "message_bytes", "check_experts"})

# Facts outside the test id that set a result's time: (what to call it, path into extra_info).
# An end-to-end TPOT of a server that routed as the weights do is another quantity than one of a
# server whose routing vLLM's simulator drew uniformly (on a dummy-weight H200 server, MoE +338 %).
SETUP_FACTS = (("server routing", ("server", "routing", "mode")),)


@dataclass(frozen=True)
class Paired:
    """An A/B entry's rounds: round i of side A ran next to round i of side B, in process pair ``pairs[i]``."""

    runs_a: Runs
    runs_b: Runs
    pairs: tuple


@dataclass(frozen=True)
class Result:
    """One result entry, read once: what it ran (``name``: pytest-benchmark's short name, ``fullname``
    the test id), its median seconds per call and its facts (``info``: :data:`FACTS`, and the machine's
    ``gpu``, ``link``, ``sm_clock_mhz``), then what the gate judges (the fields below). An entry that
    cannot be used carries only its ``problem``; ``document`` is the entry as given.

    >>> r = Result("t[a]", "rmsnorm", "vllm", {"tokens": 1}, 2e-6, {"timer": "kernel", "bytes_read": 10})
    >>> r.bytes, r.launched
    (10, {})
    """

    name: str
    component: str | None
    backend: str
    shape: dict
    median_s: float | None
    info: dict = field(default_factory=dict)
    # what the gate judges; two records of one point are equal whatever their runs
    fullname: str = field(default="", compare=False)
    document: Mapping = field(default_factory=dict, compare=False, repr=False)
    problem: str | None = field(default=None, compare=False)  # why it cannot be used at all; then nothing else is read
    runs: Runs = field(default=(), compare=False)  # seconds per call, first run first; empty runs left out
    kernels: tuple[frozenset | None, ...] = field(default=(), compare=False)  # per run: {(kernel, calls)} or None
    paired: Paired | None = field(default=None, compare=False)
    timer: str | None = field(default=None, compare=False)
    group: str = field(default="", compare=False)  # the op: component, backend, the shape bar its sweep
    tokens: int | None = field(default=None, compare=False)  # decode batch of its shape point
    invalid: str | None = field(default=None, compare=False)  # why it says it must not be judged
    loads: tuple[tuple[float, int], ...] = field(default=(), compare=False)  # (1-minute load, CPUs) before, after
    other_sessions: tuple[str, ...] = field(default=(), compare=False)  # measuring sessions beside it on its device
    setup: tuple[tuple[str, object], ...] = field(default=(), compare=False)  # (fact, value) of SETUP_FACTS it records

    def __post_init__(self):
        if self.timer is None and self.info.get("timer") is not None:
            object.__setattr__(self, "timer", self.info["timer"])

    @property
    def bytes(self) -> int:
        """Bytes one call reads and writes (0 where the result states none: a collective)."""
        return int((self.info.get("bytes_read") or 0) + (self.info.get("bytes_written") or 0))

    @property
    def launched(self) -> dict:
        """The kernels one call launched, as recorded: ``{name: {"calls": ..., "s": ...}}`` (empty: not recorded)."""
        launched = self.info.get("kernels")
        return launched if isinstance(launched, dict) else {}

    @property
    def samples(self) -> tuple[float, ...]:
        """Its first run's samples (``stats.data``): what tells this run from any other."""
        data = (self.document.get("stats") or {}).get("data") if isinstance(self.document, Mapping) else None
        return tuple(data or ())


@dataclass(frozen=True)
class ResultFile:
    """The kernel results of one file, its ``machine_info["decodebench"]`` and the entries left out."""

    path: Path
    machine: dict
    results: tuple[Result, ...]
    skipped: tuple[str, ...] = ()


def read_result(path: Path) -> Mapping:
    """A result file's JSON document, or ValueError naming what is wrong with it
    (:func:`decodebench.files.read_json`: unreadable, too large, not JSON, nested past the parser).

    >>> read_result(Path("/nonexistent/0001_x.json"))
    Traceback (most recent call last):
    decodebench.files.UnreadableFile: cannot read /nonexistent/0001_x.json: No such file or directory
    """
    document = read_json(Path(path))
    if not isinstance(document, Mapping) or not isinstance(document.get("benchmarks"), list):
        raise ValueError(f"{path} is not a pytest-benchmark result (no 'benchmarks' list)")
    return document


def not_a_baseline(path, document: Mapping) -> str | None:
    """Why the stored result ``document`` (read from ``path``) is never compared against, or None:
    a partial run, a test of the gate or an A/B run, whoever put it among the baselines.

    >>> not_a_baseline("0003_x.json", {"benchmarks": [{"fullname": "t[a]", "extra_info": {"ab": {}}}]})
    '0003_x.json is an A/B run (case t[a]): side B against side A of one session, never a baseline'
    """
    if interrupted_by(document):
        return f"{path} is a session interrupted by {interrupted_by(document)}: a partial run, not a baseline"
    injected = _first_case_with(document, "injected_slowdown")
    if injected:
        return f"{path} was measured with --inject-slowdown (case {injected}): a test of the gate, never a baseline"
    paired = _first_case_with(document, "ab")
    if paired:
        return f"{path} is an A/B run (case {paired}): side B against side A of one session, never a baseline"
    return None


def _first_case_with(document: Mapping, key: str) -> str | None:
    """The test id of the first entry whose ``extra_info`` holds ``key``, or None."""
    for entry in document["benchmarks"]:
        info = entry.get("extra_info") if isinstance(entry, Mapping) else None
        if isinstance(info, Mapping) and info.get(key) is not None:
            return str(entry.get("fullname") or entry.get("name") or "?")
    return None


def _field(document, *path: str):
    """``document[path[0]][path[1]]...``, or None where a level is missing or not an object."""
    for key in path:
        if not isinstance(document, Mapping):
            return None
        document = document.get(key)
    return document


def stored_fingerprint(document: Mapping) -> str | None:
    """The fingerprint key a stored result was measured under, or None for foreign files.

    >>> stored_fingerprint({"machine_info": {"decodebench": {"fingerprint": {"key": "cpu-x"}}}})
    'cpu-x'
    >>> stored_fingerprint({"machine_info": [1, 2]}) is None
    True
    """
    key = _field(document, "machine_info", "decodebench", "fingerprint", "key")
    return key if isinstance(key, str) else None


def interrupted_by(document: Mapping) -> str | None:
    """What interrupted the session that stored ``document`` (``SIGTERM``), or None: a partial run,
    kept for the record and never a baseline.

    >>> interrupted_by({"machine_info": {"decodebench": {"interrupted": "SIGTERM"}}})
    'SIGTERM'
    """
    why = _field(document, "machine_info", "decodebench", "interrupted")
    return str(why) if why else None


def read_file(path: Path) -> ResultFile:
    """The kernel results of a result file; ValueError naming the file when it is not one.

    An entry that cannot be used (:func:`decodebench.entry_check.entry_problem`: a NaN median, a
    string for a shape) is left out and named in ``skipped`` (``FILE: case X: why``).
    """
    document = read_result(Path(path))
    machine = _field(document, "machine_info", "decodebench")
    skipped: list[str] = []
    results = results_of(document["benchmarks"], str(path), skipped)
    gpu = _field(machine, "fingerprint", "gpu", "name")
    if gpu:  # the GPU the file was measured on, for a result that does not name it (a projection fits per GPU)
        results = [r if r.info.get("gpu") else replace(r, info={**r.info, "gpu": gpu}) for r in results]
    return ResultFile(Path(path), machine if isinstance(machine, dict) else {}, tuple(results), tuple(skipped))


def results_of(benchmarks: Iterable[Mapping], source: str = "", skipped: list[str] | None = None) -> list[Result]:
    """The kernel results of pytest-benchmark's per-benchmark dicts (stored JSON or ``as_dict()``); an
    entry that cannot be used is named in ``skipped`` when given, one that is no kernel result (no
    component, shape or median: an end-to-end run) is passed over.

    >>> rows = [{"name": "a", "stats": {"median": 1e-6}, "extra_info": {"component": "rmsnorm", "shape": {}}},
    ...         {"name": "b", "stats": {"median": float("nan")}}]
    >>> left_out = []
    >>> [r.name for r in results_of(rows, "f.json", left_out)], left_out
    (['a'], ['f.json: case b: stats.median is NaN'])
    """
    records = [read_entry(entry) for entry in benchmarks]
    if skipped is not None:
        skipped += [f"{source or 'results'}: {entry_label(r.document, i)}: {r.problem}"
                    for i, r in enumerate(records, 1) if r.problem]
    return [r for r in records if kernel_result(r)]


def kernel_result(record: Result) -> bool:
    """Whether ``record`` is a kernel result: usable, with a component, a shape (an object) and a median
    (an end-to-end run is none)."""
    stored = _field(record.document, "extra_info", "shape")
    return bool(not record.problem and record.component and isinstance(stored, dict) and record.median_s)


def read_entry(document) -> Result:
    """``document`` (one benchmark of a result) as a record; an unusable one carries its problem.

    >>> entry = read_entry({"stats": {"data": [1e-6, 2e-6]}, "extra_info": {"timer": "wall",
    ...                     "resamples": [[3e-6]], "shape": {"op": "q_a", "M": 8}}})
    >>> entry.runs, entry.timer, entry.tokens, entry.group
    (((1e-06, 2e-06), (3e-06,)), 'wall', 8, "?|?|op='q_a'")
    >>> read_entry({"stats": {"data": [float("nan")]}}).problem
    'sample 1 is NaN'
    """
    if isinstance(document, Result):
        return document
    problem = entry_problem(document)
    if problem:
        return Result("?", None, "?", {}, None, document=document, problem=problem)
    return _record(document)


def record_of(entry: Result | Mapping) -> Result:
    """``entry`` as a record: itself, or a document's fields read now, unchecked (for readers that hold
    entries :func:`decodebench.entry_check.usable_entries` let through).

    >>> record_of({"extra_info": {"ab": {"runs_a": [[1.0]], "runs_b": [[2.0]]}}}).paired.runs_b
    ((2.0,),)
    """
    return entry if isinstance(entry, Result) else _record(entry)


def _record(document: Mapping) -> Result:
    info = document.get("extra_info") or {}
    stats = document.get("stats") or {}
    shape = info.get("shape")
    median = stats.get("median")
    runs = _runs(stats, info)
    return Result(str(document.get("name", "?")), info.get("component"), str(info.get("backend", "?")),
                  shape if isinstance(shape, dict) else {}, float(median) if median else None, _facts(info),
                  fullname=str(document.get("fullname") or ""), document=document, runs=runs,
                  kernels=_run_kernels(info, len(runs)), paired=_paired(info), timer=info.get("timer"),
                  group=_group(info), tokens=_tokens(info),
                  invalid=str(info["invalid"]) if info.get("invalid") else None, loads=_loads(info),
                  other_sessions=tuple(info.get("other_sessions") or ()), setup=_setup(info))


def with_run(record: Result, samples, kernels: Mapping | None) -> Result:
    """``record`` with one more run: a re-measure's samples and the kernels it launched.

    >>> with_run(read_entry({"stats": {"data": [1.0]}}), [2.0], {"gemv": {"calls": 1}}).runs
    ((1.0,), (2.0,))
    """
    return replace(record, runs=(*record.runs, tuple(samples)), kernels=(*record.kernels, kernel_signature(kernels)))


def with_rounds(record: Result, runs_a, runs_b, pairs) -> Result:
    """An A/B ``record`` with a re-measure round's rounds of both sides (a fresh process pair) added."""
    was = record.paired or Paired((), (), ())
    return replace(record, paired=Paired((*was.runs_a, *map(tuple, runs_a)), (*was.runs_b, *map(tuple, runs_b)),
                                         (*was.pairs, *pairs)))


def kernel_signature(kernels: Mapping | None) -> frozenset | None:
    """What a run launched, as ``{(name, calls per timed call)}``; None where it was not recorded.

    >>> sorted(kernel_signature({"gemv": {"calls": 1, "s": 2e-6}}))
    [('gemv', 1.0)]
    """
    if not kernels:
        return None
    return frozenset((name, round(float((k or {}).get("calls", 1)), 3)) for name, k in kernels.items())


def _runs(stats: Mapping, info: Mapping) -> Runs:
    data = stats.get("data") or []
    return tuple(tuple(r) for r in [data, *(info.get("resamples") or [])] if r)


def _run_kernels(info: Mapping, count: int) -> tuple[frozenset | None, ...]:
    recorded = [info.get("kernels"), *(info.get("resample_kernels") or [])]
    return tuple(kernel_signature(k) for k in (recorded + [None] * count)[:count])


def _paired(info: Mapping) -> Paired | None:
    ab = info.get("ab")
    if not isinstance(ab, Mapping) or "runs_a" not in ab:
        return None
    runs_a = tuple(tuple(r) for r in ab["runs_a"])
    return Paired(runs_a, tuple(tuple(r) for r in ab["runs_b"]), tuple(ab.get("pairs") or [0] * len(runs_a)))


def _group(info: Mapping) -> str:
    """The op a case measures, whatever its shape point: component, backend and the shape fields that do
    not vary along the sweep. Cases of one group share a pooled spread.

    >>> _group({"component": "dense_gemm", "backend": "vllm", "shape": {"op": "q_a", "M": 32, "N": 2112}})
    "dense_gemm|vllm|N=2112|op='q_a'"
    """
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
    return tuple((name, _field(info, *path)) for name, path in SETUP_FACTS if _field(info, *path) is not None)


def _facts(info: Mapping) -> dict:
    """The :data:`FACTS` of ``extra_info``, the GPU model and link a collective ran over, and the SM clock
    the run had (NVML, before it)."""
    kept = {k: info[k] for k in FACTS if k in info}
    gpus = _field(info, "topology", "gpus") or []
    if isinstance(gpus, list) and gpus and isinstance(gpus[0], Mapping) and gpus[0].get("name"):
        kept["gpu"] = gpus[0]["name"]
    link = _field(info, "link", "link")
    if link:
        kept["link"] = link
    clock = _field(info, "telemetry_before", "sm_clock_mhz")
    if clock:
        kept["sm_clock_mhz"] = clock
    return kept


# --- writing: the one writer of extra_info (record_facts as a measurement is recorded, stored_entry
# as pytest-benchmark stores the session); _record above reads both back -----------------------------


def record_facts(benchmark, samples, info: Mapping | None) -> None:
    """Write a measurement's facts ``info`` (its shape, timer, traffic, telemetry, ...) into the live
    ``benchmark``'s ``extra_info``, which pytest-benchmark stores as it is; first raise
    :class:`~decodebench.entry_check.ImpossibleResult` (nothing written) unless they make a usable entry
    with its ``samples`` and the facts it holds."""
    what = getattr(benchmark, "fullname", "") or getattr(benchmark, "name", "")
    check_recordable(what, samples, {**(getattr(benchmark, "extra_info", None) or {}), **(info or {})})
    if info:
        benchmark.extra_info.update(info)


def check_run(what: str, samples, kernels: Mapping | None = None) -> None:
    """Raise :class:`~decodebench.entry_check.ImpossibleResult` naming ``what`` unless a re-measured run
    (``samples``, the ``kernels`` it launched) could be stored as one."""
    check_recordable(what, samples, {"resample_kernels": [kernels]})


def ab_record(rounds, configured: int, side_a: Mapping, side_b: Mapping) -> dict:
    """The ``ab`` fact of an A/B case from its :class:`decodebench.runner.ab.Rounds`: both sides'
    rounds, the pair each ran in, side A's kernels and what each side's interpreter was
    (``configured``: ``--ab-rounds``); read back as :attr:`Result.paired`."""
    return {"rounds": configured, "runs_a": _lists(rounds.runs_a), "runs_b": _lists(rounds.runs_b),
            "pairs": list(rounds.pairs), "kernels_a": rounds.extra_a.get("kernels"),
            "side_a": dict(side_a), "side_b": dict(side_b)}


def stored_entry(entry: Mapping, *, runs: Sequence = (), where: str | None = None, rounds: Sequence = (),
                 other_sessions: Sequence[str] = (), gate: Mapping | None = None) -> dict:
    """``entry`` (pytest-benchmark's dict of one benchmark) as it is stored: a new dict (``entry`` is left
    as it is) with what the session added, read back by :func:`read_entry`: re-measured ``runs``
    (:class:`decodebench.harness.Run`: ``resamples``, ``resample_kernels``, ``remeasured_in`` ``where``),
    an A/B case's re-measure ``rounds`` (:class:`decodebench.runner.ab.Rounds`, appended to its ``ab``
    fact), the ``other_sessions`` that measured on its device, and its verdict (``gate``).

    >>> from types import SimpleNamespace as NS
    >>> entry = {"stats": {"data": [1.0, 1.0, 1.0]}, "extra_info": {}}
    >>> stored = stored_entry(entry, runs=[NS(samples=[2.0] * 3, kernels=None)], where="fresh process")
    >>> read_entry(stored).runs, stored["extra_info"]["remeasured_in"], entry["extra_info"]
    (((1.0, 1.0, 1.0), (2.0, 2.0, 2.0)), 'fresh process', {})
    >>> ab = ab_record(NS(runs_a=[[1.0]], runs_b=[[2.0]], pairs=[0], extra_a={}), 1, {}, {})
    >>> again = NS(runs_a=[[1.5]], runs_b=[[2.5]], pairs=[1])
    >>> record_of(stored_entry({"extra_info": {"ab": ab}}, rounds=[again])).paired
    Paired(runs_a=((1.0,), (1.5,)), runs_b=((2.0,), (2.5,)), pairs=(0, 1))
    """
    info = dict(entry.get("extra_info") or {})
    if runs:
        info["resamples"] = [*info.get("resamples", []), *(list(run.samples) for run in runs)]
        info["resample_kernels"] = [*info.get("resample_kernels", []), *(run.kernels for run in runs)]
        info["remeasured_in"] = where
    if rounds:
        ab = info["ab"]
        info["ab"] = {**ab, "runs_a": [*ab["runs_a"], *(r for one in rounds for r in _lists(one.runs_a))],
                      "runs_b": [*ab["runs_b"], *(r for one in rounds for r in _lists(one.runs_b))],
                      "pairs": [*ab["pairs"], *(p for one in rounds for p in one.pairs)]}
    if other_sessions:
        info["other_sessions"] = list(other_sessions)
    if gate is not None:
        info["gate"] = dict(gate)
    return {**entry, "extra_info": info}


def stored_entries(benchmarks: Iterable[Mapping], added: Callable[[str], Mapping]) -> list[dict]:
    """Each entry of a session as it is stored (:func:`stored_entry`), with what ``added(test id)`` gives
    for it (:func:`stored_entry`'s keywords).

    >>> stored_entries([{"fullname": "t[a]"}], lambda name: {"other_sessions": [f"pid 7 (beside {name})"]})
    [{'fullname': 't[a]', 'extra_info': {'other_sessions': ['pid 7 (beside t[a])']}}]
    """
    return [stored_entry(entry, **added(str(entry.get("fullname") or ""))) for entry in benchmarks]


def _lists(runs) -> list[list[float]]:
    return [list(r) for r in runs]
