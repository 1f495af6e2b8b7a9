"""Micro -> macro: one decode step's kernel time predicted from kernel benchmark results.

For batch M and context L, each benchmarked component contributes (time per call at the
nearest benchmarked shape point) x (calls per step). The calls per step are each component's
own (:meth:`decodebench.registry.ComponentSpec.calls_per_step`, at the served depth and TP),
the counts the gate prices a verdict with (:mod:`decodebench.gate.cost`), never from names.

A result counts only at this deployment's shapes (its component's ``fits``: a MoE result of
another TP has another N and K): results that do not fit are left out and named. The MoE results are those of the
routing the server ran (``routing``: the MoE benchmark's ``uniform`` or ``skewed``, or a
routing profile replayed per layer, ``profile``); with the model's own routing, a replayed
profile when there is one, else uniform, which the prediction states as its assumption.

Results are compared with the profiled step by group: MoE is benchmarked as one fused
call (GEMMs and glue), and the router GEMM runs cuBLAS like every dense GEMM, so it is
predicted under dense GEMMs, where the profile finds it. Rotary, sampling, copies and
other are not benchmarked; the profile's share of them is named in the remainder.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

from ...model import ModelSpec
from ...registry import ComponentSpec, calls_per_step, get, registered
from ...results import read_file, results_of
from ...shapes import DecodeShapes
from .step import KernelResult, Part, Prediction, Step, Term, part_of

__all__ = ["backend_rank", "distance", "kernel_results", "load_results", "one_per_point", "predict_step",
           "step_of"]

# The order the step's terms are summed in (floating-point sums depend on it): kept as it was before the
# component registry, so that every committed prediction stays bit for bit; a component not named sums after.
SUM_ORDER = ("rmsnorm", "routing_topk", "router_gemm", "mla_decode", "allreduce", "moe", "dense_gemm")
# --server-routing -> the MoE results that describe it (model: a replayed profile, else uniform)
MOE_ROUTING_FOR = {"uniform": ("uniform",), "skewed": ("skewed",), "model": ("profile", "uniform"),
                   None: ("profile", "uniform")}


def load_results(path: Path, skipped: list[str] | None = None) -> tuple[list[KernelResult], dict]:
    """Kernel results and the run's ``machine_info["decodebench"]`` (model, tp) from a stored JSON;
    the entries left out are named in ``skipped`` when given.

    Raises ValueError naming the file when it is not a pytest-benchmark result file.
    """
    stored = read_file(path)
    if skipped is not None:
        skipped += stored.skipped
    return list(stored.results), stored.machine


def kernel_results(paths: Sequence[Path], prefer_timer: str | None = None,
                   entries: Iterable[dict] = (), skipped: list[str] | None = None) -> list[KernelResult]:
    """The kernel results a breakdown predicts from, live and offline alike: those stored in
    ``paths`` (``--predict-from``), else ``entries`` (the session's own results); of a point
    measured with two timers, ``prefer_timer``'s (``--prefer-timer``), else both, and the
    prediction takes the first and says so.

    >>> rows = [{"name": n, "extra_info": {"component": "mla_decode", "backend": "torch", "shape": {"batch": 1},
    ...          "timer": t}, "stats": {"median": 1e-6}} for n, t in (("k", "kernel"), ("c", "cold"))]
    >>> [r.name for r in kernel_results([], None, rows)], [r.name for r in kernel_results([], "cold", rows)]
    (['k', 'c'], ['c'])

    Entries that cannot be used are left out and named in ``skipped`` when given.
    Raises ValueError naming a file that is not a pytest-benchmark result file.
    """
    results = ([r for path in paths for r in load_results(path, skipped)[0]] if paths
               else results_of(entries, skipped=skipped))
    return one_per_point(results, prefer_timer)[0] if prefer_timer else results


def one_per_point(results: Iterable[KernelResult], prefer_timer: str | None = None) -> tuple[list[KernelResult],
                                                                                               list[str]]:
    """One result per measured point (component, backend, shape), and a note per point kind that
    came with more than one timer.

    Results read from several files can measure the same point twice, with different timers (the
    MLA cases once with the kernel timer and once with L2 flushed, ``--timer cold``). Of such twins
    the one of ``prefer_timer`` is kept, else the first given; the note says which was taken.

    >>> a = KernelResult("k", "mla_decode", "torch", {"batch": 1}, 2e-6, {"timer": "kernel"})
    >>> b = KernelResult("c", "mla_decode", "torch", {"batch": 1}, 3e-6, {"timer": "cold"})
    >>> [r.name for r in one_per_point([a, b])[0]], [r.name for r in one_per_point([a, b], "cold")[0]]
    (['k'], ['c'])
    >>> one_per_point([a, b])[1]
    ['mla_decode: 1 point(s) measured with timers cold and kernel; took kernel (the first given; --prefer-timer picks)']
    """
    kept: dict[tuple, KernelResult] = {}
    timers: dict[str, set[str]] = {}  # component -> the timers its twinned points were measured with
    points: Counter[str] = Counter()
    for r in results:
        key = (r.component, r.backend, json.dumps(r.shape, sort_keys=True, default=str))
        have = kept.setdefault(key, r)
        if have is r or have.info.get("timer") == r.info.get("timer"):
            continue
        timers.setdefault(r.component, set()).update((str(have.info.get("timer")), str(r.info.get("timer"))))
        points[r.component] += 1
        if prefer_timer is not None and r.info.get("timer") == prefer_timer:
            kept[key] = r
    chosen = list(kept.values())
    notes = []
    for component, seen in timers.items():
        taken = sorted({str(r.info.get("timer")) for r in chosen if r.component == component} & seen)
        how = "" if prefer_timer in taken else " (the first given; --prefer-timer picks)"
        notes.append(f"{component}: {points[component]} point(s) measured with timers {' and '.join(sorted(seen))};"
                     f" took {' and '.join(taken)}{how}")
    return chosen, notes


def backend_rank(r: KernelResult) -> int:
    """How much ``r``'s backend stands for what the server runs: the backend vLLM's selector
    dispatches here first (MLA results say so), then any vLLM backend (``vllm``,
    ``vllm-<mla backend>``), then torch, then any other id.

    >>> [backend_rank(KernelResult("", "mla_decode", b, {}, 1.0, {"dispatched": d})) for b, d in
    ...  (("vllm-flash_attn_mla", True), ("vllm-triton_mla", False), ("vllm", None), ("torch", False))]
    [0, 1, 1, 2]
    """
    if r.info.get("dispatched") and r.backend.startswith("vllm"):
        return 0
    if r.backend.startswith("vllm"):
        return 1
    return 2 if r.backend == "torch" else 3


def _nearest(results: list[KernelResult], distance) -> KernelResult | None:
    """The result nearest in shape (log distance), the preferred backend breaking ties."""
    def key(r: KernelResult):
        return (distance(r.shape), backend_rank(r))
    return min(results, key=key, default=None)


def _log_gap(value, target: int) -> float:
    return abs(math.log(value / target)) if value else math.inf


def predict_step(results: list[KernelResult], spec: ModelSpec, tp: int, batch: int, context: int,
                 routing: str | None = "uniform") -> Prediction:
    """Predict one decode step of ``spec`` (its ``num_layers`` as served) at TP ``tp``.

    ``routing`` is how the server routed its MoE layers (``--server-routing``: uniform,
    skewed or model; None when unknown).

    >>> from decodebench.model import load_model_spec
    >>> r = [KernelResult("rms", "rmsnorm", "vllm", {"tokens": 1, "width": 256, "fused_add": True}, 2e-6)]
    >>> p = predict_step(r, load_model_spec("tiny-kimi"), tp=1, batch=1, context=64)
    >>> p.groups_us()["rmsnorm"], p.terms[0].calls
    (8.0, 4)
    """
    shapes = DecodeShapes.for_deployment(spec, tp)
    results, twin_notes = one_per_point(results)
    by_component: dict[str, list[KernelResult]] = {}
    for r in results:
        by_component.setdefault(r.component, []).append(r)
    found: dict[str, tuple[list[Term], list[str]]] = {
        c.name: _case_terms(c, by_component.get(c.name, []), shapes, batch, context) for c in registered()}
    moe_terms, moe_notes = _moe_terms(by_component.get("moe", []), shapes, batch, routing)
    found["moe"] = (moe_terms, moe_notes[0])
    order = sorted(found, key=lambda name: SUM_ORDER.index(name) if name in SUM_ORDER else len(SUM_ORDER))
    terms = [term for name in order for term in found[name][0]]
    return Prediction(batch, context, tuple(terms), tuple(line for name in order for line in found[name][1]),
                      tuple(moe_notes[1] + twin_notes + _extrapolated(terms, results, batch)))


def _case_terms(component: ComponentSpec, results: list[KernelResult], shapes: DecodeShapes, batch: int,
                context: int) -> tuple[list[Term], list[str]]:
    """One term per case of ``component`` the step runs, read from the fitting result nearest the step
    (tokens, and context where a result has one); the cases without one are named."""
    terms, missing = [], []
    fitting = [r for r in results if _fits(r, shapes) and component.tokens_at(r.shape)]
    for case in component.step_cases(shapes):
        calls = component.calls_per_step(shapes, case.key)
        if calls == 0:
            continue
        mine = [r for r in fitting if case.matches(r.shape)]
        chosen = _nearest(mine, lambda s: distance(component, s, batch, context))
        if chosen is None:
            where = case.detail or _for_what(shapes, batch, context if case.at_context else None)
            missing.append(f"{component.group}: no {case.what or component.name} result{where}"
                           + _unfit_note([r for r in results if case.matches(r.shape)], mine))
            continue
        terms.append(Term(component.group, chosen.name, chosen.median_s * 1e6, calls))
    return terms, missing


def distance(component: ComponentSpec, shape: dict, batch: int, context: int) -> float:
    """How far a result's point lies from the step's: tokens, and context where it was measured at one."""
    near = _log_gap(component.tokens_at(shape), batch)
    return near + _log_gap(shape.get("context_max"), context) if "context_max" in shape else near


def _extrapolated(terms: Sequence[Term], results: Sequence[KernelResult], batch: int) -> list[str]:
    """A note naming the groups whose results were measured at another token count than the step's batch,
    with the nearest measured point each was read from: the figure is carried over, not measured.

    >>> r = KernelResult("norm", "rmsnorm", "vllm", {"tokens": 8}, 2e-6)
    >>> _extrapolated([Term("rmsnorm", "norm", 2.0, 4)], [r], 64)
    ['EXTRAPOLATED: no result at M=64 for rmsnorm: each read from its nearest measured point (rmsnorm M=8)']
    """
    by_name = {r.name: r for r in results}
    off: dict[str, set] = {}
    for term in terms:
        r = by_name.get(term.benchmark)
        measured = None if r is None else get(r.component).tokens_at(r.shape)
        if measured is not None and measured != batch:
            off.setdefault(term.group, set()).add(measured)
    if not off:
        return []
    points = ", ".join(f"{group} M={'/'.join(map(str, sorted(ms)))}" for group, ms in off.items())
    return [f"EXTRAPOLATED: no result at M={batch} for {', '.join(off)}: each read from its nearest measured "
            f"point ({points})"]


def _for_what(shapes: DecodeShapes, batch: int, context: int | None = None) -> str:
    return f" for {shapes.spec.name} at TP {shapes.tp}, M={batch}" + (f", L={context}" if context else "")


def _unfit_note(every: list[KernelResult], fitting: list[KernelResult]) -> str:
    left_out = len(every) - len(fitting)
    ranks = sorted({r.info["world_size"] for r in every if "world_size" in r.info and r not in fitting})
    if ranks:  # a collective over another world size (a 1-GPU code-path check) is not this TP's
        return f" ({left_out} result(s) measured over {', '.join(map(str, ranks))} rank(s))"
    return f" ({left_out} result(s) at other shapes: another model or TP?)" if left_out else ""


def _fits(r: KernelResult, shapes: DecodeShapes) -> bool:
    """Whether a result was measured at this deployment's per-rank shapes (its component's ``fits``)."""
    return get(r.component).fits_at(shapes, r.shape, r.info)


def _moe_terms(results: list[KernelResult], shapes: DecodeShapes, batch: int,
               routing: str | None) -> tuple[list[Term], tuple[list[str], list[str]]]:
    """The MoE terms for the server's routing, and (missing, assumptions)."""
    layers = calls_per_step(shapes, "moe", {"stage": "fused"})
    if layers == 0:
        return [], ([], [])
    fused = [r for r in results if r.shape.get("stage") == "fused" and _fits(r, shapes)]
    wanted = MOE_ROUTING_FOR.get(routing, (routing,))
    for choice in wanted:
        rows = [r for r in fused if str(r.shape.get("routing", "")).split("-")[0] == choice]
        if not rows:
            continue
        if choice == "profile":
            terms = _profile_terms(rows, shapes, batch)
        else:
            chosen = _nearest(rows, lambda s: _log_gap(get("moe").tokens_at(s), batch))
            terms = [Term("moe", chosen.name, chosen.median_s * 1e6, layers)]
        assumed = []
        if routing in ("model", None) and choice == "uniform":
            assumed.append("moe: the MoE benchmark's uniform routing stands in for the server's own routing "
                           f"({'--server-routing model' if routing else 'unknown'}); replay a captured one with "
                           "--routing-profile")
        return terms, ([], assumed)
    return [], ([f"moe: no fused moe result with {' or '.join(wanted)} routing"
                 f"{_for_what(shapes, batch)}" + _unfit_note(results, fused)], [])


def _profile_terms(rows: list[KernelResult], shapes: DecodeShapes, batch: int) -> list[Term]:
    """Replayed routing: each captured layer's own result; captured layers stand for the others."""
    by_layer: dict[object, list[KernelResult]] = {}
    for r in rows:
        by_layer.setdefault(r.shape.get("layer"), []).append(r)
    chosen = {layer: _nearest(rs, lambda s: _log_gap(get("moe").tokens_at(s), batch)) for layer, rs in by_layer.items()}
    layers = calls_per_step(shapes, "moe", {"stage": "fused"})
    if len(chosen) == layers:
        return [Term("moe", r.name, r.median_s * 1e6, 1) for _, r in sorted(chosen.items(), key=lambda i: str(i[0]))]
    mean_us = statistics.fmean(r.median_s * 1e6 for r in chosen.values())
    return [Term("moe", f"mean of {len(chosen)} replayed layers", mean_us, layers)]


def step_of(prediction: Prediction, results: Sequence[KernelResult], label: str = "today") -> Step:
    """The prediction as a :class:`Step`, each term joined to the result it was read from.

    >>> r = KernelResult("norm", "rmsnorm", "vllm", {"tokens": 1}, 2e-6, {"frac_peak_bw": 0.5})
    >>> step = step_of(Prediction(1, 64, (Term("rmsnorm", "norm", 2.0, 4),), ()), [r])
    >>> step.total_us, step.group_roofline_us("rmsnorm")
    (8.0, 4.0)
    """
    by_name: dict[str, list[KernelResult]] = {}
    for r in results:
        by_name.setdefault(r.name, []).append(r)
    parts = []
    for term in prediction.terms:
        # the result the prediction chose: its name, and its median to the bit (files may repeat a name)
        chosen = next((r for r in by_name.get(term.benchmark, []) if r.median_s * 1e6 == term.per_call_us), None)
        parts.append(part_of(term.group, chosen, term.calls) if chosen else
                     Part(term.group, term.benchmark, term.per_call_us, term.calls, None))
    return Step(label, prediction.batch, prediction.context, tuple(parts), prediction.assumptions)
