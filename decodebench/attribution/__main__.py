"""``python -m decodebench.attribution TRACE_DIR --model NAME --tp N``: break down traces on disk.

TRACE_DIR is a ``--profile-dir`` of an earlier run (its window manifest gives the loads'
labels, context and TPOT) or traces captured by hand with vLLM's profiler
(``--profiler-config`` + ``/start_profile``, ``/stop_profile``); the table and prediction
lines are the ones the live session prints. Exit status 1 when no window could be broken
down, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..model import load_model_spec
from ..options import choice, positive_int
from .analyse import Served, analyse, report, windows_in, write_outputs
from .predict import kernel_results
from .scenarios import check_what_ifs, target_option, timer_option, what_if_option
from .trace import TraceError
from .whatif import WhatIfError

ROUTINGS = ("model", "uniform", "skewed")


def _model(text: str):
    try:
        return load_model_spec(text)
    except Exception as exc:  # noqa: BLE001 - any unreadable config is a usage error naming it
        raise argparse.ArgumentTypeError(f"--model {text!r}: {exc}") from None


def _results_file(text: str) -> Path:
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"--predict-from {text!r}: no such file")
    return path


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m decodebench.attribution", description=__doc__.split("\n\n")[0])
    p.add_argument("trace_dir", metavar="TRACE_DIR", type=Path, help="directory holding the rank traces")
    p.add_argument("--model", metavar="NAME|PATH", type=_model, required=True,
                   help="the served model at its full depth: a bundled name or a config.json / model directory")
    p.add_argument("--tp", metavar="N", type=positive_int, required=True, help="the server's tensor-parallel size")
    p.add_argument("--rank-of", action="store_true", default=False,
                   help="the traces are of one rank of TP --tp served at TP 1 (--server-rank-of): predict at TP --tp "
                        "and name the all-reduces the profile lacks. Default: off")
    p.add_argument("--layers", metavar="N", type=positive_int, default=None,
                   help="decoder layers the server ran (--server-layers). Default: the model's depth")
    p.add_argument("--predict-from", metavar="FILE", type=_results_file, action="append", default=[],
                   help="pytest-benchmark JSON of kernel results (same model, TP, device); repeatable. "
                        "Default: none (no prediction)")
    p.add_argument("--prefer-timer", metavar="MODE", type=timer_option, default=None,
                   help="with --predict-from: of two results of one point measured with different timers (the MLA "
                        "cases with --timer kernel and --timer cold), take this timer's. Default: the first given, "
                        "which the prediction names as an assumption")
    p.add_argument("--context", metavar="TOKENS", type=positive_int, default=None,
                   help="decode context length the MLA term is predicted at. Default: the live run's (from the "
                        "window manifest), else none (MLA not predicted)")
    p.add_argument("--server-routing", metavar="MODE", type=choice("routing", ROUTINGS), default=None,
                   help="how the server routed its MoE layers: model, uniform or skewed. Default: the live run's "
                        "(recorded in the manifest), else unknown (the prediction assumes uniform and says so)")
    p.add_argument("--what-if", metavar="COMPONENT=VALUE", type=what_if_option, action="append", default=[],
                   help="with --predict-from: the step predicted with a component changed (a factor 0.5x, a backend "
                        "id or BACKEND@FILE, roofline, moe=ep / ep=8 / moe=ep8:agrs|a2a; comma-joined changes make one "
                        "scenario); repeatable. "
                        "Default: none")
    p.add_argument("--project-to", metavar="TARGET", type=target_option, action="append", default=[],
                   help="with --predict-from: the step projected to a shipped target (rtx-pro-6000-x8-pcie, "
                        "h200-x8-nvlink, h200-x1) or a target JSON file; repeatable. Default: none")
    p.add_argument("--out", metavar="DIR", type=Path, default=None,
                   help="also write attribution.txt, .json and .svg there. Default: print only")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        windows, notes = windows_in(args.trace_dir, args.context)
        skipped: list[str] = []  # entries of --predict-from that cannot be used, by name
        results = kernel_results(args.predict_from, args.prefer_timer, skipped=skipped)
        notes += skipped
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:
        if (args.what_if or args.project_to) and not results:
            raise WhatIfError("--what-if and --project-to ask the prediction: add --predict-from")
        check_what_ifs(args.what_if, results)
    except WhatIfError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    runs = []
    for window in windows:
        served = Served(args.model, args.tp, args.layers, args.server_routing or window.routing, rank_of=args.rank_of)
        try:
            runs.append((window.label, analyse(window, served, results, what_ifs=args.what_if,
                                               targets=args.project_to)))
        except (TraceError, ValueError, OSError) as exc:
            notes.append(f"{window.label}: {exc}")
        except WhatIfError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    if runs:
        print(report(runs))
        if args.out:
            write_outputs(args.out, runs)
    for note in notes:
        print(f"left out: {note}", file=sys.stderr)
    return 0 if runs else 1


if __name__ == "__main__":
    sys.exit(main())
