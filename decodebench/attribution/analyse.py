"""From profiler traces on disk to the attribution of a load: the one path behind ``--breakdown``
and ``python -m decodebench breakdown`` (docs/attribution.md: ``Served``, ``Window``, ``analyse``,
``report``, ``write_outputs``).

The live run records its windows in the trace directory (:data:`MANIFEST`), so that the offline
command finds the same windows, labels and context there and prints the same table; traces
captured by hand are grouped by rank and time.

Example::

    served = Served(load_model_spec("kimi-k2.5"), tp=1, layers=4, routing="uniform")
    windows, notes = windows_in(Path("/tmp/vtrace"))
    runs = [(w.label, analyse(w, served, load_results(Path("kernels.json"))[0])) for w in windows]
    print(report(runs))
"""

from __future__ import annotations

import dataclasses
import json
import re
import statistics
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .. import moe_routing, rank_model
from ..entry_check import time_problem
from ..files import read_json, write_atomic
from ..model import ModelSpec
from ..serving.server_routing import ServerRouting
from ..shapes import DecodeShapes
from ..svg import ChartError
from . import depth
from . import report as reporting
from .breakdown import components as breakdown
from .breakdown.trace import load_trace, rank_of, trace_files
from .predict import prediction as predict
from .predict import scenarios
from .predict.chart import write_scenarios_chart

__all__ = ["MANIFEST", "Served", "Window", "analyse", "record_window", "report", "split_collectives",
           "split_simulated_routing", "windows_in", "write_outputs"]

MANIFEST = "decodebench-windows.json"  # in the trace directory: the live run's windows, by label
_TRACE_ID = re.compile(r"rank\d+\.(\d+)\.")


@dataclass(frozen=True)
class Served:
    """What the server served: the model at its full depth, the layers it ran (None: all), its TP
    size, and how it routed its MoE layers (``--server-routing``; None when unknown)."""

    spec: ModelSpec
    tp: int
    layers: int | None = None
    routing: str | None = None
    rank_of: bool = False  # one rank of TP ``tp`` served at TP 1 (--server-rank-of): no collective ran

    @property
    def server_ranks(self) -> int:
        """The ranks the server ran, each writing one trace: 1 for one rank of TP N served alone."""
        return 1 if self.rank_of else self.tp

    @property
    def served_spec(self) -> ModelSpec:
        """The model as served: ``spec`` with ``layers`` decoder layers."""
        return depth.with_layers(self.spec, self.layers) if self.layers else self.spec

    def depth_scale(self) -> depth.DepthScale | None:
        """How the served step scales to the full depth (None when it ran at full depth)."""
        served = self.served_spec
        return depth.depth_scale(self.spec, served.num_layers, self.tp) if served.num_layers != self.spec.num_layers \
            else None


@dataclass(frozen=True)
class Window:
    """One profiler window: the traces of its ranks and what the run knew about it."""

    label: str
    traces: tuple[Path, ...]
    context: int | None = None  # decode context length (prompt + steps) for the MLA prediction
    tpot_s: float | None = None  # the load's median TPOT, when measured
    routing: str | None = None  # how the server routed its MoE layers, as the live run recorded it
    routing_captures: tuple[Path, ...] = ()  # the server plugin's routing counts (--capture-routing)

    def to_manifest(self) -> dict:
        tpot = None if self.tpot_s is None or time_problem(self.tpot_s) else self.tpot_s
        return {"traces": [Path(p).name for p in self.traces], "context": self.context, "tpot_s": tpot,
                "server_routing": self.routing, "routing_captures": [Path(p).name for p in self.routing_captures]}


def analyse(window: Window, served: Served, results: Sequence[predict.KernelResult],
            out_dir: Path | None = None, *, what_ifs: Sequence = (), targets: Sequence = ()) -> dict:
    """The attribution of one window as the JSON-able dict stored in ``extra_info["attribution"]``;
    with a prediction also ``scenarios`` (:func:`.scenarios.answer`: Amdahl's bounds, the
    ``what_ifs`` and the projections to ``targets``).

    With routing counts in the window, the routing profile goes to ``out_dir/routing-<label>.json``
    (for ``--routing-profile``) and its summary into the dict. Raises
    :class:`~decodebench.attribution.breakdown.trace.TraceError` or ValueError when a trace holds no usable
    decode step, :class:`~decodebench.moe_routing.RoutingProfileError` for unusable routing counts,
    :class:`~decodebench.attribution.predict.step.WhatIfError` naming a what-if or target the results
    cannot answer.
    """
    traces = [load_trace(path) for path in window.traces]
    ranks = [breakdown.break_down(trace) for trace in traces]
    slow = breakdown.slowest(ranks)
    batch = round(statistics.median(step.batch for step in slow.steps))
    scale = served.depth_scale()
    pred = full_pred = None
    collectives = simulated = None
    if results and window.context:
        pred = predict.predict_step(list(results), served.served_spec, served.tp, batch, window.context,
                                    served.routing)
        if scale is not None:
            full_pred = predict.predict_step(list(results), served.spec, served.tp, batch, window.context,
                                             served.routing)
        if served.rank_of:  # the profile has no collective: compare the rest, name the all-reduces apart
            pred, collectives = split_collectives(pred, served)
            full_pred = split_collectives(full_pred, served)[0] if full_pred is not None else None
        pred, simulated = split_simulated_routing(pred, served)  # no top-k ran: name it apart
        full_pred = split_simulated_routing(full_pred, served)[0] if full_pred is not None else None
    info = reporting.summarize(ranks, slow, scale=scale, prediction=pred, full_prediction=full_pred,
                               tpot_s=window.tpot_s)
    if served.rank_of:
        info["collectives"] = collectives or {"note": rank_model.collectives_note(served.served_spec, served.tp)}
    if pred is not None and simulated is not None:
        info["simulated_routing"] = simulated
    info.update(traces=[str(p) for p in window.traces], context=window.context, server_routing=served.routing)
    if window.routing_captures:
        info["routing_profile"] = _routing_profile(window, served, traces[0], batch, out_dir)
    if pred is None:
        info["prediction_missing"] = ("no kernel results (this session's or --predict-from)" if not results
                                      else "no decode context length (--context)")
    else:
        scenarios.check_what_ifs(what_ifs, results, served.spec)
        info["scenarios"] = scenarios.answer(pred, results, served.served_spec, served.tp, what_ifs=what_ifs,
                                             targets=targets, profiled=scenarios.Profiled.from_attribution(info),
                                             routing=served.routing)
    return info


def split_collectives(pred: predict.Prediction, served: Served) -> tuple[predict.Prediction, dict]:
    """``pred`` without its all-reduce group, and that group as the TP-N step adds it: from the all-reduce
    results where they cover it (marked so), else named as not measured."""
    kept = tuple(t for t in pred.terms if t.group != "allreduce")
    gone = [t for t in pred.terms if t.group == "allreduce"]
    missing = tuple(m for m in pred.missing if not m.startswith("allreduce:"))
    info: dict = {"note": rank_model.collectives_note(served.served_spec, served.tp),
                  "calls": DecodeShapes.for_deployment(served.served_spec, served.tp).allreduces_per_step}
    if gone:
        info.update(us=sum(t.us for t in gone), source=f"all-reduce results ({', '.join(t.benchmark for t in gone)})",
                    step_us=pred.total_us)
    else:
        info.update(us=None, source="not measured: give all-reduce results at this TP (--predict-from) or "
                                    "--project-to a target, whose link model adds them")
    return dataclasses.replace(pred, terms=kept, missing=missing), info


def split_simulated_routing(pred: predict.Prediction, served: Served) -> tuple[predict.Prediction, dict | None]:
    """``pred`` without its top-k where the server's routing was simulated (``--server-routing uniform`` or
    ``skewed``), and the top-k named apart; ``(pred, None)`` where the model's own router ran.

    vLLM's routing simulator picks the experts in place of the model's top-k, so no top-k kernel runs in
    the profiled step: the prediction's top-k has nothing to be compared with (the simulator's own kernels
    count under ``other``, not benchmarked). Comparing it anyway would add the top-k to one side only.
    """
    strategy = ServerRouting(served.routing).strategy if served.routing in {r.value for r in ServerRouting} else None
    gone = [t for t in pred.terms if t.group == "routing"]
    if strategy is None or not gone:
        return pred, None
    us = sum(t.us for t in gone)
    return dataclasses.replace(pred, terms=tuple(t for t in pred.terms if t.group != "routing")), {
        "us": us, "benchmarks": [t.benchmark for t in gone],
        "note": f"--server-routing {served.routing}: vLLM's routing simulator ({strategy}) chose the experts and no "
                f"top-k kernel ran; the top-k predicted ({us:.1f} µs) is left out of the comparison, the "
                f"simulator's kernels count under other"}


def _routing_profile(window: Window, served: Served, trace, batch: int, out_dir: Path | None) -> dict:
    """The window's routing profile, written beside the breakdown; its summary, checked against the trace:
    the counts must hold exactly the tokens of the profiled steps (the capture runs while the profiler does)."""
    captures = [read_json(p) for p in window.routing_captures]
    source = f"{window.label}: {', '.join(Path(p).name for p in window.routing_captures)}"
    profile = moe_routing.profile_from_captures(captures, served.spec.name, served.spec.first_dense_layers, source)
    in_steps = sum(mark.context_tokens + mark.generation_tokens for mark in trace.steps)
    summary = {**moe_routing.summary_of(profile, batch), "tokens_in_profiled_steps": in_steps,
               "tokens_captured": [layer.tokens for layer in profile.layers],
               "invalid_ids": [router.get("invalid", 0) for router in captures[0].get("routers", [])]}
    if out_dir is not None:
        path = moe_routing.write_routing_profile(Path(out_dir) / f"routing-{window.label}.json", profile)
        summary["file"] = str(path)
    return summary


def report(runs: Sequence[tuple[str, dict]]) -> str:
    """The table of every load, then each load's prediction lines: what a session prints."""
    lines = reporting.format_table(runs).splitlines()
    for label, info in runs:
        lines += reporting.prediction_lines(label, info)
        if "scenarios" in info:
            lines += scenarios.answer_lines(label, info["scenarios"])
    return "\n".join(lines)


def write_outputs(out_dir: Path, runs: Sequence[tuple[str, dict]]) -> None:
    """``attribution.json``, ``attribution.txt`` (the report), ``attribution.svg`` and, with a prediction,
    ``attribution-scenarios.svg`` (today, what-ifs, projections) in ``out_dir``, each written whole or not
    at all; a chart the renderer cannot draw (no pygal, or not in time: :mod:`decodebench.svg`) is left out
    with a warning naming it."""
    if not runs:
        return
    out_dir = Path(out_dir)
    write_atomic(out_dir / "attribution.json", json.dumps(dict(runs), indent=1).encode())
    write_atomic(out_dir / "attribution.txt", (report(runs) + "\n").encode())
    asked = [(label, info["scenarios"]) for label, info in runs if "scenarios" in info]
    try:
        reporting.write_chart(runs, out_dir / "attribution.svg")
        if asked:
            write_scenarios_chart(asked, out_dir / "attribution-scenarios.svg")
    except (ChartError, ImportError) as exc:
        warnings.warn(f"no stacked-bar chart: {exc}", stacklevel=2)


def record_window(trace_dir: Path, window: Window) -> None:
    """Add ``window`` to the manifest of ``trace_dir`` (replacing a window of the same label)."""
    path = Path(trace_dir) / MANIFEST
    windows = _read_manifest(path)
    windows[window.label] = window.to_manifest()
    write_atomic(path, json.dumps(windows, indent=1).encode())


def windows_in(trace_dir: Path, context: int | None = None) -> tuple[list[Window], list[str]]:
    """The profiler windows in ``trace_dir`` and notes on what was left out.

    With the live run's manifest: its windows, labels, context and TPOT (``context`` given
    overrides the recorded one). Without: window *i* is the *i*-th trace of every rank in time
    order, labelled ``window<i>``; a directory whose ranks hold different numbers of traces is
    refused with the counts.
    """
    trace_dir = Path(trace_dir)
    if not trace_dir.is_dir():
        raise ValueError(f"{trace_dir}: no such directory")
    manifest = _read_manifest(trace_dir / MANIFEST)
    if manifest:
        return _manifest_windows(trace_dir, manifest, context)
    by_rank: dict[int, list[Path]] = {}
    for path in sorted(trace_files(trace_dir), key=_trace_order):
        by_rank.setdefault(rank_of(path), []).append(path)
    if not by_rank:
        raise ValueError(f"{trace_dir}: no worker traces (*.pt.trace.json[.gz]) in it")
    counts = {rank: len(paths) for rank, paths in sorted(by_rank.items())}
    if len(set(counts.values())) != 1:
        raise ValueError(f"{trace_dir}: the ranks hold different numbers of traces {counts}; "
                         "move the traces of one window at a time into a directory")
    windows = [Window(f"window{i + 1}", tuple(paths), context)
               for i, paths in enumerate(zip(*(by_rank[r] for r in sorted(by_rank)), strict=True))]
    return windows, []


def _manifest_windows(trace_dir: Path, manifest: dict, context: int | None) -> tuple[list[Window], list[str]]:
    windows, notes = [], []
    for label, entry in manifest.items():
        _check_manifest_entry(trace_dir / MANIFEST, label, entry)
        paths = tuple(trace_dir / name for name in entry.get("traces", []))
        absent = [p.name for p in paths if not p.is_file()]
        if absent or not paths:
            notes.append(f"{label}: trace(s) {', '.join(absent) or 'none'} not in {trace_dir}; left out")
            continue
        captures = tuple(trace_dir / name for name in entry.get("routing_captures", []) if (trace_dir / name).is_file())
        windows.append(Window(label, paths, context or entry.get("context"), entry.get("tpot_s"),
                              entry.get("server_routing"), captures))
    return windows, notes


def _check_manifest_entry(path: Path, label: str, entry) -> None:
    """ValueError naming the manifest, the window and the field of an entry the live run could not have written.

    >>> _check_manifest_entry(Path("m.json"), "c1", {"traces": "a.json"})
    Traceback (most recent call last):
    ...
    ValueError: m.json: window 'c1': traces is not a list of file names
    """
    def bad(what: str) -> ValueError:
        return ValueError(f"{path}: window {label!r}: {what}")

    if not isinstance(entry, dict):
        raise bad("not an object of traces, context, tpot_s, server_routing, routing_captures")
    for key in ("traces", "routing_captures"):
        names = entry.get(key, [])
        if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
            raise bad(f"{key} is not a list of file names")
    given = entry.get("context")
    if given is not None and (isinstance(given, bool) or not isinstance(given, int) or given < 1):
        raise bad(f"context {given!r} is not a whole number of tokens of 1 or more")
    tpot = entry.get("tpot_s")
    if tpot is not None and time_problem(tpot):
        raise bad(f"tpot_s {time_problem(tpot)}")
    if not isinstance(entry.get("server_routing", ""), (str, type(None))):
        raise bad(f"server_routing {entry['server_routing']!r} is not a name")


def _read_manifest(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = read_json(path)
    except ValueError as exc:
        raise ValueError(f"{path}: not a readable window manifest ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a window manifest (expected an object of windows by label)")
    return data


def _trace_order(path: Path) -> tuple[int, int, str]:
    """Rank, then the time id vLLM puts in the name (the file's mtime where there is none)."""
    match = _TRACE_ID.search(path.name)
    return (rank_of(path), int(match.group(1)) if match else path.stat().st_mtime_ns, path.name)
