"""Beside each A/B verdict, the case's true change: the median of a plain session of side B
over that of a plain session of side A (kernel timer, each case measured apart).

    python3 validation/gpu/true_change.py TRUE_A.json TRUE_B.json AB.json > real.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _medians(path: Path) -> dict[str, float]:
    return {b["fullname"]: b["stats"]["median"] for b in json.loads(path.read_text())["benchmarks"]}


def main(true_a: Path, true_b: Path, ab: Path) -> None:
    a, b = _medians(true_a), _medians(true_b)
    rows = json.loads(ab.read_text())["benchmarks"]
    print("| case | median A µs | true change (B/A - 1) | A/B verdict | A/B ratio | interval |")
    print("|---|---|---|---|---|---|")
    for bench in sorted(rows, key=lambda r: r["fullname"]):
        name, gate = bench["fullname"], bench["extra_info"].get("gate") or {}
        true = f"{b[name] / a[name] - 1:+.2%}" if name in a and name in b else "-"
        interval = f"{gate['low']:.3f}–{gate['high']:.3f}" if gate.get("low") else "-"
        ratio = f"{gate['ratio']:.3f}" if gate.get("ratio") else "-"
        print(f"| `{name.split('::')[-1]}` | {a.get(name, 0) * 1e6:.2f} | {true} | {gate.get('verdict', '-').upper()} "
              f"| {ratio} | {interval} |")


if __name__ == "__main__":
    main(*map(Path, sys.argv[1:4]))
