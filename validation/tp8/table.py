"""The one-rank-of-TP-8 table: a profiled step of one rank (--server-rank-of 8) against the step predicted
from the same machine's --tp 8 kernel results, once per timer.

    python validation/tp8/table.py validation/tp8/h100-2026-12-05

reads PROFILE (profile-*.json: the breakdown of the windows, `python -m decodebench.attribution ... --rank-of
--out`), step.json and kernel.json of that folder, and prints a markdown table per load: each group
profiled, predicted from each timer's results and the error, and the benchmarked components in total.
The context each window is predicted at is the round's input plus the engine steps to the window's end
(the server's profiler config: delay 60, 8 steps).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from decodebench.attribution.predict import prediction as predict
from decodebench.attribution.analyse import Served, split_collectives
from decodebench.attribution.report import compare_prediction
from decodebench.model import load_model_spec

INPUT_LEN, WINDOW_END = 1024, 60 + 8
LAYERS = 24


def rows(folder: Path) -> list[str]:
    profile = json.loads(next(folder.glob("profile-*.json")).read_text())
    served = Served(load_model_spec("kimi-k2.5"), tp=8, layers=LAYERS, routing="uniform", rank_of=True)
    results = {t: predict.kernel_results([folder / f"{t}.json"], None) for t in ("step", "kernel")}
    out = [f"| C | group | profiled µs | step timer µs | error | kernel timer µs | error |", "|---|---|---|---|---|---|---|"]
    for label, info in profile.items():
        batch = round(info["batch"])
        compared = {}
        for timer, found in results.items():
            pred = predict.predict_step(found, served.served_spec, 8, batch, INPUT_LEN + WINDOW_END, "uniform")
            pred, _ = split_collectives(pred, served)
            compared[timer] = compare_prediction(pred, info["components_us"], info["idle_us"], None)
        busy = info["busy_us"]
        for group, row in compared["step"]["groups"].items():
            if not row["profiled_us"] and not row["predicted_us"]:
                continue
            k = compared["kernel"]["groups"][group]
            share = row["profiled_us"] / busy
            out.append(f"| {batch} | {group} ({share:.0%} of busy) | {row['profiled_us']:.1f} | {row['predicted_us']:.1f} | "
                       f"{_pct(row['error'])} | {k['predicted_us']:.1f} | {_pct(k['error'])} |")
        s, k = compared["step"], compared["kernel"]
        out.append(f"| {batch} | **benchmarked total** | {s['profiled_benchmarked_us']:.1f} | {s['total_us']:.1f} | "
                   f"{_pct(s['error'])} | {k['total_us']:.1f} | {_pct(k['error'])} |")
        for why in s["missing"]:
            out.append(f"| {batch} | not predicted: {why} | | | | | |")
    return out


def _pct(x) -> str:
    return "—" if x is None else f"{x:+.1%}"


if __name__ == "__main__":
    print("\n".join(rows(Path(sys.argv[1]))))
