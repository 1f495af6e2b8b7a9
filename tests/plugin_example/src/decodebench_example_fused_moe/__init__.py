"""An example decodebench backend plug-in for the routed experts ("moe").

It stands in for a user's own fused MoE kernel: one call takes the tokens, the router's
``topk_ids``/``topk_weights`` and the INT4 experts, and returns the layer's output, as
``fused_marlin_moe`` does. Here that call is plain torch that groups the tokens by expert
*inside* the timed call (the built-in ``torch`` backend is handed the grouping), so its
time includes the routing bookkeeping a fused kernel pays too. decodebench checks it
against the same fp32 reference as every backend before timing it.

A real plug-in's factory would import its extension here and raise
``BackendUnavailable`` where it cannot run (no GPU, wrong architecture), which
decodebench turns into a skip with that reason.
"""

from __future__ import annotations

import torch

from decodebench.errors import BackendUnavailable
from decodebench.kernels.backends import PluginBackend
from decodebench.kernels.experts import MoEStage, group_by_expert, run_experts

__all__ = ["BACKEND", "fused_moe_factory"]


def fused_moe_factory(case, device):
    """The kernel for ``case``: the fused layer only (a fused kernel has no GEMM-only entry point)."""
    if getattr(case, "stage", None) is not MoEStage.FUSED:
        raise BackendUnavailable(f"the example plug-in runs the fused layer only, not {case.id}")

    def fused(inputs):
        groups = group_by_expert(inputs["topk_ids"])  # inside the call, as a fused kernel sorts its tokens
        return run_experts(MoEStage.FUSED, inputs, groups, torch.bfloat16)

    return fused


BACKEND = PluginBackend(component="moe", backend="example_fused_moe", factory=fused_moe_factory)
