"""Charts drawn by the third-party renderer (pygal), bounded in what it is handed and in time.

pygal loops forever, its memory growing without end, on a chart whose title leaves the plot no
height (a history plot titled with a test id of 1,500 characters grew to 23.5 GB in 600 s). So
every text a chart carries (title, axis titles, x labels, series names) is cut to
``LABEL_CHARS`` and ended with a stable hash of the whole (:func:`short`; the caller names the
whole text elsewhere: a table, the report), and each chart is rendered in a process of its own
(this file run as a script, importing no decodebench) under a memory limit, stopped at the
caller's time limit: a renderer that does not return costs that one chart, named, and the
caller goes on with the others.

Example::

    chart = Chart("Line", {"title": "t[a]", "y_title": "median (µs)"}, ("0001", "0002"), (("median", (1.0, 2.0)),))
    write_chart(Path("plots/t_a.svg"), chart, what="the plot of t[a]")
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LABEL_CHARS", "RENDER_LIMIT_S", "Chart", "ChartError", "render", "short", "write_chart"]

LABEL_CHARS = 120  # a history title at 1,200 characters still rendered; 1,500 did not return
RENDER_LIMIT_S = 60.0  # a chart of the suite's renders in well under a second
MEMORY_BYTES = 2 << 30  # the renderer's address space: far above a chart's needs, far below a runaway's
_TEXT_OPTIONS = ("title", "x_title", "y_title")


class ChartError(RuntimeError):
    """A chart the renderer could not draw (it failed, or did not return in time), naming the chart."""


@dataclass(frozen=True)
class Chart:
    """What a pygal chart is made of: its class name, keyword options, x labels and series."""

    kind: str  # a pygal chart class: "Line", "StackedBar"
    options: dict
    x_labels: tuple[str, ...]
    series: tuple[tuple[str, tuple[float, ...]], ...]

    def bounded(self) -> dict:
        """The chart as the renderer gets it (JSON), every text cut by :func:`short`."""
        options = {k: short(v) if k in _TEXT_OPTIONS and isinstance(v, str) else v for k, v in self.options.items()}
        return {"kind": self.kind, "options": options, "x_labels": [short(x) for x in self.x_labels],
                "series": [[short(name), list(values)] for name, values in self.series]}


def short(text: str, limit: int = LABEL_CHARS) -> str:
    """``text`` as it is where it fits in ``limit`` characters, else its start, an ellipsis and a hash
    of the whole (the same text gives the same label; two that share a start give two).

    >>> short("t[a]")
    't[a]'
    >>> short("t[" + "x" * 200 + "]", limit=20)
    't[xxxxxxxx…16c0e908'
    """
    if len(text) <= limit:
        return text
    return f"{text[:limit - 10]}…{digest(text)}"


def digest(text: str) -> str:
    """A stable 8-character hash of ``text`` (labels and file names that stand for it).

    >>> digest("t[a/b]")
    '54efc291'
    """
    return hashlib.sha1(text.encode()).hexdigest()[:8]


def render(chart: Chart, what: str, limit_s: float = RENDER_LIMIT_S) -> bytes:
    """The chart's SVG, rendered in a process of its own within ``limit_s``; :class:`ChartError`
    naming ``what`` where the renderer fails or is stopped (the process is killed and reaped);
    :class:`ModuleNotFoundError` where this interpreter has no pygal."""
    if importlib.util.find_spec("pygal") is None:  # one error for the command, not one a chart
        raise ModuleNotFoundError("No module named 'pygal'", name="pygal")
    spec = json.dumps(chart.bounded()).encode()
    try:
        done = subprocess.run([sys.executable, __file__], input=spec, capture_output=True, timeout=limit_s,
                              check=False)
    except subprocess.TimeoutExpired:
        raise ChartError(f"{what}: the renderer (pygal) did not return within {limit_s:g} s and was stopped") from None
    if done.returncode != 0:
        lines = done.stderr.decode("utf-8", errors="replace").strip().splitlines() or [f"exit status {done.returncode}"]
        raise ChartError(f"{what}: the renderer (pygal) failed: {lines[-1]}")
    return done.stdout


def write_chart(path: Path, chart: Chart, what: str, limit_s: float = RENDER_LIMIT_S) -> Path:
    """Render ``chart`` (:func:`render`) and write it to ``path`` whole, or raise :class:`ChartError`."""
    from .files import write_atomic

    write_atomic(path, render(chart, what, limit_s))
    return path


def _draw() -> None:
    """The renderer's process: a chart (JSON) on stdin, its SVG on stdout."""
    import resource

    if Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        del sys.path[0]  # run as a script: decodebench's modules are no top-level modules for pygal to find

    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES if hard == resource.RLIM_INFINITY
                                            else min(MEMORY_BYTES, hard), hard))
    import pygal

    spec = json.load(sys.stdin)
    chart = getattr(pygal, spec["kind"])(**spec["options"])
    chart.x_labels = spec["x_labels"]
    for name, values in spec["series"]:
        chart.add(name, values)
    sys.stdout.buffer.write(chart.render())


if __name__ == "__main__":
    _draw()
