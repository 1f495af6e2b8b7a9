"""How the Marlin MoE's time answers a change of DRAM bandwidth, on one GPU: the p of a p-norm of its
SM and memory times (``sm_count.carried``) set from the source GPU alone (it did not set it).

    python validation/projection/bandwidth_share.py --out DIR [--tokens 16,64,256] [--programs 8,16,32]

(on a CUDA machine whose python imports vLLM; a minute or two on an H100.) For each fused MoE case
(uniform routing, Kimi-K2.5 at TP 8) and each count G of Triton programs:

* ``alone``: the MoE's time per call, CUDA events around a loop of calls;
* ``spin``: the same while G programs spin on registers (they hold what the reader holds of the SMs,
  and read nothing);
* ``read``: the same while G programs stream a buffer much larger than L2 (they take a share of the
  DRAM bandwidth);
* the reader's own bandwidth alone and during the MoE loop (its bytes over its own events).

The MoE loop runs inside the reader's and the spinner's time (checked from the events: a case whose
loop outlasted either is marked). Before any timing each MoE case is checked against the reference on
its check variant, as the benchmarks do. Written: ``DIR/bandwidth-share.json``; printed: one line a
point. ``--analyse FILE`` prints, per p, how well ``(s^p + m^p)^(1/p)`` with the bandwidth left over
explains the ``read`` times from the ``spin`` times, and the p that explains them best.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sm_count import GRID, carried  # noqa: E402  (the p-norm whose p this sets, and its grid of p)


def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def read(src, out, per_program, passes, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        base = pid.to(tl.int64) * per_program  # a buffer of 4 GiB and more: past int32 offsets
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for _ in range(passes):
            for off in range(0, per_program, BLOCK):
                acc += tl.load(src + base + off + tl.arange(0, BLOCK)).to(tl.float32)
        tl.store(out + pid * BLOCK + tl.arange(0, BLOCK), acc)

    @triton.jit
    def spin(out, per_program, passes, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        acc = tl.zeros([BLOCK], dtype=tl.float32) + pid
        for _ in range(passes):
            for _off in range(0, per_program, BLOCK):
                acc = acc * 0.999999 + 0.5
        tl.store(out + pid * BLOCK + tl.arange(0, BLOCK), acc)

    return read, spin


BLOCK = 4096


def _timed(stream, calls: int, fn, *args):
    """Events around ``calls`` calls of ``fn(*args)`` on ``stream`` (not waited for)."""
    import torch
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record(stream)
        for _ in range(calls):
            fn(*args)
        end.record(stream)
    return start, end


def _launcher(kernel, g: int, *args):
    """``kernel`` on ``g`` programs with ``args`` and the passes given at the call."""
    def launch(passes: int):
        kernel[(g,)](*args, passes, BLOCK=BLOCK)
    return launch


def measure(tokens: list[int], programs: list[int], buffer_gib: float) -> dict:
    import torch

    from decodebench.kernels.base import check_case
    from decodebench.kernels.moe import MoECase, MoEStage, moe_cases
    from decodebench.model import load_model_spec
    from decodebench.shapes import DecodeShapes, sweep_for

    device = torch.device("cuda")
    read, spin = _kernels()
    shapes = DecodeShapes.for_deployment(load_model_spec("kimi-k2.5"), 8)
    cases = [c for c in moe_cases(shapes, sweep_for("nightly")) if isinstance(c, MoECase)
             and c.stage is MoEStage.FUSED and c.routing.value == "uniform" and c.tokens in tokens]
    elements = int(buffer_gib * 2**30) // 2
    src = torch.ones(elements, dtype=torch.bfloat16, device=device)
    out = torch.empty(max(programs) * BLOCK, dtype=torch.float32, device=device)
    main, side = torch.cuda.Stream(), torch.cuda.Stream()
    props = torch.cuda.get_device_properties(device)
    result = {"gpu": props.name, "sms": props.multi_processor_count, "l2_bytes": props.L2_cache_size,
              "buffer_bytes": elements * 2, "block": BLOCK, "points": []}
    for case in cases:
        variant = case.check_variant()
        check = check_case(variant, variant.kernel("vllm", device), device, seed=0)
        kernel = case.kernel("vllm", device)
        inputs = case.make_inputs(device, seed=1)
        moe_bytes = case.traffic().bytes
        for _ in range(3):
            kernel(inputs)
        torch.cuda.synchronize()
        s, e = _timed(main, 20, kernel, inputs)
        torch.cuda.synchronize()
        alone_ms = s.elapsed_time(e) / 20
        calls = max(5, int(3.0 / alone_ms))  # about 3 ms of MoE calls
        for g in programs:
            per_program = (elements // g) // BLOCK * BLOCK
            point = {"case": case.id, "tokens": case.tokens, "moe_bytes": moe_bytes, "check_error": check.error,
                     "programs": g, "alone_us": alone_ms * 1e3}
            # each of the two alone: one pass, then the passes that last about 4x the MoE loop
            one = {"read": _launcher(read, g, src, out, per_program), "spin": _launcher(spin, g, out, per_program)}
            passes = {}
            for mode, launch in one.items():
                launch(1)  # compiled before it is timed
                rs, re_ = _timed(side, 1, launch, 1)
                torch.cuda.synchronize()
                pass_ms = rs.elapsed_time(re_)
                passes[mode] = max(1, round(4 * calls * alone_ms / pass_ms))
                if mode == "read":
                    point["read_alone_gbs"] = g * per_program * 2 / (pass_ms * 1e-3) / 1e9
            for mode in ("spin", "read"):
                hs, he = _timed(side, 1, one[mode], passes[mode])
                ms, me = _timed(main, calls, kernel, inputs)
                torch.cuda.synchronize()
                point[f"{mode}_us"] = ms.elapsed_time(me) / calls * 1e3
                point[f"{mode}_inside"] = hs.elapsed_time(ms) >= 0 and me.elapsed_time(he) >= 0
                if mode == "read":
                    point["read_during_gbs"] = (g * per_program * 2 * passes["read"] / (hs.elapsed_time(he) * 1e-3)
                                                / 1e9)
            result["points"].append(point)
            print(f"{case.id} G={g}: alone {point['alone_us']:.1f} µs, spin {point['spin_us']:.1f}, read "
                  f"{point['read_us']:.1f} (reader {point['read_alone_gbs']:.0f} GB/s alone, "
                  f"{point['read_during_gbs']:.0f} during; inside {point['spin_inside']}/{point['read_inside']})",
                  flush=True)
    return result


def analyse(path: Path, dram_bytes_per_s: float) -> str:
    """Per p, the median |predicted / measured - 1| of the ``read`` times, each predicted from its ``spin``
    time with the MoE's memory time stretched by the bandwidth the reader took during the loop."""
    data = json.loads(path.read_text())
    points = [q for q in data["points"] if q["spin_inside"] and q["read_inside"]]
    lines = [f"{path}: {data['gpu']}, {len(points)} of {len(data['points'])} points with the MoE loop inside both"]
    misses = {}
    for p in GRID:
        errors = []
        for q in points:
            m_full = q["moe_bytes"] / dram_bytes_per_s * 1e6
            left = dram_bytes_per_s - q["read_during_gbs"] * 1e9
            if left <= 0:
                continue
            errors.append(carried(q["spin_us"], m_full, q["moe_bytes"] / left * 1e6, p) / q["read_us"] - 1)
        misses[p] = statistics.median(abs(e) for e in errors) if errors else float("nan")
    best = min(misses, key=misses.get)
    lines.append("  " + "  ".join(f"{p:g}: {m:.1%}" for p, m in misses.items()) + f"  -> p = {best:g}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="folder for bandwidth-share.json")
    ap.add_argument("--tokens", default="16,64,256")
    ap.add_argument("--programs", default="8,16,32")
    ap.add_argument("--buffer-gib", type=float, default=4.0)
    ap.add_argument("--analyse", type=Path, help="a bandwidth-share.json to analyse (no GPU needed)")
    ap.add_argument("--dram-gbs", type=float, help="the achievable DRAM bandwidth of that GPU (the rule's fit)")
    args = ap.parse_args(argv)
    if args.analyse:
        if not args.dram_gbs:
            ap.error("--analyse needs --dram-gbs (the GPU's achievable DRAM bandwidth, from the rule's fit)")
        print(analyse(args.analyse, args.dram_gbs * 1e9))
        return 0
    if not args.out:
        ap.error("--out DIR is needed to measure")
    result = measure([int(t) for t in args.tokens.split(",")], [int(g) for g in args.programs.split(",")],
                     args.buffer_gib)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bandwidth-share.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
