"""The one-rank-of-TP-8 table: a profiled step of one rank (--server-rank-of 8) against the step predicted
from the same machine's --tp 8 kernel results, once per timer.

    python validation/tp8/table.py validation/tp8/h100-2026-12-05-b [--rules-only]

reads PROFILE (profile-*.json: the breakdown of the windows, `python -m decodebench breakdown TRACES
--server-rank-of 8 ... --out DIR`), step.json.gz and kernel.json.gz of that folder, and prints a markdown table
per load: each group profiled, predicted from each timer's results and the error, and the benchmarked
components in total. The context each window is predicted at is the round's input plus the engine steps
to the window's end (the server's profiler config: delay 60, 8 steps).

Where the folder holds ``from-code.txt`` (lines ``NAME=PART``: generic inductor kernels whose part the run's
generated code shows, read by hand and named in the folder's README), those kernels count in that part on the
profile's side instead of ``other``, as ``coverage.py --from-code`` counts them (``--rules-only``: not).

Where the folder holds the traces (traces.tgz), a second table sets the same predictions against the
summed durations of the kernels of the groups it predicts in the decode steps: the profile attributes
kernels that overlap (the shared expert's second stream) a share of their overlap, a sum of durations
counts each kernel whole, as the prediction does.
"""

from __future__ import annotations

import json
import sys
import tarfile
import tempfile
from collections import defaultdict
from pathlib import Path

from decodebench.attribution.analyse import Served, split_collectives, split_simulated_routing
from decodebench.attribution.breakdown.components import complete_steps, previous_names
from decodebench.attribution.breakdown.trace import load_trace
from decodebench.attribution.predict import prediction as predict
from decodebench.attribution.report import compare_prediction
from decodebench.kernel_rules import Component, classify
from decodebench.model import load_model_spec
from decodebench.registry import group_parts

INPUT_LEN, WINDOW_END = 1024, 60 + 8
LAYERS = 24


def predictions(folder: Path, names: dict[str, str]) -> tuple[dict, dict]:
    """The profile of each window, and each window's prediction from each timer's results."""
    profile = {label: _read_from_code(info, names)
               for label, info in json.loads(next(folder.glob("profile-*.json")).read_text()).items()}
    served = Served(load_model_spec("kimi-k2.5"), tp=8, layers=LAYERS, routing="uniform", rank_of=True)
    results = {t: predict.kernel_results([folder / f"{t}.json.gz"], None) for t in ("step", "kernel")}
    preds = {}
    for label, info in profile.items():
        for timer, found in results.items():
            pred = predict.predict_step(found, served.served_spec, 8, round(info["batch"]), INPUT_LEN + WINDOW_END,
                                        "uniform")
            pred, _ = split_collectives(pred, served)
            pred, _ = split_simulated_routing(pred, served)  # the simulator ran, no top-k: left out of both sides
            preds[label, timer] = pred
    return profile, preds


def from_code(folder: Path) -> dict[str, str]:
    """The folder's generic kernel names and the part its generated code shows for each (none without the file)."""
    path = folder / "from-code.txt"
    if not path.exists():
        return {}
    pairs = [line.split("=") for line in path.read_text().split() if line]
    return {name: part for name, part in pairs}


def _read_from_code(info: dict, names: dict[str, str]) -> dict:
    """A window's profile with the named generic kernels moved from ``other`` to their part."""
    parts = dict(info["components_us"])
    for name, part in names.items():
        us = info["unmatched_us"].get(name, 0.0)
        parts[Component.OTHER.value] -= us
        parts[part] = parts.get(part, 0.0) + us
    return {**info, "components_us": parts}


def rows(folder: Path, names: dict[str, str]) -> list[str]:
    """The tables, with the generic kernels ``names`` (:func:`from_code`) counted in their parts."""
    profile, preds = predictions(folder, names)
    out = [
        "| C | group | profiled µs | step timer µs | error | kernel timer µs | error |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, info in profile.items():
        batch = round(info["batch"])
        compared = {t: compare_prediction(preds[label, t], info["components_us"], info["idle_us"], None)
                    for t in ("step", "kernel")}
        busy = info["busy_us"]
        for group, row in compared["step"]["groups"].items():
            if not row["profiled_us"] and not row["predicted_us"]:
                continue
            k = compared["kernel"]["groups"][group]
            share = row["profiled_us"] / busy
            out.append(
                f"| {batch} | {group} ({share:.0%} of busy) | {row['profiled_us']:.1f} | {row['predicted_us']:.1f} | "
                f"{_pct(row['error'])} | {k['predicted_us']:.1f} | {_pct(k['error'])} |"
            )
        s, k = compared["step"], compared["kernel"]
        out.append(f"| {batch} | **benchmarked total** | {s['profiled_benchmarked_us']:.1f} | {s['total_us']:.1f} | "
                   f"{_pct(s['error'])} | {k['total_us']:.1f} | {_pct(k['error'])} |")
        for why in s["missing"]:
            out.append(f"| {batch} | not predicted: {why} | | | | | |")
    return out + duration_rows(folder, profile, preds, names)


def duration_rows(folder: Path, profile: dict, preds: dict, names: dict[str, str]) -> list[str]:
    """Predicted against the summed kernel durations of the decode steps, where traces.tgz is there."""
    archive = folder / "traces.tgz"
    if not archive.exists():
        return []
    out = [
        "",
        "| C | benchmarked kernels, summed durations µs | attributed µs | step timer µs | error "
        "| kernel timer µs | error |",
        "|---|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        for label, info in profile.items():
            (path,) = [next(Path(tmp).rglob(Path(t).name)) for t in info["traces"]]
            summed = _summed_durations(load_trace(path), names)
            covered = _predicted_parts(preds[label, "step"])
            total = sum(us for name, us in summed.items() if name in covered)
            attributed = sum(us for name, us in info["components_us"].items() if name in covered)
            s, k = preds[label, "step"].total_us, preds[label, "kernel"].total_us
            out.append(f"| {round(info['batch'])} | {total:.1f} | {attributed:.1f} | {s:.1f} | {_pct(s / total - 1)} | "
                       f"{k:.1f} | {_pct(k / total - 1)} |")
    return out


def _predicted_parts(pred) -> set[str]:
    """The profile parts of the groups the prediction has terms for (a group without results, named not predicted,
    is left out of both sides), the all-reduces apart."""
    groups = {term.group for term in pred.terms}
    return {name for group, names in group_parts().items() if group in groups for name in names
            if name != Component.ALLREDUCE.value}


def _summed_durations(trace, names: dict[str, str]) -> dict[str, float]:
    """Mean µs per decode step of each component's kernels, each kernel counted whole (the breakdown's steps)."""
    totals: dict[str, float] = defaultdict(float)
    steps = 0
    for mark, kernels, _ in complete_steps(trace):
        if not mark.is_decode:
            continue
        steps += 1
        for kernel, previous in zip(kernels, previous_names(kernels), strict=True):
            part = names.get(kernel.name) or classify(kernel.name, previous) or Component.OTHER.value
            totals[part] += kernel.end_us - kernel.start_us
    return {name: us / steps for name, us in totals.items()}


def _pct(x) -> str:
    return "—" if x is None else f"{x:+.1%}"


if __name__ == "__main__":
    folder = Path(sys.argv[1])
    print("\n".join(rows(folder, {} if "--rules-only" in sys.argv[2:] else from_code(folder))))
