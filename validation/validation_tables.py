#!/usr/bin/env python3
"""Tables of validation/reports/kernels-h200.md and timers-h200.md regenerated from the committed H200 results
(no GPU needed).

    python validation/validation_tables.py

prints, from ``baselines/nvidia-h200-x1-…/``: the MLA decode medians per backend (``0004``, every
MLA backend vLLM has), the fused add + RMSNorm at width 7168 and M = 256 in each vLLM session, and
the ``vllm`` rows that moved by more than 5 % from ``0002`` to ``0003``, and
the timer-validation drift between the two leases (``validation/h200/timer-validation*.json``). Each
figure is pytest-benchmark's ``stats.median`` (or the validation script's median of run medians).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
H200 = REPO / "baselines" / "nvidia-h200-x1-single-cc90-drv580.159.04-cuda13.0-torch2.11.0-cu130"
MLA_BACKENDS = (("vllm-flash_attn_mla", "FlashAttention MLA (dispatched)"), ("vllm-flashmla", "FlashMLA"),
                ("vllm-triton_mla", "Triton MLA"), ("torch", "torch reference path"))
MLA_SHAPES = (("b1", "l1024", "b1 × 1K"), ("b64", "l1024", "b64 × 1K"), ("b64", "l8192", "b64 × 8K"))


def _medians(path: Path) -> dict[str, float]:
    return {b["name"]: b["stats"]["median"] for b in json.loads(path.read_text())["benchmarks"]}


def _us(seconds: float) -> str:
    us = seconds * 1e6
    return f"{us:.3g} µs" if us < 1000 else f"{us:.0f} µs"


def mla_table() -> list[str]:
    medians = _medians(H200 / "0004_h200-vllm-mla-all-backends.json")
    lines = ["| shape (batch × context) | " + " | ".join(label for _, label in MLA_BACKENDS) + " |",
             "|---" * (len(MLA_BACKENDS) + 1) + "|"]
    for batch, context, label in MLA_SHAPES:
        cells = [_us(medians[f"test_mla_decode[uniform-h8-{batch}-{context}-{backend}]"])
                 for backend, _ in MLA_BACKENDS]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def fused_add_m256() -> list[str]:
    name = "test_rmsnorm[add-w7168-m256-vllm]"
    out = []
    for path in sorted(H200.glob("000[2-5]_*.json")):
        medians = _medians(path)
        if name in medians:
            out.append(f"{path.name[:4]}: {medians[name] * 1e6:.2f} µs")
    return ["fused add + RMSNorm w7168 M=256 (vllm), median: " + ", ".join(out)]


def timer_drift() -> list[str]:
    first, second = (
        json.loads((REPO / "validation" / "h200" / f"timer-validation{s}.json").read_text()) for s in ("", "-2")
    )
    changes: dict[str, list[float]] = {}
    for case, modes in _timer_medians(first).items():
        for mode, value in modes.items():
            later = _timer_medians(second).get(case, {}).get(mode)
            if later:
                changes.setdefault(mode, []).append(later / value - 1)
    return [f"timer {mode}: second lease against the first, {min(c):+.1%} to {max(c):+.1%} over {len(c)} cases"
            for mode, c in changes.items()]


def moved_between_sweeps(limit: float = 0.05) -> list[str]:
    """The ``vllm`` rows of ``0002`` whose median moved by more than ``limit`` in ``0003``, both ways."""
    then = _medians(H200 / "0002_h200-vllm-nightly.json")
    now = _medians(H200 / "0003_h200-vllm-nightly-aa.json")
    moved = sorted(((now[n] / then[n] - 1, n) for n in then if n in now and n.endswith("-vllm]")),
                   key=lambda c: -abs(c[0]))
    big = [f"{n}: {change:+.1%}" for change, n in moved if abs(change) > limit]
    return [f"0002 -> 0003, {len(moved)} vllm rows, {len(big)} moved by more than {limit:.0%} (median):", *big]


def _timer_medians(document) -> dict[str, dict[str, float]]:
    """case -> timer mode -> median of the three run medians, from validation/validate_timers.py's JSON."""
    return {row["case"]: {mode: m["median_s"] for mode, m in row["modes"].items()} for row in document["results"]}


def main() -> int:
    for block in (mla_table(), fused_add_m256(), moved_between_sweeps(), timer_drift()):
        print("\n".join(block), end="\n\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
