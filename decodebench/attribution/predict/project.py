"""The decode step on a machine not at hand, projected from this machine's kernel results.

Each part of the predicted step is re-timed for the target by what bounds it, from the bytes
and FLOPs its result carries (:mod:`decodebench.roofline`): its roofline here is
``max(bytes / bandwidth, FLOPs / tensor FLOP/s)`` of the measured device, there the same with
the target's device-table figures, and the part keeps the fraction of its roofline it reached
here. A memory-bound kernel so scales with the two bandwidths, a compute-bound one with the
two tensor FLOP/s, and one whose bound moves between the devices follows the new bound.
Beside it, the lower figure for the case that all of a kernel's time above its roofline is a
fixed latency (launch, synchronisation) that does not scale: ``roofline there + (time here -
roofline here)``. The truth of a latency-bound kernel lies between the two.

The all-reduces are not scaled: their count per step comes from
:attr:`~decodebench.shapes.DecodeShapes.allreduces_per_step` at the target's TP and each takes
``alpha + bytes / beta`` over the target's link (:mod:`.targets`), alpha and beta fitted to
all-reduce results measured on the target where there are any (at least two message sizes
over its TP), otherwise the link table's figures. Backends vLLM runs there instead of the
measured ones (Triton MLA on SM120) are swapped in first, from this machine's results of them.

Per-rank shapes depend on TP, so results measured at one TP project only to a target of the
same TP: anything else is refused, naming both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from ...distributed.links import LinkMode, vllm_would_use
from ...hardware import device_spec
from ...model import ModelSpec
from ...shapes import DecodeShapes
from ..depth import weight_bytes_per_rank
from .prediction import load_results
from .step import KernelResult, Part, Step, WhatIfError
from .targets import Target, fit_link
from .whatif import Change, ChangeKind, WhatIf, apply_what_if

__all__ = ["Projection", "project"]

ALLREDUCE = "allreduce"


@dataclass(frozen=True)
class Projection:
    """The projected step (kernels keep their fraction of roofline), and per group the lower figure
    for kernels whose time above the roofline is latency that does not scale."""

    target: Target
    step: Step
    latency_kept_us: dict[str, float]
    groups_how: dict[str, str]

    @property
    def latency_kept_total_us(self) -> float:
        return sum(self.latency_kept_us.values())


def project(step: Step, spec: ModelSpec, source_tp: int, target: Target, results: Sequence[KernelResult]) -> Projection:
    """``step`` (a prediction at TP ``source_tp`` from ``results``) on ``target``.

    Raises :class:`WhatIfError` when the TP sizes differ (the per-rank shapes would be others).
    """
    if source_tp != target.tp:
        raise WhatIfError(f"--project-to {target.id}: it runs TP {target.tp}, the kernel results are per-rank "
                          f"shapes at TP {source_tp}; measure them with --tp {target.tp} to project there")
    notes = []
    for swap in target.backends:
        before = step.groups_us()[swap.group]
        step = apply_what_if(step, WhatIf((Change(swap.group, ChangeKind.BACKEND, backend=swap.backend),)),
                             results, strict=False, label=step.label)
        if step.groups_us()[swap.group] != before:
            notes.append(f"{swap.group}: {swap.backend} ({swap.why}); its results here, scaled")
    parts, kept, how = [], {}, {}
    for part in step.parts:
        if part.group == ALLREDUCE:
            continue
        scaled, low = _scaled(part, target)
        parts.append(scaled)
        kept[part.group] = kept.get(part.group, 0.0) + low * part.calls
    link_part, link_notes = _allreduce(step, spec, target, results)
    if link_part is not None:
        parts.append(link_part)
        kept[ALLREDUCE] = link_part.us
    projected = Step(target.id, step.batch, step.context, tuple(parts),
                     step.assumptions + tuple(notes) + _assumptions(step, target, kept, parts) + link_notes
                     + _memory_note(spec, target))
    for group in projected.groups_us():
        how[group] = _group_how(group, step.parts, parts)
    return Projection(target, projected, kept, how)


def _scaled(part: Part, target: Target) -> tuple[Part, float]:
    """The part on the target (its fraction of roofline kept) and its per-call µs if the time above
    its roofline here is latency that stays."""
    info = part.result.info if part.result else {}
    nbytes = (info.get("bytes_read") or 0) + (info.get("bytes_written") or 0)
    here = part.roofline_per_call_us
    if not here or not nbytes:
        return replace(part, how=f"{part.how}; no bytes/FLOPs: carried over unscaled"), part.per_call_us
    memory_us = nbytes / target.peaks.bytes_per_s * 1e6
    compute_us = (info.get("flops") or 0) / target.peaks.flops_per_s * 1e6
    there = max(memory_us, compute_us)
    bound = "compute" if compute_us > memory_us else "memory"
    ratio = there / here
    return (replace(part, per_call_us=part.per_call_us * ratio, roofline_per_call_us=there,
                    how=f"{part.how}; {bound}-bound there: x {ratio:.2f}"),
            there + max(0.0, part.per_call_us - here))


def _group_how(group: str, before: Sequence[Part], after: Sequence[Part]) -> str:
    if group == ALLREDUCE:
        return next((p.how for p in after if p.group == ALLREDUCE), "")
    old = sum(p.us for p in before if p.group == group)
    new = [p for p in after if p.group == group]
    bounds = {b: sum(f"{b}-bound" in p.how for p in new) for b in ("memory", "compute")}
    unscaled = sum("unscaled" in p.how for p in new)
    counted = ", ".join(f"{n} {b}-bound" for b, n in bounds.items() if n) + (f", {unscaled} unscaled" if unscaled
                                                                               else "")
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
