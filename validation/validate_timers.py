"""Validate decodebench's timers against the profiler's own kernel time on a GPU.

For a fused RMSNorm (M=1, hidden width) and a ~20 µs spin kernel, it measures:

* the reference: the mean device time per call in one long torch.profiler session
  (500 calls, CPU and CUDA activities), summed over its parsed FunctionEvents — a
  different code path from decodebench's kernel timer (short sessions of a few calls,
  CUDA activity only, raw kineto events, adaptive sampling);
* every decodebench timer mode, three independent runs each.

It prints a markdown table (per mode: median of the three run medians, ratio to the
reference, run-to-run spread = (max - min) / median) and writes it, with the raw
numbers as JSON, to the folder given as the first argument.

Usage (from the repository root, on a CUDA machine)::

    PYTHONPATH=. python validation/validate_timers.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from decodebench.hardware import nvml_telemetry
from decodebench.kernels.rmsnorm import RMSNormCase
from decodebench.model import load_model_spec
from decodebench.shapes import DecodeShapes
from decodebench.timing import Budget, measure, modes_for_device

RUNS = 3
REFERENCE_CALLS = 500
SPIN_US = 20.0


def reference_seconds(fn, calls: int = REFERENCE_CALLS) -> float:
    """Mean GPU time per call in one long torch.profiler session, from its FunctionEvents."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    device_us = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == DeviceType.CUDA)
    return device_us / 1e6 / calls


def spin_cycles(target_us: float, device) -> int:
    """Cycles for ``torch.cuda._sleep`` to spin about ``target_us`` at the current SM clock."""
    torch.cuda._sleep(1_000_000)  # bring the clock up before reading it
    torch.cuda.synchronize()
    mhz = nvml_telemetry(device.index or 0).get("sm_clock_mhz") or torch.cuda.clock_rate(device)
    return int(target_us * mhz)


def validate(name: str, fn, device) -> dict:
    reference = reference_seconds(fn)
    rows = {"case": name, "reference_s": reference, "modes": {}}
    for mode in modes_for_device(device):
        medians = []
        for _ in range(RUNS):
            m = measure(fn, mode=mode, device=device, budget=Budget(budget_ms=2000))
            medians.append(m.median)
        mid = sorted(medians)[RUNS // 2]
        rows["modes"][mode.value] = {
            "run_medians_s": medians,
            "median_s": mid,
            "ratio_to_reference": mid / reference,
            "spread": (max(medians) - min(medians)) / mid,
            "stop_reason_last": m.stop_reason.value,
            "samples_last": len(m.samples),
            "calls_per_sample_last": m.calls_per_sample,
        }
    return rows


def markdown(results: list[dict]) -> str:
    lines = [
        "| case | reference (one long profiler session) | timer | median of 3 runs | ratio to reference "
        "| run-to-run spread |",
        "|---|---|---|---|---|---|",
    ]
    for row in results:
        for mode, r in row["modes"].items():
            lines.append(
                f"| {row['case']} | {row['reference_s'] * 1e6:.2f} µs | {mode} | {r['median_s'] * 1e6:.2f} µs "
                f"| {r['ratio_to_reference']:.3f} | {r['spread']:.2%} |"
            )
    return "\n".join(lines)


def main(out_dir: str) -> int:
    if not torch.cuda.is_available():
        print("validate_timers needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    shapes = DecodeShapes.for_deployment(load_model_spec("kimi-k2.5"), tp=8)
    hidden = shapes.norm_widths["hidden"]
    eps = shapes.spec.rms_norm_eps
    results = []
    for fused in (False, True):
        case = RMSNormCase(tokens=1, width=hidden, fused_add=fused, eps=eps)
        kernel = case.kernel("torch", device)
        inputs = case.make_inputs(device, seed=0)
        results.append(validate(f"rmsnorm {case.id} (torch)", lambda k=kernel, i=inputs: k(i), device))
    cycles = spin_cycles(SPIN_US, device)
    results.append(validate(f"spin {cycles} cycles (~{SPIN_US:.0f} µs)", lambda: torch.cuda._sleep(cycles), device))
    table = markdown(results)
    print(table)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
            "telemetry": nvml_telemetry(device.index or 0)}
    (out / "timer_validation.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    (out / "timer_validation.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "."))
