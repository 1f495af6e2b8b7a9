"""What the benchmarks cover of a served decode step, and what ``copies_casts`` and ``other`` hold.

Reads the traces of a ``run.sh serve`` part (one rank of TP 8, ``--server-routing uniform``) and,
per load, splits every decode step's busy time as the breakdown does (the rules of
decodebench/kernel_rules.py, overlaps shared), with one difference: the kernels of the routing
simulator are named apart. They are the kernels that stand in for the top-k (the plugin's
``decodebench_uniform`` strategy: ``torch.rand``, its ``argsort``, the weights' ``torch.full``, the
ids' cast), launched between the simulator's ``torch.rand`` and the next ``moe_align_block_size``
on the step's stream; the shared expert runs beside them on its own stream, and none of its
kernels is a copy. Prints, per load, each kernel of ``copies_casts`` and ``other`` with its µs
per step and share of busy, then the coverage: the benchmarked components' share (every part a
registered component owns) of the busy time without the simulator's kernels, and the same
without the KV-cache write, the rotary embedding and the MoE layer's buffers, which had no benchmark
before this figure was first made.

Generic Inductor kernels (``triton_red_fused_3``: a combo kernel, whose name carries no op) fall
under ``other`` in the rules, since the same name is another kernel in another compile. Where the
run's generated code (``inductor-code.tgz``) shows what one is, ``--from-code NAME=GROUP`` counts it
in that group for a third figure, read by hand from that run's code and said in its README.

Usage: python validation/tp8/coverage.py TRACES_DIR [--from-code NAME=GROUP ...]
       (TRACES_DIR: the folder traces.tgz unpacks to)
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from decodebench import registry
from decodebench.attribution.breakdown.components import attribute, complete_steps, previous_names
from decodebench.attribution.breakdown.trace import Kernel, load_trace
from decodebench.kernel_rules import Component, classify

SIMULATOR_START = re.compile(r"distribution_elementwise_grid_stride_kernel<float, 4, .*uniform")
SIMULATOR_END = re.compile(r"moe_align_block_size")
ADDED = ("kv_cache_write", "rotary", "moe_buffers")  # the parts of the components first benchmarked this wave
SHOWN = {Component.COPIES.value, Component.OTHER.value}


def tag_simulator(kernels: list[Kernel]) -> list[Kernel]:
    """The step's kernels in launch order, the simulator's renamed ``[simulator] <name>`` and a kernel whose
    part the rules place by the kernel launched before it ``[<part>] <name>``."""
    out, inside = [], False
    ordered = sorted(kernels, key=lambda k: k.launch_us)
    for kernel, previous in zip(ordered, previous_names(ordered), strict=True):
        if SIMULATOR_START.search(kernel.name):
            inside = True
        elif SIMULATOR_END.search(kernel.name):
            inside = False
        placed = classify(kernel.name, previous) or Component.OTHER.value
        tag = ("simulator" if inside and placed in SHOWN else
               placed if placed != (classify(kernel.name) or Component.OTHER.value) else None)
        out.append(Kernel(f"[{tag}] {kernel.name}", kernel.start_us, kernel.dur_us, kernel.launch_us)
                   if tag else kernel)
    return out


def benchmarked_parts() -> set[str]:
    """Every part of the step a registered component owns."""
    return {part for spec in registry.registered() for part in spec.parts}


def group_of(name: str, from_code: dict[str, str] | None = None) -> str:
    """The group a tag names (``simulator``, or a part placed by position), else the part of the step the
    rules give the name (``other`` where none matches), or, with ``from_code``, the group the run's
    generated code shows for a generic name."""
    if name.startswith("["):
        return name[1:name.index("] ")]
    return (from_code or {}).get(name) or classify(name) or Component.OTHER.value


def load_steps(path: Path) -> list[dict[str, float]]:
    """µs per kernel name (simulator tagged) of each decode step of one trace."""
    steps = []
    for mark, kernels, end_us in complete_steps(load_trace(path)):
        if not mark.is_decode:
            continue
        clipped = [Kernel(k.name, k.start_us, min(k.end_us, end_us) - k.start_us, k.launch_us)
                   for k in kernels if k.start_us < end_us]
        steps.append(attribute(tag_simulator(clipped), lambda *_: Component.OTHER)[2])
    return steps


def mean_by_name(steps: list[dict[str, float]]) -> dict[str, float]:
    totals: dict[str, float] = defaultdict(float)
    for step in steps:
        for name, us in step.items():
            totals[name] += us / len(steps)
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


def report(load: str, steps: list[dict[str, float]], from_code: dict[str, str]) -> dict:
    by_name = mean_by_name(steps)
    busy = statistics.fmean(sum(step.values()) for step in steps)
    groups: dict[str, float] = defaultdict(float)
    for name, us in by_name.items():
        groups[group_of(name)] += us
    simulator = groups["simulator"]
    served = busy - simulator
    benchmarked = benchmarked_parts()
    covered = sum(groups[part] for part in benchmarked)
    before = covered - sum(groups[part] for part in ADDED)
    read = sum(us for name, us in by_name.items() if group_of(name, from_code) in benchmarked
               and group_of(name) not in benchmarked)
    print(f"\n{load}: {len(steps)} decode steps, busy {busy:.1f} µs a step, routing simulator {simulator:.1f} µs "
          f"({simulator / busy:.1%} of busy)")
    print(f"  {'µs/step':>8} {'% busy':>7}  {'group':15} kernel")
    for name, us in by_name.items():
        group = group_of(name)
        if group in SHOWN | {"simulator", *ADDED} and us / busy >= 0.002:
            print(f"  {us:8.1f} {us / busy:7.2%}  {group:15} {name[:110]}")
    print(f"  benchmarked share of busy without the simulator ({served:.1f} µs): {before / served:.1%} without the "
          f"KV-cache write, the rotary embedding and the MoE buffers, {covered / served:.1%} with them")
    if from_code:
        print(f"  with {', '.join(f'{n} as {g}' for n, g in from_code.items())} (read from the generated code): "
              f"{(covered + read) / served:.1%}")
    return {"busy_us": busy, "simulator_us": simulator, "groups_us": dict(groups),
            "covered_before": before / served, "covered": covered / served,
            "covered_from_code": (covered + read) / served}


def from_code_pair(text: str) -> tuple[str, str]:
    name, sep, group = text.partition("=")
    parts = benchmarked_parts()
    if not sep or group not in parts:
        raise argparse.ArgumentTypeError(f"{text!r}: give NAME=GROUP, GROUP one of {', '.join(sorted(parts))}")
    return name, group


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("traces", type=Path)
    parser.add_argument("--from-code", type=from_code_pair, action="append", default=[], metavar="NAME=GROUP")
    args = parser.parse_args(argv)
    windows = json.loads((args.traces / "decodebench-windows.json").read_text())
    for load, window in windows.items():
        steps = [s for trace in window["traces"] for s in load_steps(args.traces / trace)]
        report(load, steps, dict(args.from_code))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
