"""The beta scan: would scaling the time a kernel's traffic does not explain help the rule? From the committed runs.

    python validation/projection/beta.py > validation/projection/beta.txt

The product's rule keeps the part of a kernel's time that its modelled traffic ``w`` does not explain as
latency: ``t_there = floor + w_there + (t - floor - w_here)``. The alternative scanned here scales that
part by ``(w_there / w_here) ** beta`` (0: latency, as the rule; 1: the kernel keeps its fraction of its
bound). On each GPU whose results hold the same cases timed warm (``kernel`` timer) and in the decode
step's state (``step`` timer), each beta in 0, 0.05, ..., 1 projects the warm times onto the step times
with the GPU's own fit; printed: the median miss per beta and the pick. The fused MoE takes the rule's
overlap form whatever beta.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import crosscheck  # noqa: E402

from decodebench.attribution.predict import projection_rule as rule  # noqa: E402

RUNS = ("h100-2026-12-05", "h100-2026-12-06", "h100-2026-12-06-b", "h100-2026-12-06-c", "h200-2026-12-06",
        "h200-2026-12-06-b")
BETAS = tuple(i / 20 for i in range(21))


def warm_to_step(case: rule.Case, gpu: rule.DeviceModel, beta: float) -> float:
    """The case's warm time on ``gpu`` carried into the step state, its unexplained time scaled by ``beta``."""
    if rule.is_fused_moe(case):
        return rule.project_case(case, gpu, gpu, "warm", "step")
    floor = gpu.floor_us(case)
    above = max(0.0, case.median_us - floor)
    sm = rule.sm_bounded(case, gpu)
    w_here, w_there = (rule.traffic_us(case, gpu, state, sm)[0] for state in ("warm", "step"))
    if w_here <= 0:
        return floor + above
    rest = above - w_here
    if rest <= 0:
        return floor + above * w_there / w_here
    return floor + w_there + rest * (w_there / w_here) ** beta


def scan(run: str) -> str:
    folder = REPO / "validation" / "tp8" / run
    warm, facts = crosscheck.load_cases(folder / "kernel.json.gz")
    step = {c.name: c for c in crosscheck.load_cases(folder / "step.json.gz")[0]}
    gpu = rule.DeviceModel(facts, rule.fit(warm + list(step.values()), facts, run))
    pairs = [(c, step[c.name]) for c in warm if c.name in step]
    misses = {b: statistics.median(abs(warm_to_step(w, gpu, b) / s.median_us - 1) for w, s in pairs) for b in BETAS}
    best = min(misses, key=misses.get)
    return (f"{run} ({facts.name}, {len(pairs)} cases on both timers): median miss of warm -> step at beta 0 "
            f"{misses[0.0]:.2%}, 0.5 {misses[0.5]:.2%}, 1 {misses[1.0]:.2%}; the pick {best:g} ({misses[best]:.2%})")


def main() -> None:
    print("the beta scan: the warm (kernel timer) times projected onto the step times of the same GPU, its "
          "unexplained time scaled by (w_there / w_here) ** beta; the rule keeps it (beta 0)")
    for run in RUNS:
        print(scan(run))


if __name__ == "__main__":
    main()
