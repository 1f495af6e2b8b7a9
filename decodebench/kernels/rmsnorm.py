"""RMSNorm, plain and fused with the residual add, as Kimi decode runs it.

Per layer: ``input_layernorm`` and ``post_attention_layernorm`` on the residual stream
(width ``hidden``, fused with the residual add), ``q_a_layernorm`` (``q_lora_rank``)
and ``kv_a_layernorm`` (``kv_lora_rank``), both plain.

Backends: ``torch`` (``F.rms_norm``; the reference path) and ``vllm``
(``torch.ops._C.rms_norm`` / ``fused_add_rms_norm``, in the CUDA and the CPU build).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..errors import BackendUnavailable
from ..registry import ComponentSpec, Per, StepCase, tokens_of
from ..roofline import Traffic
from ..shapes import BF16_BYTES, DecodeShapes, Sweep, per_request_shape, token_label
from .base import Inputs, KernelCase, relative_error, require_op, require_vllm_ops

__all__ = ["COMPONENT", "RMSNormCase", "rmsnorm_cases"]

_EVERY_BUILD = ("cuda", "cpu")  # both ops are in vLLM's CUDA and CPU builds: missing from either is a rename


@dataclass(frozen=True)
class RMSNormCase(KernelCase):
    """``y = x / rms(x) * w`` over ``width`` for ``tokens`` rows; with ``fused_add`` the
    residual is added first and written back, as vLLM's ``fused_add_rms_norm`` does."""

    component: ClassVar[str] = "rmsnorm"

    tokens: int
    width: int
    fused_add: bool
    eps: float
    role: str = ""
    per_request: int = 1  # K + 1 in a speculative verification step (tokens = requests x per_request)

    @property
    def id(self) -> str:
        kind = "add" if self.fused_add else "plain"
        return f"{kind}-w{self.width}-{token_label(self.tokens, self.per_request)}"

    @property
    def activation_inputs(self) -> tuple[str, ...]:
        """x and the residual come from the layer before; the weight is state; the output buffer
        is one the step reuses."""
        return ("x", "residual", "out") if self.fused_add else ("x", "out")

    def shape(self) -> dict[str, object]:
        return {"tokens": self.tokens, "width": self.width, "fused_add": self.fused_add,
                "eps": self.eps, "role": self.role, "dtype": "bfloat16", **per_request_shape(self.per_request)}

    def traffic(self) -> Traffic:
        rows = self.tokens * self.width * BF16_BYTES
        weight = self.width * BF16_BYTES
        if self.fused_add:  # read x and residual, write both back
            return Traffic(2 * rows + weight, 2 * rows, 5 * self.tokens * self.width)
        return Traffic(rows + weight, rows, 4 * self.tokens * self.width)

    def make_inputs(self, device, seed: int) -> Inputs:
        import torch

        gen = torch.Generator(device=device).manual_seed(seed)
        bf16 = torch.bfloat16

        def randn(*shape, scale=1.0):
            return (torch.randn(*shape, generator=gen, device=device) * scale).to(bf16)

        inputs = {
            "x": randn(self.tokens, self.width),
            "weight": (1.0 + randn(self.width, scale=0.1).float()).to(bf16),
            # poisoned: a kernel that does not write every element fails the check
            "out": torch.full((self.tokens, self.width), float("nan"), dtype=bf16, device=device),
        }
        if self.fused_add:
            inputs["residual"] = randn(self.tokens, self.width)
        return inputs

    def reference(self, inputs: Inputs):
        import torch

        x = inputs["x"].double()
        if self.fused_add:
            x = x + inputs["residual"].double()
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * inputs["weight"].double()
        return torch.stack([y, x]) if self.fused_add else y

    def error(self, output, expected) -> float:
        import torch

        if self.fused_add:
            output = torch.stack(list(output))
        return relative_error(output, expected)

    def kernel(self, backend: str, device):
        if backend == "torch":
            return self._torch_kernel()
        if backend == "vllm":
            return self._vllm_kernel(device)
        raise BackendUnavailable(f"rmsnorm has no backend {backend!r}")

    def _torch_kernel(self):
        import torch.nn.functional as F

        shape, eps = (self.width,), self.eps
        if self.fused_add:
            def fused(inp):
                summed = inp["x"] + inp["residual"]
                return F.rms_norm(summed, shape, inp["weight"], eps), summed
            return fused
        return lambda inp: F.rms_norm(inp["x"], shape, inp["weight"], eps)

    def _vllm_kernel(self, device):
        require_vllm_ops(device)
        eps = self.eps
        if self.fused_add:
            op = require_op("_C", "fused_add_rms_norm", _EVERY_BUILD)

            def fused(inp):  # in place: residual <- x + residual; x <- rmsnorm(residual) * w
                op(inp["x"], inp["residual"], inp["weight"], eps)
                return inp["x"], inp["residual"]
            return fused
        op = require_op("_C", "rms_norm", _EVERY_BUILD)

        def plain(inp):
            op(inp["out"], inp["x"], inp["weight"], eps)
            return inp["out"]
        return plain


def rmsnorm_cases(shapes: DecodeShapes, sweep: Sweep) -> list[RMSNormCase]:
    """Every RMSNorm of a decode layer at every token count of ``sweep``.

    >>> from decodebench.model import load_model_spec
    >>> from decodebench.shapes import sweep_for
    >>> cases = rmsnorm_cases(DecodeShapes.for_deployment(load_model_spec("kimi-k2.5"), 8), sweep_for("smoke"))
    >>> sorted({c.id for c in cases})[:3]
    ['add-w7168-m1', 'add-w7168-m8', 'plain-w1536-m1']
    """
    eps, widths, per_request = shapes.spec.rms_norm_eps, shapes.norm_widths, sweep.per_request
    return [RMSNormCase(tokens=m, width=widths[role], fused_add=fused, eps=eps, role=role, per_request=per_request)
            for role, fused in shapes.norms_per_step for m in sweep.step_tokens]


def _role(shape) -> str:
    return str(shape.get("role") or "hidden")  # results stored before the role was: the residual stream's


COMPONENT = ComponentSpec(
    name="rmsnorm", group="rmsnorm", case=RMSNormCase, identity=("role", "fused_add", "width"), per=Per.LAYER,
    parts=("rmsnorm",),
    calls=lambda shapes, s: shapes.norms_per_step[(_role(s), bool(s["fused_add"]))],
    state_bytes=lambda s, info: s["width"] * BF16_BYTES,  # the weight; x and the residual are activations
    tokens=tokens_of,
    fits=lambda shapes, s, info: s.get("width") in (None, shapes.norm_widths[_role(s)]),
    launches=1,
    step_cases=lambda shapes: tuple(StepCase({"role": role, "fused_add": fused}, absent={"role": "hidden"})
                                    for role, fused in shapes.norms_per_step),
)
