"""The dense bf16 GEMMs of a decode step: MLA projections, absorbed W_UK/W_UV, shared expert,
dense-layer MLP and lm_head, per rank, at every token count M of the sweep.

Shapes come from :attr:`DecodeShapes.dense_gemms`; an op appears only if the checkpoint keeps
it in bf16, and the absorbed per-head ``uk``/``uv`` bmm's always (vLLM keeps bf16 copies of
``W_UK``/``W_UV``). Backends: ``torch`` (``F.linear``; ``torch.bmm`` for uk/uv, vLLM's own call)
and ``vllm``: ``UnquantizedLinearMethod.process_weights_after_loading`` once per weight, as the
loader does (on the CPU build that packs the weight for oneDNN or the sgl kernel), then its
``apply`` (docs/benchmarks.md, ``test_dense.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ..errors import BackendUnavailable, ShapeError
from ..registry import ComponentSpec, Per, StepCase, tokens_of
from ..roofline import Traffic
from ..shapes import BF16_BYTES, DecodeShapes, DenseGemm, Sweep, per_request_shape, token_label
from . import dsv3
from .base import Inputs, KernelCase, require_vllm_module, require_vllm_ops
from .binding import Binding, vllm_attribute

__all__ = ["COMPONENT", "DenseGemmCase", "dense_cases"]

_ADAPTER = "decodebench/kernels/dense.py"
# bf16 whatever the checkpoint: vLLM keeps bf16 copies of W_UK/W_UV for the absorbed bmm's, and
# builds lm_head (a ParallelLMHead, not a LinearBase) without the checkpoint's linear quantization
_ALWAYS_BF16 = frozenset({"uk", "uv", "lm_head"})


@dataclass(frozen=True)
class DenseGemmCase(KernelCase):
    """``out[M, n] = x[M, k] @ W.T`` with ``W [n, k]`` (a linear), or ``batch`` of them as one bmm."""

    component: ClassVar[str] = "dense_gemm"
    activation_inputs: ClassVar[tuple[str, ...]] = ("x",)

    op: str
    tokens: int
    n: int
    k: int
    per_step: int
    batch: int = 1
    per_request: int = 1  # K + 1 in a speculative verification step (tokens = requests x per_request)

    def __post_init__(self):
        token_label(self.tokens, self.per_request)  # a whole number of requests
        if min(self.tokens, self.n, self.k, self.batch) < 1 or self.per_step < 0:
            raise ShapeError(f"dense GEMM {self.op}: M, N, K and batch must be positive, got "
                             f"M={self.tokens} N={self.n} K={self.k} batch={self.batch}")

    @property
    def batched(self) -> bool:
        return self.batch > 1

    @property
    def id(self) -> str:
        heads = f"-h{self.batch}" if self.batched else ""
        return f"{self.op}{heads}-n{self.n}-k{self.k}-{token_label(self.tokens, self.per_request)}"

    def shape(self) -> dict[str, object]:
        return {"op": self.op, "M": self.tokens, "N": self.n, "K": self.k, "batch": self.batch,
                "per_step": self.per_step, "dtype": "bfloat16", **per_request_shape(self.per_request)}

    def traffic(self) -> Traffic:
        """The weight once and the activations in, the output out; 2·M·N·K FLOPs per GEMM."""
        m, n, k, b = self.tokens, self.n, self.k, self.batch
        return Traffic(b * (m * k + n * k) * BF16_BYTES, b * m * n * BF16_BYTES, 2 * b * m * n * k)

    def make_inputs(self, device, seed: int) -> Inputs:
        """``x`` and a weight scaled by ``k**-0.5`` (outputs O(1)); bmm weights ``[batch, k, n]`` (W_UK_T's layout)."""
        import torch

        gen = torch.Generator(device=device).manual_seed(seed)
        lead = (self.batch,) if self.batched else ()
        w_shape = (*lead, self.k, self.n) if self.batched else (self.n, self.k)
        x = torch.randn(*lead, self.tokens, self.k, generator=gen, device=device)
        w = torch.randn(*w_shape, generator=gen, device=device) * self.k ** -0.5
        return {"x": x.to(torch.bfloat16), "weight": w.to(torch.bfloat16)}

    def reference(self, inputs: Inputs):
        x, w = inputs["x"].float(), inputs["weight"].float()
        return x @ w if self.batched else x @ w.T

    def kernel(self, backend: str, device):
        if backend == "torch":
            return _torch_kernel(self.batched)
        if backend == "vllm":
            if self.batched:
                raise BackendUnavailable(f"vLLM's MLA layer runs {self.op} as torch.bmm (mla_attention.py): "
                                         "the torch backend times that call")
            # DeepSeek-V3's q_a runs vLLM's own small-batch kernel where its model would
            return dsv3.fused_a_gemm(self.n, self.k, device) or _vllm_linear(device)
        raise BackendUnavailable(f"dense_gemm has no backend {backend!r}")


def _torch_kernel(batched: bool):
    import torch
    import torch.nn.functional as F

    if batched:
        return lambda inp: torch.bmm(inp["x"], inp["weight"])
    return lambda inp: F.linear(inp["x"], inp["weight"])


def _vllm_linear(device):
    """``UnquantizedLinearMethod``: the loader step once per weight, then ``apply`` per call."""
    import torch

    require_vllm_ops(device)
    linear = require_vllm_module("vllm.model_executor.layers.linear")
    # every build has this class: a missing name or a changed signature is drift, and fails
    method = vllm_attribute(linear, "UnquantizedLinearMethod", _ADAPTER)()
    prepare = Binding.of(method.process_weights_after_loading, offers=("layer",), needs=("layer",), adapter=_ADAPTER)
    apply = Binding.of(method.apply, offers=("layer", "x", "bias"), needs=("layer", "x"), adapter=_ADAPTER)
    prepared: dict[str, Any] = {}

    def layer_for(weight):
        # keep the weight referenced, so a later tensor cannot reuse its identity
        if prepared.get("weight") is not weight:
            layer = torch.nn.Module()
            layer.weight = torch.nn.Parameter(weight, requires_grad=False)
            prepare(layer=layer)  # may pack the weight and drop layer.weight (CPU build)
            prepared.update(weight=weight, layer=layer)
        return prepared["layer"]

    return lambda inp: apply(layer=layer_for(inp["weight"]), x=inp["x"], bias=None)


def _runs_in_bf16(shapes: DecodeShapes, gemm: DenseGemm) -> bool:
    return gemm.op in _ALWAYS_BF16 or not shapes.spec.quant.is_quantized(gemm.module)


def dense_cases(shapes: DecodeShapes, sweep: Sweep) -> list[DenseGemmCase]:
    """Every bf16 linear of a decode step at every token count of ``sweep``.

    >>> from decodebench.model import load_model_spec
    >>> from decodebench.shapes import sweep_for
    >>> shapes = DecodeShapes.for_deployment(load_model_spec("kimi-k2.5"), 8)
    >>> [c.id for c in dense_cases(shapes, sweep_for("smoke"))][:3]
    ['q_a-n2112-k7168-m1', 'q_a-n2112-k7168-m8', 'q_b-n1536-k1536-m1']
    """
    return [DenseGemmCase(op=g.op, tokens=m, n=g.n, k=g.k, per_step=g.per_step, batch=g.batch,
                          per_request=sweep.per_request)
            for g in shapes.dense_gemms if _runs_in_bf16(shapes, g) for m in sweep.step_tokens]


def _gemm_of(shapes: DecodeShapes, shape) -> DenseGemm:
    """The dense GEMM of the step a result's ``op`` names (KeyError naming the op when the step runs none)."""
    for gemm in shapes.dense_gemms:
        if gemm.op == shape["op"]:
            return gemm
    raise KeyError(f"op {shape['op']!r} of {shapes.spec.name}'s step")


COMPONENT = ComponentSpec(
    name="dense_gemm", group="dense_gemm", case=DenseGemmCase, identity=("op",), per=Per.OP, parts=("dense_gemm",),
    calls=lambda shapes, s: _gemm_of(shapes, s).per_step,
    # the weight (batch: the heads of the batched uk, uv); x is an activation
    state_bytes=lambda s, info: s["N"] * s["K"] * BF16_BYTES * s.get("batch", 1),
    tokens=tokens_of,
    fits=lambda shapes, s, info: any(g.op == s.get("op") and (s.get("N", g.n), s.get("K", g.k)) == (g.n, g.k)
                                     for g in shapes.dense_gemms),  # another op's N and K: another model or TP
    launches=1,
    step_cases=lambda shapes: tuple(StepCase({"op": g.op}, g.op, f" (N={g.n}, K={g.k})") for g in shapes.dense_gemms),
)
