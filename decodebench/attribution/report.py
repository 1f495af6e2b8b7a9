"""What people read: the attribution of a profiled decode step as a stored dict, a table, a chart.

:func:`summarize` joins a rank breakdown, the depth scaling and the prediction into the
dict that goes into the e2e benchmark's ``extra_info["attribution"]`` (stored and compared
with the other results); :func:`format_table` and :func:`write_chart` show the dicts of a
session side by side, one column / bar per concurrency.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path

from .. import svg
from ..kernel_rules import Component, classify, parts
from ..registry import group_parts
from ..svg import Chart
from .breakdown.components import RankBreakdown
from .depth import DepthScale
from .predict.step import Prediction

__all__ = ["FLAG_FACTOR", "compare_prediction", "format_table", "prediction_lines", "routing_lines",
           "summarize", "top_kernels", "write_chart"]

IDLE = "gpu_idle"
# A group whose profiled time is below 1/FLAG_FACTOR or above FLAG_FACTOR times its prediction
# is flagged on its line with the kernels behind the profiled figure: a kernel sorted into the
# wrong component or a wrong assumption (the routing) shows at once (on the H200:
# MLA attention profiled 7.1 µs against 62.4 predicted, the FlashAttention kernels sorted as GEMMs).
FLAG_FACTOR = 3.0
TOP_KERNELS = 8  # kernels kept per component in the stored attribution


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
    kernels = top_kernels(slowest.mean_kernels_us())
    info: dict = {
        "kernels": "gpu kernels" if slowest.on_device else "cpu ops (self time)",
        "ranks": len(ranks), "rank": slowest.rank, "steps": len(slowest.steps),
        "prefill_steps": slowest.prefill_steps,
        "batch": statistics.median(s.batch for s in slowest.steps),
        "step_wall_us": wall, "busy_us": busy, "idle_us": wall - busy, "busy_share": busy / wall if wall else None,
        "components_us": components,
        "components_share": {name: us / busy if busy else 0.0 for name, us in components.items()},
        "unmatched_us": slowest.mean_unmatched_us(),
        "top_kernels_us": kernels,
        "tpot_us": tpot_s * 1e6 if tpot_s else None,
    }
    if scale is not None:
        full = scale.apply(components)
        info.update(layers=scale.layers, full_layers=scale.full_layers, full_depth_components_us=full,
                    full_depth_kernel_us=sum(full.values()))
    if prediction is not None:
        info["prediction"] = compare_prediction(prediction, components, info["idle_us"], info["tpot_us"], kernels)
        if full_prediction is not None:
            info["prediction"]["full_depth_total_us"] = full_prediction.total_us
    return info


def top_kernels(kernels_us: dict[str, float], per_component: int = TOP_KERNELS) -> dict[str, dict[str, float]]:
    """The largest kernels of each component (µs per step), largest first.

    >>> top_kernels({"rms_norm_kernel": 3.0, "nvjet_a": 9.0, "nvjet_b": 1.0}, per_component=1)
    {'dense_gemm': {'nvjet_a': 9.0}, 'rmsnorm': {'rms_norm_kernel': 3.0}}
    """
    out: dict[str, dict[str, float]] = {}
    for name, us in sorted(kernels_us.items(), key=lambda item: -item[1]):
        component = classify(name) or Component.OTHER.value
        kept = out.setdefault(component, {})
        if len(kept) < per_component:
            kept[name] = us
    return {part: out[part] for part in parts() if part in out}


def compare_prediction(prediction: Prediction, components_us: dict[str, float], idle_us: float,
                       tpot_us: float | None, top_kernels_us: dict[str, dict[str, float]] | None = None) -> dict:
    """Predicted vs profiled per group and in total, and what is left of the TPOT.

    A group profiled below a third or above three times its prediction carries ``flag``
    (why) and ``kernels_us``, the kernels behind its profiled figure (from ``top_kernels_us``).

    >>> p = Prediction(1, 64, (), ())
    >>> compare_prediction(p, {"rmsnorm": 5.0, "sampling": 2.0}, 3.0, 12.0)["not_benchmarked_us"]
    {'sampling': 2.0}
    """
    covered = {name for names in group_parts().values() for name in names}
    predicted = prediction.groups_us()
    groups = {}
    for group, names in group_parts().items():
        profiled = sum(components_us.get(n, 0.0) for n in names)
        groups[group] = {"predicted_us": predicted[group], "profiled_us": profiled,
                         "error": predicted[group] / profiled - 1 if profiled else None}
        flag = _flag(predicted[group], profiled)
        if flag:
            behind = {k: us for n in names for k, us in (top_kernels_us or {}).get(n, {}).items()}
            groups[group].update(flag=flag, kernels_us=dict(sorted(behind.items(), key=lambda i: -i[1])[:3]))
    profiled_total = sum(g["profiled_us"] for g in groups.values())
    not_benchmarked = {n: us for n, us in components_us.items() if n not in covered and us > 0}
    info = {**prediction.to_info(), "groups": groups, "profiled_benchmarked_us": profiled_total,
            "error": prediction.total_us / profiled_total - 1 if profiled_total else None,
            "not_benchmarked_us": not_benchmarked, "idle_us": idle_us}
    if tpot_us:
        info["tpot_remainder_us"] = tpot_us - prediction.total_us
    return info


def _flag(predicted_us: float, profiled_us: float) -> str | None:
    """Why a group's profile and prediction disagree by more than FLAG_FACTOR, or None.

    >>> _flag(62.4, 7.1)
    'profiled 0.11x the prediction (outside 1/3..3x): a kernel in another component, or a wrong assumption?'
    >>> _flag(10.0, 12.0) is None
    True
    """
    if predicted_us <= 0:
        return None  # not predicted: named in "missing"
    ratio = profiled_us / predicted_us
    if 1 / FLAG_FACTOR <= ratio <= FLAG_FACTOR:
        return None
    return (f"profiled {ratio:.2f}x the prediction (outside 1/{FLAG_FACTOR:g}..{FLAG_FACTOR:g}x): "
            "a kernel in another component, or a wrong assumption?")


def _short(name: str, width: int = 70) -> str:
    return name if len(name) <= width else name[:width - 1] + "…"


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
        return [f"{label}: no prediction ({info.get('prediction_missing', 'no kernel results')})"] + routing_lines(info)
    lines = [f"{label}: predicted kernel time {pred['total_us']:.1f} µs vs profiled "
             f"{pred['profiled_benchmarked_us']:.1f} µs of benchmarked components ({_pct(pred['error'])}); "
             f"server routing {info.get('server_routing') or 'unknown'}"]
    for group, row in pred["groups"].items():
        if row["predicted_us"] or row["profiled_us"]:
            flag = f"  << CHECK: {row['flag']}" if row.get("flag") else ""
            lines.append(f"  {group:<16} predicted {row['predicted_us']:8.1f} µs  profiled {row['profiled_us']:8.1f} µs"
                         f"  {_pct(row['error'])}{flag}")
            if row.get("flag"):
                behind = "; ".join(f"{us:.1f} {_short(name)}" for name, us in row.get("kernels_us", {}).items())
                lines.append(f"      behind the profiled figure (µs/step): {behind or 'no kernel'}")
    other = ", ".join(f"{name} {us:.1f}" for name, us in pred["not_benchmarked_us"].items())
    if info.get("tpot_us"):
        lines.append(f"  TPOT {info['tpot_us']:.1f} µs = predicted {pred['total_us']:.1f} + remainder "
                     f"{info['tpot_us'] - pred['total_us']:.1f} (GPU idle {info['idle_us']:.1f}; not benchmarked: "
                     f"{other or 'none'}; the rest is prediction error and profiler overhead)")
    lines += [f"  assumed: {why}" for why in pred.get("assumptions", [])]
    lines += [f"  not predicted: {why}" for why in pred.get("missing", [])]
    lines += collectives_lines(info)
    if info.get("simulated_routing"):
        lines.append(f"  routing: {info['simulated_routing']['note']}")
    if "full_depth_total_us" in pred:
        lines.append(f"  full depth ({info.get('full_layers')} layers): predicted {pred['full_depth_total_us']:.1f} µs,"
                     f" scaled from the profile {info.get('full_depth_kernel_us', 0.0):.1f} µs of kernels per step")
    return lines + routing_lines(info)


def collectives_lines(info: dict) -> list[str]:
    """What a one-rank-of-TP-N profile leaves out (``--server-rank-of``), and what the TP-N step adds back.

    >>> for line in collectives_lines({"collectives": {"note": "no collective ran", "calls": 123, "us": 1230.0,
    ...         "source": "all-reduce results (ar-m1)", "step_us": 2000.0}}): print(line)
      collectives: no collective ran
      the TP step adds 123 all-reduces: 1230.0 µs from all-reduce results (ar-m1): 2000.0 µs of kernels per step
    """
    coll = info.get("collectives")
    if not coll:
        return []
    lines = [f"  collectives: {coll['note']}"]
    if coll.get("us") is not None:
        lines.append(f"  the TP step adds {coll['calls']} all-reduces: {coll['us']:.1f} µs from {coll['source']}: "
                     f"{coll['step_us']:.1f} µs of kernels per step")
    elif "calls" in coll:
        lines.append(f"  the TP step adds {coll['calls']} all-reduces, {coll['source']}")
    return lines


def routing_lines(info: dict) -> list[str]:
    """The captured routing of a load (``--capture-routing``): how concentrated it is, what a replay reads.

    >>> print(routing_lines({"routing_profile": {"layers": [{"layer": 1}], "mean_replay_distinct_at_batch": 6.4,
    ...                      "tokens_captured": [16], "tokens_in_profiled_steps": 16}})[0][:72])
      routing captured: 1 MoE layer(s), 16 tokens (16 in the profiled steps)
    """
    profile = info.get("routing_profile")
    if not profile:
        return []
    tokens = profile.get("tokens_captured") or [0]
    return [f"  routing captured: {len(profile.get('layers', []))} MoE layer(s), {tokens[0]} tokens "
            f"({profile.get('tokens_in_profiled_steps')} in the profiled steps); a replay at this batch reads "
            f"{profile.get('mean_replay_distinct_at_batch', 0.0):.1f} distinct experts per layer call"]


def _pct(error: float | None) -> str:
    return f"{error * 100:+6.1f}%" if error is not None else "   n/a"


def _cell(us: float, share: float | None) -> str:
    return f"{us:9.1f} {share * 100:5.1f}%" if share is not None else f"{us:9.1f}       "


def format_table(runs: Sequence[tuple[str, dict]]) -> str:
    """Components x runs (µs per step and % of the busy time), idle, wall, prediction and TPOT.

    >>> info = {"components_us": {"rmsnorm": 2.0}, "busy_us": 2.0, "idle_us": 1.0, "step_wall_us": 3.0}
    >>> print(format_table([("c1-in1024-out128", info), ("c64-in1024-out128", info)]))
    µs/step (% busy)    c1-in1024-out128  c64-in1024-out128
    rmsnorm                   2.0 100.0%         2.0 100.0%
    busy                      2.0                2.0
    gpu_idle                  1.0                1.0
    step wall                 3.0                3.0
    """
    width = 18
    columns = [max(17, len(label) + 2) for label, _ in runs]  # a label never runs into its neighbour

    def row(title: str, cells) -> str:
        return f"{title:<{width}}" + "".join(f"{cell:>{w}}" for cell, w in zip(cells, columns, strict=True))

    lines = [row("µs/step (% busy)", [label for label, _ in runs])]
    names = [part for part in parts() if any(i["components_us"].get(part) for _, i in runs)]
    for name in names:
        lines.append(row(name, [_cell(i["components_us"].get(name, 0.0), i["components_us"].get(name, 0.0) /
                                      i["busy_us"]) for _, i in runs]))
    rows = (("busy", "busy_us"), (IDLE, "idle_us"), ("step wall", "step_wall_us"), ("TPOT", "tpot_us"),
            ("full-depth kernels", "full_depth_kernel_us"))
    for label, key in rows:
        if any(i.get(key) is not None for _, i in runs):
            lines.append(row(label, [_cell(i.get(key) or 0.0, None) for _, i in runs]))
    if any("prediction" in i for _, i in runs):
        lines.append(row("predicted", [_cell(i["prediction"]["total_us"], None) if "prediction" in i else "-"
                                       for _, i in runs]))
    return "\n".join(line.rstrip() for line in lines)


def write_chart(runs: Sequence[tuple[str, dict]], path: Path, title: str = "decode step") -> Path:
    """A stacked bar chart (SVG): one bar per run, µs per step by component, GPU idle on top; rendered
    within :data:`~decodebench.svg.RENDER_LIMIT_S` or :class:`~decodebench.svg.ChartError`."""
    series = [(part, tuple(i["components_us"].get(part, 0.0) for _, i in runs)) for part in parts()]
    series = [(name, values) for name, values in series if any(values)]
    series.append((IDLE, tuple(max(0.0, i["idle_us"]) for _, i in runs)))
    chart = Chart("StackedBar", {"title": f"{title}: µs per step by component", "x_title": "load",
                                 "y_title": "µs per step", "legend_at_bottom": True},
                  tuple(label for label, _ in runs), tuple(series))
    return svg.write_chart(path, chart, f"the chart {path.name}")
