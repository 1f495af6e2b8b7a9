"""The decode step on a machine not at hand, projected from this machine's kernel results (one path:
:func:`project`; docs/projection.md, "What-if, Amdahl, projection", says how each term is re-timed).

Kernels by the ``measured`` rule of :mod:`.projection_rule` (:func:`rule_for`), bracketed by the error
measured for the pair of SM designs (:func:`band`), else by the ``datasheet`` rule, said first; the
target's backends swapped in first; all-reduces ``alpha + bytes / beta`` over the target's link.
Results measured at one TP project only to a target of the same TP (per-rank shapes differ).
"""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from ...distributed.links import LinkMode, vllm_would_use
from ...files import read_json
from ...hardware import device_spec
from ...model import ModelSpec
from ...shapes import DecodeShapes
from ..depth import weight_bytes_per_rank
from .prediction import load_results
from .projection_rule import (
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
from .step import KernelResult, Part, Step, WhatIfError
from .targets import Target, fit_link
from .whatif import Change, ChangeKind, WhatIf, apply_what_if

__all__ = ["BANDS_FILE", "Band", "Projection", "ProjectionRule", "band", "cases_by_gpu", "cases_digest", "project",
           "remember", "rule_for"]

ALLREDUCE = "allreduce"
BANDS_FILE = Path(__file__).resolve().parent / "bands.json"


@dataclass(frozen=True)
class Band:
    """The error measured for projections from one SM design to another: ``projected / truth - 1``."""

    source_arch: str
    target_arch: str
    low: float
    high: float
    what: str  # what was compared: the step against the step measured there, or against published figures
    source: str  # the files and the command that measured it


def band(source_arch: str, target_arch: str, path: Path = BANDS_FILE) -> Band | None:
    """The measured error band of the pair (None: not measured); ValueError naming a malformed file.

    >>> band("sm90", "sm90").what.startswith("the decode step")
    True
    >>> band("sm90", "sm100") is None
    True
    """
    try:
        rows = [Band(**row) for row in read_json(Path(path))["bands"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a bands file (a list 'bands' of {', '.join(Band.__dataclass_fields__)}): "
                         f"{exc}") from None
    return next((b for b in rows if (b.source_arch, b.target_arch) == (source_arch, target_arch)), None)


# (GPU, digest of its cases) -> (the rule fitted on them, where it came from): one fit per GPU per process
_FITS: dict[tuple[str, str], tuple[RuleParams, str]] = {}


def cases_digest(cases: Sequence[Case]) -> str:
    """What identifies the cases a rule is fitted on: their names, timers and times."""
    rows = sorted((c.name, c.timer, c.median_us) for c in cases)
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()


def cases_by_gpu(results: Sequence[KernelResult]) -> dict[str, list[Case]]:
    """The cases the rule is fitted on, per GPU the results name: vLLM's kernels (a reference's pace is not
    the GPU's), each with traffic and a timer whose cache state the rule knows."""
    by_gpu: dict[str, list[Case]] = {}
    for r in results:
        gpu = r.info.get("gpu") or r.info.get("peaks_source")
        case = case_of(r) if gpu and r.backend.startswith("vllm") and r.component != ALLREDUCE else None
        if case is not None and case.timer in CACHE_STATES:
            by_gpu.setdefault(str(gpu), []).append(case)
    return by_gpu


def remember(facts: DeviceFacts, digest: str, params: RuleParams, origin: str) -> None:
    """Take ``params`` as the rule of ``facts``'s GPU for the cases of ``digest`` (a stored fit)."""
    _FITS[facts.name, digest] = (params, origin)


def rule_for(cases: Sequence[Case], facts: DeviceFacts, fitted_on: str) -> tuple[RuleParams, str]:
    """The rule of one GPU's ``cases`` and where it came from: a stored fit of these very cases
    (:func:`remember`), else fitted here, once per process for the same GPU and cases."""
    key = (facts.name, cases_digest(cases))
    if key not in _FITS:
        _FITS[key] = (fit(cases, facts, fitted_on), "fitted in this process")
    return _FITS[key]


class ProjectionRule(enum.Enum):
    """How a kernel's time moves to the target (the module docstring says each)."""

    MEASURED = "measured"
    DATASHEET = "datasheet"


@dataclass(frozen=True)
class Projection:
    """The projected step (the rule's best estimate), and per group the bracket's two ends: with the
    measured rule, the estimate corrected by the rule's lowest and highest cross-GPU step error; with
    the datasheet rule, latency that does not scale (low) and the estimate (high)."""

    target: Target
    step: Step
    low_us: dict[str, float]
    high_us: dict[str, float]
    groups_how: dict[str, str]
    rule: ProjectionRule
    bracket: str  # what the bracket's ends mean
    band: Band | None = None  # the measured error of the pair of SM designs (None: not measured)

    @property
    def low_total_us(self) -> float:
        return sum(self.low_us.values())

    @property
    def high_total_us(self) -> float:
        return sum(self.high_us.values())


def project(step: Step, spec: ModelSpec, source_tp: int, target: Target, results: Sequence[KernelResult],
            rule: ProjectionRule = ProjectionRule.MEASURED) -> Projection:
    """``step`` (a prediction at TP ``source_tp`` from ``results``) on ``target`` by ``rule``: the one path from
    a step here to the step there, its parts the kernels by component (backend swaps applied) and the
    all-reduces over the target's link.

    Raises :class:`WhatIfError` when the TP sizes differ (the per-rank shapes would be others).
    """
    if source_tp != target.tp:
        raise WhatIfError(f"--project-to {target.id}: it runs TP {target.tp}, the kernel results are per-rank "
                          f"shapes at TP {source_tp}; measure them with --tp {target.tp} to project there")
    notes = []
    models, rule_notes = ({}, ()) if rule is ProjectionRule.DATASHEET else _measured_models(results, target)
    if rule is ProjectionRule.MEASURED and not models:
        rule = ProjectionRule.DATASHEET
    bands = {band(here.facts.arch, there.facts.arch) for here, there in models.values()}
    measured_band = bands.pop() if len(bands) == 1 else None
    lo_err, hi_err = (measured_band.low, measured_band.high) if measured_band else (0.0, 0.0)
    for swap in target.backends:
        before = step.groups_us()[swap.group]
        step = apply_what_if(step, WhatIf((Change(swap.group, ChangeKind.BACKEND, backend=swap.backend),)),
                             results, strict=False, label=step.label)
        if step.groups_us()[swap.group] != before:
            notes.append(f"{swap.group}: {swap.backend} ({swap.why}); its results here, scaled")
    parts, low, high, how = [], {}, {}, {}
    for part in step.parts:
        if part.group == ALLREDUCE:
            continue
        if rule is ProjectionRule.MEASURED:
            scaled = _scaled_measured(part, models, target)
            ends = (scaled.us / (1 + hi_err), scaled.us / (1 + lo_err))
        else:
            scaled, kept = _scaled(part, target)
            ends = (kept * part.calls, scaled.us)
        parts.append(scaled)
        low[part.group] = low.get(part.group, 0.0) + ends[0]
        high[part.group] = high.get(part.group, 0.0) + ends[1]
    link_part, link_notes = _allreduce(step, spec, target, results)
    if link_part is not None:
        parts.append(link_part)
        low[ALLREDUCE] = high[ALLREDUCE] = link_part.us
    if rule is ProjectionRule.MEASURED:
        bracket = _band_text(measured_band, models)
        rule_lines = (*rule_notes, f"bracket: {bracket}")
    else:
        rule_lines = (*rule_notes, *_assumptions(step, target, low, parts))
        bracket = "low: every kernel's time above its datasheet roofline is latency that does not scale"
    projected = Step(target.id, step.batch, step.context, tuple(parts),
                     step.assumptions + tuple(rule_lines) + tuple(notes) + link_notes + _memory_note(spec, target))
    for group in projected.groups_us():
        how[group] = _group_how(group, step.parts, parts)
    return Projection(target, projected, low, high, how, rule, bracket,
                      measured_band if rule is ProjectionRule.MEASURED else None)


def _band_text(measured: Band | None, models: dict) -> str:
    pairs = sorted({f"{here.facts.arch} -> {there.facts.arch}" for here, there in models.values()})
    if measured is None:
        return f"error not measured for {', '.join(pairs)}: no bracket"
    return (f"{measured.low:+.1%} .. {measured.high:+.1%}, {measured.what} ({measured.source}); the estimate over "
            "1 + each end")


def _measured_models(results: Sequence[KernelResult], target: Target) -> tuple[dict, tuple[str, ...]]:
    """Per source GPU name, (the rule fitted on that GPU's results, the target as the rule sees it);
    empty, with the reason as a note, where the rule cannot be fitted or knows no such GPU."""
    models, fitted = {}, []
    try:
        there_facts = device_facts(target.device.name)
        for gpu, cases in cases_by_gpu(results).items():
            facts = device_facts(gpu)
            params, origin = rule_for(cases, facts, f"{facts.name}: {len(cases)} kernel results")
            models[gpu] = (DeviceModel(facts, params), DeviceModel(there_facts, params))
            fitted.append(f"{facts.name} ({len(cases)} results, {origin}; floor {params.floor_us:.2f} µs per launch, "
                          f"DRAM "
                          f"{params.dram_fraction:.2f} of the datasheet, L2 {params.l2_bytes_per_sm_cycle:.1f} B per "
                          f"SM cycle, SM throughput per component "
                          + ", ".join(f"{c} {v:.1f}" for c, v in params.sm_bytes_per_cycle.items())
                          + f", fused MoE overlap share {params.moe_overlap:.2f})")
    except ValueError as exc:
        return {}, (f"rule: datasheet, because the measured rule cannot be fitted on these results ({exc})",)
    if not models:
        return {}, ("rule: datasheet, because no result names the GPU it ran on",)
    return models, (f"rule: measured (latency floor per launch, achievable DRAM bandwidth, L2 and SM throughput "
                    f"per SM cycle), fitted on the results' own GPU: {'; '.join(fitted)}; to {there_facts.name} "
                    f"({there_facts.source}); each kernel in the decode step's cache state there (weights, scales "
                    "and KV from DRAM, activations from L2), whatever its timer's here",)


def _scaled_measured(part: Part, models: dict, target: Target) -> Part:
    """The part on the target by the measured rule; a part without traffic carried over unscaled."""
    r = part.result
    gpu = r.info.get("gpu") or r.info.get("peaks_source") if r is not None else None
    case = case_of(r) if r is not None and gpu in models else None
    if case is None:
        return replace(part, how=f"{part.how}; no bytes/FLOPs or GPU: carried over unscaled")
    here, there = models[gpu]
    ratio = project_case(case, here, there, CACHE_STATES[case.timer], "step") / case.median_us
    roof = _roofline_there(part, target)
    return replace(part, per_call_us=part.per_call_us * ratio, how=f"{part.how}; measured rule: x {ratio:.2f}",
                   roofline_per_call_us=roof[0] if roof else part.roofline_per_call_us)


def _scaled(part: Part, target: Target) -> tuple[Part, float]:
    """The part on the target (its fraction of roofline kept) and its per-call µs if the time above
    its roofline here is latency that stays."""
    here = part.roofline_per_call_us
    roof = _roofline_there(part, target)
    if not here or roof is None:
        return replace(part, how=f"{part.how}; no bytes/FLOPs: carried over unscaled"), part.per_call_us
    there, bound = roof
    ratio = there / here
    return (replace(part, per_call_us=part.per_call_us * ratio, roofline_per_call_us=there,
                    how=f"{part.how}; {bound}-bound there: x {ratio:.2f}"),
            there + max(0.0, part.per_call_us - here))


def _roofline_there(part: Part, target: Target) -> tuple[float, str] | None:
    """The part's datasheet roofline per call on the target (µs) and its bound; None without bytes."""
    info = part.result.info if part.result else {}
    nbytes = (info.get("bytes_read") or 0) + (info.get("bytes_written") or 0)
    if not nbytes:
        return None
    memory_us = nbytes / target.peaks.bytes_per_s * 1e6
    compute_us = (info.get("flops") or 0) / target.peaks.flops_per_s * 1e6
    return max(memory_us, compute_us), "compute" if compute_us > memory_us else "memory"


def _group_how(group: str, before: Sequence[Part], after: Sequence[Part]) -> str:
    if group == ALLREDUCE:
        return next((p.how for p in after if p.group == ALLREDUCE), "")
    old = sum(p.us for p in before if p.group == group)
    new = [p for p in after if p.group == group]
    kinds = {f"{b}-bound": sum(f"{b}-bound" in p.how for p in new) for b in ("memory", "compute")}
    kinds["by the measured rule"] = sum("measured rule" in p.how for p in new)
    kinds["unscaled"] = sum("unscaled" in p.how for p in new)
    counted = ", ".join(f"{n} {kind}" for kind, n in kinds.items() if n)
    ratio = sum(p.us for p in new) / old if old else 0.0
    return f"x {ratio:.2f} ({counted})"


def _allreduce(step: Step, spec: ModelSpec, target: Target, results: Sequence[KernelResult]):
    shapes = DecodeShapes.for_deployment(spec, target.tp)
    calls, nbytes = shapes.allreduces_per_step, shapes.allreduce_bytes(step.batch)
    if not calls:
        return None, (f"{ALLREDUCE}: none at TP {target.tp}",)
    measured = _measured_on(target, results)
    fit = fit_link(measured, target.tp)
    if fit is not None:
        alpha, beta = fit.alpha_us, fit.beta_bytes_per_s
        source = (f"{ALLREDUCE}: alpha and beta fitted to {fit.points} all-reduce results measured on the target "
                  f"over {target.tp} ranks (worst miss of the fit {fit.worst_error:.0%})")
    else:
        link = target.link
        alpha, beta = link.alpha_us, link.beta_bytes_per_s(target.tp)
        source = (f"{ALLREDUCE}: link table {link.id}, {link.name}: beta = busbw {link.busbw_gbps:g} GB/s x "
                  f"{target.tp}/{2 * (target.tp - 1)}; {link.source}"
                  + ("; too few all-reduce results measured on the target to fit" if measured else ""))
    how = f"{calls} x ({alpha:.1f} µs + {nbytes} B / {beta / 1e9:.1f} GB/s)"
    path = vllm_would_use(target.tp, nbytes, link=target.link.kind if target.link else "single",
                          mode=LinkMode.NATIVE)
    note = f"{ALLREDUCE}: vLLM would run {path.backend} there ({path.why})"
    part = Part(ALLREDUCE, "link model" if fit is None else "link fit", alpha + nbytes / beta * 1e6, calls,
                nbytes / beta * 1e6, how)
    return part, (source, note)


def _measured_on(target: Target, results: Sequence[KernelResult]) -> list[KernelResult]:
    """All-reduce results measured on the target: its files, and results of the same GPU over its TP."""
    stored = []
    for path in target.allreduce_results:
        try:
            stored += load_results(path)[0]
        except ValueError as exc:
            raise WhatIfError(f"--project-to {target.id}: allreduce_results: {exc}") from None
    same_gpu = [r for r in results if r.component == ALLREDUCE and r.info.get("gpu")
                and getattr(device_spec(r.info["gpu"]), "name", None) == target.device.name]
    return [r for r in stored + same_gpu if r.info.get("world_size") == target.tp]


def _assumptions(step: Step, target: Target, kept: dict[str, float], parts: Sequence[Part]) -> tuple[str, ...]:
    sources = sorted({p.result.info.get("peaks_source") for p in step.parts
                      if p.result is not None and p.result.info.get("peaks_source")})
    peaks = target.peaks
    low = sum(kept.values())
    return (
        f"each kernel keeps the fraction of its roofline it reaches on the measured device ({'; '.join(sources)}): "
        f"memory-bound ones scale with bandwidth, compute-bound ones with bf16 tensor FLOP/s, to {target.device.name} "
        f"at {peaks.bytes_per_s / 1e12:.3g} TB/s and {peaks.flops_per_s / 1e12:.4g} TFLOP/s ({peaks.source}); "
        "the same kernels are assumed to run there",
        f"if every kernel's time above its roofline is latency that does not scale, the kernels take {low:.1f} µs "
        f"per step instead of {sum(p.us for p in parts):.1f}",
    )


def _memory_note(spec: ModelSpec, target: Target) -> tuple[str, ...]:
    if target.memory_bytes is None:
        return ()
    need = weight_bytes_per_rank(spec, target.tp)
    fits = "fits" if need < 0.9 * target.memory_bytes else "does NOT fit: this step cannot run there"
    return (f"weights: {spec.name} with {spec.num_layers} layers needs {need / 2**30:.0f} GiB per rank at TP "
            f"{target.tp}, a {target.device.name} holds {target.memory_bytes / 2**30:.0f} GiB: {fits}",)
