"""Measure the gate's power: false alarms on A/A and detections of injected slowdowns.

For each case of a fixed set (RMSNorm, MoE, MLA, routing; real vLLM kernels on CUDA),
checked against its reference first, it runs many comparisons. One comparison is two
independent measurements of the case, interleaved in rounds (A B B A, the A/B gate's
order), judged by the gate's own model in its paired form (``decodebench.gate.judge`` on
an A/B entry), with the error budget of a whole session of ``--session-cases`` cases
(Bonferroni: the per-case level a nightly of that size gives each case). Side B is either
the same kernel (an A/A comparison: any SLOWER is a false alarm) or the kernel followed by
a spin of 2, 5 or 10 % of the case's median (``decodebench.inject``: a SLOWER is a
detection). The comparisons of a case are shuffled across sizes, so a drift during the run
does not fall on one size.

Each comparison is judged at several gate thresholds from the same samples. The spread a
comparison leans on is its own rounds' plus that of the case's other comparisons so far (the
pooled op spread a session would lend it). It writes
``power.json`` (every comparison) and ``power.md`` (rates per size, per case) to OUTDIR
and prints progress. Every case gets an equal share of ``--deadline-s``; a case that runs
out of time stops early and says so.

Usage (repository root; ``python3`` imports the vLLM build)::

    PYTHONPATH=. python3 validation/gate_power.py OUTDIR                # H200: about 4 minutes
    PYTHONPATH=. python3 validation/gate_power.py OUTDIR --cpu-smoke    # torch backends on the CPU
    PYTHONPATH=. python3 validation/gate_power.py OUTDIR --backend torch  # CUDA box without vLLM
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import re
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from decodebench.errors import BackendUnavailable, KernelMismatch
from decodebench.gate import CaseInput, Policy, judge
from decodebench.gate.decision import per_test_alpha
from decodebench.harness import RunContext, prepare_kernel_case
from decodebench.inject import slow_down
from decodebench.model import load_model_spec
from decodebench.runner import ab
from decodebench.shapes import DecodeShapes, sweep_for
from decodebench.timing import Budget, TimerMode, measure

SIZES = (0.0, 0.02, 0.05, 0.10)
THRESHOLDS = (0.01, 0.02, 0.03, 0.05)
MIN_CASE_US = 5.0  # below this, launch jitter dominates and the case says nothing about kernels


@dataclass(frozen=True)
class PowerCase:
    """A case picked by the pattern its id must match in a factory's list."""

    name: str
    factory: str  # module:function
    pattern: str  # regular expression the case id must match in full
    backend: str


GPU_CASES = (
    PowerCase("rmsnorm-add-m256", "decodebench.kernels.rmsnorm:rmsnorm_cases", r"add-w\d+-m256", "vllm"),
    PowerCase("moe-fused-m8", "decodebench.kernels.moe:moe_cases", r"fused-.*-uniform-m8", "vllm"),
    PowerCase("moe-fused-m64", "decodebench.kernels.moe:moe_cases", r"fused-.*-uniform-m64", "vllm"),
    PowerCase("mla-b32-l8192", "decodebench.kernels.mla:mla_cases", r"uniform-h\d+-b32-l8192", "vllm-flash_attn_mla"),
    PowerCase("router-gemm-m256", "decodebench.kernels.router:router_gemm_cases", r"n\d+-k\d+-m256", "vllm"),
    PowerCase("topk-m256", "decodebench.kernels.router:topk_cases", r"e\d+-top\d+.*-m256", "vllm"),
)
CPU_CASES = (
    PowerCase("rmsnorm-add-m8", "decodebench.kernels.rmsnorm:rmsnorm_cases", r"add-w\d+-m8", "torch"),
    PowerCase("router-gemm-m8", "decodebench.kernels.router:router_gemm_cases", r"n\d+-k\d+-m8", "torch"),
    PowerCase("topk-m8", "decodebench.kernels.router:topk_cases", r"e\d+-top\d+.*-m8", "torch"),
    PowerCase("mla-b8-l256", "decodebench.kernels.mla:mla_cases", r"uniform-h\d+-b8-l256", "torch"),
)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("outdir", type=Path)
    p.add_argument("--cpu-smoke", action="store_true", help="torch backends on the CPU, tiny budgets")
    p.add_argument("--cases", type=int, default=None, help="only the first N cases of the set")
    p.add_argument("--only", default=None, help="only the cases whose name contains this (e.g. moe)")
    p.add_argument("--trials", type=int, default=20, help="comparisons per size and case (default 20)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds per side (default 2: A B B A)")
    p.add_argument("--round-ms", type=float, default=None, help="budget of one round (GPU 20, CPU 5)")
    p.add_argument("--deadline-s", type=float, default=225.0, help="time for all cases (default 225)")
    p.add_argument("--timer", default=None, help="timer mode (default: kernel on CUDA, wall on CPU)")
    p.add_argument("--backend", default=None,
                   help="run every case on this backend instead (e.g. torch on a CUDA box without vLLM)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--session-cases", type=int, default=180,
                   help="judge each comparison at the per-case error level of a session of this many cases "
                        "(default 180, the nightly vllm kernel set)")
    return p.parse_args(argv)


def find_case(spec: PowerCase, shapes: DecodeShapes, sweep):
    import importlib

    module, _, name = spec.factory.partition(":")
    cases = getattr(importlib.import_module(module), name)(shapes, sweep)
    for case in cases:
        if re.fullmatch(spec.pattern, case.id):
            return case
    raise LookupError(f"{spec.factory} has no case matching {spec.pattern!r} in this sweep")


def session(args):
    import torch

    if args.cpu_smoke:
        device, sweep = torch.device("cpu"), sweep_for("smoke")
        budget = Budget(warmup_ms=2, budget_ms=args.round_ms or 5, sample_ms=0.5, min_samples=3, max_samples=50)
        cases = CPU_CASES
    else:
        device, sweep = torch.device("cuda", torch.cuda.current_device()), sweep_for("nightly")
        # a profiler session costs ~4 ms of wall time (notes: measured.md): 8 samples of ~1 ms of
        # calls keep one comparison near 0.2 s, 480 of them well inside the 4 minutes
        budget = Budget(warmup_ms=2, budget_ms=args.round_ms or 20, sample_ms=1.0, min_samples=8, max_samples=50)
        cases = GPU_CASES
    timer = TimerMode(args.timer) if args.timer else (TimerMode.WALL if device.type == "cpu" else TimerMode.KERNEL)
    if args.backend:
        cases = tuple(dataclasses.replace(c, backend=args.backend) for c in cases)
    if args.only:
        cases = tuple(c for c in cases if args.only in c.name)
    return RunContext(device, timer, budget, None), sweep, cases[: args.cases]


def comparison(ctx: RunContext, fn_a, fn_b, rounds: int, session_cases: int, peers: list,
               budget_b: Budget) -> dict:
    """One A-vs-B comparison, judged at every threshold from the same samples. ``peers``: the
    case's earlier comparisons (their A/B entries), judged beside it as a session would;
    ``budget_b``: side B's budget (an injected spin's sample alignment)."""
    def side(fn, budget):
        return lambda: measure(fn, mode=ctx.timer, device=ctx.device, budget=budget).samples

    runs_a, runs_b = ab.interleave(side(fn_a, ctx.budget), side(fn_b, budget_b), rounds)
    entry = {"stats": {"data": [s for r in runs_b for s in r]},
             "extra_info": {"timer": ctx.timer.value, "component": "power", "backend": "x",
                            # every round its own unit: both sides run in this one process, so rounds
                            # are all that separates them (process-level spread is not measured here)
                            "ab": {"runs_a": [list(r) for r in runs_a], "runs_b": [list(r) for r in runs_b],
                                   "pairs": list(range(rounds))}}}
    verdicts = {}
    for threshold in THRESHOLDS:
        policy = Policy(threshold=threshold, resamples=0)
        cases = [CaseInput("now", entry)] + [CaseInput(f"peer{i}", e) for i, e in enumerate(peers[-20:])]
        # the per-case level of a whole session of session_cases cases, whatever the peers' count
        scaled = Policy(threshold=threshold, resamples=0,
                        confidence=1 - per_test_alpha(policy, session_cases) * len(cases))
        c = judge(cases, scaled)[0]
        verdicts[f"{threshold:g}"] = c.verdict.value
    peers.append(entry)
    return {"ratio": c.ratio, "low": c.low, "high": c.high, "verdicts": verdicts,
            "samples": [len(r) for r in runs_a + runs_b], "runs_a": entry["extra_info"]["ab"]["runs_a"],
            "runs_b": entry["extra_info"]["ab"]["runs_b"]}


def run_case(spec: PowerCase, ctx, shapes, sweep, args, deadline: float, log) -> dict:
    record = {"name": spec.name, "backend": spec.backend, "trials": []}
    case = find_case(spec, shapes, sweep)
    record.update(component=case.component, case=case.id)
    prepared = prepare_kernel_case(case, spec.backend, ctx)  # correct before timed
    base = measure(prepared.timed, mode=ctx.timer, device=ctx.device, budget=ctx.budget).median
    record["median_us"] = base * 1e6
    if ctx.device.type == "cuda" and base * 1e6 < MIN_CASE_US:
        record["note"] = f"median {base * 1e6:.2f} µs is below {MIN_CASE_US} µs"
    slowed, budgets = {0.0: prepared.timed}, {0.0: ctx.budget}
    for size in SIZES[1:]:
        slowed[size], injected = slow_down(prepared.timed, size, mode=ctx.timer, device=ctx.device, budget=ctx.budget)
        budgets[size] = injected.aligned(ctx.budget)
        record.setdefault("injected", {})[f"{size:g}"] = injected.info()
    plan = [size for size in SIZES for _ in range(args.trials)]
    random.Random(args.seed).shuffle(plan)
    peers: dict[float, list] = {size: [] for size in SIZES}  # a size's comparisons share a spread, as one op
    for index, size in enumerate(plan):
        if time.monotonic() > deadline:
            record["stopped_early"] = f"out of time after {index} of {len(plan)} comparisons"
            log(f"  {spec.name}: {record['stopped_early']}")
            break
        record["trials"].append({"size": size, **comparison(ctx, prepared.timed, slowed[size], args.rounds,
                                                            args.session_cases, peers[size], budgets[size])})
        if (index + 1) % 20 == 0:
            log(f"  {spec.name}: {index + 1}/{len(plan)} comparisons")
    return record


def rates(trials: list[dict]) -> dict:
    """``{threshold: {size: {"slower": k, "n": n}}}`` over ``trials``."""
    table: dict = {}
    for threshold in (f"{t:g}" for t in THRESHOLDS):
        for size in (f"{s:g}" for s in SIZES):
            picked = [t for t in trials if f"{t['size']:g}" == size]
            slower = sum(t["verdicts"][threshold] == "slower" for t in picked)
            table.setdefault(threshold, {})[size] = {"slower": slower, "n": len(picked)}
    return table


def markdown(report: dict) -> str:
    lines = [f"# Gate power ({report['config']['device']}, timer {report['config']['timer']})", "",
             "Rows: injected slowdown (0 = A/A: a SLOWER there is a false alarm). "
             "Cells: SLOWER verdicts / comparisons.", ""]
    cases = [c for c in report["cases"] if "trials" in c]
    for threshold, by_size in report["rates"].items():
        lines += [f"## gate threshold {float(threshold):.0%}", "",
                  "| injected | all cases | " + " | ".join(c["name"] for c in cases) + " |",
                  "|---|---|" + "---|" * len(cases)]
        for size, cell in by_size.items():
            per_case = [c["rates"][threshold][size] for c in cases]
            row = [f"{cell['slower']}/{cell['n']}"] + [f"{p['slower']}/{p['n']}" for p in per_case]
            lines.append(f"| {float(size):.0%} | " + " | ".join(row) + " |")
        lines.append("")
    lines += ["## cases", "", "| case | id | median µs | note |", "|---|---|---|---|"]
    for c in report["cases"]:
        median = f"{c['median_us']:.2f}" if "median_us" in c else "-"
        note = c.get("skipped") or c.get("note") or c.get("stopped_early") or ""
        lines.append(f"| {c['name']} | {c.get('case', '-')} | {median} | {note} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    args.outdir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()

    def log(message: str) -> None:
        print(f"[{time.monotonic() - start:6.1f} s] {message}", flush=True)

    ctx, sweep, specs = session(args)
    shapes = DecodeShapes.for_deployment(load_model_spec("kimi-k2.5"), 8)
    records = []
    for position, spec in enumerate(specs):
        share = (args.deadline_s - (time.monotonic() - start)) / (len(specs) - position)
        log(f"{spec.name} ({spec.backend}): up to {share:.0f} s")
        try:
            record = run_case(spec, ctx, shapes, sweep, args, time.monotonic() + share, log)
            record["rates"] = rates(record["trials"])
        except (BackendUnavailable, KernelMismatch, LookupError) as exc:
            record = {"name": spec.name, "backend": spec.backend, "skipped": f"{type(exc).__name__}: {exc}"}
        except Exception:  # one failing case must not cost the others their figures
            record = {"name": spec.name, "backend": spec.backend, "skipped": traceback.format_exc(limit=3)}
        if "skipped" in record:
            log(f"  {spec.name} skipped: {record['skipped']}")
        records.append(record)
        report = write_report(args, ctx, records, time.monotonic() - start)  # after every case: a kill keeps these
    log(f"wrote {args.outdir / 'power.json'} and power.md")
    print(markdown(report))
    return 0


def write_report(args, ctx: RunContext, records: list[dict], wall_s: float) -> dict:
    trials = [t for r in records for t in r.get("trials", [])]
    config = {"device": str(ctx.device), "timer": ctx.timer.value, "budget": dataclasses.asdict(ctx.budget),
              "rounds": args.rounds, "trials": args.trials, "sizes": SIZES, "thresholds": THRESHOLDS,
              "verdict": "decodebench.gate.judge (paired)", "session_cases": args.session_cases,
              "wall_s": wall_s}
    report = {"config": config, "rates": rates(trials), "cases": records}
    _write(args.outdir / "power.json", json.dumps(report, indent=1))
    _write(args.outdir / "power.md", markdown(report))
    return report


def _write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)  # atomic: a reader never sees half a file


if __name__ == "__main__":
    sys.exit(main())
