"""The projection rule with a soft roofline for the MoE, set against the shipped rule (the larger bound).

    python validation/projection/soft_roofline.py > validation/projection/soft-roofline.txt

For the MoE only, the modelled traffic time ``w`` of a case is made from its DRAM, L2, SM-throughput
and compute times ``d, l, s, c`` by one of three forms with one exponent ``p`` (the shipped rule takes
their largest):

* ``p-norm``: ``(d^p + l^p + s^p + c^p)^(1/p)`` (p -> inf is the max);
* ``p-norm of d, s``: ``max((d^p + s^p)^(1/p), l, c)``, the two bounds the MoE sits between;
* ``overlap``: ``max(d + s - p min(d, s), l, c)``, p in 0..1 (1 is the max of the two).

Each GPU's ``p`` is fitted on that GPU's own MoE cases alone (all M, uniform and skewed routing, both
of the H100's timers): the value of the form's grid whose ``floor + w`` misses the measured times by
the least median; the rule's other parameters are the shipped fit's. Both directions of the cross-GPU
check (validation/projection/make.sh) are then run with each side's own ``p``, and for the p-norm, to
show how much rides on ``p``, with a few fixed values on both sides.
"""

from __future__ import annotations

import statistics
import sys
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from decodebench.attribution.predict import projection_rule as rule  # noqa: E402
from decodebench.attribution.predict.crosscheck import direction  # noqa: E402
from decodebench.attribution.predict.prediction import load_results  # noqa: E402
from decodebench.attribution.predict.targets import load_target  # noqa: E402
from decodebench.model import load_model_spec  # noqa: E402

H200 = (REPO / "baselines/nvidia-h200-x1-single-cc90-drv580.159.04-cuda13.0-torch2.11.0-cu130"
        / "0005_h200-vllm-nightly-gated.json")
H100 = [REPO / "validation/tp8/h100-2026-12-05/kernel.json", REPO / "validation/tp8/h100-2026-12-05/step.json"]
TARGETS = ("h200-x8-nvlink", str(REPO / "validation/projection/targets/h100-x8-nvlink.json"))
COMPONENT = "moe"
shipped_traffic = rule.traffic_us


def p_norm(d, l2, sm, c, p):
    return sum(t ** p for t in (d, l2, sm, c) if t > 0) ** (1 / p)


def p_norm_ds(d, l2, sm, c, p):
    return max(sum(t ** p for t in (d, sm) if t > 0) ** (1 / p), l2, c)


def overlap(d, l2, sm, c, p):
    return max(d + sm - p * min(d, sm), l2, c)


FORMS = {"p-norm": (p_norm, (1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0, 10.0, 20.0)),
         "p-norm of d, s": (p_norm_ds, (1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0, 10.0, 20.0)),
         "overlap": (overlap, (0.0, 0.2, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0))}
form = p_norm


def soft_traffic(p: float):
    """``traffic_us`` with the MoE's bounds combined by ``form`` and ``p`` instead of their largest."""
    def traffic(case, device, state, sm=True):
        us, bound = shipped_traffic(case, device, state, sm)
        if case.component != COMPONENT:
            return us, bound
        dram = {"warm": rule.warm_dram_bytes(case.bytes, device.facts.l2_bytes), "step": case.state_bytes,
                "cold": case.bytes}[state]
        rate = device.sm_bytes_per_s(case.component) if sm else None
        terms = (dram / device.dram_bytes_per_s, case.bytes / device.l2_bytes_per_s, case.bytes / rate if rate else 0.0,
                 case.tensor_flops / device.facts.bf16_flops + case.dequant_weights / device.facts.alu_ops_per_s)
        return form(*terms, p) * 1e6, bound
    return traffic


@contextmanager
def combined(p: float | None):
    """The rule with the MoE's bounds combined by ``p`` (None: the shipped max) while the block runs."""
    if p is not None:
        rule.traffic_us = soft_traffic(p)
    try:
        yield
    finally:
        rule.traffic_us = shipped_traffic


def in_sample_miss(cases, device, p: float) -> float:
    """Median |floor + w - t| / t over the GPU's own MoE cases, with its bounds combined by ``p``."""
    with combined(p):
        return statistics.median(
            abs(device.floor_us(c) + rule.traffic_us(c, device, rule.CACHE_STATES[c.timer],
                                                     rule.sm_bounded(c, device))[0] - c.median_us) / c.median_us
            for c in cases if c.component == COMPONENT)


def side(paths, target_id, grid):
    cases, facts = rule.load_cases(paths[0])
    results, _ = load_results(paths[0])
    fit_cases = cases + [c for p in paths[1:] for c in rule.load_cases(p)[0]]
    params = rule.fit(fit_cases, facts, facts.name)
    misses = {p: in_sample_miss(fit_cases, rule.DeviceModel(facts, params), p) for p in grid}
    best = min(misses, key=misses.get)
    return {"cases": cases, "results": [r for r in results if r.backend.startswith("vllm")],
            "target": load_target(target_id), "facts": facts, "params": params, "p": best, "misses": misses,
            "n": sum(c.component == COMPONENT for c in fit_cases)}


def row(src, dst, p, spec) -> str:
    with combined(p):
        d = direction((src["cases"], src["results"], src["target"]), (dst["cases"], dst["results"], dst["target"]),
                      src["params"], spec, (1, 64, 256), 1024, src["facts"], dst["facts"])
    return summary(d, "max (shipped)" if p is None else f"p = {p:g}", 14)


def summary(d, name: str, width: int) -> str:
    """One line of a cross-GPU direction: per-kernel median / p90 (all, MoE), the step's and its MoE's error."""
    k = d.kernels["rule"]
    steps = " ".join(f"{s['rule']['error']:+6.1%}" for s in d.steps)
    moe = " ".join(f"{s['rule']['groups_error'].get('moe', 0):+6.1%}" for s in d.steps)
    return (f"  {d.source} -> {d.target}  {name:<{width}} all {k['all']['median']:+6.2%} / {k['all']['p90']:5.1%}   "
            f"moe {k['moe']['median']:+6.2%} / {k['moe']['p90']:5.1%}   step {steps}   step's moe {moe}")


def main() -> None:
    global form
    spec = load_model_spec("kimi-k2.5")
    for name, (combine, grid) in FORMS.items():
        form = combine
        a, b = side([H200], TARGETS[0], grid), side(H100, TARGETS[1], grid)
        print(f"{name}: p fitted on each GPU's own MoE cases (median |floor + w - t| / t per p)")
        for s in (a, b):
            misses = "  ".join(f"{p:g}: {m:.1%}" for p, m in s["misses"].items())
            print(f"  {s['facts'].name} ({s['n']} MoE cases): {misses}  -> p = {s['p']:g}")
        print(f"{name}: cross-GPU check (kernel timer, 211 cases): per kernel median / p90, step error at M = 1 64 256")
        fixed = tuple((p, p) for p in (2.0, 3.0, 4.0, 6.0, 10.0)) if name == "p-norm" else ()
        for p_a, p_b in ((None, None), (a["p"], b["p"])) + fixed:
            print(row(a, b, p_a, spec))
            print(row(b, a, p_b, spec))
        print()


if __name__ == "__main__":
    main()
