"""The facts under the projection rule's fused MoE and DRAM rate, from the committed runs.

    python validation/projection/overlap.py > validation/projection/overlap.txt

Prints, each from files committed here:

* per ``sm_count.py`` run of each GPU, the fused MoE's SM time ``s``, memory time ``m`` and overlap share
  ``k`` (``a = s + m - k min(s, m)``) per case, at that GPU's fit, and the median the rule reads;
* the cross-GPU check of the five pairs with each GPU's own share and with the product's (its stated
  default, 0.70), and per direction the shares of the source's fit that keep every step error within
  0.2 points of the own share's: why the product's one share cannot give each pair's own figures;
* each lent machine's achievable DRAM rate: the fastest stream timed warm (the rule's fit), and the 90th
  percentile of every case that reads more than L2 from DRAM (the rule's earlier fit: the kernels' mix);
* each uniform MoE case's DRAM rate at M = 64 and 256 on both GPUs of each pair;
* the SM clock, power and throttle reasons NVML read around the MoE at M = 64 and 256.
"""

from __future__ import annotations

import math
import sys
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import crosscheck  # noqa: E402
import share as sm_count  # noqa: E402

from decodebench.attribution.predict import projection_rule as rule  # noqa: E402
from decodebench.attribution.predict.targets import load_target  # noqa: E402
from decodebench.files import read_json  # noqa: E402
from decodebench.model import load_model_spec  # noqa: E402

HERE = REPO / "validation/projection"
TP8 = REPO / "validation/tp8"
H200_0005 = (REPO / "baselines/nvidia-h200-x1-single-cc90-drv580.159.04-cuda13.0-torch2.11.0-cu130"
             / "0005_h200-vllm-nightly-gated.json")
SM_COUNTS = {"H200 SXM": sorted(HERE.glob("sm-count-h200*/sm-count.json")),
             "H100 SXM": sorted(HERE.glob("sm-count-h100*/sm-count.json"))}
TARGETS = {"H200 SXM": "h200-x8-nvlink", "H100 SXM": str(HERE / "targets/h100-x8-nvlink.json")}
# the five same-code pairs of the cross-GPU check: (GPU A's files, GPU B's files), the first of each compared
PAIRS = {"pair 1 (0005 against h100-2026-12-05)": ([H200_0005], [TP8 / "h100-2026-12-05/kernel.json.gz",
                                                                  TP8 / "h100-2026-12-05/step.json.gz"]),
         "pair 2 (h200-2026-12-06 against h100-2026-12-06)": (
             [TP8 / "h200-2026-12-06/kernel.json.gz", TP8 / "h200-2026-12-06/step.json.gz"],
             [TP8 / "h100-2026-12-06/kernel.json.gz", TP8 / "h100-2026-12-06/step.json.gz"]),
         "pair 3 (h200-2026-12-06 against h100-2026-12-06-b)": (
             [TP8 / "h200-2026-12-06/kernel.json.gz", TP8 / "h200-2026-12-06/step.json.gz"],
             [TP8 / "h100-2026-12-06-b/kernel.json.gz", TP8 / "h100-2026-12-06-b/step.json.gz"]),
         "pair 4 (h200-2026-12-06 against h100-2026-12-06-c)": (
             [TP8 / "h200-2026-12-06/kernel.json.gz", TP8 / "h200-2026-12-06/step.json.gz"],
             [TP8 / "h100-2026-12-06-c/kernel.json.gz", TP8 / "h100-2026-12-06-c/step.json.gz"]),
         "pair 5 (h200-2026-12-06-b against h100-2026-12-06-c)": (
             [TP8 / "h200-2026-12-06-b/kernel.json.gz", TP8 / "h200-2026-12-06-b/step.json.gz"],
             [TP8 / "h100-2026-12-06-c/kernel.json.gz", TP8 / "h100-2026-12-06-c/step.json.gz"])}
# every lent machine's TP-8 set (kernel timer first)
MACHINES = {"H200 of 0005": [H200_0005], "H200 GPU-482174ea (h200-2026-12-06)": list(PAIRS[
    "pair 2 (h200-2026-12-06 against h100-2026-12-06)"][0]), "H200 GPU-77c2e4b5 (h200-2026-12-06-b)": list(PAIRS[
    "pair 5 (h200-2026-12-06-b against h100-2026-12-06-c)"][0])} | {
    f"H100 ({run})": [TP8 / run / "kernel.json.gz", TP8 / run / "step.json.gz"]
    for run in ("h100-2026-12-05", "h100-2026-12-05-b", "h100-2026-12-06", "h100-2026-12-06-b", "h100-2026-12-06-c")}


def fitted(paths: list[Path]) -> tuple[list[rule.Case], rule.DeviceModel]:
    """The first file's cases and the GPU as the rule fits it on all the files and its SM-count runs."""
    cases, facts = crosscheck.load_cases(paths[0])
    every = cases + [c for p in paths[1:] for c in crosscheck.load_cases(p)[0]]
    return cases, rule.DeviceModel(facts, sm_count.fit_with_share(every, facts, facts.name, SM_COUNTS[facts.name]))


def overlap_lines(name: str, paths: list[Path]) -> list[str]:
    """Per SM-count run of the GPU, each case's whole-GPU time (the run's CUDA-event loop, and the results'
    kernel timer, which the rule reads), s, m and k at the fit of ``paths``; then what the rule reads."""
    cases, gpu = fitted(paths)
    floor_us, measured_us = sm_count.moe_timing(cases, gpu.params.floor_us)
    out = [f"{name}: floor {gpu.params.floor_us:.3f} µs per launch, DRAM {gpu.dram_bytes_per_s / 1e9:.0f} GB/s "
           "(the fit of these files)"]
    for path in SM_COUNTS[gpu.facts.name]:
        cells = []
        for q, e, _ in sm_count.readings(path, gpu.facts.name, floor_us, gpu.dram_bytes_per_s, measured_us):
            left = "" if q["tokens"] >= sm_count.MIN_TOKENS else ", not read"
            cells.append(f"M = {q['tokens']} whole {q['us']['all']:.1f} events / {measured_us(q['case']):.1f} kernel, "
                         f"s {e.s:.1f} m {e.m:.1f} k {e.overlap:.3f}{left}")
        out.append(f"  {path.parent.relative_to(REPO)}: " + "; ".join(cells))
    out.append(f"  the rule reads k = {gpu.params.moe_overlap:.3f}, the median over the cases at M >= "
               f"{sm_count.MIN_TOKENS}")
    return out


def summary(d: crosscheck.Direction, label: str) -> str:
    """One direction: per-kernel median / p90 (all, MoE), the step's error and its MoE's at M = 1, 64, 256."""
    k = d.kernels["rule"]
    steps = " ".join(f"{s['rule']['error']:+6.1%}" for s in d.steps)
    moe = " ".join(f"{s['rule']['groups_error'].get('moe', 0):+6.1%}" for s in d.steps)
    return (f"  {d.source} -> {d.target}  {label:<24} all {k['all']['median']:+6.2%} / {k['all']['p90']:5.1%}   "
            f"moe {k['moe']['median']:+6.2%} / {k['moe']['p90']:5.1%}   step {steps}   step's moe {moe}")


TOLERANCE = 0.002  # a step error within 0.2 points of the own share's


def own_fit(cases, facts, fitted_on: str) -> rule.RuleParams:
    """The GPU's fit with the overlap share its own SM-count runs read."""
    return sm_count.fit_with_share(cases, facts, fitted_on, SM_COUNTS[facts.name])


def check_lines() -> list[str]:
    """The five pairs, both directions, with each GPU's own share and with the product's; per direction the
    source's shares that give its own step errors within 0.2 points; then whether one share does for all."""
    out, windows = [], []
    for name, (a, b) in PAIRS.items():
        out.append(f"{name}: kernel timer, per kernel median / p90, step error at M = 1 64 256")
        sides = [crosscheck.load_side(p, load_target(TARGETS[crosscheck.load_cases(p[0])[1].name]), fit_rule=own_fit)
                 for p in (a, b)]
        own = crosscheck.directions(*sides, (1, 64, 256), 1024)
        product = crosscheck.directions(*sides, (1, 64, 256), 1024,
                                        tuple(replace(s.params, moe_overlap=rule.MOE_OVERLAP) for s in sides))
        out += [summary(d, label) for label, ds in (("own share", own), ("product's share 0.70", product))
                for d in ds]
        for d, pair in zip(own, (sides, sides[::-1]), strict=True):
            low, high = share_window(d, *pair)
            windows.append((low, high))
            out.append(f"  {d.source} -> {d.target}  own share {d.params.moe_overlap:.3f}: shares "
                       f"{low:.3f}-{high:.3f} keep every step error within {TOLERANCE * 100:.1f} points of it")
    low, high = max(w[0] for w in windows), min(w[1] for w in windows)
    out.append(f"one share for all ten directions: {'none' if low > high else f'{low:.3f}-{high:.3f}'} "
               f"(the windows' highest start {low:.3f}, lowest end {high:.3f})")
    return out


def share_window(d: crosscheck.Direction, src: crosscheck.Side, dst: crosscheck.Side,
                 step: float = 0.001) -> tuple[float, float]:
    """The shares of ``src``'s fit, on a grid of ``step`` out from its own, whose step errors stay within
    ``TOLERANCE`` of ``d``'s (``src`` projected to ``dst`` with its own share)."""
    own, spec = [s["rule"]["error"] for s in d.steps], load_model_spec(src.model)
    def holds(k: float) -> bool:
        moved = crosscheck.direction((src.cases, src.results, src.target), (dst.cases, dst.results, dst.target),
                                     replace(src.params, moe_overlap=k), spec, [s["batch"] for s in d.steps], 1024,
                                     src.facts, dst.facts)
        return all(abs(s["rule"]["error"] - e) <= TOLERANCE for s, e in zip(moved.steps, own, strict=True))
    low = high = d.params.moe_overlap
    while holds(round(low - step, 6)):
        low = round(low - step, 6)
    while holds(round(high + step, 6)):
        high = round(high + step, 6)
    return low, high


def dram_lines() -> list[str]:
    """Per lent machine, the fastest warm stream over 4 L2 sizes (the fit) and the 90th percentile of all the
    cases that read more than their L2 from DRAM, as fractions of the datasheet."""
    out = []
    for name, paths in MACHINES.items():
        cases, facts = crosscheck.load_cases(paths[0])
        every = cases + [c for p in paths[1:] for c in crosscheck.load_cases(p)[0]]
        params = rule.fit(every, facts, name)
        floor = params.floor_us
        rates = sorted(dram / ((c.median_us - c.kernels * floor) * 1e-6) for c in every
                       for dram in ({"warm": c.bytes if c.bytes > 4 * facts.l2_bytes else 0, "step": c.state_bytes,
                                     "cold": c.bytes}[rule.CACHE_STATES[c.timer]],)
                       if dram > facts.l2_bytes)
        p90 = rates[min(len(rates) - 1, math.ceil(0.9 * len(rates)) - 1)]
        out.append(f"  {name}: fastest stream {params.dram_fraction:.3f} of {facts.dram_bytes_per_s / 1e12:.3g} TB/s; "
                   f"90th percentile of {len(rates)} cases beyond L2 {p90 / facts.dram_bytes_per_s:.3f}")
    return out


def moe_rate_lines() -> list[str]:
    """Per pair and uniform MoE case at M = 64 and 256, the DRAM rate it reached on each GPU (its bytes over its
    time above the floor: none fits in L2) against that GPU's fitted achievable rate."""
    out = []
    for name, sides in PAIRS.items():
        out.append(f"  {name}")
        fits = [fitted(paths) for paths in sides]
        by_name = [{c.name: c for c in cases} for cases, _ in fits]
        for case in fits[0][0]:
            if case.component != "moe" or not any(f"-uniform-m{m}-" in case.name for m in (64, 256)):
                continue
            cells = []
            for (_, gpu), cases in zip(fits, by_name, strict=True):
                c = cases[case.name]
                rate = c.bytes / ((c.median_us - gpu.floor_us(c)) * 1e-6)
                cells.append(f"{gpu.facts.name} {rate / 1e12:.2f} TB/s ({rate / gpu.dram_bytes_per_s:.0%} of "
                             f"{gpu.dram_bytes_per_s / 1e12:.2f})")
            out.append(f"    {case.name}: " + ", ".join(cells))
    return out


def clock_lines() -> list[str]:
    """What NVML read before and after each MoE case at M = 64 and 256 of each kernel-timer run."""
    out = []
    for name, paths in MACHINES.items():
        reads = [t for b in read_json(paths[0])["benchmarks"] if b["name"].startswith("test_moe[")
                 and any(f"-m{m}-" in b["name"] for m in (64, 256))
                 for t in (b["extra_info"].get("telemetry_before"), b["extra_info"].get("telemetry_after")) if t]
        mhz, watts = [t["sm_clock_mhz"] for t in reads], [t["power_w"] for t in reads]
        out.append(f"  {name}: {len(reads)} reads, SM clock {min(mhz)}-{max(mhz)} MHz, power {min(watts):.0f}-"
                   f"{max(watts):.0f} W of {max(t['power_limit_w'] for t in reads):.0f} W, throttle reasons "
                   f"{', '.join(sorted({t['throttle_reasons'] for t in reads}))}")
    return out


def main() -> None:
    print("the fused MoE's overlap share, a = s + m - k min(s, m), per sm_count.py run (µs above the floor; a from "
          f"the results' kernel timer, s from the counts of {sm_count.SCARCE_WAVES}+ of Marlin's waves, m the case's "
          "bytes at the GPU's fitted DRAM rate)")
    sides = {tuple(side): name for name, pair in reversed(PAIRS.items()) for side in pair}
    for side, name in reversed(sides.items()):
        print("\n".join(overlap_lines(f"{name}, {crosscheck.load_cases(side[0])[1].name}", list(side))))
    print("\nthe cross-GPU check with each GPU's own overlap share and with the product's")
    print("\n".join(check_lines()))
    print("\nthe achievable DRAM rate of each lent machine, as a fraction of the datasheet")
    print("\n".join(dram_lines()))
    print("\nthe uniform MoE's DRAM rate on each GPU (kernel timer), against the GPU's fitted achievable rate")
    print("\n".join(moe_rate_lines()))
    print("\nthe SM clock under the MoE at M = 64 and 256 (NVML, before and after each case)")
    print("\n".join(clock_lines()))


if __name__ == "__main__":
    main()
