"""The per-night table of ``validation/gate/nights.sh``: for each night, the stored runs it was
judged against, its verdicts (SLOWER, FASTER, UNDECIDED, SAME, from each result's
``extra_info["gate"]``), its conclusion and exit status; on an injected night, the cases caught
(SLOWER among the injected) as the power at that history.

    python validation/gate/nights_table.py OUTDIR          # reads OUTDIR/night-N.json (or .json.gz) and .log
"""

from __future__ import annotations

import gzip
import json
import re
import sys
from pathlib import Path

VERDICTS = ("slower", "faster", "undecided", "same", "incomparable")
HEADER = ("| night | stored runs | gate | cases | SLOWER | FASTER | UNDECIDED | SAME | caught (injected) "
          "| conclusion | exit |")


def night_row(out: Path, night: int) -> str:
    log = out / f"night-{night}.log"
    text = log.read_text(errors="replace") if log.exists() else ""
    conclusion = next((line for line in text.splitlines() if line.startswith("gate ")), "no conclusion line")
    status = re.search(rf"night {night} exit (\d+)", text)
    stored = re.search(rf"night {night}: (\d+) stored results", text)
    counts, injected, caught, threshold = {v: 0 for v in VERDICTS}, 0, 0, "?"
    result, packed = out / f"night-{night}.json", out / f"night-{night}.json.gz"
    if result.exists():
        benches = json.loads(result.read_text())["benchmarks"]
    elif packed.exists():  # as committed: the raw result gzipped
        benches = json.loads(gzip.decompress(packed.read_bytes()))["benchmarks"]
    else:
        benches = []
    for bench in benches:
        info = bench.get("extra_info") or {}
        verdict = (info.get("gate") or {}).get("verdict")
        if verdict in counts:
            counts[verdict] += 1
        if "injected_slowdown" in info:
            injected += 1
            caught += verdict == "slower"
    found = re.search(rf"night {night}: .*--gate (\d+(?:\.\d+)?%)", text) or re.search(r"by more than ([\d.]+%)",
                                                                                    conclusion)
    threshold = found.group(1) if found else threshold
    power = f"{caught} of {injected} ({caught / injected:.1%})" if injected else "-"
    cases = sum(counts.values()) if benches else "no result"
    return (
        f"| {night} | {stored.group(1) if stored else '?'} | {threshold} | {cases} | {counts['slower']} "
        f"| {counts['faster']} "
        f"| {counts['undecided']} | {counts['same']} | {power} | {conclusion} "
        f"| {status.group(1) if status else '?'} |"
    )


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print("usage: python validation/gate/nights_table.py OUTDIR (the folder nights.sh wrote)", file=sys.stderr)
        return 2
    out = Path(argv[0])
    nights = sorted(
        int(m.group(1)) for p in out.glob("night-*.log") if (m := re.fullmatch(r"night-(\d+)\.log", p.name))
    )
    print(HEADER)
    print("|---" * (HEADER.count("|") - 1) + "|")
    for night in nights:
        print(night_row(out, night))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
