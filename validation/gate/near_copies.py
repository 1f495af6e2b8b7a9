"""How close two genuinely distinct runs of one case come, in the committed sessions: the figure
behind :data:`decodebench.gate.reference.SAME_RUN_WITHIN`.

Every run of every case (a stored entry's first run and its fresh-process re-measures) in the
committed baselines (``baselines/*/*.json``) and gate sessions (``validation/gate/*/night-*.json.gz``)
is paired with every other run of the same test id and the same number of samples. A pair's
distance is the largest relative difference of their samples, both sorted (sorting can only bring
two runs closer). Exact copies (distance 0: a run stored in two files) are counted apart; the rest
are runs of separate measurements, and the smallest distance among them is how close a timer came
to repeating itself.

    python validation/gate/near_copies.py > validation/gate/near-copies.txt
"""

from __future__ import annotations

import gzip
import json
import sys
from collections import defaultdict
from itertools import combinations
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def sessions() -> list[Path]:
    return sorted(ROOT.glob("baselines/*/*.json")) + sorted(ROOT.glob("validation/gate/*/night-*.json.gz"))


def read(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        return json.load(handle)


def runs_of(path: Path) -> dict[str, list[tuple[str, tuple[float, ...]]]]:
    """Test id -> (where, sorted samples) of each run the file stores."""
    found = defaultdict(list)
    for entry in read(path)["benchmarks"]:
        where = str(path.relative_to(ROOT))
        data = (entry.get("stats") or {}).get("data") or []
        resamples = (entry.get("extra_info") or {}).get("resamples") or []
        for index, samples in enumerate([data, *resamples]):
            if samples:
                found[entry["fullname"]].append((f"{where} run {index}", tuple(sorted(samples))))
    return found


def distance(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    return max(abs(x - y) / min(x, y) for x, y in zip(a, b, strict=False))


def main() -> None:
    runs = defaultdict(list)
    for path in sessions():
        for name, found in runs_of(path).items():
            runs[name] += found
    pairs, copies, closest = 0, 0, []
    for name, found in runs.items():
        for (where_a, a), (where_b, b) in combinations(found, 2):
            if len(a) != len(b):
                continue
            pairs += 1
            gap = distance(a, b)
            if gap == 0:
                copies += 1
            else:
                closest.append((gap, name, where_a, where_b, len(a)))
    closest.sort()
    print(f"# {len(sessions())} session files, {sum(map(len, runs.values()))} runs of {len(runs)} test ids")
    print(f"# {pairs} pairs of runs of one test id with as many samples; {copies} exact copies (distance 0)")
    print("# the 10 closest distinct pairs (largest relative difference of their sorted samples):")
    for gap, name, where_a, where_b, count in closest[:10]:
        print(f"{gap:.3e}  {count:3d} samples  {name}  ({where_a} / {where_b})")
    print(f"# median distance of distinct pairs: {closest[len(closest) // 2][0]:.3e}")


if __name__ == "__main__":
    sys.exit(main())
