"""The attribution's offline commands, verbs of ``python -m decodebench`` (what each does:
:data:`decodebench.__main__.VERBS`; docs/attribution.md): ``breakdown TRACE_DIR`` (exit 1 when no
window could be broken down), ``scenarios RESULTS.json...`` and ``steps TRACE_DIR...``.

Their prediction options are declared once, in :mod:`.options`. Every command exits 2 on a bad
argument, naming it: a TP the model's shapes cannot have, a depth beyond the model's, a what-if
that needs an option not given.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from ..files import write_atomic
from ..model import load_model_spec
from ..options import output_dir, positive_int_list
from ..svg import ChartError
from .analyse import Served, Window, analyse, report, windows_in, write_outputs
from .breakdown.steps import report as steps_report
from .breakdown.steps import step_time
from .breakdown.trace import TraceError
from .depth import with_layers
from .options import add_prediction_options, check_context, check_deployment
from .predict.chart import write_scenarios_chart
from .predict.prediction import kernel_results, load_results, one_per_point, predict_step
from .predict.rule_file import use_stored
from .predict.scenarios import answer, answer_lines, check_what_ifs, ep_table_lines
from .predict.step import KernelResult, WhatIfError

__all__ = ["breakdown", "breakdown_parser", "scenarios", "scenarios_parser", "steps"]


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line naming the bad value, as the pytest options give
        self.exit(2, f"{self.prog}: error: {message}\n")


def _fail(prog: str, exc: Exception) -> int:
    print(f"{prog}: error: {exc}", file=sys.stderr)
    return 2


# --- breakdown ---------------------------------------------------------------------------------------


def breakdown_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m decodebench breakdown",
                description="Break down profiler traces on disk into the model's components, with the prediction "
                            "from kernel results.")
    p.add_argument("trace_dir", metavar="TRACE_DIR", type=Path, help="directory holding the rank traces")
    add_prediction_options(p.add_argument, ("model", "tp"), {"model": (None, "none: required"),
                                                            "tp": (None, "--server-rank-of's N, else required")})
    add_prediction_options(p.add_argument, ("server_layers", "server_rank_of", "predict_from", "prefer_timer",
                                            "context", "server_routing", "what_if", "project_to"))
    p.add_argument("--out", metavar="DIR", type=output_dir, default=None,
                   help="also write attribution.txt, .json and .svg there. Default: print only")
    return p


def breakdown(argv: Sequence[str] | None = None) -> int:
    """``python -m decodebench breakdown TRACE_DIR ...``: the live session's table and prediction lines from
    traces on disk; 0, 1 when no window could be broken down, 2 on a bad argument (named)."""
    parser = breakdown_parser()
    args = parser.parse_args(argv)
    if args.server_rank_of and args.tp not in (None, args.server_rank_of):
        parser.error(f"--server-rank-of {args.server_rank_of} served one rank of TP {args.server_rank_of}: its "
                     f"prediction is at that TP, so --tp {args.tp} contradicts it (leave --tp out)")
    flag = "--tp" if args.tp else "--server-rank-of"
    args.tp = args.tp or args.server_rank_of
    for name in ("model", "tp"):
        if getattr(args, name) is None:
            parser.error(f"--{name} is required")
    try:
        check_deployment(args.model, args.tp, args.server_layers, flag)
        check_context(args.model, args.context)
    except WhatIfError as exc:
        return _fail(parser.prog, exc)
    try:
        windows, notes = windows_in(args.trace_dir, args.context)
        skipped: list[str] = []  # entries of --predict-from that cannot be used, by name
        results = kernel_results(args.predict_from, args.prefer_timer, skipped=skipped)
        notes += skipped
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:
        _check_questions(args, results, windows)
        _stored_rules(args.predict_from if args.project_to else ())
    except (WhatIfError, ValueError) as exc:
        return _fail(parser.prog, exc)
    runs = []
    for window in windows:
        served = Served(args.model, args.tp, args.server_layers, args.server_routing or window.routing,
                        rank_of=bool(args.server_rank_of))
        try:
            runs.append((window.label, analyse(window, served, results, what_ifs=args.what_if,
                                               targets=args.project_to)))
        except (TraceError, ValueError, OSError) as exc:
            notes.append(f"{window.label}: {exc}")
        except WhatIfError as exc:
            return _fail(parser.prog, exc)
    if runs:
        print(report(runs))
        if args.out:
            write_outputs(args.out, runs)
    for note in notes:
        print(f"left out: {note}", file=sys.stderr)
    return 0 if runs else 1


def _check_questions(args, results: Sequence[KernelResult], windows: Sequence[Window]) -> None:
    """A what-if or projection needs the prediction, and the prediction of a step needs its context."""
    if not (args.what_if or args.project_to):
        return
    if not results:
        raise WhatIfError("--what-if and --project-to ask the prediction: add --predict-from")
    blind = [w.label for w in windows if w.context is None]
    if blind:
        raise WhatIfError(f"--what-if and --project-to need the decode context the step is predicted at, and the "
                          f"window manifest gives none for {', '.join(blind)}: add --context TOKENS")
    check_what_ifs(args.what_if, results, args.model)


# --- scenarios ---------------------------------------------------------------------------------------


def scenarios_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m decodebench scenarios",
                description="Predict decode steps from stored kernel results; what-ifs, Amdahl, projections.")
    p.add_argument("results", nargs="+", type=Path, metavar="RESULTS.json",
                   help="pytest-benchmark JSON of kernel results (same model and TP)")
    add_prediction_options(p.add_argument, ("model", "tp"), {"model": (None, "the results' machine_info, else "
                                                                             "kimi-k2.5"),
                                                            "tp": (None, "the results' machine_info, else 8")})
    add_prediction_options(p.add_argument, ("server_layers", "prefer_timer", "context", "what_if", "project_to"),
                           {"context": (1024, "1024")})
    p.add_argument("--batch", metavar="LIST", type=positive_int_list, default=(1, 64, 256),
                   help="decode batch sizes M (tokens per step); a batch no result was measured at is read from "
                        "the nearest measured one and named EXTRAPOLATED. Default: 1,64,256")
    p.add_argument("--out", metavar="DIR", type=output_dir, default=None,
                   help="write scenarios.json, scenarios.txt and the stacked-bar scenarios.svg here. "
                        "Default: print only")
    return p


def scenarios(argv: Sequence[str] | None = None) -> int:
    """``python -m decodebench scenarios RESULTS.json...``: the step at each batch, under each what-if and on
    each target, from stored kernel results; 0, or 2 on a bad argument (named)."""
    parser = scenarios_parser()
    args = parser.parse_args(argv)
    try:
        results, meta = _load(args.results)
        if args.prefer_timer:
            results = one_per_point(results, args.prefer_timer)[0]
        spec = args.model or load_model_spec(meta.get("model") or "kimi-k2.5")
        tp = args.tp or int(meta.get("tp") or 8)
        check_deployment(spec, tp, args.server_layers)
        check_context(spec, args.context)
        spec = with_layers(spec, args.server_layers) if args.server_layers else spec
        check_what_ifs(args.what_if, results, spec)
        _stored_rules(args.results if args.project_to else ())
        runs = [(f"m{m}-l{args.context}", answer(_predicted(results, spec, tp, m, args.context, args.results), results,
                                                   spec, tp, what_ifs=args.what_if, targets=args.project_to))
                for m in args.batch]
    except (WhatIfError, ValueError, OSError) as exc:
        return _fail(parser.prog, exc)
    lines = [line for label, info in runs for line in answer_lines(label, info)] + ep_table_lines(runs)
    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    if args.out:
        _write(args.out, runs, text)
    return 0


def _predicted(results: list[KernelResult], spec, tp: int, batch: int, context: int, paths: Sequence[Path]):
    """The step predicted at ``batch``; ValueError naming the files and what the step lacks when no
    result covers any of its components (an empty file predicted "0.0 µs of kernels" and exited 0)."""
    prediction = predict_step(results, spec, tp, batch, context)
    if not prediction.terms:
        lacking = sorted({line.split(":", 1)[0] for line in prediction.missing})
        raise ValueError(f"{', '.join(map(str, paths))}: no kernel result of any component the step of {spec.name} "
                         f"at TP {tp}, M={batch} needs (none of {', '.join(lacking)}): nothing to predict from")
    return prediction


def _stored_rules(paths: Sequence[Path]) -> None:
    """The stored fits beside the results (``python -m decodebench fit``), for the projections; what was
    used or left out, on stderr."""
    for note in use_stored(paths):
        print(f"projection rule: {note}", file=sys.stderr)


def _load(paths: Sequence[Path]) -> tuple[list[KernelResult], dict]:
    results, meta = [], {}
    for path in paths:
        rs, m = load_results(path)
        results += rs
        meta = meta or m
    return results, meta


def _write(out: Path, runs: list[tuple[str, dict]], text: str) -> None:
    write_atomic(out / "scenarios.json", json.dumps(dict(runs), indent=1).encode())
    write_atomic(out / "scenarios.txt", text.encode())
    try:
        write_scenarios_chart(runs, out / "scenarios.svg")
    except ChartError as exc:
        print(f"table and JSON: {out}; no chart: {exc}")
        return
    print(f"table, JSON and chart: {out}")


# --- steps -------------------------------------------------------------------------------------------


def steps(argv: Sequence[str] | None = None) -> int:
    """``python -m decodebench steps TRACE_DIR...``: GPU busy against host time per decode step; 1 when a
    trace could not be read."""
    parser = _Parser(prog="python -m decodebench steps",
                     description="Where a profiled server's decode step goes: GPU busy and idle, and the host's "
                                 "spans (execute, waiting on the GPU, ops, untraced Python).")
    parser.add_argument("trace_dirs", nargs="+", type=Path, help="profiler trace directories (--profile-dir)")
    args = parser.parse_args(argv)
    rows, labels, failed = [], [], 0
    for directory in args.trace_dirs:
        try:
            windows, notes = windows_in(directory)
        except ValueError as exc:
            print(f"{directory}: {exc}", file=sys.stderr)
            failed += 1
            continue
        for note in notes:
            print(f"{directory}: {note}", file=sys.stderr)
        for window in windows:
            # a column per load, named by its directory and concurrency (``ngram4/c64``); the loads' full
            # ids and batches are in the last line
            short = f"{directory.name}/{window.label.split('-')[0]}" if len(args.trace_dirs) > 1 else window.label
            for path in window.traces[:1]:  # rank 0 runs the steps as every rank does
                try:
                    rows.append((short, step_time(path)))
                    labels.append(f"{short}: {window.label}")
                except TraceError as exc:
                    print(f"{window.label}: {exc}", file=sys.stderr)
                    failed += 1
    print(steps_report(rows))
    if len(args.trace_dirs) > 1:  # the columns carry short names
        print("; ".join(labels))
    return 1 if failed or not rows else 0
