"""The gate's power and false alarms offline, on the committed H200 results.

BASELINE is the committed H200 fingerprint folder; CURRENT is a copy of one committed nightly
(default ``0005``, the gated nightly of 211 cases with its re-measures), every sample and
re-measure scaled by 1.00, 1.05 and 1.10 in turn. The baseline is the other committed sessions (a copy of the
folder without CURRENT's file: a run is never its own baseline, scaled or not; the gate itself leaves out a
stored run whose samples equal CURRENT's). Each scaled copy is judged at ``--gate 3%`` and ``5%`` with the
default policy, exactly as ``python -m decodebench.gate BASELINE COPY --gate PCT`` would: one look, what is
stored. Per run (scale, gate) it counts the verdicts, and, for the cases whose run spread (the spread the
model judged them by, :attr:`CaseVerdict.spread`) is at most 1 %, how many are SLOWER.

Usage (repository root)::

    python validation/gate_offline_power.py [--current 0005_h200-vllm-nightly-gated.json] [--out validation/h200/gate]

writes ``offline-power.json`` (every verdict) and ``offline-power.md`` (the table) to ``--out``
and prints the table.
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from decodebench.files import write_atomic  # noqa: E402 - after the checkout is on the path
from decodebench.gate.decision import Policy  # noqa: E402
from decodebench.gate.offline import judge_files  # noqa: E402

sys.path.insert(0, str(REPO / "validation"))
from readme_examples import H200, scale_entry  # noqa: E402 - the README examples' folder and scaling

SCALES = (1.0, 1.05, 1.10)
GATES = (0.03, 0.05)
TIGHT = 0.01  # "run spread at most 1 %"


def scaled(document: dict, factor: float) -> dict:
    """``document`` with every sample and re-measured sample times ``factor``."""
    out = copy.deepcopy(document)
    for bench in out["benchmarks"]:
        scale_entry(bench, factor)
    return out


def judge_scaled(document: dict, factor: float, gate: float, workdir: Path, baseline: Path) -> list:
    path = workdir / f"current-x{factor:.2f}.json"
    path.write_text(json.dumps(scaled(document, factor)))
    judgment, _, _ = judge_files(baseline, path, Policy(threshold=gate), gate)
    return judgment.verdicts


def others(current: str, workdir: Path) -> Path:
    """A copy of the H200 folder without ``current``: the baseline of its scaled copies."""
    folder = workdir / H200.name
    shutil.copytree(H200, folder, ignore=lambda _, names: [n for n in names if n == current])
    return folder


def summarise(verdicts: list, factor: float, gate: float) -> dict:
    counts = collections.Counter(v.verdict.value for v in verdicts)
    tight = [v for v in verdicts if v.spread is not None and v.spread <= TIGHT]
    return {"scale": factor, "gate": gate, "cases": len(verdicts), "counts": dict(sorted(counts.items())),
            "tight_cases": len(tight), "tight_slower": sum(v.verdict.value == "slower" for v in tight),
            "verdicts": [{"name": v.name, "verdict": v.verdict.value, "ratio": v.ratio, "low": v.low,
                          "high": v.high, "spread": v.spread, "runs": list(v.runs), "reason": v.reason}
                         for v in verdicts]}


def table(rows: list[dict], current: str) -> str:
    lines = [f"Offline gate on the committed H200 folder, CURRENT = a copy of `{current}` scaled "
             "(`python validation/gate_offline_power.py`):", "",
             "| scale | gate | cases | SLOWER | SAME | UNDECIDED | SLOWER among run spread ≤ 1 % |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        c = r["counts"]
        lines.append(f"| {r['scale']:.2f} | {r['gate']:.0%} | {r['cases']} | {c.get('slower', 0)} | {c.get('same', 0)} "
                     f"| {c.get('undecided', 0)} | {r['tight_slower']} of {r['tight_cases']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--current", default="0005_h200-vllm-nightly-gated.json", help="a committed H200 result")
    parser.add_argument("--out", type=Path, default=None, help="write offline-power.{json,md} here")
    args = parser.parse_args(argv)
    document = json.loads((H200 / args.current).read_text())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        baseline = others(args.current, Path(tmp))
        for factor in SCALES:
            for gate in GATES:
                rows.append(summarise(judge_scaled(document, factor, gate, Path(tmp), baseline), factor, gate))
    text = table(rows, args.current)
    print(text, end="")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        write_atomic(args.out / "offline-power.json", (json.dumps(rows) + "\n").encode())
        write_atomic(args.out / "offline-power.md", text.encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
