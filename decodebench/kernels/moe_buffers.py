"""The two buffers vLLM's MoE layer fills around its fused Marlin call: the workspace and the output.

A served Marlin MoE layer runs ``fused_marlin_moe`` through vLLM's modular kernel, which launches
two kernels that the fused call alone (:mod:`.moe`) does not:

* the Marlin workspace: ``MarlinExperts`` passes none, so ``fused_marlin_moe`` makes one per call,
  ``marlin_make_workspace_new``: ``torch.zeros`` of ``SMs x MARLIN_MAX_BLOCKS_PER_SM`` int32, one
  fill kernel, launched between the token sort and the first Marlin GEMM;
* the layer's output: the experts write into a buffer of the modular kernel's workspace, and the
  finalize step (``TopKWeightAndReduceNoOP``) copies it into the layer's own output, ``[M, hidden]``
  bf16, right after the top-k sum.

One case is both, at ``M`` tokens. Its check: the workspace is all zeros at vLLM's size for the
device, and the output equals the experts' output bit for bit.

Backends: ``torch`` (``torch.zeros`` and ``copy_``, the reference path) and ``vllm`` (vLLM's own
workspace maker and finalize step; CUDA only: the CPU build's MoE has neither).

Registered (:data:`COMPONENT`) as the step group and profile part ``moe_buffers``, once per MoE
layer; its own rules place the two generic kernels by the kernel launched before each (the fill
after ``count_and_sort_expert_tokens``, the copy after ``moe_sum``): the same names elsewhere in
the step stay copies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..errors import BackendUnavailable
from ..registry import ComponentSpec, Per, Rule, StepCase, tokens_of
from ..roofline import Traffic
from ..shapes import BF16_BYTES, DecodeShapes, Sweep, per_request_shape, token_label
from .base import Inputs, KernelCase, relative_error, require_vllm_module, require_vllm_ops
from .binding import Binding, vllm_attribute

__all__ = ["COMPONENT", "MoEBuffersCase", "moe_buffers_cases"]

_ADAPTER = "decodebench/kernels/moe_buffers.py"
_FINALIZE = ("output", "fused_expert_output", "topk_weights", "topk_ids", "apply_router_weight_on_input")


def workspace_ints(device) -> int:
    """The int32 count of the workspace vLLM makes on ``device``: its SMs times Marlin's blocks per SM
    (on a CPU, which has no SMs, its threads stand in, for the torch path's check)."""
    import torch

    from .marlin import marlin_blocks_per_sm

    units = (torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda"
             else torch.get_num_threads())
    return units * marlin_blocks_per_sm()


@dataclass(frozen=True)
class MoEBuffersCase(KernelCase):
    """``zeros(workspace_ints, int32)`` and ``out.copy_(experts_out)`` for ``tokens`` rows of ``hidden``."""

    component: ClassVar[str] = "moe_buffers"
    # the experts have just written their output, and the router its top-k (which the finalize step takes)
    activation_inputs: ClassVar[tuple[str, ...]] = ("experts_out", "topk_weights", "topk_ids")
    tolerance: ClassVar[float] = 0.0
    metric: ClassVar[str] = ("relative_l2 of the layer output against the experts' output (an exact copy), "
                             "inf where the workspace is not all zeros at vLLM's size")

    tokens: int
    hidden: int
    top_k: int
    per_request: int = 1  # K + 1 in a speculative verification step (tokens = requests x per_request)

    @property
    def id(self) -> str:
        return f"h{self.hidden}-{token_label(self.tokens, self.per_request)}"

    def shape(self) -> dict[str, object]:
        return {"tokens": self.tokens, "hidden": self.hidden, "top_k": self.top_k,
                **per_request_shape(self.per_request)}

    def traffic(self) -> Traffic:
        """The copy's rows, read and written (the workspace's few KiB, which depend on the device, left out)."""
        rows = self.tokens * self.hidden * BF16_BYTES
        return Traffic(rows, rows)

    def make_inputs(self, device, seed: int) -> Inputs:
        import torch

        gen = torch.Generator(device=device).manual_seed(seed)
        return {
            "experts_out": torch.randn(self.tokens, self.hidden, generator=gen, device=device).to(torch.bfloat16),
            "topk_weights": torch.rand(self.tokens, self.top_k, generator=gen, device=device),
            "topk_ids": torch.randint(0, 2 * self.top_k, (self.tokens, self.top_k), generator=gen, device=device,
                                      dtype=torch.int32),
        }

    def reference(self, inputs: Inputs):
        return inputs["experts_out"].clone(), workspace_ints(inputs["experts_out"].device)

    def error(self, output, expected) -> float:
        import torch

        workspace, out = output
        rows, ints = expected
        if workspace.dtype != torch.int32 or workspace.numel() != ints or bool(workspace.any()):
            return float("inf")
        return relative_error(out, rows)

    def kernel(self, backend: str, device):
        if backend == "torch":
            return self._torch_kernel(device)
        if backend == "vllm":
            return self._vllm_kernel(device)
        raise BackendUnavailable(f"moe_buffers has no backend {backend!r}")

    @staticmethod
    def _torch_kernel(device):
        import torch

        ints = workspace_ints(device)  # once: the timed call allocates and fills, as vLLM's does

        def fill_and_copy(inp):
            rows = inp["experts_out"]
            workspace = torch.zeros(ints, dtype=torch.int32, device=rows.device)
            return workspace, torch.empty_like(rows).copy_(rows)
        return fill_and_copy

    @staticmethod
    def _vllm_kernel(device):
        import torch

        require_vllm_ops(device)
        if device.type != "cuda":
            raise BackendUnavailable("vLLM's Marlin MoE layer runs on CUDA only: the CPU build's MoE makes no Marlin "
                                     "workspace and writes its output itself")
        from .marlin import marlin_api, marlin_blocks_per_sm

        api, blocks = marlin_api(), marlin_blocks_per_sm()  # looked up once, not in the timed call
        module = require_vllm_module("vllm.model_executor.layers.fused_moe.topk_weight_and_reduce")
        finalize = Binding.of(vllm_attribute(module, "TopKWeightAndReduceNoOP", _ADAPTER)().apply,
                              offers=_FINALIZE, needs=_FINALIZE[:2], name="TopKWeightAndReduceNoOP.apply",
                              adapter=_ADAPTER)

        def fill_and_copy(inp):  # as fused_marlin_moe (workspace=None) and the modular kernel's finalize run them
            rows = inp["experts_out"]
            workspace = api.make_workspace(device=rows.device, max_blocks_per_sm=blocks)
            out = torch.empty_like(rows)
            finalize(output=out, fused_expert_output=rows, topk_weights=inp["topk_weights"],
                     topk_ids=inp["topk_ids"], apply_router_weight_on_input=False)
            return workspace, out
        return fill_and_copy


def moe_buffers_cases(shapes: DecodeShapes, sweep: Sweep) -> list[MoEBuffersCase]:
    """One case per token count of ``sweep`` (none for a model without MoE layers).

    >>> from decodebench.model import load_model_spec
    >>> from decodebench.shapes import sweep_for
    >>> [c.id for c in moe_buffers_cases(DecodeShapes.for_deployment(load_model_spec("kimi-k2.5"), 8),
    ...                                  sweep_for("smoke"))]
    ['h7168-m1', 'h7168-m8']
    """
    if not shapes.spec.num_moe_layers:
        return []
    return [MoEBuffersCase(tokens=m, hidden=shapes.hidden, top_k=shapes.top_k, per_request=sweep.per_request)
            for m in sweep.step_tokens]


COMPONENT = ComponentSpec(
    name="moe_buffers", group="moe_buffers", case=MoEBuffersCase, identity=("hidden",), per=Per.MOE_LAYER,
    parts=("moe_buffers",),
    rules=(Rule("moe_buffers", r"FillFunctor<int>",
                "the Marlin workspace's zero fill, right after the MoE layer's token sort", "moe_workspace",
                after=r"count_and_sort_expert_tokens"),
           Rule("moe_buffers", r"memcpy|direct_copy_kernel",
                "the copy of the experts' output into the MoE layer's output, right after the top-k sum",
                "moe_output_copy", after=r"moe_sum")),
    calls=lambda shapes, s: shapes.spec.num_moe_layers,
    state_bytes=lambda s, info: 0,  # it reads only the experts' output, an activation, and makes the workspace anew
    tokens=tokens_of,
    fits=lambda shapes, s, info: s["hidden"] == shapes.hidden,
    launches=2,
    step_cases=lambda shapes: (StepCase({}),),
)
