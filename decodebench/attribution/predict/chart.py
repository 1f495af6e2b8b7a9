"""One picture per run: the decode step per component today, under each what-if and on each target.

Stacked bars (pygal, SVG), one bar per load and scenario: the predicted kernel time of every
group of the prediction, then, where a profile measured them, the kernels no benchmark covers
and the GPU idle (carried over unchanged to what-ifs and targets, as :mod:`.scenarios` says).
The SVG renders without scripts (pygal's tooltip script is left out, so a browser offline
shows the same chart); ``tests/test_scenarios.py`` checks its structure as XML, and renders it
in headless Chromium where one is installed.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ...registry import group_parts
from ...svg import Chart, write_chart

__all__ = ["EXTRA_SERIES", "chart_bars", "write_scenarios_chart"]

EXTRA_SERIES = ("not_benchmarked", "gpu_idle")


def chart_bars(runs: Sequence[tuple[str, dict]]) -> tuple[list[str], dict[str, list[float]]]:
    """Bar labels and, per series (group, then the profile's extras), one value per bar.

    >>> today = {"label": "today", "groups_us": {"moe": 5.0}, "kernel_us": 5.0}
    >>> info = {"today": today, "what_if": [{**today, "label": "moe=0.5x", "groups_us": {"moe": 2.5}}],
    ...         "projections": [{"target": "box", "groups_us": {"moe": 9.0}, "carried": {"gpu_idle": {"us": 1.0}}}]}
    >>> chart_bars([("c1", info)])
    (['c1 today', 'c1 moe=0.5x', 'c1 -> box'], {'moe': [5.0, 2.5, 9.0], 'gpu_idle': [0.0, 0.0, 1.0]})
    """
    labels: list[str] = []
    bars: list[dict[str, float]] = []
    for load, info in runs:
        profile = _profile_extras(info)
        for scenario in (info["today"], *info["what_if"]):
            labels.append(f"{load} {scenario['label']}")
            bars.append({**scenario["groups_us"], **profile})
        for p in info["projections"]:
            labels.append(f"{load} -> {p['target']}")
            bars.append({**p["groups_us"], **{name: row["us"] for name, row in p.get("carried", {}).items()}})
    series = {name: [bar.get(name, 0.0) for bar in bars] for name in (*group_parts(), *EXTRA_SERIES)}
    return labels, {name: values for name, values in series.items() if any(values)}


def _profile_extras(info: dict) -> dict[str, float]:
    """The profile's kernels that no benchmark covers and its GPU idle, where a profile was taken."""
    today = info["today"]
    step, kernels = today.get("step_us"), today["kernel_us"]
    extras = info.get("profile") or {}
    if step is None:
        return {}
    return {"not_benchmarked": extras.get("not_benchmarked_us") or 0.0,
            "gpu_idle": extras.get("idle_us") if extras.get("idle_us") is not None else max(0.0, step - kernels)}


def write_scenarios_chart(runs: Sequence[tuple[str, dict]], path: Path,
                          title: str = "decode step: today, what-ifs, projections") -> Path:
    """Write the stacked-bar SVG of :func:`chart_bars` to ``path`` (whole or not at all), rendered within
    :data:`~decodebench.svg.RENDER_LIMIT_S` or :class:`~decodebench.svg.ChartError`."""
    labels, series = chart_bars(runs)
    chart = Chart("StackedBar", {"title": f"{title} (µs per step)", "x_title": "load and scenario",
                                 "y_title": "µs per step", "legend_at_bottom": True, "x_label_rotation": 25,
                                 "truncate_label": -1, "js": [], "width": max(800, 90 * len(labels)), "height": 600},
                  tuple(labels), tuple((name, tuple(values)) for name, values in series.items()))
    return write_chart(path, chart, f"the chart {path.name}")
