"""What a change would buy, and the step on another box: the prediction asked questions.

:func:`answer` takes one load's prediction (and the profile of its step, where there is one)
and gives, as a JSON-able dict: the predicted kernel time per step today and under each
what-if (:mod:`.whatif`), per group and in total, with the step and the TPOT moved by the
same change; Amdahl's bounds per group (the step with that group at zero and at its
roofline); and the step projected to each target (:mod:`.project`), with every assumption
beside the figure it produced. :func:`answer_lines` prints it. The live session
(``--what-if``, ``--project-to`` with ``--breakdown``) and the offline command below call
the same two functions::

    python -m decodebench scenarios baselines/nvidia-h200-*/000[24]_*.json \\
        --model kimi-k2.5 --tp 8 --batch 1,64,256 --context 1024 --project-to rtx-pro-6000-x8-pcie --out DIR
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

from ...errors import ShapeError
from ...model import ModelSpec
from ...registry import group_components, group_parts
from ...serving.spec import SpecMethod
from ...shapes import DecodeShapes
from ..depth import weight_bytes_per_rank
from .ep import EPMode, apply_expert_parallel, ep_facts, ep_plan, project_comm
from .prediction import load_results, step_of
from .project import ALLREDUCE, Projection, project
from .speculative import SpecWhatIf, projected, spec_lines, spec_scenario, verification_step
from .step import KernelResult, Prediction, Step, WhatIfError
from .targets import Target
from .whatif import ChangeKind, WhatIf, amdahl, apply_what_if

__all__ = ["Profiled", "answer", "answer_lines", "check_what_ifs", "ep_table_lines"]

WHAT_IF_MOVES = ("a what-if moves the step and the TPOT by its change of predicted kernel time: GPU idle and the "
                 "kernels no benchmark covers stay as profiled")


@dataclass(frozen=True)
class Profiled:
    """What the profile of the step measured (None where there was no profile)."""

    step_us: float | None = None
    tpot_us: float | None = None
    idle_us: float | None = None
    not_benchmarked_us: float | None = None  # profiled kernels of the components no benchmark covers

    @classmethod
    def from_attribution(cls, info: dict) -> Profiled:
        """From the attribution dict of one load (:func:`.report.summarize`).

        >>> Profiled.from_attribution({"step_wall_us": 10.0, "idle_us": 4.0, "tpot_us": None,
        ...     "prediction": {"not_benchmarked_us": {"sampling": 1.0}}}).not_benchmarked_us
        1.0
        """
        other = (info.get("prediction") or {}).get("not_benchmarked_us")
        return cls(info.get("step_wall_us"), info.get("tpot_us"), info.get("idle_us"),
                   sum(other.values()) if other is not None else None)


def check_what_ifs(what_ifs: Sequence[WhatIf], results: Sequence[KernelResult], spec: ModelSpec | None = None) -> None:
    """Fail early, naming the value, on a backend what-if that no result of ``results`` (or of its
    ``@FILE``) can answer, and (given the model ``spec``) on an expert-parallel size the model cannot be
    split into: more ranks than routed experts, or attention heads that do not divide among them.

    >>> from decodebench.attribution.predict.whatif import parse_what_if
    >>> check_what_ifs([parse_what_if("moe=mine")], [KernelResult("m", "moe", "vllm", {}, 1e-6)])
    Traceback (most recent call last):
    ...
    decodebench.attribution.predict.step.WhatIfError: --what-if moe=mine: no moe results of backend 'mine' (have: vllm)
    """
    for what_if in what_ifs:
        for change in getattr(what_if, "changes", ()):  # a SpecWhatIf names no backend
            if change.kind is ChangeKind.EXPERT_PARALLEL:
                ep_plan(change.label, change.ep, EPMode(change.ep_mode), results, Step("check", 1, 1, ()), 1)
                if spec is not None and change.ep is not None:
                    _check_ep_size(change.label, change.ep, spec)
            if change.kind is not ChangeKind.BACKEND:
                continue
            try:
                pool = load_results(change.source)[0] if change.source else results
            except ValueError as exc:
                raise WhatIfError(f"--what-if {change.label}: {exc}") from None
            wanted = group_components()[change.group]
            if not any(r.backend == change.backend and r.component in wanted for r in pool):
                have = sorted({r.backend for r in pool if r.component in wanted})
                raise WhatIfError(f"--what-if {change.label}: no {change.group} results of backend "
                                  f"{change.backend!r} (have: {', '.join(have) or 'none'})")


def _check_ep_size(label: str, ep: int, spec: ModelSpec) -> None:
    """An EP-``ep`` step holds ``experts / ep`` whole experts a rank and runs TP-``ep`` attention."""
    if ep > spec.num_experts:
        raise WhatIfError(f"--what-if {label}: EP {ep} is more ranks than {spec.name}'s {spec.num_experts} routed "
                          "experts")
    try:
        DecodeShapes.for_deployment(spec, ep)
    except (ShapeError, ValueError) as exc:
        raise WhatIfError(f"--what-if {label}: EP {ep} runs TP-{ep} attention, which {spec.name} cannot: "
                          f"{exc}") from None


def answer(prediction: Prediction, results: Sequence[KernelResult], spec: ModelSpec, tp: int, *,
           what_ifs: Sequence[WhatIf | SpecWhatIf] = (), targets: Sequence[Target] = (),
           profiled: Profiled | None = None, routing: str | None = "uniform") -> dict:
    """Today, each what-if and each projection of one load's predicted step, as a JSON-able dict.

    A speculative-decoding what-if (:class:`~.speculative.SpecWhatIf`, ``spec=ngram:4:0.6``) goes to
    ``spec`` (and each projection's ``spec``): the TPOT with K drafts at that acceptance and the
    acceptance above which it wins (:mod:`.speculative`); ``routing`` is the server's, for its
    verification step's MoE.

    >>> from decodebench.attribution.predict.prediction import predict_step
    >>> from decodebench.attribution.predict.whatif import parse_what_if
    >>> from decodebench.model import load_model_spec
    >>> r = KernelResult("norm", "rmsnorm", "vllm", {"tokens": 1, "role": "hidden", "fused_add": True}, 2e-6,
    ...                  {"frac_peak_bw": 0.5})
    >>> spec = load_model_spec("tiny-kimi")
    >>> info = answer(predict_step([r], spec, 1, 1, 64), [r], spec, 1, what_ifs=[parse_what_if("rmsnorm=0.5x")],
    ...               profiled=Profiled(step_us=100.0, tpot_us=90.0, idle_us=80.0, not_benchmarked_us=12.0))
    >>> info["today"]["kernel_us"], info["what_if"][0]["kernel_us"], info["what_if"][0]["tpot_us"]
    (8.0, 4.0, 86.0)
    """
    profiled = profiled or Profiled()
    specs = [w for w in what_ifs if isinstance(w, SpecWhatIf)]
    what_ifs = [w for w in what_ifs if not isinstance(w, SpecWhatIf)]
    what_ifs = [_with_ep_size(w, results, tp) for w in what_ifs]
    today = step_of(prediction, results)
    out = {"batch": prediction.batch, "context": prediction.context, "missing": list(prediction.missing),
           "profile": asdict(profiled), "today": _scenario(today, today, profiled)}
    out["what_if"] = [_scenario(apply_what_if(today, w, results), today, profiled) for w in what_ifs]
    for w, info in zip(what_ifs, out["what_if"], strict=True):
        for change in (c for c in getattr(w, "changes", ()) if c.kind is ChangeKind.EXPERT_PARALLEL):
            info["assumptions"].append(ep_facts(spec, change.ep, weight_bytes_per_rank(spec, change.ep), None, ""))
            info["expert_parallel"] = True
            info["ep_missing"] = any(a.startswith("MISSING") for a in info["assumptions"])
    out["spec"] = [spec_scenario(w, today, results, spec, tp, routing=routing, tpot_us=profiled.tpot_us)
                   for w in specs]
    out["projections"] = [_projection(today, spec, tp, t, results, what_ifs, profiled) for t in targets]
    for projection, target in zip(out["projections"], targets, strict=True):
        projection["spec"] = [_projected_spec(row, spec, tp, target, results, projection, routing)
                              for row in out["spec"]]
    return out


def _projected_spec(row: dict, spec: ModelSpec, tp: int, target: Target, results: Sequence[KernelResult],
                    projection: dict, routing: str | None) -> dict:
    """A spec what-if on the target: the verification step projected as today's is; the draft scaled with
    the step where it is GPU work (MTP and EAGLE layers) and carried as it is where it is host time
    (ngram's lookup: the kernels' ratio says nothing of the target's host); the profile's carried time
    as the projection carries it (none without a profile)."""
    verify = verification_step(results, spec, tp, row["requests"], row["context"], row["k"], routing)
    there = project(verify, spec, tp, target, results).step
    ratio = projection["kernel_us"] / row["today_kernel_us"] if row["today_kernel_us"] else 1.0
    if SpecMethod(row["method"]).prompt_lookup:
        ratio = 1.0
    carried = (projection["step_us"] - projection["kernel_us"]) if projection["step_us"] is not None else 0.0
    return projected(row, there, row["draft_us"] * ratio, projection["kernel_us"], carried)


def _with_ep_size(what_if: WhatIf, results: Sequence[KernelResult], tp: int) -> WhatIf:
    """``what_if`` with every EP change's size named: the results' own EP size, else the TP size."""
    changes = []
    for c in what_if.changes:
        if c.kind is ChangeKind.EXPERT_PARALLEL and c.ep is None:
            c = replace(c, ep=ep_plan(c.label, None, EPMode(c.ep_mode), results, Step("size", 1, 1, ()), tp).ep)
        changes.append(c)
    return WhatIf(tuple(changes))


def _scenario(step: Step, today: Step, profiled: Profiled) -> dict:
    change = step.total_us - today.total_us
    moved = lambda value: None if value is None else value + change  # noqa: E731
    info = {"label": step.label, "kernel_us": step.total_us, "groups_us": step.groups_us(), "change_us": change,
            "step_us": moved(profiled.step_us), "tpot_us": moved(profiled.tpot_us),
            "assumptions": list(step.assumptions) + ([WHAT_IF_MOVES] if step is not today else []),
            "parts": [p.to_info() for p in step.parts]}
    info["amdahl"] = _bounds(step, profiled.step_us if step is today else moved(profiled.step_us))
    return info


def _bounds(step: Step, step_us: float | None) -> dict:
    """Amdahl per group, in kernel time and (with a profile) in step time."""
    out = {}
    for group, b in amdahl(step).items():
        row = dict(b)
        if step_us is not None:
            row["step_zero_us"] = step_us - b["group_us"]
            row["step_roofline_us"] = None if b["roofline_us"] is None else step_us - step.total_us + b["roofline_us"]
        out[group] = row
    return out


def _projection(today: Step, spec: ModelSpec, tp: int, target: Target, results: Sequence[KernelResult],
                what_ifs: Sequence[WhatIf], profiled: Profiled) -> dict:
    there = project(today, spec, tp, target, results)
    carried = [("gpu_idle", profiled.idle_us, "GPU idle carried over from the profile of this machine's step "
                                              "(an assumption: launch gaps and host work as here)"),
               ("not_benchmarked", profiled.not_benchmarked_us,
                "kernels no benchmark covers, carried over unscaled from the profile (an assumption)")]
    extra = sum(us for _, us, _ in carried if us is not None)
    known = all(us is not None for _, us, _ in carried)
    step_us = there.step.total_us + extra if known else None
    info = _projection_figures(there, step_us)
    info.update(carried={name: {"us": us, "how": how} for name, us, how in carried if us is not None},
                step_us=step_us, step_how="predicted kernels + GPU idle + kernels no benchmark covers" if known
                else "not known: no profile of the step (GPU idle and unbenchmarked kernels unknown)",
                amdahl=_bounds(there.step, step_us))
    info["what_if"] = [_projected_what_if(today, there, w, spec, tp, target, results, extra if known else None)
                       for w in what_ifs]
    return info


def _projection_figures(there: Projection, step_us: float | None) -> dict:
    step, target = there.step, there.target
    groups = step.groups_us()
    base = step_us or step.total_us
    return {"target": target.id, "name": target.name, "device": target.device.name, "gpus": target.gpus,
            "tp": target.tp, "kernel_us": step.total_us, "groups_us": groups, "groups_how": there.groups_how,
            "rule": there.rule.value, "bracket": there.bracket,
            "low_groups_us": there.low_us, "high_groups_us": there.high_us,
            "low_kernel_us": there.low_total_us, "high_kernel_us": there.high_total_us,
            "shares": {g: us / base if base else 0.0 for g, us in groups.items()},
            "share_of": "step" if step_us else "predicted kernels",
            "allreduce_share": groups.get(ALLREDUCE, 0.0) / base if base else 0.0,
            "allreduce_share_range": (_share(groups.get(ALLREDUCE, 0.0), there.high_total_us + base - step.total_us),
                                      _share(groups.get(ALLREDUCE, 0.0), there.low_total_us + base - step.total_us)),
            "assumptions": list(step.assumptions), "parts": [p.to_info() for p in step.parts]}


def _share(us: float, of: float) -> float:
    return us / of if of else 0.0


def _projected_what_if(today: Step, there: Projection, what_if: WhatIf, spec, tp, target, results,
                       extra: float | None) -> dict:
    """A what-if on the target: backend swaps (and EP's MoE at EP shapes) before the projection, EP's
    dispatch and combine on the target's link, factors and rooflines after it."""
    swaps = tuple(c for c in what_if.changes if c.kind is ChangeKind.BACKEND)
    eps = tuple(c for c in what_if.changes if c.kind is ChangeKind.EXPERT_PARALLEL)
    rest = tuple(c for c in what_if.changes if c.kind not in (ChangeKind.BACKEND, ChangeKind.EXPERT_PARALLEL))
    before = apply_what_if(today, WhatIf(swaps), results) if swaps else today
    plans = [ep_plan(c.label, c.ep, EPMode(c.ep_mode), results, today, target.tp) for c in eps]
    for plan in plans:
        before = apply_expert_parallel(before, plan.label, plan.ep, plan.mode, results, comm=False,
                                       default_ep=target.tp)
    step = project(before, spec, tp, target, results).step if swaps or eps else there.step
    for plan in plans:
        step = project_comm(step, plan, target, spec, results)
        step = step.with_parts(step.parts, step.label, [ep_facts(spec, plan.ep, weight_bytes_per_rank(spec, plan.ep),
                                                                 target.memory_bytes, f"a {target.device.name}")])
    if rest:
        step = apply_what_if(step, WhatIf(rest), results)
    change = step.total_us - there.step.total_us
    info = {"label": what_if.label, "kernel_us": step.total_us, "groups_us": step.groups_us(), "change_us": change,
            "step_us": None if extra is None else step.total_us + extra}
    if eps:  # what EP assumes is stated beside its figure
        info.update(assumptions=[a for a in step.assumptions if a not in there.step.assumptions],
                    parts=[p.to_info() for p in step.parts], expert_parallel=True,
                    ep_missing=any(a.startswith("MISSING") for a in step.assumptions))
    return info


# --- text ------------------------------------------------------------------------------------


def answer_lines(label: str, info: dict) -> list[str]:
    """The answer of one load as text: today and the what-ifs side by side, Amdahl, the projections.

    >>> from decodebench.attribution.predict.prediction import predict_step
    >>> from decodebench.attribution.predict.whatif import parse_what_if
    >>> from decodebench.model import load_model_spec
    >>> r = KernelResult("norm", "rmsnorm", "vllm", {"tokens": 1, "role": "hidden", "fused_add": True}, 2e-6,
    ...                  {"frac_peak_bw": 0.5})
    >>> spec = load_model_spec("tiny-kimi")
    >>> lines = answer_lines("c1", answer(predict_step([r], spec, 1, 1, 64), [r], spec, 1,
    ...                                   what_ifs=[parse_what_if("rmsnorm=0.5x")]))
    >>> print(lines[2])
    rmsnorm                        8.0           4.0
    """
    columns = [info["today"], *info["what_if"]]
    width = max(12, *(len(c["label"]) + 2 for c in columns))
    lines = [f"{label} (M={info['batch']}, L={info['context']}): what a change would buy, µs per step",
             f"{'':<20}" + "".join(f"{c['label']:>{width}}" for c in columns)]
    for group in group_parts():
        if any(c["groups_us"].get(group) for c in columns):
            lines.append(f"{group:<20}" + "".join(f"{c['groups_us'].get(group, 0.0):>{width}.1f}" for c in columns))
    lines.append(f"{'predicted kernels':<20}" + "".join(
        f"{_with_change(c['kernel_us'], c['change_us'], c is info['today']):>{width}}" for c in columns))
    for key, name in (("step_us", "step (profiled)"), ("tpot_us", "TPOT (measured)")):
        if info["today"][key] is not None:
            lines.append(f"{name:<20}" + "".join(f"{c[key]:>{width}.1f}" for c in columns))
    notes = dict.fromkeys(a for c in columns for a in c["assumptions"])
    lines += [f"  {note}" for note in notes]
    lines += [f"  not predicted: {why}" for why in info.get("missing", [])]
    lines += _versus_lines(info["today"], [w for w in info["what_if"] if w.get("expert_parallel")], "here", "  ")
    lines += _amdahl_lines(info["today"]["amdahl"], info["today"]["step_us"], "  ")
    lines += spec_lines(f"{label} (M={info['batch']}, L={info['context']})", info.get("spec", []))
    for projection in info["projections"]:
        lines += _projection_lines(projection, info)
        lines += spec_lines(f"  on {projection['target']}", projection.get("spec", []))
    return lines


def decides(before: dict, after: dict) -> tuple[str, float]:
    """The group whose change moves the step most between two scenarios, and that change in µs.

    >>> decides({"groups_us": {"moe": 10.0, "allreduce": 5.0}}, {"groups_us": {"moe": 14.0, "allreduce": 4.0}})
    ('moe', 4.0)
    """
    groups = set(before["groups_us"]) | set(after["groups_us"])
    deltas = {g: after["groups_us"].get(g, 0.0) - before["groups_us"].get(g, 0.0) for g in groups}
    group = max(sorted(deltas), key=lambda g: abs(deltas[g]))
    if abs(deltas[group]) < 0.05:  # below the table's resolution: no term moves
        return "nothing", 0.0
    return group, deltas[group]


def _versus_lines(tp: dict, eps: list[dict], where: str, indent: str) -> list[str]:
    """One line per EP what-if: its predicted kernels against TP's, and which term decides."""
    lines = []
    for ep in eps:
        group, delta = decides(tp, ep)
        change = ep["kernel_us"] - tp["kernel_us"]
        verdict = "EP faster" if change < 0 else "TP faster" if change > 0 else "the same"
        lines.append(f"{indent}{ep['label']} vs TP ({where}): predicted kernels {tp['kernel_us']:.1f} -> "
                     f"{ep['kernel_us']:.1f} ({change:+.1f} µs, {verdict}); decided by {group} ({delta:+.1f} µs)"
                     + ("; MISSING: the MoE at EP shapes (no EP results)" if ep.get("ep_missing") else ""))
    return lines


def _with_change(value: float, change: float, today: bool) -> str:
    return f"{value:.1f}" if today else f"{value:.1f} ({change:+.1f})"


def _amdahl_lines(bounds: dict, step_us: float | None, indent: str) -> list[str]:
    what = "step" if step_us is not None else "predicted kernels"
    total = step_us if step_us is not None else None
    lines = [f"{indent}the most one component can give (Amdahl): {what} with it at zero / at its roofline"]
    for group, b in bounds.items():
        zero, roof = (b.get("step_zero_us"), b.get("step_roofline_us")) if total is not None else \
            (b["zero_us"], b["roofline_us"])
        base = total if total is not None else b["zero_us"] + b["group_us"]
        roof_text = f"{roof:.1f} ({roof / base - 1:+.1%})" if roof is not None else \
            "n/a (its results carry no bytes/FLOPs)"
        lines.append(f"{indent}  {group:<16}{zero:>10.1f} ({zero / base - 1:+.1%}) / {roof_text}")
    return lines


def _projection_lines(p: dict, info: dict) -> list[str]:
    lines = [f"projected to {p['target']}: {p['name']} (M={info['batch']}, L={info['context']}), µs per step, "
             f"share of the {p['share_of']}; rule: {p['rule']}, [bracket: {p['bracket']}]"]
    for group, us in p["groups_us"].items():
        if us:
            lines.append(f"  {group:<18}{us:>10.1f} {p['shares'][group]:>6.1%}  {p['groups_how'].get(group, '')}"
                         f"  [{p['low_groups_us'].get(group, us):.1f} .. {p['high_groups_us'].get(group, us):.1f}]")
    lines.append(f"  {'predicted kernels':<18}{p['kernel_us']:>10.1f}          "
                 f"[{p['low_kernel_us']:.1f} .. {p['high_kernel_us']:.1f}]")
    for name, row in p["carried"].items():
        lines.append(f"  {name:<18}{row['us']:>10.1f}          {row['how']}")
    step = f"{p['step_us']:>10.1f}" if p["step_us"] is not None else f"{'n/a':>10}"
    lines.append(f"  {'step':<18}{step}          {p['step_how']}")
    low_share, high_share = p["allreduce_share_range"]
    lines.append(f"  all-reduce: {p['allreduce_share']:.1%} of the {p['share_of']} "
                 f"[{low_share:.1%} .. {high_share:.1%}]")
    lines += [f"  assumption: {a}" for a in p["assumptions"]]
    lines += _amdahl_lines(p["amdahl"], p["step_us"], "  ")
    for w in p["what_if"]:
        step = f", step {w['step_us']:.1f}" if w["step_us"] is not None else ""
        lines.append(f"  under {w['label']}: predicted kernels {w['kernel_us']:.1f} ({w['change_us']:+.1f}){step}")
        if w.get("expert_parallel"):
            lines += [f"    {g:<18}{us:>10.1f}" for g, us in w["groups_us"].items() if us]
            lines += [f"    assumption: {a}" for a in w["assumptions"]]
    lines += _versus_lines(p, [w for w in p["what_if"] if w.get("expert_parallel")], p["target"], "  ")
    return lines


def ep_table_lines(runs: list[tuple[str, dict]]) -> list[str]:
    """TP against each EP what-if, per load (batch), here and on every projection target, with the deciding term.

    >>> tp = {"label": "today", "kernel_us": 100.0, "groups_us": {"moe": 60.0, "allreduce": 40.0}}
    >>> ep = {"label": "moe=ep8", "kernel_us": 130.0, "groups_us": {"moe": 90.0, "allreduce": 40.0},
    ...       "expert_parallel": True}
    >>> print("\\n".join(ep_table_lines([("m1-l1024", {"batch": 1, "today": tp, "what_if": [ep], "projections": []})])))
    TP against expert parallelism, predicted kernels per step (µs)
      where  what-if     M          TP          EP    EP - TP  decided by
      here   moe=ep8     1       100.0       130.0      +30.0  moe +30.0
    """
    rows = []
    for _, info in runs:
        places = [("here", info["today"], info["what_if"])] + [
            (p["target"], p, p["what_if"]) for p in info["projections"]]
        for where, tp, whatifs in places:
            for ep in (w for w in whatifs if w.get("expert_parallel")):
                group, delta = decides(tp, ep)
                rows.append((where, ep["label"], info["batch"], tp["kernel_us"], ep["kernel_us"], group, delta,
                             ep.get("ep_missing", False)))
    if not rows:
        return []
    w1 = max(5, *(len(r[0]) for r in rows))
    w2 = max(7, *(len(r[1]) for r in rows))
    lines = ["TP against expert parallelism, predicted kernels per step (µs)",
             f"  {'where':<{w1}}  {'what-if':<{w2}} {'M':>5} {'TP':>11} {'EP':>11} {'EP - TP':>10}  decided by"]
    for where, label, batch, tp_us, ep_us, group, delta, missing in sorted(
            rows, key=lambda r: (r[0] != "here", r[0], r[1], r[2])):
        lines.append(f"  {where:<{w1}}  {label:<{w2}} {batch:>5} {tp_us:>11.1f} {ep_us:>11.1f} {ep_us - tp_us:>+10.1f}"
                     f"  {group} {delta:+.1f}" + ("  (MISSING: MoE at TP shapes, no EP results)" if missing else ""))
    return lines
