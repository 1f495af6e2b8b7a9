"""What expert parallelism would buy: ``--what-if moe=ep`` (``moe=epN``, ``ep=N``, ``moe=epN:agrs|a2a``).

The step under EP N: attention and the dense parts stay tensor-parallel; every MoE term is taken from
the EP-shape MoE results (the busiest rank of its routing: :mod:`decodebench.kernels.moe_ep`) of the
same routing at the shape point nearest the step; the MoE's all-reduces are taken out and the EP
dispatch and combine of every MoE layer put in, as the mode says (:class:`EPMode`: ``vllm``, ``agrs``,
``a2a``). Collectives are priced from results over N ranks where there are any, on a projection
target by its link table. Each mode and how vLLM runs it: docs/projection.md, "Expert parallelism".
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import Enum

from ...moe_routing import RoutingDistribution
from ...shapes import BF16_BYTES, ExpertParallel
from .prediction import backend_rank
from .step import KernelResult, Part, Step, WhatIfError, roofline_us
from .targets import fit_points

__all__ = ["EPMode", "EPPlan", "apply_expert_parallel", "ep_comm_on_target", "ep_facts", "ep_plan",
           "parse_ep_value", "project_comm", "vllm_ep_backend_note"]

ALLREDUCE = "allreduce"
_VALUE = re.compile(r"^ep(\d+)?(?::(\w+))?$")


class EPMode(str, Enum):
    VLLM = "vllm"  # vLLM at DP 1: no dispatch, the combine is the MoE's all-reduce
    AGRS = "agrs"  # all-gather dispatch, reduce-scatter combine (vLLM's allgather_reducescatter)
    A2A = "a2a"  # all-to-all dispatch and combine (pplx, DeepEP)


def parse_ep_value(text: str) -> tuple[int | None, EPMode] | None:
    """``ep``, ``ep8``, ``ep8:a2a`` -> (EP size or None: the results' own, mode); None if not an EP value.

    >>> parse_ep_value("ep8:agrs"), parse_ep_value("ep"), parse_ep_value("0.5x")
    ((8, <EPMode.AGRS: 'agrs'>), (None, <EPMode.VLLM: 'vllm'>), None)
    """
    match = _VALUE.match(text)
    if not match:
        return None
    size, mode = match.group(1), match.group(2) or EPMode.VLLM.value
    if mode not in {m.value for m in EPMode}:
        raise ValueError(f"{text!r}: unknown EP mode {mode!r}; choose one of {', '.join(m.value for m in EPMode)}")
    if size is not None and int(size) < 2:
        raise ValueError(f"{text!r}: an expert-parallel size is at least 2")
    return (int(size) if size else None), EPMode(mode)


@dataclass(frozen=True)
class EPPlan:
    """One EP what-if resolved against the results: its size and mode, and the step's MoE layers."""

    ep: int
    mode: EPMode
    moe_calls: int  # MoE calls per step (= the MoE's all-reduces under TP)
    label: str
    missing: bool = False  # no EP-shape MoE results: the MoE term stays at TP shapes (said as MISSING)


def ep_plan(label: str, ep: int | None, mode: EPMode, results: Sequence[KernelResult], step: Step,
            default_ep: int | None = None) -> EPPlan:
    """The EP size (given, else the results' own, else ``default_ep``: the TP size EP would replace) and
    the step's MoE calls; ``missing`` when no EP-shape MoE result of that size is at hand."""
    size, pool = _ep_results(results, ep)
    size = size or default_ep
    if not size:
        raise WhatIfError(f"--what-if {label}: no expert-parallel MoE results to take the EP size from; "
                          "write moe=epN")
    return EPPlan(size, mode, sum(p.calls for p in step.parts if p.group == "moe"), label, missing=not pool)


def missing_note(plan: EPPlan) -> str:
    return (f"MISSING: no EP {plan.ep} MoE results (ids with ep{plan.ep}): the MoE term stays at TP shapes; "
            f"measure them with benchmarks/test_moe.py --ep {plan.ep}")


def project_comm(step: Step, plan: EPPlan, target, spec, results: Sequence[KernelResult] = ()) -> Step:
    """:func:`ep_comm_on_target` with the EP layout of ``spec`` at the target's TP, and the dispatch results
    measured on the target: its ``allreduce_results`` files and ``results`` of the same GPU model."""
    from ...hardware import device_spec
    from ...shapes import DecodeShapes
    from .prediction import load_results

    layout = DecodeShapes(spec, target.tp, ep=plan.ep).expert_parallel
    layout.validate()
    stored = [r for path in target.allreduce_results for r in load_results(path)[0]]
    same_gpu = [r for r in results if r.info.get("gpu")
                and getattr(device_spec(r.info["gpu"]), "name", None) == target.device.name]
    measured = [r for r in stored + same_gpu if r.component == "ep_dispatch"]
    return ep_comm_on_target(step, plan, target, layout, spec.hidden_size, measured)


def _ep_results(results: Sequence[KernelResult], ep: int | None) -> tuple[int, list[KernelResult]]:
    mine = [r for r in results if r.component == "moe" and r.shape.get("ep") and r.shape.get("stage") == "fused"]
    sizes = sorted({int(r.shape["ep"]) for r in mine})
    if ep is None:
        if len(sizes) > 1:
            raise WhatIfError(f"results of EP sizes {sizes}: name one (moe=ep{sizes[0]})")
        ep = sizes[0] if sizes else None
    return ep, [r for r in mine if r.shape.get("ep") == ep]


def _distance(r: KernelResult, batch: int) -> float:
    tokens = r.shape.get("tokens")
    return abs(math.log(tokens / batch)) if tokens else math.inf


def _ep_part(part: Part, pool: Sequence[KernelResult], batch: int) -> Part | None:
    """The EP-rank result standing for one TP MoE term: same routing (and layer), nearest tokens,
    the TP term's backend first."""
    shape = part.result.shape if part.result is not None else {}
    same = [r for r in pool if r.shape.get("routing") == shape.get("routing", "uniform")
            and r.shape.get("layer") == shape.get("layer")]
    backend = part.result.backend if part.result is not None else None
    chosen = min(same, key=lambda r: (_distance(r, batch), r.backend != backend, backend_rank(r)), default=None)
    if chosen is None:
        return None
    s = chosen.shape
    how = (f"EP {s.get('ep')} rank {s.get('rank')} of {s.get('global_experts')} experts ({s.get('local_experts')} "
           f"whole experts; the busiest: {s.get('rank_slots')} slots, {s.get('distinct_experts')} experts) in place "
           f"of the TP term")
    return Part(part.group, chosen.name, chosen.median_s * 1e6, part.calls, roofline_us(chosen), how, chosen)


def apply_expert_parallel(step: Step, label: str, ep: int | None, mode: EPMode, results: Sequence[KernelResult],
                          *, comm: bool = True, default_ep: int | None = None) -> Step:
    """``step`` under expert parallelism: the MoE at EP shapes and, with ``comm``, the MoE's all-reduces
    swapped for the mode's dispatch and combine priced on this machine (see the module docstring).
    Without EP-shape results for a MoE term, the term stays at TP shapes and the step says MISSING.

    >>> tp = KernelResult("tp", "moe", "vllm", {"stage": "fused", "routing": "uniform", "tokens": 1}, 100e-6)
    >>> ep = KernelResult("ep", "moe", "vllm", {"stage": "fused", "routing": "uniform", "tokens": 1, "ep": 8,
    ...                   "rank": 0, "rank_slots": 2}, 150e-6)
    >>> ar = KernelResult("ar", "allreduce", "torch", {"tokens": 1}, 20e-6)
    >>> from decodebench.attribution.predict.step import part_of
    >>> today = Step("today", 1, 64, (part_of("moe", tp, 60), part_of("allreduce", ar, 123)))
    >>> after = apply_expert_parallel(today, "moe=ep", None, EPMode.VLLM, [tp, ep, ar])
    >>> after.groups_us()["moe"], after.groups_us()["allreduce"]
    (9000.0, 2460.0)
    """
    if not any(p.group == "moe" for p in step.parts):
        return step.with_parts(step.parts, step.label, [f"{label} changes nothing: the step has no moe term"])
    plan = ep_plan(label, ep, mode, results, step, default_ep)
    pool = _ep_results(results, plan.ep)[1]
    parts, notes = [], [missing_note(plan)] if plan.missing else _rank_notes(pool, step.batch)
    for part in step.parts:
        swapped = _ep_part(part, pool, step.batch) if part.group == "moe" and pool else None
        if part.group == "moe" and pool and swapped is None:
            routing = part.result.shape.get("routing") if part.result is not None else "?"
            notes.append(f"MISSING: no EP {plan.ep} result for {part.benchmark} ({routing} routing): that term "
                         "stays at TP shapes")
        parts.append(swapped or part)
    stepped = step.with_parts(parts, step.label, notes)
    return _comm_here(stepped, plan, results) if comm else stepped


def _rank_notes(pool: Sequence[KernelResult], batch: int) -> list[str]:
    """Load balance: the busiest rank against the mean, per routing, at the token count nearest ``batch``."""
    notes = []
    for routing in sorted({str(r.shape.get("routing")) for r in pool}):
        rows = [r for r in pool if r.shape.get("routing") == routing]
        r = min(rows, key=lambda x: _distance(x, batch))
        s = r.shape
        notes.append(f"EP load balance ({routing}, M={s.get('tokens')}): the step waits for the busiest rank, "
                     f"rank {s.get('rank')} with {s.get('rank_slots')} slots on {s.get('distinct_experts')} of its "
                     f"{s.get('local_experts')} experts, {s.get('rank_imbalance', 0):.2f}x the mean rank's slots "
                     f"(vLLM's linear placement"
                     + ("; the skewed hot experts 0..15 all sit on rank 0: EPLB or round_robin placement would "
                        "spread them" if routing == "skewed" else "") + ")")
    return notes


def _comm_here(step: Step, plan: EPPlan, results: Sequence[KernelResult]) -> Step:
    """The MoE's all-reduces out, dispatch and combine in, priced from this machine's results."""
    ar = next((p for p in step.parts if p.group == ALLREDUCE), None)
    if ar is None:
        return step.with_parts(step.parts, step.label, [
            f"{plan.label}: the step predicted here has no all-reduce term (no results over {plan.ep} ranks): "
            "the MoE's all-reduces and the EP dispatch/combine are not priced here (--project-to prices them)"])
    parts = _without_moe_allreduces(step.parts, ar, plan.moe_calls)
    if plan.mode is EPMode.VLLM:
        parts.append(_combine_allreduce(ar, plan))
        return step.with_parts(parts, step.label, [vllm_ep_backend_note(plan.ep)])
    added, missing = [], []
    for collective, role in _collectives(plan.mode):
        r = _measured(results, collective, plan.ep, step.batch)
        if r is None:
            missing.append(collective)
            continue
        added.append(Part(ALLREDUCE, f"EP {role}: {r.name}", r.median_s * 1e6, plan.moe_calls, None,
                          f"{collective} measured over {plan.ep} ranks"))
    notes = [_mode_note(plan)]
    if missing:
        notes.append(f"{plan.label}: no {' or '.join(missing)} results over {plan.ep} ranks on this machine: "
                     "that collective is not priced here (--project-to prices it on the target's link)")
    return step.with_parts(parts + added, step.label, notes)


def _without_moe_allreduces(parts: Sequence[Part], ar: Part, moe_calls: int) -> list[Part]:
    kept = max(0, ar.calls - moe_calls)
    return [replace(p, calls=kept, how=f"{p.how}; the MoE's {moe_calls} taken out (EP), attention's kept")
            if p is ar else p for p in parts]


def _combine_allreduce(ar: Part, plan: EPPlan) -> Part:
    return Part(ALLREDUCE, "EP combine: the all-reduce of the ranks' partial outputs", ar.per_call_us,
                plan.moe_calls, ar.roofline_per_call_us,
                f"vLLM at DP 1: every rank holds every token, no dispatch; the combine sums the {plan.ep} ranks' "
                "partial MoE outputs, the MoE's all-reduce of [M, hidden] as under TP")


def _collectives(mode: EPMode) -> tuple[tuple[str, str], ...]:
    if mode is EPMode.AGRS:
        return ("all_gather", "dispatch"), ("reduce_scatter", "combine")
    return ("all_to_all", "dispatch"), ("all_to_all", "combine")


def _measured(results: Sequence[KernelResult], collective: str, ranks: int, batch: int) -> KernelResult | None:
    rows = [r for r in results if r.component == "ep_dispatch" and r.shape.get("collective") == collective
            and r.info.get("world_size") == ranks]
    return min(rows, key=lambda r: _distance(r, batch), default=None)


def vllm_ep_backend_note(ep: int) -> str:
    return (f"vLLM at --tensor-parallel-size {ep} --enable-expert-parallel (DP 1) runs no all-to-all: its all2all "
            "backends run only with DP > 1 (FusedMoEParallelConfig.use_all2all_kernels); after attention's "
            "all-reduce every rank holds every token, each computes its own experts' slots, and the MoE's "
            "all-reduce is the combine")


def _mode_note(plan: EPPlan) -> str:
    which = ("allgather_reducescatter (vLLM's default all2all backend with DP > 1; NCCL all-gather and "
             "reduce-scatter, so it runs over PCIe)" if plan.mode is EPMode.AGRS else
             "an all-to-all backend (pplx, deepep_high_throughput, deepep_low_latency: NVSHMEM over NVLink or "
             "InfiniBand GPUDirect; none has a PCIe-only path)")
    return (f"{plan.label}: dispatch and combine as {which}, in place of the MoE's all-reduces; vLLM runs them only "
            "with data-parallel attention, while this step keeps attention tensor-parallel (an approximation: "
            "the all-gather a TP attention would need after the combine is not counted)")


# --- on a projection target -------------------------------------------------------------------------


def ep_comm_on_target(step: Step, plan: EPPlan, target, shapes_ep: ExpertParallel, hidden: int,
                      measured: Sequence[KernelResult] = ()) -> Step:
    """A projected step (its link all-reduce part at the target's TP) with the MoE's all-reduces out and
    the mode's dispatch and combine in: fitted to ``measured`` dispatch results of the target where there
    are two sizes or more, else its link table; notes where vLLM cannot run it."""
    ar = next((p for p in step.parts if p.group == ALLREDUCE), None)
    if ar is None:
        return step.with_parts(step.parts, step.label, [f"{plan.label}: no all-reduce on {target.id}"])
    parts = _without_moe_allreduces(step.parts, ar, plan.moe_calls)
    notes = []
    if plan.mode is EPMode.VLLM:
        parts.append(_combine_allreduce(ar, plan))
        notes.append(vllm_ep_backend_note(plan.ep))
    else:
        link = target.link
        for collective, role in _collectives(plan.mode):
            chunk = (shapes_ep.gather_tokens(step.batch) if plan.mode is EPMode.AGRS
                     else shapes_ep.dispatch_pair_tokens(RoutingDistribution.UNIFORM, step.batch)) * hidden * BF16_BYTES
            fit = fit_points([(float(r.shape["chunk_bytes"]), r.median_s * 1e6) for r in measured
                              if r.shape.get("collective") == collective and r.info.get("world_size") == plan.ep])
            if fit is not None:
                parts.append(Part(ALLREDUCE, f"EP {role}: {collective} (fit)", fit.allreduce_us(chunk),
                                  plan.moe_calls, None,
                                  f"alpha + chunk / beta fitted to {fit.points} {collective} results measured on "
                                  f"{target.id} over {plan.ep} ranks (worst miss {fit.worst_error:.0%})"))
                continue
            wire_us = (plan.ep - 1) * chunk / (link.busbw_gbps * 1e9) * 1e6
            parts.append(Part(ALLREDUCE, f"EP {role}: {collective} (link model)", link.alpha_us + wire_us,
                              plan.moe_calls, wire_us,
                              f"{link.alpha_us:.1f} µs + {plan.ep - 1} x {chunk} B / {link.busbw_gbps:g} GB/s "
                              f"({link.id}; alpha of its all-reduce; no {collective} results over {plan.ep} ranks "
                              "measured there to fit)"))
        notes.append(_mode_note(plan))
        if plan.mode is EPMode.A2A and link.kind != "nvlink":
            notes.append(f"vLLM cannot run this on {target.id}: pplx and DeepEP need NVSHMEM over NVLink or "
                         "InfiniBand GPUDirect (IBGDA), and its link is PCIe only; the figure is what the traffic "
                         "would cost")
    return step.with_parts(parts, step.label, notes)


def ep_facts(spec, ep: int, weight_bytes: int, memory_bytes: int | None, where: str) -> str:
    """Whether the weights of an EP rank fit: the same bytes as TP ``ep`` (whole experts / ep of every expert)."""
    local = spec.num_experts // ep
    fits = ("" if memory_bytes is None else
            f", {where} holds {memory_bytes / 2**30:.0f} GiB: "
            + ("fits" if weight_bytes < 0.9 * memory_bytes else "does NOT fit: vLLM cannot run this step there"))
    return (f"weights per EP {ep} rank: {local} whole experts x {spec.num_moe_layers} MoE layers plus the TP-{ep} "
            f"attention and dense parts: {weight_bytes / 2**30:.0f} GiB, the same as TP {ep}{fits}")
