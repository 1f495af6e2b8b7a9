"""How the Marlin MoE's time answers fewer SMs with its DRAM bytes fixed, on one GPU: the runs the
cross-GPU checks read each GPU's fused MoE overlap share from (``share.py``).

    python validation/projection/sm_count.py --out DIR [--tokens 64,256,16] [--sms 112,96,72,48,40,24]
    python validation/projection/sm_count.py --analyse DIR/sm-count.json --dram-gbs 3060 --floor-us 8.93
        [--slowdown two-stage]  (one command line)

(on a CUDA machine whose python imports vLLM and whose torch has green contexts.) Each fused MoE case
(uniform routing, Kimi-K2.5 at TP 8), checked against its reference first, is timed with CUDA events
around a loop of calls inside a CUDA green context of N SMs, and on the whole GPU. A compute-bound
bf16 GEMM (4096 x 4096 x 4096, cuBLAS) is timed the same way as the control: its time over the whole
GPU's is how much slower the SMs left run SM-bound work (the partition held where it grows with
fewer SMs). Written: ``DIR/sm-count.json``, after every case (a cut run keeps what it measured).

``--analyse`` fits, per p, ``above(N) = ((s x r(N))^p + m^p)^(1/p)``: ``above`` the MoE's time over the
GPU's floor, ``r(N)`` how much longer its SM work takes on N SMs, ``m`` the case's DRAM bytes over the
achievable bandwidth (the rule's fit, fixed: fewer SMs do not change the bytes), ``s`` the case's SM time on
the whole GPU, fitted per case. It prints the median miss per p and the p that explains the times best.
``r(N)`` is either the control's slowdown (``--slowdown control``) or Marlin's waves (``waves``, the
default): assuming Marlin launches one block per SM of the whole GPU (its launchers read the device's SM
count, which a green context does not change), on N SMs its blocks run in ``ceil(SMs / N)`` waves. The SM
counts are multiples of 8, the granularity of a Hopper green context. ``--slowdown two-stage`` reads each
case instead in two steps (:func:`two_stage`): its SM time from the counts that need four or more waves,
where memory's share of a wave is small, then the p that makes the whole GPU's time; those fits are flat in
p, this reading is not.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from share import SCARCE_WAVES, estimate  # noqa: E402  (the reading: share.py, the checks' own)

CONTROL = 4096  # the control GEMM's M = N = K
GRID = (1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0)  # the p the least-squares fits try


def carried(above: float, m_here: float, m_there: float, p: float) -> float:
    """``above`` (a case's time above the floor) with its memory time moved from ``m_here`` to ``m_there``,
    its SM time kept, the two combined as ``(s^p + m^p)^(1/p)``; a case faster than its memory time here
    keeps that fraction of it."""
    if m_here <= 0:
        return above
    if above <= m_here:
        return above * m_there / m_here
    return above * (1 - (m_here / above) ** p + (m_there / above) ** p) ** (1 / p)


class GreenStreams:
    """One CUDA green context per SM count, made on first use and kept for the run; ``stream(n)`` is a
    context manager that makes n SMs' stream current (None: the whole GPU, no context)."""

    def __init__(self):
        self._contexts = {}

    def _context(self, sms: int):
        import torch
        from torch.cuda import green_contexts
        if not getattr(green_contexts, "SUPPORTED", True):
            raise RuntimeError("torch.cuda.green_contexts: this torch was built without green contexts")
        if sms not in self._contexts:
            try:
                self._contexts[sms] = green_contexts.GreenContext.create(num_sms=sms,
                                                                        device_id=torch.cuda.current_device())
            except TypeError:
                self._contexts[sms] = green_contexts.GreenContext.create(sms, torch.cuda.current_device())
        return self._contexts[sms]

    @contextmanager
    def stream(self, sms: int | None):
        import torch
        if sms is None:
            yield torch.cuda.current_stream()
            return
        ctx = self._context(sms)
        if hasattr(ctx, "Stream"):
            with torch.cuda.stream(ctx.Stream()):
                yield torch.cuda.current_stream()
            return
        enter = getattr(ctx, "set_context", None) or getattr(ctx, "make_current", None)
        leave = getattr(ctx, "pop_context", None) or getattr(ctx, "pop_current", None)
        if enter is None or leave is None:
            raise RuntimeError(f"torch.cuda.green_contexts.GreenContext has none of Stream, set_context/pop_context"
                               f", make_current/pop_current: {sorted(n for n in dir(ctx) if not n.startswith('_'))}")
        enter()
        try:
            yield torch.cuda.current_stream()
        finally:
            torch.cuda.synchronize()
            leave()


def per_call_us(stream, calls: int, fn, *args) -> float:
    """The mean time of ``calls`` calls of ``fn(*args)`` on ``stream``, from events around the loop."""
    import torch
    fn(*args)  # warm in this context
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    for _ in range(calls):
        fn(*args)
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / calls * 1e3


def measure(tokens: list[int], sms: list[int], out: Path, deadline_s: float) -> dict:
    import torch

    from decodebench.kernels.base import check_case
    from decodebench.kernels.moe import MoECase, MoEStage, moe_cases
    from decodebench.model import load_model_spec
    from decodebench.shapes import DecodeShapes, sweep_for

    began = time.monotonic()
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    shapes = DecodeShapes.for_deployment(load_model_spec("kimi-k2.5"), 8)
    cases = [c for c in moe_cases(shapes, sweep_for("nightly")) if isinstance(c, MoECase)
             and c.stage is MoEStage.FUSED and c.routing.value == "uniform" and c.tokens in tokens]
    cases.sort(key=lambda c: tokens.index(c.tokens))  # in the order asked: the most wanted first
    a = torch.randn(CONTROL, CONTROL, dtype=torch.bfloat16, device=device)
    b = torch.randn(CONTROL, CONTROL, dtype=torch.bfloat16, device=device)
    result = {"gpu": props.name, "sms": props.multi_processor_count, "l2_bytes": props.L2_cache_size,
              "control": f"torch.mm bf16 {CONTROL}^3", "control_us": {}, "points": [], "cut": None}
    counts = [None, *sms]
    green = GreenStreams()
    for n in counts:
        with green.stream(n) as stream:
            result["control_us"][str(n or "all")] = per_call_us(stream, 20, torch.mm, a, b)
    print(f"{props.name}: control {result['control_us']}", flush=True)
    for case in cases:
        if time.monotonic() - began > deadline_s:
            result["cut"] = f"deadline {deadline_s:.0f} s reached before {case.id}"
            break
        variant = case.check_variant()
        check = check_case(variant, variant.kernel("vllm", device), device, seed=0)
        kernel = case.kernel("vllm", device)
        inputs = case.make_inputs(device, seed=1)
        point = {"case": case.id, "tokens": case.tokens, "moe_bytes": case.traffic().bytes,
                 "check_error": check.error, "us": {}}
        for n in counts:
            with green.stream(n) as stream:
                alone = per_call_us(stream, 5, kernel, inputs)
                point["us"][str(n or "all")] = per_call_us(stream, max(5, int(3000 / alone)), kernel, inputs)
        result["points"].append(point)
        print(f"{case.id}: " + ", ".join(f"{k} SMs {v:.1f} µs" for k, v in point["us"].items()), flush=True)
        (out / "sm-count.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "sm-count.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def fit_case(above: list[float], slowdown: list[float], m: float, p: float) -> tuple[float, list[float]]:
    """The SM time ``s`` (on the whole GPU) that best explains ``above`` with the SM work stretched by
    ``slowdown`` (least squares of the log miss, golden-section on log s), and each point's miss."""
    def misses(s: float) -> list[float]:
        return [((s * r) ** p + m ** p) ** (1 / p) / t - 1 for t, r in zip(above, slowdown, strict=True)]

    def cost(log_s: float) -> float:
        return sum(math.log1p(e) ** 2 for e in misses(math.exp(log_s)))

    lo, hi = math.log(min(above) * 1e-3), math.log(max(above) * 10)
    g = (math.sqrt(5) - 1) / 2
    for _ in range(200):
        x1, x2 = hi - g * (hi - lo), lo + g * (hi - lo)
        if cost(x1) < cost(x2):
            hi = x2
        else:
            lo = x1
    s = math.exp((lo + hi) / 2)
    return s, misses(s)


def analyse(path: Path, dram_bytes_per_s: float, floor_us: float, by: str = "waves") -> str:
    data = json.loads(path.read_text())
    control = data["control_us"]
    keys = [k for k in control if k != "all"]
    measured = [1.0, *(control[k] / control["all"] for k in keys)]
    waves = [1.0, *(float(math.ceil(data["sms"] / int(k))) for k in keys)]
    slowdown = waves if by == "waves" else measured
    lines = [f"{path}: {data['gpu']} ({data['sms']} SMs), floor {floor_us} µs, DRAM {dram_bytes_per_s / 1e9:.0f} GB/s, "
             f"r(N): {by}",
             "  control slowdown (its SMs' share would give " + ", ".join(f"{data['sms'] / int(k):.2f}x" for k in keys)
             + "): " + ", ".join(f"{k} SMs {r:.2f}x" for k, r in zip(["all", *keys], measured, strict=True)),
             "  Marlin's waves: " + ", ".join(f"{k} SMs {w:g}" for k, w in zip(["all", *keys], waves, strict=True))]
    # per case: its times above the floor at each SM count, and its memory time
    cases = [(q, [q["us"][k] - floor_us for k in ["all", *keys]], q["moe_bytes"] / dram_bytes_per_s * 1e6)
             for q in data["points"]]
    misses = {}
    for p in GRID:
        errors = [abs(x) for _, above, m in cases for x in fit_case(above, slowdown, m, p)[1]]
        misses[p] = statistics.median(errors) if errors else float("nan")
    best = min(misses, key=misses.get)
    lines.append("  median miss per p: " + "  ".join(f"{p:g}: {m:.1%}" for p, m in misses.items())
                 + f"  -> p = {best:g}")
    for q, above, m in cases:
        s, e = fit_case(above, slowdown, m, best)
        lines.append(f"  {q['case']}: m {m:.1f} µs, s {s:.1f} µs at p = {best:g}; times "
                     + ", ".join(f"{q['us'][k]:.1f}" for k in ["all", *keys]) + " µs; misses "
                     + ", ".join(f"{x:+.1%}" for x in e))
    return "\n".join(lines)


def analyse_two_stage(path: Path, dram_bytes_per_s: float, floor_us: float) -> str:
    """Per case, :func:`two_stage`'s SM time and p, and the median p over the cases."""
    data = json.loads(path.read_text())
    sms = data["sms"]
    lines = [f"{path}: {data['gpu']} ({sms} SMs), floor {floor_us} µs, DRAM {dram_bytes_per_s / 1e9:.0f} GB/s, "
             f"s from the counts of {SCARCE_WAVES}+ waves, p from the whole GPU"]
    ps = []
    for q in data["points"]:
        e = estimate(q, sms, floor_us, dram_bytes_per_s)
        ps.append(e.p if e.p is not None else math.inf)
        said = "none (the larger)" if e.p is None else "1 (the sum or more)" if e.summed else f"{e.p:.2f}"
        lines.append(f"  {q['case']}: whole GPU {e.above[sms]:.1f} µs above the floor, m {e.m:.1f} µs, "
                     f"s {e.s:.1f} µs (from {', '.join(map(str, e.scarce))} SMs), p {said}")
    if ps:
        lines.append(f"  median p over {len(ps)} cases: {statistics.median(ps):.2f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="folder for sm-count.json")
    ap.add_argument("--tokens", default="64,256,16", help="the cases' M, in the order they run")
    ap.add_argument("--sms", default="112,96,72,48,40,24", help="SM counts of the green contexts (multiples of 8)")
    ap.add_argument("--deadline", type=float, default=120.0, help="seconds after which no new case starts")
    ap.add_argument("--analyse", type=Path, help="an sm-count.json to analyse (no GPU needed)")
    ap.add_argument("--dram-gbs", type=float, help="the GPU's achievable DRAM bandwidth (the rule's fit)")
    ap.add_argument("--floor-us", type=float, default=0.0, help="the case's floor (the rule's fit)")
    ap.add_argument("--slowdown", choices=("waves", "control", "two-stage"), default="waves",
                    help="what r(N) is in the least-squares fit; two-stage: s from the SM-scarce counts, p from "
                         "the whole GPU")
    args = ap.parse_args(argv)
    if args.analyse:
        if not args.analyse.is_file():
            ap.error(f"--analyse {args.analyse}: no such file (an sm-count.json that --out wrote)")
        if not args.dram_gbs:
            ap.error("--analyse needs --dram-gbs (the GPU's achievable DRAM bandwidth, from the rule's fit)")
        if args.slowdown == "two-stage":
            print(analyse_two_stage(args.analyse, args.dram_gbs * 1e9, args.floor_us))
        else:
            print(analyse(args.analyse, args.dram_gbs * 1e9, args.floor_us, args.slowdown))
        return 0
    if not args.out:
        ap.error("--out DIR is needed to measure")
    args.out.mkdir(parents=True, exist_ok=True)
    measure([int(t) for t in args.tokens.split(",")], [int(n) for n in args.sms.split(",")], args.out, args.deadline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
