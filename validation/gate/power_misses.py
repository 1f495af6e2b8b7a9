"""The 5 %-at-3 % trials that the gate did not call SLOWER against five stored sessions, each with the
reason the session prints: what the misses of ``short-history.md``'s last power row are.

    python validation/gate/power_misses.py > validation/gate/h200/power-misses.txt   (about a minute)
"""

from __future__ import annotations

import collections
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from short_history import INJECTED, UNCHANGED, family, load, night  # noqa: E402

from decodebench.gate import Policy, Verdict  # noqa: E402


def main() -> int:
    sessions = [load(path) for path in UNCHANGED]
    misses, trials = [], 0
    for path in INJECTED:
        verdicts = night(sessions, load(path), Policy(threshold=0.03))
        trials += len(verdicts)
        misses += [(path, v) for v in verdicts if v.verdict is not Verdict.SLOWER]
    print(f"{len(misses)} of {trials} trials not SLOWER against the five unchanged sessions, --gate 3%, 5 % injected")
    by_family = collections.Counter(family(v.name) for _, v in misses)
    print("by family: " + ", ".join(f"{f} {n}" for f, n in by_family.most_common()))
    observed = [float(m.group(1)) for _, v in misses if "q_a-" not in v.name
                and (m := re.match(r"([+-][\d.]+)%", v.reason or ""))]
    below = sum(o <= 3.0 for o in observed)
    print(f"outside q_a: {len(observed)} misses, {below} of them with an observed change of at most +3.0 % "
          "with 5 % injected (within the threshold as measured: the run, without the injection, about 2 % or "
          "more below its history)")
    for path, v in misses:
        print(f"{v.verdict.name:<9} {Path(path).parent.parent.name}/{Path(path).parent.name}/{Path(path).name}  "
              f"{v.name.split('::')[-1]}  {v.reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
