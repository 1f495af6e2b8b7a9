"""How far one case's run-to-run spread strays from its op's, in the committed H200 sessions: the
figures behind :data:`decodebench.gate.decision.CASE_PRIOR_DF`.

Each case's runs (first runs and fresh-process re-measures) over the five committed sessions of
the unchanged nightly build (``short_history.UNCHANGED``), grouped into the gate's own levels
(:func:`decodebench.gate.series.levels_of` at 5 %), give the case's own spread (pooled within its
levels, with its df). Per op (the gate's group: component, backend, fixed shape fields): the
op's pooled spread, the spread of its cases, and the weight an op's spread deserves as a prior
for one case of it: limma's prior df, fitted to the scatter of the op's case spreads
(:func:`decodebench.gate.decision.fit_prior`); then the same fit over every case, each
spread taken relative to its op's (how unlike its op one case is, whatever the op).

    python validation/gate/case_spreads.py > validation/gate/h200/case-spreads.md

The held-out check, the H100 step-timer nights of ``validation/gate/nights.sh`` (the unchanged ones):

    python validation/gate/case_spreads.py validation/gate/h100-2026-12-06-step-a/night-{1,2,3,4,5}.json.gz \
        validation/gate/h100-2026-12-06-step-b/night-{1,2,3,4}.json.gz > validation/gate/h100-step/case-spreads.md
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from short_history import UNCHANGED, load  # noqa: E402

from decodebench import stats  # noqa: E402
from decodebench.gate import runs as R  # noqa: E402
from decodebench.gate.decision import Spread, fit_prior, pooled  # noqa: E402
from decodebench.gate.series import levels_of  # noqa: E402
from decodebench.results import record_of  # noqa: E402

THRESHOLD = 0.05  # the levels are split as a nightly at --gate 5% splits them


def case_runs(paths: Sequence[str]) -> dict[str, tuple[str, list[float], list]]:
    """Per case: its op, and the log run values and kernel signatures of every session of ``paths``."""
    found: dict[str, tuple[str, list[float], list]] = {}
    for session in map(load, paths):
        for name, entry in session.entries.items():
            values, kernels = R.run_values(entry)
            op, have, sigs = found.setdefault(name, (record_of(entry).group, [], []))
            have.extend(values)
            sigs.extend(kernels)
    return found


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("sessions", nargs="*", default=list(UNCHANGED), metavar="FILE",
                   help="sessions of one unchanged build (default: the committed H200 ones)")
    args = p.parse_args(argv)
    by_op: dict[str, list[Spread]] = defaultdict(list)
    for name, (op, values, kernels) in case_runs(args.sessions).items():
        if len(values) >= 3:
            by_op[op].append(pooled([lv.values for lv in levels_of(values, kernels, THRESHOLD)], name))
    given = " ".join(args.sessions) if args.sessions != list(UNCHANGED) else ""
    print(f"$ python validation/gate/case_spreads.py {given}".rstrip() + "\n")
    print("| op | cases | op spread | case spreads: median | 90th pct | max | prior df of the op (limma) |")
    print("|---|---|---|---|---|---|---|")
    relative, every = [], []
    for op, spreads in sorted(by_op.items()):
        usable = [s for s in spreads if s.df > 0]
        op_spread = Spread(math.fsum(s.variance * s.df for s in usable) / math.fsum(s.df for s in usable),
                           math.fsum(s.df for s in usable))
        sigmas = sorted(s.sigma for s in usable)
        prior = fit_prior(usable, op)
        relative += [Spread(s.variance / op_spread.variance, s.df) for s in usable if op_spread.variance > 0]
        every += sigmas
        print(f"| `{op[:60]}` | {len(usable)} | {op_spread.sigma:.2%} | {stats.median(sigmas):.2%} "
              f"| {stats.quantile(sigmas, 0.9):.2%} | {sigmas[-1]:.2%} | {prior.df if prior else float('nan'):.1f} |")
    together = fit_prior(relative, "all")
    ratios = sorted(math.sqrt(s.variance) for s in relative)
    every.sort()
    print()
    print(f"cases: {len(every)}; case spread median {stats.median(every):.2%}, 90th percentile "
          f"{stats.quantile(every, 0.9):.2%}, 95th {stats.quantile(every, 0.95):.2%}, max {every[-1]:.2%}")
    print(f"case spread over its op's: median {stats.median(ratios):.2f}, 90th percentile "
          f"{stats.quantile(ratios, 0.9):.2f}, 95th {stats.quantile(ratios, 0.95):.2f}, max {ratios[-1]:.2f}")
    print(f"prior df of an op's spread for one of its cases, fitted over every case: {together.df:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
