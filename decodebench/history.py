"""History plots: one SVG per benchmark across the stored results of one fingerprint.

Usage::

    python -m decodebench history baselines/<fingerprint> OUTDIR

Each point is one stored result's median (µs), with the spread of its re-measured
runs where there are any; the x axis is the stored file's number. Damaged or foreign
files, and entries holding a number that cannot be a time, are named and skipped, as the
gate does.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from . import stats
from .baselines import History, load_history, stored_fingerprint
from .files import write_atomic
from .gate.runs import invalid_reason, runs_of
from .options import output_dir

__all__ = ["main", "plot_history", "series_of"]


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
        for name, entry in result.entries().items():
            runs = runs_of(entry)
            if runs and not invalid_reason(entry):
                level = stats.median([stats.median(r) for r in runs])
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
                   f"{stem[:longest]}-{hashlib.sha1(name.encode()).hexdigest()[:8]}.svg")
            for name, stem in plain.items()}


def plot_history(folder: Path, outdir: Path) -> list[Path]:
    """Write one line chart per benchmark of ``folder`` into ``outdir``; returns the files."""
    import pygal

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
    written = []
    for name, points in series.items():
        chart = pygal.Line(title=name, x_title="stored result", y_title="median (µs)", show_legend=False)
        chart.x_labels = [label for label, _ in points]
        chart.add("median", [value for _, value in points])
        written.append(outdir / files[name])
        write_atomic(written[-1], chart.render())
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m decodebench history", description=__doc__.split("\n")[0])
    parser.add_argument("folder", type=Path, help="baselines/<fingerprint>: the stored results of one fingerprint")
    parser.add_argument("outdir", type=output_dir, help="where the SVG files go (created)")
    args = parser.parse_args(argv)
    if not args.folder.is_dir():
        parser.error(f"{args.folder} is not a folder")
    try:
        written = plot_history(args.folder, args.outdir)
    except ValueError as exc:
        parser.error(str(exc))
    print(f"decodebench.history: {len(written)} plots in {args.outdir}")
    return 0

