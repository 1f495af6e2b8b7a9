"""Why the 5 %-at-3 % trials that were not caught were not: each miss of a ``--verdicts`` file of
``short_history.py``, sorted by the reason the gate printed, per history length.

* *borrowed level*: its runs show one level, and a level its op's (else its component's) cases show
  kept it UNDECIDED (the reason names a level gap its op's cases or its component's other ops show);
* *own levels*: the case sits on two levels of its own and the run lies between them, or on the upper;
* *within the threshold as measured*: one level, and the change measured with 5 % injected is at most
  +3 %: the night ran 2 % or more below its history, so no rule that calls SLOWER only beyond the
  threshold can catch it (the ceiling column: every trial but these);
* *interval*: one level and a change beyond +3 %, but its interval reaches below no change.

    python validation/gate/miss_causes.py validation/gate/decision/before/h200-verdicts.tsv.gz \\
        validation/gate/decision/after/h200-verdicts.tsv.gz ... > validation/gate/decision/miss-causes.md
"""

from __future__ import annotations

import argparse
import collections
import gzip
import re
import sys
from collections.abc import Sequence
from pathlib import Path

CAUSES = ("borrowed level", "own levels", "within the threshold as measured", "interval")


def cause(reason: str, threshold: float = 0.03) -> str:
    """The cause of one miss, from its reason line.

    >>> cause("+4.1%, the interval reaches past ±3.0%; runs 2 then 3, a level gap its op's cases show")
    'borrowed level'
    >>> cause("+2.0%, the interval reaches past ±3.0%; runs 5 then 3, interval 0.98–1.06x")
    'within the threshold as measured'
    """
    if "a level gap its" in reason:
        return "borrowed level"
    if "nearest of" in reason or "from the lowest" in reason or "a level that is not the lowest" in reason:
        return "own levels"
    change = re.match(r"([+-][\d.]+)%", reason)
    if change and float(change.group(1)) / 100 <= threshold:
        return "within the threshold as measured"
    return "interval"


def table(path: Path) -> list[str]:
    trials, caught = collections.Counter(), collections.Counter()
    causes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    with gzip.open(path, "rt", encoding="utf8") as f:
        next(f)
        for line in f:
            kind, _, stored, _, _, _, verdict, reason = line.rstrip("\n").split("\t")
            if kind != "injected":
                continue
            trials[stored] += 1
            if verdict == "slower":
                caught[stored] += 1
            else:
                causes[stored][cause(reason)] += 1
    lines = [f"`{path.as_posix()}`, 5 % injected at `--gate 3%`:", "",
             "| stored runs | trials | caught | " + " | ".join(f"missed: {c}" for c in CAUSES) + " | ceiling |",
             "|---" * (4 + len(CAUSES)) + "|"]
    for k in sorted(trials, key=int):
        n = trials[k]
        ceiling = 1 - causes[k]["within the threshold as measured"] / n
        lines.append(f"| {k} | {n} | {caught[k]} ({caught[k] / n:.1%}) | "
                     + " | ".join(str(causes[k][c]) for c in CAUSES) + f" | {ceiling:.1%} |")
    return lines + [""]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("verdicts", nargs="+", type=Path, help="--verdicts files of short_history.py")
    args = p.parse_args(argv)
    print("$ python validation/gate/miss_causes.py " + " ".join(a.as_posix() for a in args.verdicts) + "\n")
    for path in args.verdicts:
        print("\n".join(table(path)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
