"""Expert routing of a MoE layer as Kimi decode runs it: router GEMM, then top-k selection.

Per MoE layer: ``logits = x @ W_gate.T`` (bf16, hidden -> one logit per expert), then
scores (sigmoid for Kimi), ``e_score_correction_bias`` added for *selection only*
(``topk_method = noaux_tc``), the best ``topk_group`` of ``n_group`` groups kept, the
top-k biased scores chosen, and the chosen experts weighted by their *unbiased*
scores, renormalized (``norm_topk_prob``) and scaled by ``routed_scaling_factor``.

Two case kinds, because vLLM runs two kernels with different ceilings, and a regression
in one should not hide in the other:

* :class:`RouterGemmCase` -- the GEMM, memory-bound on the 5.5 MB gate weight. ``torch`` is
  ``F.linear``; ``vllm`` is what ``GateLinear`` runs for Kimi: ``dsv3_router_gemm`` at small
  batches on Hopper and SM 10.x (:mod:`.dsv3`), else vLLM's ``dispatch_unquantized_gemm``
  (``GateLinear`` itself needs an initialised TP group).
* :class:`TopkCase` -- score, bias, select, renormalize, scale: latency-bound (a few KB).
  ``torch`` is plain torch in fp32; ``vllm`` is ``ops.grouped_topk`` on CUDA (the op vLLM's
  ``GroupedTopKRouter`` calls for this config; handed the routed scaling factor, which 0.32
  applies to the MoE output instead, one multiply in the same kernel's epilogue) and
  ``biased_topk_cpu`` (AVX512-BF16 builds only) on the CPU build.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, ClassVar

from ..errors import BackendUnavailable, KernelMismatch
from ..registry import ComponentSpec, Per, StepCase, tokens_of
from ..roofline import Traffic
from ..shapes import BF16_BYTES, FP32_BYTES, ID_BYTES, DecodeShapes, Sweep, per_request_shape, token_label
from . import dsv3
from .base import Inputs, KernelCase, relative_error, require_cpu_op, require_op, require_vllm_module, require_vllm_ops
from .binding import Binding, VllmApiMismatch, vllm_attribute

__all__ = ["ROUTER_GEMM", "ROUTING_TOPK", "MAX_ROUTING_TOKENS", "TIE_GAP", "RouterGemmCase", "Routing", "TopkCase",
           "router_gemm_cases", "select_experts", "topk_cases"]

MAX_ROUTING_TOKENS = 256  # the largest decode batch the routing benchmarks cover
# Biased scores closer than this at the k-th boundary are a tie: an fp32 kernel may
# legitimately pick either expert (fp32 sigmoid differs from fp64 by ~1e-7).
TIE_GAP = 1e-5
# Spread of the random correction bias: wide enough that biased and unbiased selections
# differ on most tokens, so a kernel that ignores the bias fails the check.
_BIAS_STD = 0.1
_ADAPTER = "decodebench/kernels/router.py"


@dataclass(frozen=True)
class RouterGemmCase(KernelCase):
    """``logits[M, experts] = x[M, hidden] @ W[experts, hidden].T`` in bf16, replicated on every rank."""

    component: ClassVar[str] = "router_gemm"
    activation_inputs: ClassVar[tuple[str, ...]] = ("x",)

    tokens: int
    hidden: int
    experts: int
    per_request: int = 1  # K + 1 in a speculative verification step (tokens = requests x per_request)

    @property
    def id(self) -> str:
        return f"n{self.experts}-k{self.hidden}-{token_label(self.tokens, self.per_request)}"

    def shape(self) -> dict[str, object]:
        return {"kind": "router_gemm", "tokens": self.tokens, "n": self.experts, "k": self.hidden,
                "dtype": "bfloat16", "out_dtype": "bfloat16", **per_request_shape(self.per_request)}

    def traffic(self) -> Traffic:
        m, n, k = self.tokens, self.experts, self.hidden
        return Traffic((m * k + n * k) * BF16_BYTES, m * n * BF16_BYTES, 2 * m * n * k)

    def make_inputs(self, device, seed: int) -> Inputs:
        import torch

        gen = torch.Generator(device=device).manual_seed(seed)
        x = torch.randn(self.tokens, self.hidden, generator=gen, device=device)
        # scaled like a trained gate so the logits are O(1), as the top-k sees them
        w = torch.randn(self.experts, self.hidden, generator=gen, device=device) * self.hidden ** -0.5
        return {"x": x.to(torch.bfloat16), "weight": w.to(torch.bfloat16)}

    def reference(self, inputs: Inputs):
        return inputs["x"].double() @ inputs["weight"].double().T

    def kernel(self, backend: str, device):
        if backend == "torch":
            import torch.nn.functional as F

            return lambda inp: F.linear(inp["x"], inp["weight"])
        if backend == "vllm":  # GateLinear's small-batch kernel where vLLM's model would run it, else its linear
            return dsv3.router_gemm(self.experts, self.hidden, self.tokens, device) or _vllm_gemm(device)
        raise BackendUnavailable(f"router_gemm has no backend {backend!r}")


# What the adapter passes to vLLM's GEMM dispatch; each is bound to the installed signature.
GEMM_OFFERS = ("layer", "x", "weight", "bias")
GEMM_NEEDS = ("layer", "x", "weight")
CPU_PREPARE_OFFERS = ("layer", "remove_weight")


def _vllm_gemm(device):
    """vLLM's unquantized-GEMM dispatch, prepared once per weight as vLLM prepares a layer."""
    import torch

    require_vllm_ops(device)
    layer_utils = require_vllm_module("vllm.model_executor.layers.utils")
    dispatch = vllm_attribute(layer_utils, "dispatch_unquantized_gemm", _ADAPTER)  # every build: gone is drift
    gemm = Binding.of(Binding.of(dispatch, offers=(), needs=(), adapter=_ADAPTER)(), offers=GEMM_OFFERS,
                      needs=GEMM_NEEDS, name="the GEMM dispatch_unquantized_gemm() returns", adapter=_ADAPTER)
    prepare = _cpu_prepare(layer_utils) if device.type == "cpu" else None
    prepared: dict[str, Any] = {}

    def layer_for(weight):
        # The CPU path packs the weight into the layer (oneDNN handle or sgl packing);
        # keep the weight referenced so a later tensor cannot reuse its identity.
        if prepared.get("weight") is not weight:
            layer = torch.nn.Module()
            layer.weight = torch.nn.Parameter(weight, requires_grad=False)
            if prepare is not None:
                prepare(layer=layer, remove_weight=False)
            prepared.update(weight=weight, layer=layer)
        return prepared["layer"]

    return lambda inp: gemm(layer=layer_for(inp["weight"]), x=inp["x"], weight=inp["weight"], bias=None)


def _cpu_prepare(layer_utils) -> Binding:
    # the CPU build packs a weight before its GEMM; without this step the GEMM timed would not be vLLM's
    prepare = vllm_attribute(layer_utils, "dispatch_cpu_unquantized_gemm", _ADAPTER)
    return Binding.of(prepare, offers=CPU_PREPARE_OFFERS, needs=("layer",), adapter=_ADAPTER)


@dataclass(frozen=True)
class Routing:
    """A routing decision: weights and expert ids ``[M, top_k]``, and which tokens tie at the boundary."""

    weights: Any
    ids: Any
    tied: Any  # bool [M]: the k-th and (k+1)-th choice (or the group boundary) are within TIE_GAP


@dataclass(frozen=True)
class TopkCase(KernelCase):
    """Scores, selection and weights of ``top_k`` experts of ``experts`` for ``tokens`` rows of logits."""

    component: ClassVar[str] = "routing_topk"
    activation_inputs: ClassVar[tuple[str, ...]] = ("logits",)  # the correction bias is state
    # Error = tokens whose expert set differs (ties aside) + relative L2 error of the
    # weights: any wrong set fails, and fp32 weights agree with fp64 to ~1e-7.
    tolerance: ClassVar[float] = 1e-3
    metric: ClassVar[str] = "mismatched_tokens+weight_rel_l2"

    tokens: int
    experts: int
    top_k: int
    n_group: int
    topk_group: int
    scoring_func: str
    biased: bool
    renormalize: bool
    scaling: float
    per_request: int = 1  # K + 1 in a speculative verification step (tokens = requests x per_request)

    @property
    def id(self) -> str:
        groups = f"-g{self.n_group}x{self.topk_group}" if self.n_group > 1 else ""
        return f"e{self.experts}-top{self.top_k}{groups}-{token_label(self.tokens, self.per_request)}"

    def shape(self) -> dict[str, object]:
        return {"kind": "topk", "tokens": self.tokens, "experts": self.experts, "top_k": self.top_k,
                "n_group": self.n_group, "topk_group": self.topk_group, "scoring_func": self.scoring_func,
                "correction_bias": self.biased, "renormalize": self.renormalize,
                "routed_scaling_factor": self.scaling, "logits_dtype": "bfloat16",
                **per_request_shape(self.per_request)}

    def traffic(self) -> Traffic:
        """Logits (and the fp32 bias) in, fp32 weights and int32 ids out; FLOPs count one
        per score and one per bias add per logit, three (sum, divide, scale) per choice."""
        m, e, k = self.tokens, self.experts, self.top_k
        read = m * e * BF16_BYTES + (e * FP32_BYTES if self.biased else 0)
        return Traffic(read, m * k * (FP32_BYTES + ID_BYTES), 2 * m * e + 3 * m * k)

    def make_inputs(self, device, seed: int) -> Inputs:
        import torch

        gen = torch.Generator(device=device).manual_seed(seed)
        logits = torch.randn(self.tokens, self.experts, generator=gen, device=device).to(torch.bfloat16)
        bias = None
        if self.biased:
            bias = torch.randn(self.experts, generator=gen, device=device) * _BIAS_STD
        return {"logits": logits, "bias": bias}

    def reference(self, inputs: Inputs) -> Routing:
        import torch

        weights, ids, choice = select_experts(self, inputs["logits"], inputs["bias"], torch.float64)
        return Routing(weights, ids, _ties(self, choice))

    def error(self, output, expected: Routing) -> float:
        """Tokens with a different expert set (tied tokens excluded) plus the weights' relative error."""
        import torch

        weights, ids = (t.detach().to("cpu") for t in output)
        if tuple(weights.shape) != tuple(expected.weights.shape) or tuple(ids.shape) != tuple(expected.ids.shape):
            raise KernelMismatch(f"routing output shapes {tuple(weights.shape)}, {tuple(ids.shape)} != "
                                 f"reference {tuple(expected.weights.shape)}")
        if not torch.isfinite(weights.double()).all():
            return float("inf")
        got_ids, got_w = _by_expert(ids, weights)
        ref_ids, ref_w = _by_expert(expected.ids.cpu(), expected.weights.cpu())
        compared = ~expected.tied.cpu()
        same = (got_ids == ref_ids).all(dim=-1)
        mismatched = int((compared & ~same).sum())
        keep = compared & same
        weight_err = relative_error(got_w[keep], ref_w[keep]) if keep.any() else 0.0
        return mismatched + weight_err

    def kernel(self, backend: str, device):
        if backend == "torch":
            import torch

            return lambda inp: select_experts(self, inp["logits"], inp["bias"], torch.float32)[:2]
        if backend == "vllm":
            ops = require_vllm_ops(device)
            if device.type != "cuda":
                return _cpu_biased_topk(self)
            require_op("_moe_C", "grouped_topk", every_build=("cuda",))  # the kernel behind it: every CUDA build
            return _vllm_grouped_topk(self, ops)
        raise BackendUnavailable(f"routing_topk has no backend {backend!r}")


def select_experts(case: TopkCase, logits, bias, dtype):
    """Route ``logits [M, E]`` in ``dtype``: ``(weights, ids, choice)``, ``choice`` being the
    biased scores the experts are chosen by (before the group mask).

    >>> import torch
    >>> case = TopkCase(1, 4, 2, 1, 1, "sigmoid", True, True, 2.0)
    >>> w, ids, _ = select_experts(case, torch.zeros(1, 4), torch.tensor([0.0, 0.3, 0.0, 0.2]), torch.float64)
    >>> sorted(ids[0].tolist()), w[0].tolist()
    ([1, 3], [1.0, 1.0])
    """
    scores = logits.to(dtype)
    scores = scores.sigmoid() if case.scoring_func == "sigmoid" else scores.softmax(dim=-1)
    choice = scores if bias is None else scores + bias.to(dtype)
    ids = _keep_best_groups(case, choice).topk(case.top_k, dim=-1).indices
    weights = scores.gather(-1, ids)  # the bias steers the choice, never the weight
    if case.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * case.scaling, ids, choice


def _group_scores(case: TopkCase, choice):
    """A group's score, as vLLM ranks groups: top-2 sum with a bias, else the max."""
    grouped = choice.view(choice.shape[0], case.n_group, -1)
    if case.biased:
        return grouped.topk(2, dim=-1).values.sum(dim=-1)
    return grouped.amax(dim=-1)


def _keep_best_groups(case: TopkCase, choice):
    if case.n_group == 1:
        return choice
    best = _group_scores(case, choice).topk(case.topk_group, dim=-1).indices
    keep = choice.new_zeros(choice.shape[0], case.n_group, dtype=bool).scatter_(1, best, True)
    keep = keep.repeat_interleave(case.experts // case.n_group, dim=1)
    return choice.masked_fill(~keep, float("-inf"))


def _ties(case: TopkCase, choice):
    """Tokens whose selection a last-bit difference could flip (expert or group boundary)."""
    import torch

    tied = torch.zeros(choice.shape[0], dtype=torch.bool, device=choice.device)
    if case.top_k < case.experts:  # a -inf runner-up (masked group) gives an infinite gap: no tie
        top = _keep_best_groups(case, choice).topk(case.top_k + 1, dim=-1).values
        tied |= (top[:, -2] - top[:, -1]) < TIE_GAP
    if case.n_group > case.topk_group:
        ranked = _group_scores(case, choice).topk(case.topk_group + 1, dim=-1).values
        tied |= (ranked[:, -2] - ranked[:, -1]) < TIE_GAP
    return tied


def _by_expert(ids, weights):
    """Ids sorted per token with their weights, so two routings compare as sets."""
    order = ids.long().argsort(dim=-1)
    return ids.long().gather(-1, order), weights.double().gather(-1, order)


def _require_noaux_sigmoid(case: TopkCase, op: str) -> None:
    if case.scoring_func != "sigmoid" or not case.biased:
        raise BackendUnavailable(f"{op} is benchmarked for sigmoid scoring with a correction bias (noaux_tc); "
                                 f"this model uses {case.scoring_func}{' with' if case.biased else ' without'} a bias")


# ops.grouped_topk: 0.32 takes raw logits and fuses the sigmoid (scoring_func); older
# releases take pre-activated scores and the biased scores (scores_with_bias).
TOPK_OFFERS = ("scores", "scores_with_bias", "num_expert_group", "topk_group", "topk", "renormalize",
               "routed_scaling_factor", "bias", "scoring_func")
TOPK_NEEDS = ("scores", "num_expert_group", "topk_group", "topk", "renormalize", "routed_scaling_factor")
_SIGMOID = 1  # ops.grouped_topk's scoring_func: 0 = scores already activated, 1 = sigmoid fused


def _vllm_grouped_topk(case: TopkCase, ops):
    """``ops.grouped_topk``, bound to the 0.32 signature (sigmoid fused) or the older one."""
    _require_noaux_sigmoid(case, "vLLM grouped_topk")
    op = vllm_attribute(ops, "grouped_topk", _ADAPTER)  # the Python wrapper is in every build
    topk = Binding.of(op, offers=TOPK_OFFERS, needs=TOPK_NEEDS, name="grouped_topk", adapter=_ADAPTER)
    args = dict(num_expert_group=case.n_group, topk_group=case.topk_group, topk=case.top_k,
                renormalize=case.renormalize, routed_scaling_factor=case.scaling)
    if "scoring_func" in topk.accepted:  # 0.32: raw logits in, sigmoid fused, fp32 weights out
        return lambda inp: topk(scores=inp["logits"], bias=inp["bias"], scoring_func=_SIGMOID, **args)
    if "scores_with_bias" in topk.accepted:  # older: scores activated by the caller, as vLLM did then

        def older(inp):
            # fp32 scores keep the selection exact (the old kernel returns the input dtype)
            scores = inp["logits"].float().sigmoid()
            return topk(scores=scores, scores_with_bias=scores + inp["bias"], **args)
        return older
    raise VllmApiMismatch(f"grouped_topk takes neither scoring_func (0.32) nor scores_with_bias (older): "
                          f"grouped_topk{inspect.signature(op)}; update {_ADAPTER}")


def _cpu_biased_topk(case: TopkCase):
    """``biased_topk_cpu``: the CPU build's native top-k (AVX512-BF16 build only, no expert groups).

    vLLM's own CPURouter routes Kimi through plain torch (``_grouped_topk``), which the
    ``torch`` backend already times; this is the native kernel the CPU build has.
    """
    _require_noaux_sigmoid(case, "biased_topk_cpu")
    op = require_cpu_op("biased_topk_cpu")  # built into the AVX512-BF16 library only
    if case.n_group != 1:
        raise BackendUnavailable(f"biased_topk_cpu has no expert groups; this model has n_group={case.n_group}")
    # A torch op (no Python signature to bind): its schema is checked by torch at the call.
    # The last flag True puts the routed scaling into the weights (vLLM 0.32.0, checked
    # against the reference by the correctness check before any timing).
    def call(logits, bias):
        return op(logits, logits, bias, case.top_k, case.renormalize, "sigmoid", 0, case.scaling, True)

    # it serves some (experts, top-k) pairs only and says so: "biased_topk_cpu: unsupported
    # num_experts 16", "... unsupported routed_topk 4 for num_experts=384"; asked once on one row
    import torch

    try:
        call(torch.zeros(1, case.experts, dtype=torch.bfloat16), torch.zeros(case.experts, dtype=torch.float32))
    except RuntimeError as exc:
        if "unsupported" not in str(exc):
            raise
        raise BackendUnavailable(f"{exc} (experts {case.experts}, top-k {case.top_k})") from None
    return lambda inp: call(inp["logits"], inp["bias"])


def _routing_tokens(sweep: Sweep) -> list[int]:
    """The step's tokens at each batch of up to 256 requests (verification steps: x K + 1)."""
    return [m * sweep.per_request for m in sweep.tokens if m <= MAX_ROUTING_TOKENS]


def router_gemm_cases(shapes: DecodeShapes, sweep: Sweep) -> list[RouterGemmCase]:
    """The router GEMM at every token count of ``sweep`` (up to 256).

    >>> from decodebench.model import load_model_spec
    >>> from decodebench.shapes import sweep_for
    >>> [c.id for c in router_gemm_cases(DecodeShapes.for_deployment(load_model_spec("kimi-k2.5"), 8),
    ...                                  sweep_for("smoke"))]
    ['n384-k7168-m1', 'n384-k7168-m8']
    """
    gemm = shapes.router
    return [RouterGemmCase(tokens=m, hidden=gemm.k, experts=gemm.n, per_request=sweep.per_request)
            for m in _routing_tokens(sweep)]


def topk_cases(shapes: DecodeShapes, sweep: Sweep) -> list[TopkCase]:
    """The top-k selection at every token count of ``sweep`` (up to 256), configured from the model.

    >>> from decodebench.model import load_model_spec
    >>> from decodebench.shapes import sweep_for
    >>> cases = topk_cases(DecodeShapes.for_deployment(load_model_spec("kimi-k2.5"), 8), sweep_for("smoke"))
    >>> [c.id for c in cases], cases[0].scaling
    (['e384-top8-m1', 'e384-top8-m8'], 2.827)
    """
    spec = shapes.spec  # its scoring function and expert groups were checked when its config was read
    return [
        TopkCase(tokens=m, experts=shapes.experts, top_k=shapes.top_k, n_group=spec.num_expert_groups,
                 topk_group=spec.topk_groups, scoring_func=spec.scoring_func,
                 biased=spec.topk_method == "noaux_tc", renormalize=spec.norm_topk_prob,
                 scaling=float(spec.routed_scaling_factor), per_request=sweep.per_request)
        for m in _routing_tokens(sweep)
    ]


def _same_experts(shapes: DecodeShapes, s, info) -> bool:
    return s.get("n", s.get("experts", shapes.experts)) == shapes.experts


ROUTER_GEMM = ComponentSpec(
    name="router_gemm", group="dense_gemm", case=RouterGemmCase, identity=("n", "k"), per=Per.MOE_LAYER,
    parts=("dense_gemm",),  # cuBLAS like every bf16 GEMM (or vLLM's dsv3_router_gemm): by name a dense GEMM
    calls=lambda shapes, s: shapes.spec.num_moe_layers,
    state_bytes=lambda s, info: s["n"] * s["k"] * BF16_BYTES,  # the gate's weight
    tokens=tokens_of,
    fits=_same_experts,
    launches=1,
    step_cases=lambda shapes: (StepCase({}),),
)
ROUTING_TOPK = ComponentSpec(
    name="routing_topk", group="routing", case=TopkCase, identity=("experts", "top_k"), per=Per.MOE_LAYER,
    parts=("routing",),
    calls=lambda shapes, s: shapes.spec.num_moe_layers,
    # the logits are activations; the correction bias (experts x fp32) is counted with them, below the
    # traffic rule's resolution (the projections in docs/attribution.md were fitted so)
    state_bytes=lambda s, info: 0,
    tokens=tokens_of,
    fits=_same_experts,
    launches=1,
    step_cases=lambda shapes: (StepCase({}),),
)
