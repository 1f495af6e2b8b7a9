"""Every verdict that differs between two runs of the offline simulations (before and after a change
of the gate's model): ``short_history.py --verdicts`` files, ``gate_offline_power.py``'s
``offline-power.json`` files, or what ``python -m decodebench.gate`` printed (``.txt``), of the same
trials.

    python validation/gate/verdict_changes.py BEFORE AFTER [--out FILE.md]

prints (and writes to ``--out``) a count per transition (``undecided -> slower``: so many) and then
every changed verdict: its trial, its case, and both reasons, the one before and the one after.
A trial or case in one file and not in the other is an error naming it: the two runs must be of
the same sessions.
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path

LINE = re.compile(r"^(SLOWER|FASTER|SAME|UNDECIDED|INCOMPARABLE) .*?  (\S+::\S+)  \((.*)\)$")


def read(path: Path) -> dict[tuple, tuple[str, str]]:
    """``(trial..., case) -> (verdict, reason)`` from a ``--verdicts`` TSV or an ``offline-power.json``."""
    if path.name.endswith(".txt"):  # what python -m decodebench.gate printed: one line per verdict
        found = (LINE.match(line) for line in path.read_text().splitlines())
        return {("offline", m.group(2)): (m.group(1).lower(), m.group(3)) for m in found if m}
    if path.name.endswith(".json"):
        rows = json.loads(path.read_text())
        return {(f"x{r['scale']:.2f}", f"{r['gate']:.0%}", v["name"]): (v["verdict"], v.get("reason", ""))
                for r in rows for v in r["verdicts"]}
    with gzip.open(path, "rt", encoding="utf8") as f:
        reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        next(reader)
        return {tuple(row[:6]): (row[6], row[7]) for row in reader}


def changes(before: dict, after: dict) -> list[tuple[tuple, tuple[str, str], tuple[str, str]]]:
    missing = set(before) ^ set(after)
    if missing:
        first = sorted(missing)[0]
        raise SystemExit(f"verdict_changes: {len(missing)} trials or cases are in one file only, e.g. {first}")
    return [(key, before[key], after[key]) for key in sorted(before) if before[key][0] != after[key][0]]


def report(before: dict, after: dict, names: Sequence[str]) -> str:
    changed = changes(before, after)
    lines = [f"$ python validation/gate/verdict_changes.py {' '.join(names)}", "",
             f"{len(changed)} of {len(before)} verdicts changed.", ""]
    if changed:
        lines += ["| before | after | verdicts |", "|---|---|---|"]
        counts = collections.Counter((b[0], a[0]) for _, b, a in changed)
        lines += [f"| {b} | {a} | {n} |" for (b, a), n in sorted(counts.items())]
        lines += ["", "Each change: the trial, the case, the reason before, the reason after.", ""]
        for key, b, a in changed:
            lines += [f"- {' '.join(key[:-1])} `{key[-1].split('::')[-1]}`: **{b[0]} -> {a[0]}**",
                      f"  - before: {b[1]}", f"  - after: {a[1]}"]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("before", type=Path)
    p.add_argument("after", type=Path)
    p.add_argument("--out", type=Path, help="also write the report here (gzipped where the name ends in .gz)")
    args = p.parse_args(argv)
    text = report(read(args.before), read(args.after), [str(args.before), str(args.after)])
    print(text, end="")
    if args.out and args.out.suffix == ".gz":
        args.out.write_bytes(gzip.compress(text.encode(), mtime=0))
    elif args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
