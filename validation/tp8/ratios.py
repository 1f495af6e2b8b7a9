"""The step timer against the kernel timer, case by case: the median ratio per component.

    python validation/tp8/ratios.py validation/tp8/h100-2026-12-05

reads step.json.gz and kernel.json.gz of the folder (the same kernel set, one machine) and prints, per
component, the cases both hold and the median, lowest and highest step/kernel ratio of their medians.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from decodebench.files import read_json


def ratios(folder: Path) -> dict[str, list[float]]:
    step, kernel = (read_json(folder / f"{t}.json.gz")["benchmarks"] for t in ("step", "kernel"))
    medians = {b["name"]: b["stats"]["median"] for b in kernel}
    out: dict[str, list[float]] = {}
    for b in step:
        if b["name"] in medians:
            out.setdefault(b["extra_info"]["component"], []).append(b["stats"]["median"] / medians[b["name"]])
    return out


if __name__ == "__main__":
    print("| component | cases | step / kernel, median | lowest | highest |\n|---|---|---|---|---|")
    for component, values in sorted(ratios(Path(sys.argv[1])).items()):
        print(
            f"| {component} | {len(values)} | {statistics.median(values):.2f} | {min(values):.2f} | {max(values):.2f} |"
        )
