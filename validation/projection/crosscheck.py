"""The projection rule checked between two GPUs that are both at hand.

Two pytest-benchmark files of the same kernel set, measured on two GPUs with the same timer,
and the two machines' target files. Each run is projected to the other GPU, per kernel and per
decode step, by the rule of :mod:`.projection_rule` with its parameters fitted on the source
GPU's results only (never on the GPU it is checked against), and beside it by the datasheet rule
of :mod:`.project` (each kernel keeps its fraction of the datasheet roofline). Printed and
written: per component the median, 90th percentile and worst error of the projected time per
call against the time measured on the other GPU (over all cases, then apart over the cases whose
profiled kernels are the same on both GPUs and those where a library such as cuBLAS launched other
ones on one of them), and per M the projected step's error::

    python validation/projection/crosscheck.py H200.json H100.json \\
        --target-a h200-x8-nvlink --target-b h100-x8-nvlink.json \\
        --batch 1,64,256 --context 1024 --out DIR

``--also-a FILE`` / ``--also-b FILE`` add results of the same GPU measured with another timer;
they join that GPU's fit, never the comparison. Each GPU's rule is the product's fit of its results
(``projection_rule.fit``, what ``python -m decodebench fit`` stores and ``--project-to`` applies), the fused
MoE's overlap share at its stated default; ``overlap.py`` sets it beside each GPU's own share.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from decodebench.attribution.options import add_prediction_options  # noqa: E402
from decodebench.attribution.predict.prediction import load_results, predict_step  # noqa: E402
from decodebench.attribution.predict.projection_rule import (  # noqa: E402
    CACHE_STATES,
    Case,
    DeviceFacts,
    DeviceModel,
    RuleParams,
    case_of,
    device_facts,
    fit,
    project_case,
)
from decodebench.attribution.predict.step import KernelResult, WhatIfError  # noqa: E402
from decodebench.attribution.predict.targets import Target, load_target  # noqa: E402
from decodebench.files import write_atomic  # noqa: E402
from decodebench.hardware import device_spec  # noqa: E402
from decodebench.model import load_model_spec  # noqa: E402
from decodebench.options import output_dir, positive_int_list  # noqa: E402
from decodebench.registry import get, projected_groups  # noqa: E402
from decodebench.results import read_file  # noqa: E402

__all__ = ["Direction", "Side", "check", "direction", "directions", "error_stats", "load_cases", "load_side", "main"]

SAME, OTHER = "all, same kernels", "all, other kernels"


@dataclass(frozen=True)
class Direction:
    """One GPU's run projected to the other: per-kernel errors and per-M step errors, both rules."""

    source: str
    target: str
    timer: str
    params: RuleParams
    kernels: dict  # rule -> group -> error stats (and "all")
    steps: list  # one dict per M: measured, projected per rule, group errors
    other_kernels: list = field(default_factory=list)  # [case, µs here, µs there] where the kernels differ


def load_cases(path: Path, backends: str = "vllm") -> tuple[list[Case], DeviceFacts]:
    """The cases of one result file whose backend starts with ``backends``, and its GPU as the machine reported it
    (L2, SMs, and the SM clock NVML read during the run); ValueError naming the file when it is not a result file,
    names no known GPU, or holds a timer whose cache state the rule does not know."""
    stored = read_file(path)
    gpu = (stored.machine.get("fingerprint") or {}).get("gpu")
    if not isinstance(gpu, dict):
        raise ValueError(f"{path}: its machine_info names no GPU (machine_info.decodebench.fingerprint.gpu)")
    facts = device_facts(str(gpu.get("name", "")), gpu)
    clocks = [r.info["sm_clock_mhz"] for r in stored.results if r.info.get("sm_clock_mhz")]  # NVML's, per run
    if clocks:
        facts = replace(facts, sm_clock_hz=statistics.median(clocks) * 1e6)
    cases = [c for c in map(case_of, stored.results) if c is not None and c.backend.startswith(backends)]
    unknown = sorted({c.timer for c in cases} - set(CACHE_STATES))
    if unknown:
        raise ValueError(f"{path}: timer(s) {', '.join(unknown)}: the rule knows the cache state of "
                         f"{', '.join(CACHE_STATES)} only")
    return cases, facts


def error_stats(errors: Sequence[float]) -> dict:
    """Median (signed), 90th percentile of the size, and the worst (signed) of relative errors.

    >>> error_stats([0.01, -0.02, 0.03, 0.10])
    {'n': 4, 'median': 0.02, 'p90': 0.1, 'worst': 0.1}
    """
    if not errors:
        return {"n": 0, "median": None, "p90": None, "worst": None}
    sizes = sorted(abs(e) for e in errors)
    p90 = sizes[min(len(sizes) - 1, max(0, -(-9 * len(sizes) // 10) - 1))]
    return {"n": len(errors), "median": round(statistics.median(errors), 6), "p90": round(p90, 6),
            "worst": round(max(errors, key=abs), 6)}


def _old_rule_us(case: Case, here: Target, there: Target) -> float:
    """The datasheet rule: the kernel keeps its fraction of the datasheet roofline (:mod:`.project`)."""
    def roof(target: Target) -> float:
        peaks = target.peaks
        return max(case.bytes / peaks.bytes_per_s, case.tensor_flops / peaks.flops_per_s if not case.dequant_weights
                   else 0.0)
    return case.median_us * roof(there) / roof(here)


def direction(src: tuple[list[Case], list[KernelResult], Target], dst: tuple[list[Case], list[KernelResult], Target],
              params_src: RuleParams, spec, batches: Sequence[int], context: int, facts_src, facts_dst) -> Direction:
    """``src``'s run projected to ``dst``'s GPU and set against ``dst``'s measured results; the rule's
    parameters are the source's (fitted on its results), the target GPU's only its facts (L2, SMs, clock)."""
    cases_src, results_src, target_src = src
    cases_dst, results_dst, target_dst = dst
    measured = {c.name: c for c in cases_dst}
    here, there = DeviceModel(facts_src, params_src), DeviceModel(facts_dst, params_src)
    shared = [c for c in cases_src if c.name in measured and c.timer == measured[c.name].timer]
    timers = sorted({c.timer for c in shared})
    projected = {"rule": {}, "datasheet": {}}
    for c in shared:
        state = CACHE_STATES[c.timer]
        projected["rule"][c.name] = project_case(c, here, there, state, state)
        projected["datasheet"][c.name] = _old_rule_us(c, target_src, target_dst)
    kernels = {rule: _kernel_errors(shared, values, measured) for rule, values in projected.items()}
    steps = [_step(results_src, results_dst, projected, spec, target_dst.tp, m, context, {c.name for c in shared})
             for m in batches]
    other = [[c.name, round(c.median_us, 3), round(measured[c.name].median_us, 3)] for c in shared
             if _kernels_differ(c, measured[c.name])]
    return Direction(facts_src.name, facts_dst.name, ",".join(timers), params_src, kernels, steps, other)


def _kernels_differ(here: Case, there: Case) -> bool | None:
    """Whether the two GPUs launched other kernels for the case; None where one side did not record them."""
    if not (here.kernel_names and there.kernel_names):
        return None
    return here.kernel_names != there.kernel_names


def _kernel_errors(shared: Sequence[Case], values: dict, measured: dict) -> dict:
    """Error stats per group and over all cases; ``all`` is also split by whether the two GPUs launched the
    same kernels (``SAME``) or a library picked other ones on one of them (``OTHER``: the cross-check then
    sets two programs against each other, not one program on two GPUs)."""
    errors: dict[str, list[float]] = {}
    for c in shared:
        e = values[c.name] / measured[c.name].median_us - 1
        errors.setdefault(get(c.component).group, []).append(e)
        errors.setdefault("all", []).append(e)
        differ = _kernels_differ(c, measured[c.name])
        if differ is not None:
            errors.setdefault(OTHER if differ else SAME, []).append(e)
    return {group: error_stats(es) for group, es in errors.items()}


def _step(results_src, results_dst, projected, spec, tp, batch, context, names) -> dict:
    """Per M: the step predicted from the measured results of the target against the same prediction
    from the source's results with every time replaced by its projection."""
    mine = [r for r in results_dst if r.name in names]
    truth = predict_step(mine, spec, tp, batch, context)
    row = {"batch": batch, "measured_us": truth.total_us, "measured_groups_us": truth.groups_us(),
           "missing": list(truth.missing)}
    for rule, values in projected.items():
        moved = [replace(r, median_s=values[r.name] * 1e-6) for r in results_src if r.name in values]
        step = predict_step(moved, spec, tp, batch, context)
        row[rule] = {"us": step.total_us, "error": step.total_us / truth.total_us - 1 if truth.total_us else None,
                     "groups_error": {g: (us / truth.groups_us()[g] - 1) for g, us in step.groups_us().items()
                                      if truth.groups_us().get(g)}}
    return row


# --- the offline command ------------------------------------------------------------------------


@dataclass(frozen=True)
class Side:
    """One GPU's run as the check reads it: its compared cases and vLLM results, its target, facts and fit."""

    cases: list
    results: list
    target: Target
    facts: object
    params: RuleParams
    model: str


def load_side(paths: Sequence[Path], target: Target, model: str | None = None,
              fit_rule: Callable[..., RuleParams] = fit) -> Side:
    """The first file's cases and results, fitted by ``fit_rule(cases, facts, fitted_on)`` on every file;
    WhatIfError where the files' TP or GPU is not the target's."""
    cases, facts = load_cases(paths[0])
    results, meta = load_results(paths[0])
    if int(meta.get("tp") or target.tp) != target.tp:
        raise WhatIfError(f"{paths[0]}: measured at TP {meta.get('tp')} shapes, target {target.id} runs TP {target.tp}")
    if device_spec(facts.name) is None or device_spec(facts.name).name != target.device.name:
        raise WhatIfError(f"{paths[0]}: measured on {facts.name}, but target {target.id} is a {target.device.name}")
    extra = [c for p in paths[1:] for c in load_cases(p)[0]]
    params = fit_rule(cases + extra, facts, f"{facts.name}: {', '.join(str(p) for p in paths)}")
    return Side(cases, [r for r in results if r.backend.startswith("vllm")], target, facts, params,
                model or meta.get("model") or "kimi-k2.5")


def directions(a: Side, b: Side, batches: Sequence[int], context: int,
               params: tuple[RuleParams, RuleParams] | None = None) -> list[Direction]:
    """``a`` projected to ``b`` and ``b`` to ``a``, each by its own fit (or by ``params``, one per side)."""
    spec = load_model_spec(a.model)
    pa, pb = params or (a.params, b.params)
    return [direction((a.cases, a.results, a.target), (b.cases, b.results, b.target), pa, spec, batches, context,
                      a.facts, b.facts),
            direction((b.cases, b.results, b.target), (a.cases, a.results, a.target), pb, spec, batches, context,
                      b.facts, a.facts)]


def check(paths_a: Sequence[Path], paths_b: Sequence[Path], target_a: Target, target_b: Target,
          batches: Sequence[int], context: int, model: str | None = None,
          fit_rule: Callable[..., RuleParams] = fit) -> tuple[list[Direction], dict]:
    """Both directions, and the fitted parameters of each side (``a-<GPU>``, ``b-<GPU>``), each side fitted by
    ``fit_rule`` on its own files; ValueError / WhatIfError naming what is wrong."""
    a, b = (load_side(paths, target, model, fit_rule) for paths, target in ((paths_a, target_a), (paths_b, target_b)))
    return directions(a, b, batches, context), {f"a-{a.facts.name}": a.params, f"b-{b.facts.name}": b.params}


def lines(directions: Sequence[Direction]) -> list[str]:
    """The cross-GPU table as text."""
    out = []
    for d in directions:
        out.append(f"{d.source} -> {d.target} (timer {d.timer}; rule fitted on {d.params.fitted_on})")
        out.append(f"  per kernel, projected / measured - 1: {'component':<18} {'n':>4}  "
                   f"{'rule: median':>12} {'p90':>7} {'worst':>7}   {'datasheet: median':>17} {'p90':>7} {'worst':>7}")
        for group in (*projected_groups(), "all", SAME, OTHER):
            new, old = d.kernels["rule"].get(group), d.kernels["datasheet"].get(group)
            if not new:
                continue
            out.append(f"  {'':<38}{group:<18} {new['n']:>4}  {_pct(new['median']):>12} {_pct(new['p90']):>7} "
                       f"{_pct(new['worst']):>7}   {_pct(old['median']):>17} {_pct(old['p90']):>7} "
                       f"{_pct(old['worst']):>7}")
        for row in d.steps:
            groups = ", ".join(f"{g} {_pct(e)}" for g, e in row["rule"]["groups_error"].items())
            out.append(f"  step M={row['batch']}: measured {row['measured_us']:.1f} µs; rule {row['rule']['us']:.1f} "
                       f"({_pct(row['rule']['error'])}); datasheet rule {row['datasheet']['us']:.1f} "
                       f"({_pct(row['datasheet']['error'])}); rule per group: {groups}")
    if directions and directions[0].other_kernels:
        d = directions[0]
        out.append(f"cases whose profiled kernels differ between the two GPUs ({len(d.other_kernels)}), "
                   f"µs on {d.source}, on {d.target}, and the ratio:")
        out += [f"  {name:<60} {here:>10.2f} {there:>10.2f} {there / here:>6.2f}"
                for name, here, there in d.other_kernels]
    return out


def _pct(value) -> str:
    return "n/a" if value is None else f"{value:+.1%}"


def _target(text: str) -> Target:
    try:
        return load_target(text)
    except WhatIfError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python validation/projection/crosscheck.py",
                                description="Project two GPUs' kernel results to each other and measure the error.")
    p.add_argument("a", type=Path, metavar="A.json", help="kernel results of GPU A (pytest-benchmark JSON)")
    p.add_argument("b", type=Path, metavar="B.json", help="the same kernel set measured on GPU B, same timer")
    p.add_argument("--target-a", required=True, type=_target, metavar="TARGET", help="GPU A's target id or file")
    p.add_argument("--target-b", required=True, type=_target, metavar="TARGET", help="GPU B's target id or file")
    p.add_argument("--also-a", type=Path, action="append", default=[], metavar="FILE",
                   help="more results of GPU A (another timer), for its fit only; repeatable. Default: none")
    p.add_argument("--also-b", type=Path, action="append", default=[], metavar="FILE",
                   help="more results of GPU B (another timer), for its fit only; repeatable. Default: none")
    p.add_argument("--batch", type=positive_int_list, default=(1, 64, 256), metavar="LIST",
                   help="decode batch sizes M of the step. Default: 1,64,256")
    add_prediction_options(p.add_argument, ("context",), {"context": (1024, "1024")})
    p.add_argument("--model", default=None, metavar="NAME|PATH",
                   help="model of the results. Default: the results' machine_info, else kimi-k2.5")
    p.add_argument("--out", type=output_dir, default=None, metavar="DIR",
                   help="write crosscheck.txt, crosscheck.json and fit-a-<GPU>.json, fit-b-<GPU>.json here. "
                   "Default: print only")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        directions, fits = check([args.a, *args.also_a], [args.b, *args.also_b], args.target_a, args.target_b,
                                 args.batch, args.context, args.model)
    except (ValueError, WhatIfError, OSError) as exc:
        print(f"{_parser().prog}: error: {exc}", file=sys.stderr)
        return 2
    text = "\n".join(lines(directions)) + "\n"
    sys.stdout.write(text)
    if args.out:
        write_atomic(args.out / "crosscheck.txt", text.encode())
        write_atomic(args.out / "crosscheck.json", json.dumps([asdict(d) for d in directions], indent=1).encode())
        for name, params in fits.items():
            fit = json.dumps(asdict(params), indent=1) + "\n"
            write_atomic(args.out / f"fit-{name.replace(' ', '-').lower()}.json", fit.encode())
        print(f"table, JSON and fits: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
