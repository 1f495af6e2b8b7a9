"""Do the runs of one session cluster? A one-way random-effects analysis of stored results.

The gate's model takes every run of a case (a session's first run and its re-measures, each in
a fresh process) as an independent draw with one run-to-run spread. If the runs of one session
sat closer together than runs of different sessions (a slow phase of a shared VM, a GPU's clock
state on one day), the re-measures of a session would narrow its interval more than they should.

For each case present in every given result with runs in at least two of them, the log run
values (:func:`decodebench.gate.runs.run_values`, the model's own) are grouped by session, and
the between-session and within-session mean squares are compared. Pooled over cases, a ratio
near 1 means the sessions are no more apart than the runs within them: no clustering to model;
per case, the share of cases whose F test finds a session effect at 5 % should be about 5 %.
Cases whose history shows two kernel levels (``--skip`` names them) are the levels model's
business and are left out.

Usage: ``python validation/run_clusters.py RESULT.json RESULT.json [...] [--skip TEXT ...]``
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from decodebench import stats
from decodebench.gate import runs as R
from decodebench.gate.decision import pooled


def mean_squares(groups: list[list[float]]) -> tuple[float, int, float, int, float]:
    """(sum of squares between, its df, within, its df, the effective group size n0).

    >>> ssb, dfb, ssw, dfw, n0 = mean_squares([[0.0, 0.2], [1.0, 1.2]])
    >>> round(ssb, 6), dfb, round(ssw, 6), dfw, n0
    (1.0, 1, 0.04, 2, 2.0)
    """
    values = [v for g in groups for v in g]
    grand = statistics.fmean(values)
    between = math.fsum(len(g) * (statistics.fmean(g) - grand) ** 2 for g in groups)
    within = pooled(groups)  # the model's own pooled within-group variance
    n0 = (len(values) - sum(len(g) ** 2 for g in groups) / len(values)) / (len(groups) - 1)
    return between, len(groups) - 1, within.variance * within.df, int(within.df), n0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="validation/run_clusters.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", type=Path, metavar="RESULT.json")
    parser.add_argument("--skip", action="append", default=[], metavar="TEXT",
                        help="leave out cases whose name contains TEXT (repeatable)")
    args = parser.parse_args(argv)
    if len(args.results) < 2:
        parser.error("give at least two stored results (sessions)")
    sessions = []
    for path in args.results:
        try:
            sessions.append({b["name"]: b for b in json.loads(path.read_text())["benchmarks"]})
        except (OSError, ValueError, KeyError, TypeError) as exc:
            parser.error(f"{path}: not a pytest-benchmark result file ({exc})")
    names = sorted(set.intersection(*(set(s) for s in sessions)))
    totals = [0.0, 0, 0.0, 0]
    taus, sigmas, tails = [], [], []
    for name in names:
        if any(text in name for text in args.skip):
            continue
        groups = [g for s in sessions if (g := R.run_values(s[name])[0])]
        if len(groups) < 2 or all(len(g) < 2 for g in groups):
            continue
        ssb, dfb, ssw, dfw, n0 = mean_squares(groups)
        totals = [totals[0] + ssb, totals[1] + dfb, totals[2] + ssw, totals[3] + dfw]
        sigmas.append(ssw / dfw)
        taus.append(max(0.0, (ssb / dfb - ssw / dfw) / n0))
        if ssw > 0:  # the case's own test: P(F > observed) with no session effect
            tails.append(stats.f_survival((ssb / dfb) / (ssw / dfw), dfb, dfw))
    if not sigmas:
        print("no case has runs in two sessions and two runs in one", file=sys.stderr)
        return 1
    msb, msw = totals[0] / totals[1], totals[2] / totals[3]
    print(f"{len(sigmas)} cases over {len(sessions)} sessions")
    print(f"per case, median: run spread within a session {math.sqrt(statistics.median(sigmas)):.2%}, "
          f"between sessions beyond it {math.sqrt(statistics.median(taus)):.2%}")
    print(f"pooled: mean square between sessions {msb:.3g} ({totals[1]} df), within {msw:.3g} ({totals[3]} df), "
          f"ratio {msb / msw:.2f}")
    if tails:
        print(f"per case, F test of a session effect: p < 0.05 in {sum(p < 0.05 for p in tails) / len(tails):.1%} "
              f"of {len(tails)} cases, p < 0.01 in {sum(p < 0.01 for p in tails) / len(tails):.1%} "
              "(without one: 5 % and 1 %)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
