"""Tables for ci/gpu/process.sh: the process-to-process spread of each case's first run, and
the gate's verdicts in the A/A sessions and in the session with an injected slowdown.

    python3 ci/process_drift.py OUTDIR > OUTDIR/process-drift.md
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

from decodebench.compare import run_floor


def _entries(path: Path) -> dict[str, dict]:
    if not path.exists():
        return {}
    return {b["name"]: b for b in json.loads(path.read_text())["benchmarks"]}


def main(out: Path) -> None:
    sessions = [_entries(out / f"s{i}.json") for i in range(1, 6)]
    injected = _entries(out / "inject.json")
    names = sorted(set().union(*sessions))
    print("| case | floor µs per session (first run) | spread | A/A verdicts (runs) | injected 10 % |")
    print("|---|---|---|---|---|")
    verdicts: Counter = Counter()
    spreads = []
    for name in names:
        floors = [run_floor(s[name]["stats"]["data"]) * 1e6 for s in sessions if name in s]
        spread = max(floors) / min(floors) - 1
        spreads.append((spread, name))
        gated = [s[name]["extra_info"].get("gate") for s in sessions[1:] if name in s]
        aa = ", ".join(f"{g['verdict']} ({g['runs'][1]})" for g in gated if g)
        verdicts.update(g["verdict"] for g in gated if g)
        inj = injected.get(name, {}).get("extra_info", {})
        mark = "" if not inj.get("injected_slowdown") else " ← injected"
        inj_text = f"{inj['gate']['verdict']} ({inj['gate']['runs'][1]}){mark}" if inj.get("gate") else "—"
        print(f"| {name.split('::')[-1]} | {' '.join(f'{f:.2f}' for f in floors)} | {spread:+.1%} | {aa} | {inj_text} |")
    print()
    print(f"A/A verdicts over {len(sessions) - 1} gated sessions: {dict(verdicts)}")
    hit = [e["extra_info"]["gate"]["verdict"] for e in injected.values() if e["extra_info"].get("injected_slowdown")]
    clean = [e["extra_info"]["gate"]["verdict"] for e in injected.values()
             if not e["extra_info"].get("injected_slowdown") and e["extra_info"].get("gate")]
    print(f"injected 10 %: {Counter(hit)} on the injected cases, {Counter(clean)} on the others")
    spreads.sort(reverse=True)
    print("largest process-to-process spreads of the first run's floor: "
          + "; ".join(f"{n.split('::')[-1]} {s:+.1%}" for s, n in spreads[:5]))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
