"""What people read: the attribution of a profiled decode step as a stored dict, a table, a chart.

:func:`summarize` joins a rank breakdown, the depth scaling and the prediction into the
dict that goes into the e2e benchmark's ``extra_info["attribution"]`` (stored and compared
with the other results); :func:`format_table` and :func:`write_chart` show the dicts of a
session side by side, one column / bar per concurrency.
"""

from __future__ import annotations

import os
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path

from .breakdown import RankBreakdown
from .depth import DepthScale
from .predict import GROUPS, Prediction
from .rules import Component

__all__ = ["compare_prediction", "depth_agreement", "format_table", "prediction_lines", "summarize", "write_chart",
           "write_atomic"]

IDLE = "gpu_idle"


def summarize(ranks: Sequence[RankBreakdown], slowest: RankBreakdown, *, scale: DepthScale | None = None,
              prediction: Prediction | None = None, full_prediction: Prediction | None = None,
              tpot_s: float | None = None) -> dict:
    """The attribution of one load as a JSON-able dict (µs per step, shares of busy time).

    Example::

        info = summarize(ranks, slowest(ranks), scale=depth_scale(spec, 4, 1), prediction=p, tpot_s=2.45e-3)
        info["components_us"]["moe_gemm"], info["prediction"]["total_us"]
    """
    components = slowest.mean_components_us()
    busy, wall = slowest.mean("busy_us"), slowest.mean("wall_us")
    info: dict = {
        "kernels": "gpu kernels" if slowest.on_device else "cpu ops (self time)",
        "ranks": len(ranks), "rank": slowest.rank, "steps": len(slowest.steps),
        "prefill_steps": slowest.prefill_steps,
        "batch": statistics.median(s.batch for s in slowest.steps),
        "step_wall_us": wall, "busy_us": busy, "idle_us": wall - busy, "busy_share": busy / wall if wall else None,
        "components_us": components,
        "components_share": {name: us / busy if busy else 0.0 for name, us in components.items()},
        "unmatched_us": slowest.mean_unmatched_us(),
        "tpot_us": tpot_s * 1e6 if tpot_s else None,
    }
    if scale is not None:
        full = scale.apply(components)
        info.update(layers=scale.layers, full_layers=scale.full_layers, full_depth_components_us=full,
                    full_depth_kernel_us=sum(full.values()))
    if prediction is not None:
        info["prediction"] = compare_prediction(prediction, components, info["idle_us"], info["tpot_us"])
        if full_prediction is not None:
            info["prediction"]["full_depth_total_us"] = full_prediction.total_us
    return info


def compare_prediction(prediction: Prediction, components_us: dict[str, float], idle_us: float,
                       tpot_us: float | None) -> dict:
    """Predicted vs profiled per group and in total, and what is left of the TPOT.

    >>> p = Prediction(1, 64, (), ())
    >>> compare_prediction(p, {"rmsnorm": 5.0, "sampling": 2.0}, 3.0, 12.0)["not_benchmarked_us"]
    {'sampling': 2.0}
    """
    covered = {name for names in GROUPS.values() for name in names}
    predicted = prediction.groups_us()
    groups = {}
    for group, names in GROUPS.items():
        profiled = sum(components_us.get(n, 0.0) for n in names)
        groups[group] = {"predicted_us": predicted[group], "profiled_us": profiled,
                         "error": predicted[group] / profiled - 1 if profiled else None}
    profiled_total = sum(g["profiled_us"] for g in groups.values())
    not_benchmarked = {n: us for n, us in components_us.items() if n not in covered and us > 0}
    info = {**prediction.to_info(), "groups": groups, "profiled_benchmarked_us": profiled_total,
            "error": prediction.total_us / profiled_total - 1 if profiled_total else None,
            "not_benchmarked_us": not_benchmarked, "idle_us": idle_us}
    if tpot_us:
        info["tpot_remainder_us"] = tpot_us - prediction.total_us
    return info


def prediction_lines(label: str, info: dict) -> list[str]:
    """Predicted vs profiled per group, the total, and what remains of the TPOT, as text lines.

    >>> info = {"idle_us": 40.0, "tpot_us": 100.0, "prediction": {"total_us": 50.0, "profiled_benchmarked_us": 55.0,
    ...     "error": -0.09, "groups": {"rmsnorm": {"predicted_us": 50.0, "profiled_us": 55.0, "error": -0.09}},
    ...     "not_benchmarked_us": {"sampling": 5.0}, "missing": []}}
    >>> prediction_lines("c1", info)[1]
    '  rmsnorm          predicted     50.0 µs  profiled     55.0 µs    -9.0%'
    """
    pred = info.get("prediction")
    if pred is None:
        return [f"{label}: no prediction ({info.get('prediction_missing', 'no kernel results')})"]
    lines = [f"{label}: predicted kernel time {pred['total_us']:.1f} µs vs profiled "
             f"{pred['profiled_benchmarked_us']:.1f} µs of benchmarked components ({_pct(pred['error'])})"]
    for group, row in pred["groups"].items():
        if row["predicted_us"] or row["profiled_us"]:
            lines.append(f"  {group:<16} predicted {row['predicted_us']:8.1f} µs  profiled {row['profiled_us']:8.1f} µs"
                         f"  {_pct(row['error'])}")
    other = ", ".join(f"{name} {us:.1f}" for name, us in pred["not_benchmarked_us"].items())
    if info.get("tpot_us"):
        lines.append(f"  TPOT {info['tpot_us']:.1f} µs = predicted {pred['total_us']:.1f} + remainder "
                     f"{info['tpot_us'] - pred['total_us']:.1f} (GPU idle {info['idle_us']:.1f}; not benchmarked: "
                     f"{other or 'none'}; the rest is prediction error and profiler overhead)")
    lines += [f"  not predicted: {why}" for why in pred.get("missing", [])]
    if "full_depth_total_us" in pred:
        lines.append(f"  full depth ({info.get('full_layers')} layers): predicted {pred['full_depth_total_us']:.1f} µs,"
                     f" scaled from the profile {info.get('full_depth_kernel_us', 0.0):.1f} µs of kernels per step")
    return lines


def _pct(error: float | None) -> str:
    return f"{error * 100:+6.1f}%" if error is not None else "   n/a"


def _cell(us: float, share: float | None) -> str:
    return f"{us:9.1f} {share * 100:5.1f}%" if share is not None else f"{us:9.1f}       "


def format_table(runs: Sequence[tuple[str, dict]]) -> str:
    """Components x runs (µs per step and % of the busy time), idle, wall, prediction and TPOT.

    >>> info = {"components_us": {"rmsnorm": 2.0}, "busy_us": 2.0, "idle_us": 1.0, "step_wall_us": 3.0}
    >>> print(format_table([("c1", info)]).splitlines()[1])
    rmsnorm                 2.0 100.0%
    """
    width = 18
    lines = [f"{'µs/step (% busy)':<{width}}" + "".join(f"{label:>17}" for label, _ in runs)]
    names = [c.value for c in Component if any(i["components_us"].get(c.value) for _, i in runs)]
    for name in names:
        lines.append(f"{name:<{width}}" + "".join(
            _cell(i["components_us"].get(name, 0.0), i["components_us"].get(name, 0.0) / i["busy_us"])
            for _, i in runs))
    rows = (("busy", "busy_us"), (IDLE, "idle_us"), ("step wall", "step_wall_us"), ("TPOT", "tpot_us"),
            ("full-depth kernels", "full_depth_kernel_us"))
    for label, key in rows:
        if any(i.get(key) is not None for _, i in runs):
            lines.append(f"{label:<{width}}" + "".join(_cell(i.get(key) or 0.0, None) for _, i in runs))
    if any("prediction" in i for _, i in runs):
        lines.append(f"{'predicted':<{width}}" + "".join(
            _cell(i["prediction"]["total_us"], None) if "prediction" in i else f"{'-':>17}" for _, i in runs))
    return "\n".join(lines)


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename (never half a file), with the
    mode a plain write gets (0666 less the umask; mkstemp's own 0600 would hide it from the group)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    mask = os.umask(0o022)  # reading the umask means setting it: put it back at once
    os.umask(mask)
    try:
        os.fchmod(fd, 0o666 & ~mask)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_chart(runs: Sequence[tuple[str, dict]], path: Path, title: str = "decode step") -> Path:
    """A stacked bar chart (SVG): one bar per run, µs per step by component, GPU idle on top."""
    import pygal

    chart = pygal.StackedBar(title=f"{title}: µs per step by component", x_title="load",
                             y_title="µs per step", legend_at_bottom=True)
    chart.x_labels = [label for label, _ in runs]
    for component in Component:
        values = [i["components_us"].get(component.value, 0.0) for _, i in runs]
        if any(values):
            chart.add(component.value, values)
    chart.add(IDLE, [max(0.0, i["idle_us"]) for _, i in runs])
    write_atomic(path, chart.render())
    return path


def depth_agreement(a: dict, b: dict) -> dict[str, tuple[float, float, float | None]]:
    """Full-depth µs per component estimated from two runs of different depth, and their relative gap.

    When per-layer components scale, a 2-layer and a 4-layer run give the same estimate.

    >>> four, two = ({"full_depth_components_us": {"moe_gemm": us}} for us in (100.0, 95.0))
    >>> depth_agreement(four, two)
    {'moe_gemm': (100.0, 95.0, 0.05)}
    """
    first, second = a.get("full_depth_components_us") or {}, b.get("full_depth_components_us") or {}
    return {name: (us, second.get(name, 0.0), (us - second.get(name, 0.0)) / us if us else None)
            for name, us in first.items() if us or second.get(name)}


def _print_depth_agreement(path_a: str, path_b: str) -> None:
    import json

    runs_a, runs_b = (json.loads(Path(p).read_text()) for p in (path_a, path_b))
    for load, info in runs_a.items():
        if load not in runs_b:
            continue
        other = runs_b[load]
        print(f"{load}: full-depth estimate from {info.get('layers')} vs {other.get('layers')} layers (µs/step)")
        for name, (x, y, gap) in depth_agreement(info, other).items():
            print(f"  {name:<16}{x:10.1f}{y:10.1f}  {_pct(gap)}")


if __name__ == "__main__":
    import sys

    _print_depth_agreement(*sys.argv[1:3])
