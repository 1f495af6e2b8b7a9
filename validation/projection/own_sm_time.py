"""The MoE's own SM time carried to the other GPU, its memory time combined with it by an exponent p,
set against the shipped rule in both directions of the cross-GPU check; the p the H100's SM-count runs
set (``sm_count.py``) and the check from the H100 at it; each uniform MoE case's DRAM rate on both GPUs;
the SM-side time each GPU's fused MoE has at that p; the SM clock NVML read around the MoE on both; and
the p that one GPU's two cache states would pick.

    python validation/projection/own_sm_time.py > validation/projection/own-sm-time.txt

For a MoE case measured at ``t`` (``a = t - floor``) with memory time ``m`` here (DRAM or L2 bytes over
the fitted bandwidth, the larger; compute never binds), its SM-side time is what ``a`` leaves over
``m`` when the two combine as ``(s^p + m^p)^(1/p)``: ``s^p = a^p - m^p``. There, ``s`` stays and ``m``
becomes the memory time there. p = 1 adds the two, a large p takes the larger. The other components
keep the shipped rule. The question is where p comes from on one GPU: the SM-count runs hold the
bytes and stretch the SM work; the H100's kernel -> step pairs of its MoE cases within L2 (M <= 16: the
same SM work, read from L2 then from DRAM) change the memory's latency with the SM work fixed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sm_count import estimate  # noqa: E402
from soft_roofline import H100, H200, REPO, TARGETS, summary  # noqa: E402  (the same runs and targets)

from decodebench.attribution.predict import crosscheck  # noqa: E402
from decodebench.attribution.predict import projection_rule as rule  # noqa: E402
from decodebench.attribution.predict.prediction import load_results  # noqa: E402
from decodebench.attribution.predict.targets import load_target  # noqa: E402
from decodebench.model import load_model_spec  # noqa: E402

H100_RUNS = [H100[0].parent, REPO / "validation/tp8/h100-2026-12-05-b"]  # two H100 machines, both timers each
SM_COUNT_RUNS = sorted((REPO / "validation/projection").glob("sm-count-h100*/sm-count.json"))  # sm_count.py --out
H200_SM_COUNT_RUNS = sorted((REPO / "validation/projection").glob("sm-count-h200*/sm-count.json"))
OVERLAP_TOKENS = (64, 256)  # the M whose fused MoE the SM-count runs read in the two-stage regime on both GPUs
GRID = (1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0)
shipped = rule.project_case


def memory_us(case, device, state) -> float:
    return rule.traffic_us(case, device, state, sm=False)[0]


def carried(above: float, m_here: float, m_there: float, p: float) -> float:
    """``above`` (a case's time above the floor) with its memory time moved from ``m_here`` to ``m_there``,
    its SM time kept; a case faster than its memory time here keeps that fraction of it."""
    if m_here <= 0:
        return above
    if above <= m_here:
        return above * m_there / m_here
    return above * (1 - (m_here / above) ** p + (m_there / above) ** p) ** (1 / p)


def overlapped(above: float, m_here: float, m_there: float, k: float) -> float:
    """``above`` with its memory time moved from ``m_here`` to ``m_there``, the two combined as
    ``s + m - k * min(s, m)`` (``k``: the share of the shorter that overlaps the longer), ``s`` kept."""
    if m_here <= 0:
        return above
    if above <= m_here:
        return above * m_there / m_here
    s = above - (1 - k) * m_here
    if s < m_here:
        s = (above - m_here) / (1 - k)
    return s + m_there - k * min(s, m_there)


def projector(p: float, combine=None):
    """The rule with every MoE case carried by ``combine`` (default :func:`carried`) at ``p``."""
    combine = combine or carried

    def project(case, here, there, state_here, state_there):
        if case.component != "moe":
            return shipped(case, here, there, state_here, state_there)
        above = max(0.0, case.median_us - here.floor_us(case))
        return there.floor_us(case) + combine(above, memory_us(case, here, state_here),
                                              memory_us(case, there, state_there), p)
    return project


def side(paths, target_id):
    cases, facts = rule.load_cases(paths[0])
    results, _ = load_results(paths[0])
    fit_cases = cases + [c for p in paths[1:] for c in rule.load_cases(p)[0]]
    return {"cases": cases, "results": [r for r in results if r.backend.startswith("vllm")],
            "target": load_target(target_id), "facts": facts, "params": rule.fit(fit_cases, facts, facts.name)}


def row(src, dst, p, spec, combine=None, label=None) -> str:
    crosscheck.project_case = shipped if p is None else projector(p, combine)
    try:
        d = crosscheck.direction((src["cases"], src["results"], src["target"]),
                                 (dst["cases"], dst["results"], dst["target"]), src["params"], spec, (1, 64, 256),
                                 1024, src["facts"], dst["facts"])
    finally:
        crosscheck.project_case = shipped
    return summary(d, label or ("shipped" if p is None else f"p = {p:g}"), 8)


def pair_misses(run: Path) -> tuple[int, dict, list[float]]:
    """Per p, the median |projected / measured - 1| of the run's MoE cases within L2, kernel -> step; and
    each pair's step / kernel time (weights from DRAM against from L2, the same SM work)."""
    warm, facts = rule.load_cases(run / "kernel.json")
    step = {c.name: c for c in rule.load_cases(run / "step.json")[0]}
    model = rule.DeviceModel(facts, rule.fit(warm + list(step.values()), facts, str(run)))
    pairs = [(w, step[w.name]) for w in warm if w.component == "moe" and w.name in step
             and rule.warm_dram_bytes(w.bytes, facts.l2_bytes) == 0]
    misses = {}
    for p in GRID:
        misses[p] = statistics.median(
            abs(model.floor_us(s) + carried(max(0.0, w.median_us - model.floor_us(w)), memory_us(w, model, "warm"),
                                            memory_us(s, model, "step"), p) - s.median_us) / s.median_us
            for w, s in pairs)
    return len(pairs), misses, sorted(s.median_us / w.median_us for w, s in pairs)


def device(side_: dict) -> rule.DeviceModel:
    """A side's GPU as its own fit sees it."""
    return rule.DeviceModel(side_["facts"], side_["params"])


def sm_count_estimates(runs: list[Path], side_: dict) -> list[tuple[Path, list[tuple[int, object]]]]:
    """Per SM-count run, each point's M and ``sm_count.py``'s two-stage estimate at the side's own fit (its
    floor per launch times the case's kernels, its achievable DRAM bandwidth)."""
    gpu = device(side_)
    cases = {c.name: c for c in side_["cases"] if c.component == "moe"}
    out = []
    for path in runs:
        data = json.loads(path.read_text())
        out.append((path, [(q["tokens"], estimate(q, data["sms"], gpu.floor_us(cases[f"test_moe[{q['case']}-vllm]"]),
                                                  gpu.dram_bytes_per_s)) for q in data["points"]]))
    return out


def sm_count_p(side_: dict) -> tuple[float, list[str]]:
    """The p that the H100's SM-count runs set: the median over every case of every run, and a line per run."""
    ps, lines = [], []
    for path, got in sm_count_estimates(SM_COUNT_RUNS, side_):
        ps += [math.inf if e.p is None else e.p for _, e in got]
        lines.append(f"  {path.parent.relative_to(REPO)}: " + ", ".join(
            f"M = {m} p {math.inf if e.p is None else e.p:.2f}" + (" (the sum or more)" if e.summed else "")
            for m, e in got))
    return statistics.median(ps), lines


def shared_moe(a: dict, b: dict, kind: str) -> list[tuple]:
    """The uniform MoE cases of ``kind`` (fused, gate_up, down; "" for all) at M = 64 and 256 that both sides
    measured: (the case on ``b``, the same case on ``a``)."""
    there = {c.name: c for c in a["cases"]}
    return [(c, there[c.name]) for c in b["cases"] if c.name in there and c.name.startswith(f"test_moe[{kind}")
            and any(f"-uniform-m{m}-" in c.name for m in (64, 256))]


def dram_rates(a: dict, b: dict) -> list[str]:
    """Per uniform MoE case at M = 64 and 256, the DRAM rate it reached on each GPU (its bytes over its time
    above the floor, all its bytes from DRAM: none fits in L2) against each GPU's fitted achievable rate."""
    out = []
    for pair in shared_moe(a, b, ""):
        cells = []
        for side_, case in zip((b, a), pair, strict=True):
            gpu = device(side_)
            rate = case.bytes / ((case.median_us - gpu.floor_us(case)) * 1e-6)
            cells.append(f"{side_['facts'].name} {rate / 1e12:.2f} TB/s ({rate / gpu.dram_bytes_per_s:.0%} of "
                         f"{gpu.dram_bytes_per_s / 1e12:.2f})")
        out.append(f"  {pair[0].name}: " + ", ".join(cells))
    return out


def sm_side_times(a: dict, b: dict, p: float) -> list[str]:
    """Per fused uniform MoE case at M = 64 and 256, the SM-side time ``s`` (``s^p = above^p - m^p``) on each
    GPU at ``p``, each with its own fit's floor and DRAM rate, and their ratio: what would have to move
    from the H100 to the H200 for that ``p`` to hold on both (the SMs and clock are the same)."""
    out = []
    for pair in shared_moe(a, b, "fused-"):
        sides = []
        for side_, case in zip((b, a), pair, strict=True):
            gpu = device(side_)
            above, m = case.median_us - gpu.floor_us(case), memory_us(case, gpu, "warm")
            sides.append((above ** p - m ** p) ** (1 / p))
        out.append(f"  {pair[0].name}: s {sides[0]:.1f} µs on the H100, {sides[1]:.1f} µs on the H200 "
                   f"({sides[1] / sides[0] - 1:+.1%})")
    return out


def sm_count_overlap(runs: list[Path], side_: dict) -> tuple[float, list[str]]:
    """Per SM-count run of one GPU, the overlap share ``k = (s + m - a) / min(s, m)`` of each fused case
    (``a`` its whole-GPU time above the floor, ``s`` its SM time from the counts of four or more waves,
    ``m`` its bytes over the side's fitted DRAM rate): the median over the cases at M = 64 and 256 of every
    run, and a line per run. M = 16 is shown but left out: there the whole GPU took the sum of the two or
    more in some runs on both GPUs (a bound the SM count does not change)."""
    ks, lines = [], []
    for path, got in sm_count_estimates(runs, side_):
        cells = []
        for m, e in got:
            k = (e.s + e.m - e.above[max(e.above)]) / min(e.s, e.m)
            if m in OVERLAP_TOKENS:
                ks.append(k)
            cells.append(f"M = {m} s {e.s:.1f} µs m {e.m:.1f} µs k {k:.3f}")
        lines.append(f"  {path.parent.relative_to(REPO)}: " + ", ".join(cells))
    return statistics.median(ks), lines


def clocks(path: Path) -> str:
    """What NVML read before and after each MoE case at M = 64 and 256 of one run: the SM clock, the power
    against its limit and the throttle reasons (a clock that fell under load would lengthen the SM time)."""
    reads = [t for b in json.loads(path.read_text())["benchmarks"] if b["name"].startswith("test_moe[")
             and any(f"-m{m}-" in b["name"] for m in (64, 256))
             for t in (b["extra_info"].get("telemetry_before"), b["extra_info"].get("telemetry_after")) if t]
    mhz, watts = [t["sm_clock_mhz"] for t in reads], [t["power_w"] for t in reads]
    reasons = sorted({t["throttle_reasons"] for t in reads})
    return (f"  {path.relative_to(REPO)}: {len(reads)} reads, SM clock {min(mhz)}-{max(mhz)} MHz, power "
            f"{min(watts):.0f}-{max(watts):.0f} W of {max(t['power_limit_w'] for t in reads):.0f} W, throttle "
            f"reasons {', '.join(reasons)}")


def main() -> None:
    spec = load_model_spec("kimi-k2.5")
    a = side([H200], TARGETS[0])
    b = side(H100, TARGETS[1])
    print("cross-GPU check (kernel timer, 211 cases): per kernel median / p90, step error at M = 1 64 256")
    for p in (None, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0):
        print(row(a, b, p, spec))
        print(row(b, a, p, spec))
    p, lines = sm_count_p(b)
    print(f"\nthe p the H100 sets from the fused MoE on fewer SMs (sm_count.py, two-stage; floor "
          f"{b['params'].floor_us:.3f} µs per launch, DRAM {device(b).dram_bytes_per_s / 1e9:.0f} GB/s from its fit)")
    print("\n".join(lines))
    print(f"  median over {len(SM_COUNT_RUNS)} runs' cases: p = {p:.2f}; the check from the H100 at it (from the H200 "
          "it would need the H200's own runs):")
    print(row(b, a, round(p, 2), spec))
    print("\nthe MoE's DRAM rate on each GPU (kernel timer), against the GPU's fitted achievable rate")
    print("\n".join(dram_rates(a, b)))
    print(f"\nthe SM-side time of each GPU's fused MoE at p = {round(p, 2):g}, each GPU's own fit (the same p on both"
          " needs the H200's longer by this)")
    print("\n".join(sm_side_times(a, b, round(p, 2))))
    print("\nthe overlap of the fused MoE's SM and memory times, a = s + m - k min(s, m), from each GPU's SM-count"
          " runs (sm_count.py two-stage: s from the counts of 4+ waves; m at the GPU's own fitted DRAM rate)")
    overlap = {}
    for name, runs, side_ in (("H100", SM_COUNT_RUNS, b), ("H200", H200_SM_COUNT_RUNS, a)):
        overlap[name], lines = sm_count_overlap(runs, side_)
        print("\n".join(lines))
        print(f"  {name}: median k over M = {' and '.join(map(str, OVERLAP_TOKENS))} of {len(runs)} runs: "
              f"{overlap[name]:.3f}")
    print("  the check with every MoE case carried by that form, k the source GPU's own:")
    print(row(a, b, round(overlap["H200"], 2), spec, overlapped, f"k = {round(overlap['H200'], 2):g}"))
    print(row(b, a, round(overlap["H100"], 2), spec, overlapped, f"k = {round(overlap['H100'], 2):g}"))
    a2 = side([REPO / "validation/tp8/h200-2026-12-06/kernel.json", REPO / "validation/tp8/h200-2026-12-06/step.json"],
              TARGETS[0])
    b2 = side([REPO / "validation/tp8/h100-2026-12-06/kernel.json", REPO / "validation/tp8/h100-2026-12-06/step.json"],
              TARGETS[1])
    print("  the same on the second pair (validation/tp8/h200-2026-12-06 against h100-2026-12-06: the same code the"
          " same day, each GPU fitted on both its timers):")
    k2 = {"H200": sm_count_overlap(H200_SM_COUNT_RUNS, a2)[0], "H100": sm_count_overlap(SM_COUNT_RUNS, b2)[0]}
    print(f"  k read at this pair's fits (their DRAM rates set m): H200 {k2['H200']:.3f}, H100 {k2['H100']:.3f}")
    for label, (src, dst, k) in (("shipped", (a2, b2, None)), ("shipped", (b2, a2, None)),
                                 ("k", (a2, b2, k2["H200"])), ("k", (b2, a2, k2["H100"]))):
        print(row(src, dst, None if k is None else round(k, 2), spec, overlapped,
                  label if k is None else f"k = {round(k, 2):g}"))
    print("  the shipped rule there with beta 0 on both GPUs (the time the traffic does not explain kept as latency):")
    a0, b0 = ({**x, "params": dataclasses.replace(x["params"], beta=0.0)} for x in (a2, b2))
    print(row(a0, b0, None, spec, label="beta 0"))
    print(row(b0, a0, None, spec, label="beta 0"))
    print("\nthe SM clock under the MoE at M = 64 and 256 (NVML, before and after each case)")
    print("\n".join(clocks(path) for path in (H200, H100[0])))
    print("\nthe p of one GPU's two cache states: MoE cases within L2, kernel timer -> step timer, median miss per p")
    for run in H100_RUNS:
        n, misses, ratios = pair_misses(run)
        best = min(misses, key=misses.get)
        print(f"  {run.relative_to(REPO)} ({n} pairs): " + "  ".join(f"{p:g}: {m:.1%}" for p, m in misses.items())
              + f"  -> p = {best:g}; step / kernel time {ratios[0]:.2f}-{ratios[-1]:.2f}, median "
              f"{statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
