"""The rotary embedding of MLA decode: the rope part of every query head and of the latent key.

Per layer and decode step, vLLM's MLA attention rotates each token's ``q_pe`` (``heads`` x
``rope_dim``, 8 x 64 per rank for Kimi at TP 8) and its one ``k_pe`` (``rope_dim``) by the angles of
the token's position, read from a ``cos_sin_cache`` of ``max_position`` rows. DeepSeek-V3's MLA
rotates interleaved pairs (GPT-J style: vLLM's deepseek_v2 builds its MLA rope with
``is_neox_style=False``). The served step (vLLM's compiled graph, custom ops off) runs vLLM's
``forward_native`` through inductor, which fuses it into one generated kernel
(``triton_poi_fused_…index_mul_neg…stack…``), so the ``vllm`` backend is vLLM's own
``forward_static`` compiled by ``torch.compile``, as the step's inductor compiles it.

Backends: ``torch`` (the same rotation in eager torch: the reference path) and ``vllm``.
The check compares both rotated tensors with a float64 rotation of the inputs at bf16's 1e-2.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

from ..errors import BackendUnavailable
from ..registry import ComponentSpec, Per, Rule, StepCase, tokens_of
from ..roofline import Traffic
from ..shapes import DecodeShapes, Sweep, per_request_shape, token_label
from .base import Inputs, KernelCase, relative_error, require_vllm_module
from .binding import Binding, vllm_attribute

__all__ = ["COMPONENT", "RotaryCase", "rotary_cases"]

_BF16_BYTES = 2  # q, k and the cos/sin table (vLLM casts the table to the model's dtype)
_POSITION_BYTES = 8
_ROPE_MODULE = "vllm.model_executor.layers.rotary_embedding.deepseek_scaling_rope"
_ADAPTER = "decodebench/kernels/rotary.py"
_STATIC_ARGS = ("positions", "query", "key", "head_size", "rotary_dim", "cos_sin_cache", "is_neox_style")


@dataclass(frozen=True)
class RotaryCase(KernelCase):
    """``x * cos + rotate(x) * sin`` over the rope part of ``heads`` query heads and one key, ``tokens`` rows."""

    component: ClassVar[str] = "rotary"
    # the step has just written q_pe, k_pe and the positions; the cos/sin table is state
    activation_inputs: ClassVar[tuple[str, ...]] = ("q_pe", "k_pe", "positions")

    tokens: int
    heads: int
    rope_dim: int
    max_position: int
    neox: bool = False  # DeepSeek-V3's MLA rope: interleaved pairs
    per_request: int = 1  # K + 1 in a speculative verification step (tokens = requests x per_request)

    @property
    def id(self) -> str:
        return f"h{self.heads}-r{self.rope_dim}-{token_label(self.tokens, self.per_request)}"

    def shape(self) -> dict[str, object]:
        return {"tokens": self.tokens, "heads": self.heads, "rope_dim": self.rope_dim,
                "max_position": self.max_position, "neox": self.neox, "dtype": "bfloat16",
                **per_request_shape(self.per_request)}

    def traffic(self) -> Traffic:
        rows = self.tokens * (self.heads + 1) * self.rope_dim * _BF16_BYTES
        table = self.tokens * self.rope_dim * _BF16_BYTES  # one cos/sin row a token
        flops = 3 * self.tokens * (self.heads + 1) * self.rope_dim
        return Traffic(rows + table + self.tokens * _POSITION_BYTES, rows, flops)

    def make_inputs(self, device, seed: int) -> Inputs:
        import torch

        gen = torch.Generator(device=device).manual_seed(seed)
        bf16 = torch.bfloat16
        angles = torch.rand(self.max_position, self.rope_dim // 2, generator=gen, device=device) * 6.283
        return {
            "q_pe": torch.randn(self.tokens, self.heads, self.rope_dim, generator=gen, device=device).to(bf16),
            "k_pe": torch.randn(self.tokens, 1, self.rope_dim, generator=gen, device=device).to(bf16),
            "positions": torch.randint(0, self.max_position, (self.tokens,), generator=gen, device=device),
            "cos_sin_cache": torch.cat([angles.cos(), angles.sin()], dim=-1).to(bf16),
        }

    def reference(self, inputs: Inputs):
        """Both rotated tensors, stacked, in float64."""
        import torch

        cos, sin = inputs["cos_sin_cache"][inputs["positions"]].double().chunk(2, dim=-1)
        return torch.cat([_rotated(inputs[name].double(), cos, sin, self.neox).flatten(1) for name in ("q_pe", "k_pe")],
                         dim=1)

    def error(self, output, expected) -> float:
        import torch

        query, key = output
        return relative_error(torch.cat([query.flatten(1), key.flatten(1)], dim=1), expected)

    def kernel(self, backend: str, device):
        if backend == "torch":
            return self._torch_kernel()
        if backend == "vllm":
            return self._vllm_kernel()
        raise BackendUnavailable(f"rotary has no backend {backend!r}")

    def _torch_kernel(self):
        neox = self.neox

        def rotate(inp):
            cos, sin = inp["cos_sin_cache"][inp["positions"]].chunk(2, dim=-1)
            return tuple(_rotated(inp[name], cos, sin, neox) for name in ("q_pe", "k_pe"))
        return rotate

    def _vllm_kernel(self):
        import torch

        module = require_vllm_module(_ROPE_MODULE)
        static = vllm_attribute(module.DeepseekScalingRotaryEmbedding, "forward_static", _ADAPTER)
        Binding.of(static, offers=_STATIC_ARGS, needs=_STATIC_ARGS, name="forward_static", adapter=_ADAPTER)
        compiled = _compiled(static)
        dim, neox = self.rope_dim, self.neox

        def rotate(inp):  # the rope part is the whole head here, as the MLA layer passes q_pe and k_pe
            with torch.no_grad():
                return compiled(positions=inp["positions"], query=inp["q_pe"], key=inp["k_pe"], head_size=dim,
                                rotary_dim=dim, cos_sin_cache=inp["cos_sin_cache"], is_neox_style=neox)
        return rotate


@functools.cache
def _compiled(static):
    """vLLM's rotation compiled once per process, with the token count dynamic as vLLM compiles its graph (one
    compile range for every batch; static shapes would also run past dynamo's recompile limit in a sweep)."""
    import torch

    return torch.compile(static, dynamic=True, fullgraph=True)


def _rotated(x, cos, sin, neox: bool):
    """``x * cos + rotate(x) * sin`` with ``cos``/``sin`` of half the width, per token (rows of ``x``)."""
    import torch

    if neox:
        cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
        half = x.shape[-1] // 2
        turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    else:
        cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
        turned = torch.stack([-x[..., 1::2], x[..., ::2]], dim=-1).flatten(-2)
    return x * cos.unsqueeze(-2) + turned * sin.unsqueeze(-2)


def rotary_cases(shapes: DecodeShapes, sweep: Sweep) -> list[RotaryCase]:
    """The MLA rope of one layer at every token count of ``sweep``.

    >>> from decodebench.model import load_model_spec
    >>> from decodebench.shapes import sweep_for
    >>> [c.id for c in rotary_cases(DecodeShapes.for_deployment(load_model_spec("kimi-k2.5"), 8), sweep_for("smoke"))]
    ['h8-r64-m1', 'h8-r64-m8']
    """
    mla, positions = shapes.mla, shapes.spec.max_positions
    if positions is None:
        raise ValueError(f"{shapes.spec.name}: the config states no max_position_embeddings, the rope table's rows")
    return [RotaryCase(tokens=m, heads=mla.heads, rope_dim=mla.rope_dim, max_position=positions,
                       per_request=sweep.per_request) for m in sweep.step_tokens]


COMPONENT = ComponentSpec(
    name="rotary", group="rotary", case=RotaryCase, identity=("heads", "rope_dim"), per=Per.LAYER,
    parts=("rotary",),
    # inductor's kernel of the served step's rope: the table gather, multiply, negate and interleave
    rules=(Rule("rotary", r"triton_\w*fused\w*index\w*mul\w*neg\w*(stack|cat)",
                "the MLA rope as inductor compiles vLLM's forward_native (with the copies around it in the step)",
                "rotary"),),
    calls=lambda shapes, s: shapes.spec.num_layers,
    state_bytes=lambda s, info: s["tokens"] * s["rope_dim"] * _BF16_BYTES,  # the table rows its tokens read
    tokens=tokens_of,
    fits=lambda shapes, s, info: (s["heads"], s["rope_dim"]) == (shapes.mla.heads, shapes.mla.rope_dim),
    launches=1,
    step_cases=lambda shapes: (StepCase({}),),
)
