"""History plots: one SVG per benchmark across the stored results of one fingerprint.

Usage::

    python -m decodebench history baselines/<fingerprint> OUTDIR

Each point is one stored result's median (µs), with the spread of its re-measured
runs where there are any; the x axis is the stored file's number. Damaged or foreign
files, and entries holding a number that cannot be a time, are named and skipped, as the
gate does. ``OUTDIR/index.md`` is the table of plots: each file with its benchmark's whole id
(a plot's title is the id cut to a length the renderer can draw, :mod:`decodebench.svg`). A plot
the renderer cannot draw within ``--plot-timeout-s`` is named, the others are still written, and
the command exits 1.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from . import stats
from .baselines import History, load_history
from .files import write_atomic
from .options import output_dir, positive_float
from .results import stored_fingerprint
from .svg import RENDER_LIMIT_S, Chart, ChartError, digest, write_chart

__all__ = ["Plots", "main", "plot_history", "series_of"]


def series_of(history: History) -> dict[str, list[tuple[str, float]]]:
    """Benchmark node id -> [(result label, median in µs)], oldest first; entries marked invalid or
    that cannot be used (:mod:`decodebench.entry_check`, :meth:`StoredResult.skipped` names them) left out.

    >>> from decodebench.baselines import StoredResult
    >>> entry = {"fullname": "t[a]", "stats": {"data": [1e-6, 2e-6, 3e-6]}, "extra_info": {}}
    >>> result = StoredResult(Path("0007_x.json"), {"benchmarks": [entry]})
    >>> series_of(History(Path("."), (result,), ()))
    {'t[a]': [('0007', 2.0)]}
    """
    series: dict[str, list[tuple[str, float]]] = {}
    for result in history.results:
        label = result.path.name.split("_", 1)[0]
        for name, record in result.entries().items():
            if record.runs and not record.invalid:
                level = stats.median([stats.median(r) for r in record.runs])
                series.setdefault(name, []).append((label, level * 1e6))
    return series


def _file_names(names: Sequence[str], longest: int = 150) -> dict[str, str]:
    """Benchmark id -> its SVG's file name: the id with every run of other characters than letters, digits,
    ``_.-`` made one ``_``; where two ids would share a name, or one is longer than ``longest``, cut to it and
    followed by a short hash of the id, so that no plot overwrites another.

    >>> sorted(_file_names(["t[a/b]", "t[a_b]", "t[c]"]).values())
    ['t_a_b-54efc291.svg', 't_a_b-ade59aac.svg', 't_c.svg']
    """
    plain = {name: re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") for name in names}
    taken = Counter(plain.values())
    return {name: (f"{stem}.svg" if taken[stem] == 1 and len(stem) <= longest else
                   f"{stem[:longest]}-{digest(name)}.svg")
            for name, stem in plain.items()}


@dataclass(frozen=True)
class Plots:
    """What :func:`plot_history` wrote: the plots and the table of them, and the plots it could not draw."""

    written: tuple[Path, ...]
    index: Path
    failed: tuple[str, ...]  # one line each, naming the plot and why


def plot_history(folder: Path, outdir: Path, limit_s: float = RENDER_LIMIT_S) -> Plots:
    """Write one line chart per benchmark of ``folder`` into ``outdir``, each rendered within ``limit_s``,
    and ``index.md``, the table of plot files and benchmark ids."""
    history = load_history(folder)
    keys = {stored_fingerprint(r.document) for r in history.results}
    if len(keys) > 1:
        raise ValueError(f"{folder} mixes fingerprints {sorted(map(str, keys))}: plot one fingerprint's folder")
    for skipped in [*history.skipped, *(line for r in history.results for line in r.skipped())]:
        print(f"decodebench.history: skipped {skipped}", file=sys.stderr)
    series = series_of(history)
    if not series:
        raise ValueError(f"{folder}: no stored result with a usable entry to plot (what was skipped is named above)")
    files = _file_names(list(series))
    written, failed = [], []
    for name, points in series.items():
        chart = Chart("Line", {"title": name, "x_title": "stored result", "y_title": "median (µs)",
                               "show_legend": False},
                      tuple(label for label, _ in points), (("median", tuple(value for _, value in points)),))
        try:
            written.append(write_chart(outdir / files[name], chart, f"the plot {files[name]}", limit_s))
        except ChartError as exc:
            failed.append(str(exc))
    index = outdir / "index.md"
    write_atomic(index, _index(series, files, {path.name for path in written}).encode())
    return Plots(tuple(written), index, tuple(failed))


def _index(series: dict, files: dict[str, str], drawn: set[str]) -> str:
    """The table of plots: file, benchmark id (whole), points; a plot not drawn says so."""
    rows = ["| plot | benchmark | points |", "|---|---|---|"]
    for name, points in series.items():
        plot = files[name] if files[name] in drawn else f"{files[name]} (not drawn)"
        rows.append(f"| {plot} | `{name.replace('|', '&#124;')}` | {len(points)} |")
    return "\n".join(rows) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m decodebench history", description=__doc__.split("\n")[0])
    parser.add_argument("folder", type=Path, help="baselines/<fingerprint>: the stored results of one fingerprint")
    parser.add_argument("outdir", type=output_dir, help="where the SVG files go (created)")
    parser.add_argument("--plot-timeout-s", metavar="S", type=positive_float, default=RENDER_LIMIT_S,
                        help="stop a plot the renderer has not drawn within S seconds, name it and go on with the "
                             "others (default: %(default)g)")
    args = parser.parse_args(argv)
    if not args.folder.is_dir():
        parser.error(f"{args.folder} is not a folder")
    try:
        plots = plot_history(args.folder, args.outdir, args.plot_timeout_s)
    except ValueError as exc:
        parser.error(str(exc))
    for line in plots.failed:
        print(f"decodebench.history: not drawn: {line}", file=sys.stderr)
    not_drawn = f"; {len(plots.failed)} not drawn (named above)" if plots.failed else ""
    print(f"decodebench.history: {len(plots.written)} plots in {args.outdir}{not_drawn}; the table: {plots.index}")
    return 1 if plots.failed else 0

