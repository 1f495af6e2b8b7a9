"""Micro -> macro: one decode step's kernel time predicted from kernel benchmark results.

For batch M and context L, each benchmarked component contributes (time per call at the
nearest benchmarked shape point) x (calls per step from the ModelSpec):

* RMSNorm: per layer one fused-add residual norm pair, the q and kv latent norms, plus the
  final norm (the very first residual norm has no add);
* MoE (fused, uniform routing), routing top-k and the router GEMM: once per MoE layer;
* MLA decode (uniform batch M at context L): once per layer;
* dense bf16 GEMMs: the op's calls per step (lm_head once, dense MLP per dense layer,
  shared expert per MoE layer, attention projections per layer);
* all-reduce at M tokens: ``1 + 2 * layers`` times per step at TP > 1.

Results are compared with the profiled step by group: MoE is benchmarked as one fused
call (GEMMs and glue), and the router GEMM runs cuBLAS like every dense GEMM, so it is
predicted under dense GEMMs, where the profile finds it. Rotary, sampling, copies and
other are not benchmarked; the profile's share of them is named in the remainder.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ..model import ModelSpec
from .rules import Component

__all__ = ["GROUPS", "KernelResult", "Prediction", "Term", "load_results", "predict_step", "results_from_dicts"]

# Comparison groups: a benchmarked part of the step and the profiled components it covers.
GROUPS: dict[str, tuple[str, ...]] = {
    "moe": (Component.MOE_GEMM.value, Component.MOE_GLUE.value),
    "routing": (Component.ROUTING.value,),
    "mla_attention": (Component.ATTENTION.value,),
    "dense_gemm": (Component.DENSE_GEMM.value,),
    "allreduce": (Component.ALLREDUCE.value,),
    "rmsnorm": (Component.RMSNORM.value,),
}
BACKEND_PREFERENCE = ("vllm", "torch")
# extra_info fields a result keeps beside its median: its roofline (what-if, projection), whether vLLM's
# selector dispatches it here (MLA), and where a collective ran.
INFO_KEYS = ("bytes_read", "bytes_written", "flops", "frac_peak_bw", "frac_peak_flops", "bound", "peaks_source",
             "dispatched", "timer", "world_size", "message_bytes", "link_mode")


@dataclass(frozen=True)
class KernelResult:
    """One stored kernel benchmark: what it ran (component, shape) and its median seconds per call."""

    name: str
    component: str
    backend: str
    shape: dict
    median_s: float
    info: dict = field(default_factory=dict)  # the INFO_KEYS of its extra_info (plus ``gpu``, ``link``)


@dataclass(frozen=True)
class Term:
    """One benchmark's share of the predicted step."""

    group: str
    benchmark: str
    per_call_us: float
    calls: int

    @property
    def us(self) -> float:
        return self.per_call_us * self.calls


@dataclass(frozen=True)
class Prediction:
    """The predicted kernel time of one decode step, term by term."""

    batch: int
    context: int
    terms: tuple[Term, ...]
    missing: tuple[str, ...]  # groups the results could not cover, with why

    def groups_us(self) -> dict[str, float]:
        out = {group: 0.0 for group in GROUPS}
        for term in self.terms:
            out[term.group] += term.us
        return out

    @property
    def total_us(self) -> float:
        return sum(term.us for term in self.terms)

    def to_info(self) -> dict:
        return {"batch": self.batch, "context": self.context, "total_us": self.total_us,
                "groups_us": self.groups_us(), "missing": list(self.missing),
                "terms": [{"group": t.group, "benchmark": t.benchmark, "per_call_us": t.per_call_us,
                           "calls": t.calls} for t in self.terms]}


def results_from_dicts(benchmarks: Iterable[dict]) -> list[KernelResult]:
    """Kernel results from pytest-benchmark's per-benchmark dicts (stored JSON or ``as_dict()``)."""
    results = []
    for bench in benchmarks:
        info = bench.get("extra_info") or {}
        median = (bench.get("stats") or {}).get("median")
        if info.get("component") and isinstance(info.get("shape"), dict) and median:
            results.append(KernelResult(bench.get("name", "?"), info["component"], info.get("backend", "?"),
                                        info["shape"], float(median), _kept_info(info)))
    return results


def _kept_info(info: dict) -> dict:
    """The INFO_KEYS of ``extra_info``, and for a collective the GPU model and link it ran over."""
    kept = {k: info[k] for k in INFO_KEYS if k in info}
    gpus = (info.get("topology") or {}).get("gpus") or []
    if gpus and gpus[0].get("name"):
        kept["gpu"] = gpus[0]["name"]
    if isinstance(info.get("link"), dict) and info["link"].get("link"):
        kept["link"] = info["link"]["link"]
    return kept


def load_results(path: Path) -> tuple[list[KernelResult], dict]:
    """Kernel results and the run's ``machine_info["decodebench"]`` (model, tp) from a stored JSON.

    Raises ValueError naming the file when it is not a pytest-benchmark result file.
    """
    try:
        data = json.loads(Path(path).read_text())
        benchmarks = data["benchmarks"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a pytest-benchmark result file ({exc})") from None
    return results_from_dicts(benchmarks), (data.get("machine_info") or {}).get("decodebench") or {}


def backend_rank(r: KernelResult) -> int:
    """How much ``r``'s backend stands for what the server runs: the one vLLM's selector dispatches
    here first (MLA results say so), then ``vllm``, then ``torch``, then any other id."""
    if r.info.get("dispatched"):
        return 0
    return 1 + (BACKEND_PREFERENCE.index(r.backend) if r.backend in BACKEND_PREFERENCE else len(BACKEND_PREFERENCE))


def _nearest(results: list[KernelResult], distance) -> KernelResult | None:
    """The result nearest in shape (log distance), the preferred backend breaking ties."""
    def key(r: KernelResult):
        return (distance(r.shape), backend_rank(r))
    return min(results, key=key, default=None)


def _log_gap(value, target: int) -> float:
    return abs(math.log(value / target)) if value else math.inf


def predict_step(results: list[KernelResult], spec: ModelSpec, tp: int, batch: int, context: int) -> Prediction:
    """Predict one decode step of ``spec`` (its ``num_layers`` as served) at TP ``tp``.

    >>> from decodebench.model import load_model_spec
    >>> r = [KernelResult("rms", "rmsnorm", "vllm", {"tokens": 1, "width": 256, "fused_add": True}, 2e-6)]
    >>> p = predict_step(r, load_model_spec("tiny-kimi"), tp=1, batch=1, context=64)
    >>> p.groups_us()["rmsnorm"], p.terms[0].calls
    (8.0, 4)
    """
    terms: list[Term] = []
    missing: list[str] = []
    by_component, other_ranks = _by_component(results, tp)
    moe_layers = max(0, spec.num_layers - spec.first_dense_layers)
    router_in_dense = any("router" in str(r.shape.get("op", "")) for r in by_component.get("dense_gemm", []))
    for group, component, calls, pick in _plan(spec, tp, batch, context, moe_layers):
        if calls == 0 or (component == "router_gemm" and router_in_dense):  # counted once, among dense GEMMs
            continue
        chosen = pick(by_component.get(component, []))
        if chosen is None:
            why = f" (only at world size {', '.join(map(str, other_ranks))})" if component == "allreduce" and \
                other_ranks else ""
            missing.append(f"{group}: no {component} result{_for_what(component, spec, tp, batch, context)}{why}")
            continue
        terms.append(Term(group, chosen.name, chosen.median_s * 1e6, calls))
    terms += _dense_terms(by_component.get("dense_gemm", []), spec, batch, moe_layers)
    if not by_component.get("dense_gemm"):
        missing.append("dense_gemm: no dense_gemm results (projections, shared expert, lm_head not benchmarked)")
    return Prediction(batch, context, tuple(terms), tuple(missing))


def _by_component(results: list[KernelResult], tp: int) -> tuple[dict[str, list[KernelResult]], list[int]]:
    """The results by component, all-reduce results measured over another number of ranks than ``tp``
    (a 1-GPU code-path check) set aside; the world sizes set aside."""
    by_component: dict[str, list[KernelResult]] = {}
    other_ranks: set[int] = set()
    for r in results:
        if r.component == "allreduce" and r.info.get("world_size", tp) != tp:
            other_ranks.add(r.info["world_size"])
            continue
        by_component.setdefault(r.component, []).append(r)
    return by_component, sorted(other_ranks)


def _for_what(component: str, spec: ModelSpec, tp: int, batch: int, context: int) -> str:
    return f" for {spec.name} at TP {tp}, M={batch}" + (f", L={context}" if component == "mla_decode" else "")


def _plan(spec: ModelSpec, tp: int, batch: int, context: int, moe_layers: int):
    """(group, result component, calls per step, picker) for every benchmark kind but dense GEMMs."""
    layers = spec.num_layers
    near_m = lambda extra=None: lambda rs: _nearest(  # noqa: E731 - a family of small pickers
        [r for r in rs if extra is None or extra(r.shape)], lambda s: _log_gap(s.get("tokens"), batch))
    norm = lambda role, fused: near_m(lambda s: s.get("role", "hidden") == role and s.get("fused_add") == fused)  # noqa: E731
    return (
        ("rmsnorm", "rmsnorm", 2 * layers, norm("hidden", True)),
        ("rmsnorm", "rmsnorm", 1, norm("hidden", False)),
        ("rmsnorm", "rmsnorm", layers, norm("q_lora", False)),
        ("rmsnorm", "rmsnorm", layers, norm("kv_lora", False)),
        ("moe", "moe", moe_layers, near_m(lambda s: s.get("stage") == "fused" and s.get("routing") == "uniform")),
        ("routing", "routing_topk", moe_layers, near_m()),
        ("dense_gemm", "router_gemm", moe_layers, near_m()),
        ("mla_attention", "mla_decode", layers, lambda rs: _nearest(
            [r for r in rs if not r.shape.get("mixed")],
            lambda s: _log_gap(s.get("batch"), batch) + _log_gap(s.get("context_max"), context))),
        ("allreduce", "allreduce", 1 + 2 * layers if tp > 1 else 0, near_m(lambda s: s.get("tokens"))),
    )


def _dense_calls(op: str, spec: ModelSpec, moe_layers: int) -> int:
    """Calls per step of a dense GEMM, from its op name."""
    name = op.lower()
    if "lm_head" in name:
        return 1
    if "shared" in name or "router" in name:
        return moe_layers
    if "dense" in name or "mlp" in name:
        return min(spec.num_layers, spec.first_dense_layers)
    return spec.num_layers  # attention projections: every layer


def _dense_terms(results: list[KernelResult], spec: ModelSpec, batch: int, moe_layers: int) -> list[Term]:
    """One term per dense GEMM op (``shape["op"]``), at the token count nearest ``batch``."""
    ops: dict[str, list[KernelResult]] = {}
    for r in results:
        ops.setdefault(str(r.shape.get("op", r.name)), []).append(r)
    terms = []
    for op, rs in sorted(ops.items()):
        chosen = _nearest(rs, lambda s: _log_gap(s.get("tokens", s.get("M", s.get("m"))), batch))
        terms.append(Term("dense_gemm", chosen.name, chosen.median_s * 1e6, _dense_calls(op, spec, moe_layers)))
    return terms
