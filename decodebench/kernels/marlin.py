"""vLLM's Marlin W4A16 MoE path, bound once to the installed signatures.

The weights go through vLLM's own loader step (``gptq_marlin_moe_repack`` +
``marlin_moe_permute_scales``), then one ``fused_marlin_moe`` call runs the layer:
``moe_align_block_size`` (sort the tokens by expert), the gate_up Marlin GEMM,
``silu_and_mul``, the down Marlin GEMM, and the weighted sum over ``top_k``. Every vLLM
function is bound through :class:`~decodebench.kernels.binding.Binding`; a parameter
that moved is a :class:`VllmApiMismatch` naming it. The per-GEMM figures come from the fused
call's kernel trace, whose kernels :data:`FUSED_MARLIN_PARTS` names (:meth:`.moe.MoECase.timed_part`).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import BackendUnavailable
from ..hardware import vllm_version
from ..kernel_parts import PartRule
from ..shapes import GemmShape
from . import fallbacks
from .base import Inputs, require_op, require_vllm_ops
from .binding import Binding, VllmApiMismatch
from .int4 import BITS, ExpertLayout, ExpertWeights

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["FUSED_MARLIN_PARTS", "MarlinApi", "MarlinWeights", "marlin_api", "marlin_blocks_per_sm",
           "marlin_fused_kernel", "marlin_weights"]

_MARLIN_GROUP_SIZES = (32, 64, 128)
# The kernels one fused_marlin_moe call launches, by their kernel family in the decode-step
# attribution's rules (decodebench/kernel_rules.py: one set of name rules for the live
# step and this split). vLLM 0.26 on CUDA: marlin_moe_wna16::Marlin<...> twice (gate_up, then
# down), vllm::moe::moe_align_block_size* / count_and_sort_expert_tokens_kernel,
# vllm::act_and_mul_kernel<..silu..>, and vllm::moe::moe_sum(_vec)_kernel for the weighted sum (what
# the served layer's MarlinExperts passes as `moe_sum`; a bare call would sum with a bf16 torch sum,
# reduce_kernel<..sum_functor..>: 5.2 against 1.7 µs at M = 1 on an H100, the TP-8 report of docs/validation.md).
FUSED_MARLIN_PARTS = (
    PartRule("gate_up", kind="marlin_moe", nth=0),
    PartRule("down", kind="marlin_moe", nth=1),
    PartRule("unexpected_gemm", kind="marlin_moe"),
    PartRule("align", kind="moe_align"),
    PartRule("activation", kind="moe_activation"),
    PartRule("sum", kind="moe_sum"),
)

# Old releases take `gating_output` (passed as None) and repack with a `perm` argument
# (an empty [E, 0] tensor); 0.32 has neither, so they are offered but never needed.
FUSED_OFFERS = ("hidden_states", "w1", "w2", "bias1", "bias2", "w1_scale", "w2_scale", "gating_output",
                "topk_weights", "topk_ids", "quant_type_id", "global_num_experts", "workspace", "expert_map",
                "moe_sum")
FUSED_NEEDS = ("hidden_states", "w1", "w2", "w1_scale", "w2_scale", "topk_weights", "topk_ids", "quant_type_id")
REPACK_OFFERS = ("b_q_weight", "perm", "size_k", "size_n", "num_bits")
REPACK_NEEDS = ("b_q_weight", "size_k", "size_n", "num_bits")
SCALES_NEEDS = ("s", "size_k", "size_n", "group_size")
WORKSPACE_OFFERS = ("device", "max_blocks_per_sm")
_MAX_BLOCKS_PER_SM = 4  # vLLM 0.26 / 0.32 marlin_utils.MARLIN_MAX_BLOCKS_PER_SM, used where vLLM lacks it


@dataclass(frozen=True)
class MarlinWeights:
    """Experts in Marlin layout, as vLLM's loader leaves them for ``fused_marlin_moe``."""

    w1: Tensor  # [E, hidden / 16, 2 * 2I] int32
    w2: Tensor  # [E, I / 16, 2 * hidden] int32
    w1_scale: Tensor  # [E, hidden / group, 2I] bf16, permuted
    w2_scale: Tensor  # [E, I / group, hidden] bf16, permuted


@dataclass(frozen=True)
class MarlinApi:
    """The vLLM functions the Marlin path calls, each bound to its installed signature."""

    fused_moe: Binding
    repack: Binding
    permute_scales: Binding
    make_workspace: Binding
    quant_type_id: int  # scalar_types.uint4b8: symmetric int4 stored with bias 8
    moe_sum: Callable | None = None  # the top-k sum the served layer passes (None: fused_marlin_moe's own)

    def workspace(self, device) -> Tensor:
        """Marlin's lock buffer, allocated once (the kernel resets it after each call)."""
        return self.make_workspace(device=device, max_blocks_per_sm=marlin_blocks_per_sm())

    def to_marlin(self, weights: ExpertWeights) -> MarlinWeights:
        """vLLM's loader step: N-first -> K-first, repack the nibbles, permute the scales."""
        layout = weights.layout
        return MarlinWeights(
            self._repacked(weights.w13_packed, layout.gate_up),
            self._repacked(weights.w2_packed, layout.down),
            self._permuted(weights.w13_scale, layout.gate_up, layout.group_size),
            self._permuted(weights.w2_scale, layout.down, layout.group_size),
        )

    def _repacked(self, packed: Tensor, gemm: GemmShape) -> Tensor:
        import torch

        k_first = packed.transpose(1, 2).contiguous()
        no_perm = torch.empty((packed.shape[0], 0), dtype=torch.int32, device=packed.device)
        return self.repack(b_q_weight=k_first, perm=no_perm, size_k=gemm.k, size_n=gemm.n, num_bits=BITS)

    def _permuted(self, scales: Tensor, gemm: GemmShape, group: int) -> Tensor:
        # vLLM passes size_k = I for w13; size_k only decides group < size_k, true for K too.

        k_first = scales.transpose(1, 2).contiguous()
        return self.permute_scales(s=k_first, size_k=gemm.k, size_n=gemm.n, group_size=group)

    def run(self, inputs: Inputs, marlin: MarlinWeights, workspace: Tensor) -> Tensor:
        """One fused MoE call on ``inputs`` (x, topk_weights, topk_ids; an expert-parallel rank's also
        its ``expert_map``, one entry per expert of the model) with Marlin weights."""
        expert_map = inputs.get("expert_map")
        ep = {} if expert_map is None else {"expert_map": expert_map}  # only an EP rank's call names it
        return self.fused_moe(
            hidden_states=inputs["x"], w1=marlin.w1, w2=marlin.w2, bias1=None, bias2=None,
            w1_scale=marlin.w1_scale, w2_scale=marlin.w2_scale, gating_output=None,
            topk_weights=inputs["topk_weights"], topk_ids=inputs["topk_ids"],
            quant_type_id=self.quant_type_id,
            global_num_experts=marlin.w1.shape[0] if expert_map is None else expert_map.numel(),
            workspace=workspace, moe_sum=self.moe_sum, **ep)


@functools.cache
def marlin_api() -> MarlinApi:
    """Import vLLM's Marlin MoE functions and bind each to its installed signature (calls none).

    Raises :class:`VllmApiMismatch` naming the parameter or module that moved.
    """
    import vllm._custom_ops as ops
    from vllm.model_executor.layers.quantization.utils import marlin_utils
    from vllm.scalar_type import scalar_types

    return MarlinApi(
        fused_moe=Binding.of(_import_fused_marlin_moe(), offers=FUSED_OFFERS, needs=FUSED_NEEDS,
                             name="fused_marlin_moe"),
        repack=Binding.of(ops.gptq_marlin_moe_repack, offers=REPACK_OFFERS, needs=REPACK_NEEDS),
        permute_scales=Binding.of(marlin_utils.marlin_moe_permute_scales, offers=SCALES_NEEDS, needs=SCALES_NEEDS),
        make_workspace=Binding.of(marlin_utils.marlin_make_workspace_new, offers=WORKSPACE_OFFERS,
                                  needs=("device",)),
        quant_type_id=scalar_types.uint4b8.id,
        moe_sum=_served_moe_sum(ops),
    )


def marlin_blocks_per_sm() -> int:
    """vLLM's ``MARLIN_MAX_BLOCKS_PER_SM`` (the workspace's ints per SM), or ours, noted, where vLLM is not
    installed or its marlin_utils has no such constant."""
    try:
        from vllm.model_executor.layers.quantization.utils import marlin_utils
    except ImportError:
        marlin_utils = None
    value = getattr(marlin_utils, "MARLIN_MAX_BLOCKS_PER_SM", None)
    if value is None:
        fallbacks.note(f"Marlin workspace: MARLIN_MAX_BLOCKS_PER_SM = {_MAX_BLOCKS_PER_SM}, decodebench's value "
                       "(vLLM's marlin_utils has no such constant)")
        return _MAX_BLOCKS_PER_SM
    return value


def _served_moe_sum(ops) -> Callable | None:
    """The top-k sum a served Marlin MoE layer runs: vLLM's ``MarlinExperts.moe_sum`` calls
    ``ops.moe_sum`` (with ``topk_ids`` and ``expert_map`` on an expert-parallel rank), where a bare
    ``fused_marlin_moe`` call would fall back to a torch sum. None where this vLLM has no
    ``ops.moe_sum`` (its fused_marlin_moe then sums as it does in its own layer)."""
    moe_sum = getattr(ops, "moe_sum", None)
    if moe_sum is None:
        return None

    def served(moe_output, output, topk_ids, expert_map):
        if expert_map is None:
            moe_sum(moe_output, output)
        else:
            moe_sum(moe_output, output, topk_ids, expert_map)
        return output

    return served


def _import_fused_marlin_moe() -> Callable:
    modules = ("vllm.model_executor.layers.fused_moe.experts.marlin_moe",  # 0.32
               "vllm.model_executor.layers.fused_moe.fused_marlin_moe")  # older releases
    for module in modules:
        try:
            return importlib.import_module(module).fused_marlin_moe
        except (ImportError, AttributeError):
            continue
    raise VllmApiMismatch(f"vLLM {vllm_version()} has no fused_marlin_moe in {' or '.join(modules)}; "
                          "update decodebench/kernels/marlin.py")


@functools.lru_cache(maxsize=4)
def marlin_weights(weights: ExpertWeights) -> MarlinWeights:
    """``weights`` in Marlin layout, converted once per session (like vLLM's weight loading)."""
    return marlin_api().to_marlin(weights)


def _require_marlin_kernels(device) -> None:
    try:
        # every CUDA build has both; the CPU build has neither (its INT4 MoE is another computation)
        require_op("_C", "gptq_marlin_repack", every_build=("cuda",))
        require_op("_moe_C", "moe_wna16_marlin_gemm", every_build=("cuda",))
    except BackendUnavailable as exc:
        why = f"no Marlin W4A16 MoE kernel: {exc}"
        if device.type == "cpu":  # the CPU build's INT4 experts exist, but compute something else
            why += "; vLLM's CPU INT4 MoE quantizes activations to int8 (W4A8), a different computation"
        raise BackendUnavailable(why) from exc


def _require_marlin_shape(layout: ExpertLayout) -> None:
    """The shapes fused_marlin_moe takes without the tile padding vLLM's loader would add."""
    if layout.hidden % 128:
        raise BackendUnavailable(f"Marlin MoE needs hidden % 128 == 0, hidden is {layout.hidden}")
    if layout.intermediate % 64:
        raise BackendUnavailable(f"Marlin MoE needs the intermediate size per rank ({layout.intermediate}) "
                                 "padded to a multiple of 64, which this adapter does not do")
    if layout.group_size not in _MARLIN_GROUP_SIZES:
        raise BackendUnavailable(f"Marlin MoE takes group sizes {_MARLIN_GROUP_SIZES}, not {layout.group_size}")



def marlin_fused_kernel(layout: ExpertLayout, device, expert_parallel: bool = False) \
        -> Callable[[Inputs], Tensor]:
    """One ``fused_marlin_moe`` call on ``inputs`` (x, topk_weights, topk_ids, weights; an
    ``expert_parallel`` rank's call: global ids and its ``expert_map``); raises
    :class:`BackendUnavailable` where this vLLM build or the layout cannot run it."""
    require_vllm_ops(device)
    _require_marlin_kernels(device)
    _require_marlin_shape(layout)
    api = marlin_api()
    if expert_parallel and "expert_map" not in api.fused_moe.accepted:
        raise BackendUnavailable("this vLLM's fused_marlin_moe takes no expert_map: it cannot run one "
                                 "expert-parallel rank's experts")
    workspace = api.workspace(device)
    return lambda inp: api.run(inp, marlin_weights(inp["weights"]), workspace)
