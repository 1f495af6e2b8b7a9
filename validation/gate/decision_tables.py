"""The gate's decision before and after ``gate-decision`` (issue 60), side by side, against the
issue's targets, from the committed raw files of the offline simulations run on both packages.

    python validation/gate/decision_tables.py

*Before* is ``validation/gate/decision/before/`` (``short_history.py``, ``gate_offline_power.py`` and
``python -m decodebench.gate`` on the committed A/B session, run on a checkout of 45f51bf); *after*
is the same commands on this package, whose files are where the docs read them. It prints markdown
tables: the unchanged nights that failed, per gate and history (target: at most 1 in 20); the
5 %-at-3 % power per history (targets: >= 95 % at five stored runs, >= 90 % at two); SAME verdicts
whose interval reaches past the threshold (target: 0); the offline power rows; the A/B counts
(target: within a point); the A/B prior on the H200 A/A session it was chosen on and on the held-out H100 A/A
session, with the rule and with ``variants/ab-case-prior-df.diff``. ``validation/gate/decision/README.md`` shows them.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BEFORE = ROOT / "validation/gate/decision/before"
AFTER = {"h200": ROOT / "validation/gate/h200", "h100-step-a": ROOT / "validation/gate/decision/after/h100-step-a",
         "h100": ROOT / "validation/gate/h100", "offline": ROOT / "validation/h200/gate/offline-power.json",
         "ab": ROOT / "validation/gate/decision/after/ab.txt"}
SETS = ("h200", "h100-step-a", "h100")
DECISION = ROOT / "validation/gate/decision"
ALL_DF, CASE_DF = "all its df (the rule)", "`CASE_PRIOR_DF` (`variants/ab-case-prior-df.diff`)"
AB_PRIOR = (("H200 (chose it)", "5%", DECISION / "after/ab.txt", ALL_DF),
            ("H200 (chose it)", "5%", DECISION / "variants/ab-case-prior-df.txt", CASE_DF),
            ("H100 (held out)", "5%", DECISION / "after/ab-h100-5.txt", ALL_DF),
            ("H100 (held out)", "5%", DECISION / "variants/ab-case-prior-df-h100-5.txt", CASE_DF),
            ("H100 (held out)", "3%", DECISION / "after/ab-h100-3.txt", ALL_DF),
            ("H100 (held out)", "3%", DECISION / "variants/ab-case-prior-df-h100-3.txt", CASE_DF))


def nights(folder: Path) -> list[dict]:
    packed = folder / "short-history.json.gz"  # short_history.py writes it packed now; earlier runs, plain
    text = gzip.decompress(packed.read_bytes()) if packed.exists() else (folder / "short-history.json").read_bytes()
    return json.loads(text)["nights"]


def unchanged_rows(before: list[dict], after: list[dict]) -> list[str]:
    lines = []
    keys = sorted({(r["gate"], r["stored"]) for r in before + after if not r["injected"]})
    for gate, k in keys:
        cells = []
        for records in (before, after):
            rows = [r for r in records if not r["injected"] and (r["gate"], r["stored"]) == (gate, k)]
            failed = sum(r["slower"] > 0 for r in rows)
            same = sum(r["same"] for r in rows)
            past = sum(len(r["same_beyond"]) for r in rows)
            share = f"{failed} of {len(rows)} ({failed / len(rows):.1%})" if rows else "-"
            cells.append(f"{share} | {same} | {past}" if rows else "- | - | -")
        lines.append(f"| {gate:.0%} | {k} | {cells[0]} | {cells[1]} |")
    return lines


def power_rows(before: list[dict], after: list[dict]) -> list[str]:
    lines = []
    for k in sorted({r["stored"] for r in before + after if r["injected"]}):
        cells = []
        for records in (before, after):
            rows = [r for r in records if r["injected"] and r["stored"] == k]
            cases, caught = sum(r["cases"] for r in rows), sum(r["slower"] for r in rows)
            same = sum(r["same"] for r in rows)
            past = sum(len(r["same_beyond"]) for r in rows)
            cells.append(f"{caught} of {cases} ({caught / cases:.1%}) | {same} | {past}" if cases else "- | - | -")
        lines.append(f"| 3% | {k} | {cells[0]} | {cells[1]} |")
    return lines


def offline_rows(before: Path, after: Path) -> list[str]:
    rows = [json.loads(path.read_text()) for path in (before, after)]
    lines = []
    for b, a in zip(*rows, strict=True):
        cells = [f"{r['counts'].get('slower', 0)} / {r['counts'].get('same', 0)} / {r['counts'].get('undecided', 0)}"
                 for r in (b, a)]
        lines.append(f"| {b['scale']:.2f} | {b['gate']:.0%} | {b['cases']} | {cells[0]} | {cells[1]} |")
    return lines


def ab_counts(path: Path) -> collections.Counter:
    text = path.read_text()
    return collections.Counter(m.group(1) for m in re.finditer(r"^(SLOWER|FASTER|SAME|UNDECIDED|INCOMPARABLE) ",
                                                               text, re.M))


def ab_excluding_one(path: Path) -> int:
    """The verdict lines whose interval (at the family's level, ``q / m`` a side) leaves out no change: in an A/A
    session every true change is zero, and a calibrated spread leaves it out of ``2 q / m`` of the cases (0.1 a session
    at 95 % confidence)."""
    spans = re.findall(r"^(?:SLOWER|FASTER|SAME|UNDECIDED) .*interval ([0-9.]+)–([0-9.]+)x", path.read_text(), re.M)
    return sum(float(low) > 1 or float(high) < 1 for low, high in spans)


def tables() -> str:
    out = []
    for which in SETS:
        b, a = nights(BEFORE / which), nights(AFTER[which])
        out += [f"### {which}", "", "Unchanged nights (a night fails on any SLOWER):", "",
                "| gate | stored runs | before: failed | SAME | SAME past the threshold "
                "| after: failed | SAME | SAME past the threshold |", "|---|---|---|---|---|---|---|---|",
                *unchanged_rows(b, a), ""]
        power = power_rows(b, a)
        if power:
            out += ["+5 % injected on every case:", "",
                    "| gate | stored runs | before: caught | SAME | SAME past the threshold "
                    "| after: caught | SAME | SAME past the threshold |", "|---|---|---|---|---|---|---|---|",
                    *power, ""]
    out += ["### Offline power (`gate_offline_power.py`: `0005` scaled, against the other committed sessions)", "",
            "| scale | gate | cases | before: SLOWER / SAME / UNDECIDED | after: SLOWER / SAME / UNDECIDED |",
            "|---|---|---|---|---|", *offline_rows(BEFORE / "offline-power.json", AFTER["offline"]), ""]
    counts = [ab_counts(path) for path in (BEFORE / "ab.txt", AFTER["ab"])]
    out += ["### A/B (the committed A/A session `validation/h200/gate/ab-lease6/ab.json.gz`, judged offline at 5 %)",
            "", "| verdict | before | after |", "|---|---|---|"]
    out += [f"| {v} | {counts[0][v]} | {counts[1][v]} |" for v in ("SLOWER", "FASTER", "SAME", "UNDECIDED")]
    out += ["", "### A/B prior, held out (the H100 A/A session `validation/gate/h100-ab-2026-12-07/ab.json.gz`, "
            "beside the H200 one it was chosen on)", "",
            "| session | gate | A/B prior | SLOWER | FASTER | SAME | UNDECIDED | intervals excluding 1.000x |",
            "|---|---|---|---|---|---|---|---|"]
    for session, gate, path, rule in AB_PRIOR:
        n = ab_counts(path)
        out.append(f"| {session} | {gate} | {rule} | {n['SLOWER']} | {n['FASTER']} | {n['SAME']} | {n['UNDECIDED']} "
                   f"| {ab_excluding_one(path)} of {sum(n.values())} |")
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    print(tables(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
