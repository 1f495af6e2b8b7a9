"""Tally the live power of the stored-mode gate over repeated sessions (``validation/gpu/gate.sh stored-power``).

Each SESSION.json is one ``pytest benchmarks/ -k vllm --benchmark-compare --gate PCT
[--inject-slowdown PCT]`` session against the committed baselines. A case is one trial per
session; its family is its component and the part of the call it times (``test_moe[fused-…]``,
``test_dense_gemm[q_a-…]``). Per family: trials, SLOWER among the injected (caught), SLOWER among
the not injected (false alarms), UNDECIDED, and the median of the families' run spreads; then the
injected trials split by each case's own run spread (at most 1 % or more). Its gate threshold and
injection are read from each result; a result without a verdict is counted apart.

    python3 validation/gpu/stored_power.py SESSION.json[.gz] [SESSION.json[.gz] ...] > stored-power.md
"""

from __future__ import annotations

import gzip
import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def family(name: str) -> str:
    """``test_moe[fused-e384-…-m64-vllm]`` -> ``test_moe fused``; the first field of the id names the op.

    >>> family("benchmarks/test_dense.py::test_dense_gemm[q_a-n2112-k7168-m8-vllm]")
    'test_dense_gemm q_a'
    """
    test = name.split("::")[-1]
    match = re.match(r"([^\[]+)\[([^-\]]+)", test)
    return f"{match.group(1)} {match.group(2)}" if match else test


def by_case_spread(documents: list[dict], edge: float = 0.01) -> str:
    """The injected trials split by each case's own run spread (the gate's ``spread``) at ``edge``:
    trials, caught, and the cases of the misses among the tight ones."""
    groups: dict[str, dict] = {k: {"trials": 0, "caught": 0, "missed": []} for k in ("tight", "wide")}
    for document in documents:
        for bench in document.get("benchmarks", []):
            info = bench.get("extra_info") or {}
            gate = info.get("gate")
            if not gate or "injected_slowdown" not in info or not isinstance(gate.get("spread"), float):
                continue
            group = groups["tight" if gate["spread"] <= edge else "wide"]
            group["trials"] += 1
            if gate.get("verdict") == "slower":
                group["caught"] += 1
            else:
                group["missed"].append(f"{bench.get('name', '?')} {gate.get('verdict')}")
    lines = ["| case's own run spread | injected trials | caught |", "|---|---|---|"]
    for key, label in (("tight", f"<= {edge:.0%}"), ("wide", f"> {edge:.0%}")):
        g = groups[key]
        share = f" ({g['caught'] / g['trials']:.1%})" if g["trials"] else ""
        lines.append(f"| {label} | {g['trials']} | {g['caught']}{share} |")
    misses = groups["tight"]["missed"]
    return "\n".join(lines) + "\n" + (f"\nnot caught at <= {edge:.0%}: " + "; ".join(misses) + "\n" if misses else "")


def tally(documents: list[dict]) -> dict[str, dict]:
    rows: dict[str, dict] = defaultdict(lambda: {"trials": 0, "injected": 0, "caught": 0, "false_alarms": 0,
                                                 "undecided": 0, "unjudged": 0, "spreads": []})
    for document in documents:
        for bench in document.get("benchmarks", []):
            info = bench.get("extra_info") or {}
            row = rows[family(bench.get("fullname") or bench.get("name", "?"))]
            gate = info.get("gate")
            if not gate:
                row["unjudged"] += 1
                continue
            row["trials"] += 1
            injected = "injected_slowdown" in info
            slower = gate.get("verdict") == "slower"
            row["injected"] += injected
            row["caught"] += injected and slower
            row["false_alarms"] += slower and not injected
            row["undecided"] += gate.get("verdict") == "undecided"
            if isinstance(gate.get("spread"), float):
                row["spreads"].append(gate["spread"])
    return dict(rows)


def table(rows: dict[str, dict]) -> str:
    lines = ["| family | trials | injected | caught | false alarms | UNDECIDED | median run spread |",
             "|---|---|---|---|---|---|---|"]
    for name, r in sorted(rows.items()):
        spread = f"{statistics.median(r['spreads']):.2%}" if r["spreads"] else "-"
        caught = f"{r['caught']} ({r['caught'] / r['injected']:.0%})" if r["injected"] else "-"
        lines.append(f"| `{name}` | {r['trials']} | {r['injected']} | {caught} | {r['false_alarms']} "
                     f"| {r['undecided']} | {spread} |")
    total = {k: sum(r[k] for r in rows.values()) for k in ("trials", "injected", "caught", "false_alarms", "undecided")}
    lines.append(f"| all | {total['trials']} | {total['injected']} | {total['caught']} | {total['false_alarms']} "
                 f"| {total['undecided']} | |")
    return "\n".join(lines) + "\n"


def main(paths: list[str]) -> int:
    if not paths:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    documents, read = [], []
    for path in paths:
        try:
            data = Path(path).read_bytes()
            documents.append(json.loads(gzip.decompress(data) if path.endswith(".gz") else data))
            read.append(path)
        except (OSError, ValueError, EOFError) as exc:  # a session cut off by its time limit leaves an empty file
            print(f"stored_power: {path} left out, it is no session result ({type(exc).__name__}: {exc}); "
                  "did the session finish?", file=sys.stderr)
    if not documents:
        print("stored_power: no readable session result", file=sys.stderr)
        return 1
    print(f"{len(documents)} sessions: {', '.join(read)}\n")
    print(table(tally(documents)), end="")
    print()
    print(by_case_spread(documents), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
