"""What speculative decoding would buy: ``--what-if spec=METHOD:K:ACCEPT[:DRAFT_US[:HOST_US]]``.

A step with K drafts per request verifies K + 1 tokens of each of the C requests at once
(:func:`verification_step`, from the ``--verify-tokens`` kernel results), and the draft adds its cost
(:func:`draft_cost`). Each draft token is accepted with probability ``a`` given that every one before
it was, so a step yields ``E = sum_{i=0..K} a**i`` tokens per request, and

    TPOT(spec) = (verification step + carried + draft + h·C·(E − 1)) / E,    TPOT(today) = step + carried,

``carried`` the profile's time beyond the predicted kernels (0 from kernel results alone), ``h``
(HOST_US) host time per extra token. :func:`break_even` gives the acceptance at which speculative
decoding wins (None: no acceptance does). Each term and the measurements behind ``h``:
docs/projection.md, "Speculative decoding".
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from ...model import ModelSpec
from ...registry import get
from ...serving.spec import SpecMethod, expected_tokens, per_position_acceptance
from ...shapes import DecodeShapes
from ..depth import with_layers
from .prediction import _fits, _log_gap, backend_rank, one_per_point, predict_step, step_of
from .step import KernelResult, Part, Step, roofline_us

__all__ = ["SPEC_PREFIX", "SpecWhatIf", "break_even", "draft_cost", "parse_spec_what_if", "projected",
           "spec_lines", "spec_scenario", "spec_tpot_us", "verification_step"]

SPEC_PREFIX = "spec="
_NUMBER = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)$")
MLA = "mla_attention"


@dataclass(frozen=True)
class SpecWhatIf:
    """K draft tokens per step by ``method``, each accepted with probability ``acceptance``.

    >>> w = parse_spec_what_if("spec=ngram:4:0.6")
    >>> w.label, w.expected_tokens
    ('spec=ngram:4:0.6', 2.3056)
    """

    method: SpecMethod
    k: int
    acceptance: float
    draft_us: float | None = None  # the draft's time per step, given; None: estimated (ngram: 0)
    host_us: float = 0.0  # host µs per token a step emits beyond one per request, given

    @property
    def label(self) -> str:
        draft = f":{self.draft_us:g}" if self.draft_us is not None else ""
        host = f":{self.host_us:g}" if self.host_us else ""
        return f"{SPEC_PREFIX}{self.method.value}:{self.k}:{self.acceptance:g}{draft}{host}"

    @property
    def expected_tokens(self) -> float:
        return expected_tokens(self.acceptance, self.k)


def parse_spec_what_if(text: str) -> SpecWhatIf:
    """``spec=METHOD:K:ACCEPT[:DRAFT_US[:HOST_US]]`` -> :class:`SpecWhatIf`; ValueError naming what is wrong.

    >>> parse_spec_what_if("spec=mtp:2:0.8:120").draft_us
    120.0
    >>> parse_spec_what_if("spec=ngram:4:0.6:0:56").host_us
    56.0
    >>> parse_spec_what_if("spec=ngram:4:1.5")
    Traceback (most recent call last):
    ...
    ValueError: spec=ngram:4:1.5: ACCEPT must be a per-position acceptance in [0, 1], got '1.5'
    """
    body = text[len(SPEC_PREFIX):] if text.startswith(SPEC_PREFIX) else text
    fields = body.split(":")
    usage = "write spec=METHOD:K:ACCEPT[:DRAFT_US[:HOST_US]], e.g. spec=ngram:4:0.6"
    if len(fields) not in (3, 4, 5):
        raise ValueError(f"{text}: {usage}")
    method, k, accept = fields[:3]
    if method not in {m.value for m in SpecMethod}:
        raise ValueError(f"{text}: unknown method {method!r}; choose one of {', '.join(m.value for m in SpecMethod)}")
    if not k.isdigit() or int(k) < 1:
        raise ValueError(f"{text}: K must be a whole number of draft tokens of 1 or more, got {k!r}")
    if not _NUMBER.match(accept) or not 0 <= float(accept) <= 1:
        raise ValueError(f"{text}: ACCEPT must be a per-position acceptance in [0, 1], got {accept!r}")
    draft = fields[3] if len(fields) >= 4 else None
    if draft is not None and not _NUMBER.match(draft):
        raise ValueError(f"{text}: DRAFT_US must be the draft's µs per step, got {draft!r}")
    host = fields[4] if len(fields) == 5 else "0"
    if not _NUMBER.match(host):
        raise ValueError(f"{text}: HOST_US must be the host µs per token a step emits beyond one per request, "
                         f"got {host!r}")
    return SpecWhatIf(SpecMethod(method), int(k), float(accept), float(draft) if draft is not None else None,
                      float(host))


# --- the verification step and the draft ------------------------------------------------------------


def verification_step(results: Sequence[KernelResult], spec: ModelSpec, tp: int, requests: int, context: int,
                      k: int, routing: str | None = "uniform") -> Step:
    """The predicted kernel time of one verification step of ``requests`` requests with K drafts each:
    token-wise terms at M = requests·(K + 1), MLA with K + 1 query tokens per request.

    >>> r = [KernelResult("n1", "rmsnorm", "vllm", {"tokens": 1, "fused_add": True}, 2e-6),
    ...      KernelResult("n3", "rmsnorm", "vllm", {"tokens": 3, "fused_add": True, "per_request": 3}, 3e-6)]
    >>> from decodebench.model import load_model_spec
    >>> step = verification_step(r, load_model_spec("tiny-kimi"), 1, 1, 64, k=2)
    >>> step.batch, step.groups_us()["rmsnorm"]
    (3, 12.0)
    """
    tokens = requests * (k + 1)
    step = step_of(predict_step(list(results), spec, tp, tokens, context, routing), results,
                   label=f"verify K={k}")
    step = _with_verification_mla(step, results, spec, tp, requests, context, k + 1)
    return step.with_parts(step.parts, step.label, _far_note(step, requests, k + 1))


FAR = 1.25  # a term read from a result measured more than this factor away from the step's tokens


def _far_note(step: Step, requests: int, q_len: int) -> list[str]:
    """A note naming the terms whose nearest result lies far from the verification step's tokens
    (the nearest point of a sweep that ends below M = C·(K + 1) under-predicts it)."""
    far = {}
    for part in step.parts:
        r = part.result
        if r is None or r.component == "allreduce" and r.info.get("world_size") is None:
            continue
        measured, wanted = get(r.component).tokens_at(r.shape), step.batch  # step.batch = requests x q_len
        if measured and max(measured / wanted, wanted / measured) > FAR:
            far.setdefault(part.group, set()).add(measured)
    if not far:
        return []
    what = "; ".join(f"{g} at {'/'.join(map(str, sorted(ms)))}" for g, ms in far.items())
    return [f"verification step M={step.batch}: terms read from results measured far from it ({what} tokens): "
            f"the nearest measured point stands in, which under-predicts a larger step; measure it "
            f"(--verify-tokens {q_len}, {requests} requests)"]


def _with_verification_mla(step: Step, results: Sequence[KernelResult], spec: ModelSpec, tp: int, requests: int,
                           context: int, q_len: int) -> Step:
    """``step`` with its MLA term from the results of ``q_len`` query tokens per request nearest
    (``requests``, ``context``); without any, the step keeps its one-query stand-in and says so."""
    shapes = DecodeShapes.for_deployment(spec, tp)
    offered = [r for r in one_per_point(results)[0] if r.component == "mla_decode" and r.shape.get("q_len") == q_len
               and not r.shape.get("mixed") and _fits(r, shapes)]
    mine = [p for p in step.parts if p.group == MLA]
    if not mine:
        return step
    def nearest(r: KernelResult):
        return (_log_gap(r.shape.get("batch"), requests) + _log_gap(r.shape.get("context_max"), context),
                backend_rank(r))
    chosen = min(offered, key=nearest, default=None)
    if chosen is None:
        note = (f"{MLA}: no MLA result with {q_len} query tokens per request (--verify-tokens {q_len}); one query "
                f"token per request at batch {requests * q_len} stands in (it reads the KV cache {q_len}x)")
        return step.with_parts(step.parts, step.label, [note])
    part = Part(MLA, chosen.name, chosen.median_s * 1e6, mine[0].calls, roofline_us(chosen),
                f"{q_len} query tokens per request", chosen)
    return step.with_parts([p for p in step.parts if p.group != MLA] + [part], step.label)


def draft_cost(what_if: SpecWhatIf, results: Sequence[KernelResult], spec: ModelSpec, tp: int, requests: int,
               context: int, routing: str | None = "uniform") -> tuple[float, str]:
    """The draft's µs per step and how it was reached.

    ``ngram`` drafts on the host (prompt lookup): no kernel result holds that time, so it is 0
    unless the what-if gives it. MTP and EAGLE run K passes of one decoder layer and the lm_head
    at M = ``requests`` (one draft token per request per pass), each pass predicted from the
    results as the difference between a 2- and a 1-layer step (one MoE layer past the dense one).
    """
    if what_if.draft_us is not None:
        return what_if.draft_us, f"{what_if.draft_us:g} µs per step, as the what-if gives it"
    if what_if.method is SpecMethod.NGRAM:
        return 0.0, ("ngram proposes on the host and no kernel result holds its time: 0 µs assumed "
                     "(give it as spec=ngram:K:ACCEPT:DRAFT_US)")
    if what_if.method is SpecMethod.NGRAM_GPU:
        return 0.0, ("ngram_gpu looks the drafts up in a few small kernels that no kernel result holds: 0 µs "
                     "assumed (give it as spec=ngram_gpu:K:ACCEPT:DRAFT_US)")
    layer = _one_layer_us(results, spec, tp, requests, context, routing)
    head = _lm_head_us(results, spec, tp, requests, context, routing)
    draft = what_if.k * (layer + head)
    what = ("the model's MTP layer" if what_if.method is SpecMethod.MTP
            else "an EAGLE layer, taken as one of the model's")
    return draft, (f"{what_if.k} passes x ({what}: {layer:.1f} µs + lm_head {head:.1f} µs) at M={requests}, "
                   "from the kernel results")


def _one_layer_us(results, spec: ModelSpec, tp: int, tokens: int, context: int, routing) -> float:
    """One MoE decoder layer: the step with one more layer than the dense ones, minus the step without it."""
    first = spec.first_dense_layers
    deeper = predict_step(list(results), with_layers(spec, first + 1), tp, tokens, context, routing).total_us
    if not first:  # no dense layer to stand on: the 1-layer step without its lm_head
        return max(0.0, deeper - _lm_head_us(results, spec, tp, tokens, context, routing))
    shallow = predict_step(list(results), with_layers(spec, first), tp, tokens, context, routing).total_us
    return max(0.0, deeper - shallow)


def _lm_head_us(results, spec: ModelSpec, tp: int, tokens: int, context: int, routing) -> float:
    prediction = predict_step(list(results), with_layers(spec, 1), tp, tokens, context, routing)
    return sum(t.us for t in prediction.terms if t.group == "dense_gemm" and "lm_head" in t.benchmark)


# --- TPOT and the break-even acceptance ---------------------------------------------------------------


def spec_tpot_us(verify_us: float, draft_us: float, tokens_per_step: float, carried_us: float = 0.0,
                 host_us: float = 0.0) -> float:
    """TPOT with speculative decoding: the step (verification + carried + draft, and ``host_us`` for
    each token per request beyond the first: h·C) over its tokens.

    >>> spec_tpot_us(verify_us=1500.0, draft_us=0.0, tokens_per_step=2.5, carried_us=1000.0)
    1000.0
    >>> spec_tpot_us(verify_us=1500.0, draft_us=0.0, tokens_per_step=2.5, carried_us=1000.0, host_us=100.0)
    1060.0
    """
    if tokens_per_step < 1:
        raise ValueError(f"a step yields at least one token per request, got {tokens_per_step}")
    return (verify_us + carried_us + draft_us + host_us * (tokens_per_step - 1)) / tokens_per_step


def break_even(today_us: float, verify_us: float, draft_us: float, k: int, carried_us: float = 0.0,
               host_us: float = 0.0) -> float | None:
    """The per-position acceptance above which speculative decoding's TPOT beats today's; 0 when
    it wins at any acceptance, None when it wins at none (the step costs more than K + 1 plain ones).
    ``host_us``: h·C, as :func:`spec_tpot_us` takes it; it wins where
    E > (verify + carried + draft − h·C) / (today + carried − h·C).

    >>> round(break_even(today_us=1000.0, verify_us=1500.0, draft_us=0.0, k=4), 4)  # a + a² + a³ + a⁴ = 0.5
    0.3362
    >>> break_even(1000.0, 6000.0, 0.0, k=4) is None
    True
    >>> round(break_even(1000.0, 1500.0, 0.0, k=4, host_us=500.0), 4)  # E > 2: a + a² + a³ + a⁴ = 1
    0.5188
    """
    if today_us + carried_us - host_us <= 0:  # each extra token costs the host a whole step or more
        return None
    ratio = (verify_us + carried_us + draft_us - host_us) / (today_us + carried_us - host_us)
    if ratio <= 1:
        return 0.0
    if ratio >= k + 1:
        return None
    return per_position_acceptance(ratio, k)


def spec_scenario(what_if: SpecWhatIf, today: Step, results: Sequence[KernelResult], spec: ModelSpec, tp: int, *,
                  routing: str | None = "uniform", carried_us: float | None = None,
                  tpot_us: float | None = None) -> dict:
    """One spec what-if at ``today``'s batch (the requests) and context, as a JSON-able dict.

    ``tpot_us``: the TPOT measured at today's step (live, or from a profile); what it holds beyond
    the predicted kernels is carried into the speculative step. ``carried_us`` gives that directly.
    """
    verify = verification_step(results, spec, tp, today.batch, today.context, what_if.k, routing)
    draft, draft_how = draft_cost(what_if, results, spec, tp, today.batch, today.context, routing)
    carried = carried_us if carried_us is not None else (tpot_us - today.total_us if tpot_us is not None else 0.0)
    e, host = what_if.expected_tokens, what_if.host_us * today.batch
    return {"label": what_if.label, "method": what_if.method.value, "k": what_if.k, "acceptance": what_if.acceptance,
            "expected_tokens": e, "requests": today.batch, "context": today.context, "verify_tokens": verify.batch,
            "today_kernel_us": today.total_us, "verify_kernel_us": verify.total_us,
            "verify_groups_us": verify.groups_us(),
            "draft_us": draft, "draft_how": draft_how, "carried_us": carried,
            "carried_how": _carried_how(carried_us, tpot_us),
            "host_us_per_token": what_if.host_us, "host_how": _host_how(what_if.host_us, today.batch),
            "today_tpot_us": today.total_us + carried,
            "tpot_us": spec_tpot_us(verify.total_us, draft, e, carried, host),
            "break_even_acceptance": break_even(today.total_us, verify.total_us, draft, what_if.k, carried, host),
            "extrapolated": _extrapolated(verify), "assumptions": [ASSUMPTION, *verify.assumptions],
            "parts": [p.to_info() for p in verify.parts]}


def _extrapolated(verify: Step) -> bool:
    """Whether a term of the verification step was read from a result far from its shape."""
    return any(a.startswith("verification step M=") for a in verify.assumptions)


ASSUMPTION = ("spec: i.i.d. acceptance (each draft accepted with probability ACCEPT given the ones before it), "
              "K drafts every step, E = sum_{i=0..K} ACCEPT^i tokens per step; "
              "TPOT = (verification step + carried + draft + HOST_US x C x (E - 1)) / E")


def _host_how(host_us: float, requests: int) -> str:
    if not host_us:
        return ""
    return (f"{host_us:g} µs per token a step emits beyond one per request, as the what-if gives it "
            f"(x {requests} requests x (E - 1) per step), serial with the step, the same on any GPU")


def _carried_how(carried_us: float | None, tpot_us: float | None) -> str:
    if carried_us is not None:
        return "carried over from the profile of today's step (GPU idle and kernels no benchmark covers)"
    if tpot_us is not None:
        return "the measured TPOT minus today's predicted kernels, carried over unchanged"
    return "none: from kernel results alone both TPOTs are kernel time per step"


def spec_lines(label: str, rows: Sequence[dict]) -> list[str]:
    """The spec what-ifs of one load as text, a row each.

    >>> row = {"label": "spec=ngram:4:0.6", "requests": 1, "verify_tokens": 5, "today_tpot_us": 1000.0,
    ...        "verify_kernel_us": 1500.0, "draft_us": 0.0, "carried_us": 0.0, "expected_tokens": 2.3056,
    ...        "tpot_us": 650.6, "break_even_acceptance": 0.3532, "assumptions": [], "draft_how": "", "carried_how": ""}
    >>> print(spec_lines("m1", [row])[2])
      spec=ngram:4:0.6             1  M=5      1000.0     1500.0      0.0      0.0   2.31    650.6 -34.9%    0.35
    """
    if not rows:
        return []
    lines = [f"{label}: speculative decoding, µs per output token (TPOT) and the acceptance above which it wins",
             f"  {'what-if':<24}{'C':>6}  {'verify':<6}{'today':>9}{'step':>11}{'draft':>9}{'carried':>9}"
             f"{'E':>7}{'TPOT':>9}{'change':>7}{'wins at':>8}"]
    for r in rows:
        wins = "never" if r["break_even_acceptance"] is None else f"{r['break_even_acceptance']:.2f}"
        wins += "*" if r.get("extrapolated") else ""
        change = r["tpot_us"] / r["today_tpot_us"] - 1 if r["today_tpot_us"] else math.nan
        lines.append(f"  {r['label']:<24}{r['requests']:>6}  M={r['verify_tokens']:<4}{r['today_tpot_us']:>9.1f}"
                     f"{r['verify_kernel_us']:>11.1f}{r['draft_us']:>9.1f}{r['carried_us']:>9.1f}"
                     f"{r['expected_tokens']:>7.2f}{r['tpot_us']:>9.1f}{change:>+7.1%}{wins:>8}")
    notes = dict.fromkeys(n for r in rows for n in (*r["assumptions"], f"draft: {r['draft_how']}",
                                                      f"carried: {r['carried_how']}",
                                                      f"host per token: {r.get('host_how', '')}")
                          if not n.endswith(": "))
    if any(r.get("extrapolated") for r in rows):
        notes["* read from kernel results far from the verification step's shape (the note above): not a figure"] = None
    return lines + [f"  {n}" for n in notes]


def projected(row: dict, verify: Step, draft: float, today_us: float, carried: float) -> dict:
    """A spec row recomputed from a projected verification step (the target's kernels)."""
    e, host = row["expected_tokens"], row.get("host_us_per_token", 0.0) * row["requests"]
    return {**row, "today_kernel_us": today_us, "verify_kernel_us": verify.total_us, "verify_groups_us":
            verify.groups_us(), "draft_us": draft, "carried_us": carried, "today_tpot_us": today_us + carried,
            "tpot_us": spec_tpot_us(verify.total_us, draft, e, carried, host),
            "break_even_acceptance": break_even(today_us, verify.total_us, draft, row["k"], carried, host),
            "extrapolated": _extrapolated(verify),
            "assumptions": [a for a in verify.assumptions if a.startswith(("verification step", MLA + ": no MLA"))],
            "carried_how": ("the projection's GPU idle and kernels no benchmark covers" if carried else
                            "none: without a profile the projected TPOTs are kernel time per step"),
            "parts": [p.to_info() for p in verify.parts]}

