"""vLLM's DeepSeek-V3 small-batch kernels, where its model runs them instead of a cuBLAS GEMM.

On SM 9.0 (Hopper) and the SM 10.x family, vLLM's DeepSeek-V2/V3 model (Kimi-K2.5 included) runs
two linears of a decode step through kernels of its own at small batches:

* ``q_a`` (``fused_qkv_a_proj``, a bf16 2112 x 7168 weight): the registered op
  ``torch.ops.vllm.min_latency_fused_qkv_a_proj``, which calls ``dsv3_fused_a_gemm`` for 1–16
  tokens and ``F.linear`` above (``DeepSeekV2FusedQkvAProjLinear``, models/deepseek_v2.py);
* the router GEMM (``GateLinear``, a bf16 weight of a hidden size and expert count its
  ``DSV3_SUPPORTED_*`` lists name): ``ops.dsv3_router_gemm`` with fp32 logits up to 16 tokens on
  Hopper, 8 on SM 10.x, unless CUTLASS's Python DSL is installed and the router's logits are fp32
  (Kimi's are not: its config names no ``moe_router_dtype``); above that, the unquantized linear.

A profiled one-rank-of-TP-8 step on an H100 ran ``fused_a_gemm_kernel`` and
``router_gemm_kernel_float_output`` at C = 1 (the TP-8 report of docs/validation.md). Elsewhere
(the CPU build, SM 12.0 such as the RTX PRO 6000, other shapes) vLLM runs the unquantized linear,
and so does the benchmark. Where vLLM's eligibility rule depends on a number it keeps in a local
variable (the router's batch bound), the rule is restated here (``_ROUTER_MAX_TOKENS``).
"""

from __future__ import annotations

from collections.abc import Callable

from .base import Inputs, require_vllm_module
from .binding import VllmApiMismatch, vllm_attribute

__all__ = ["fused_a_gemm", "router_gemm", "small_batch_family"]

_ADAPTER = "decodebench/kernels/dsv3.py"
_Q_A_SHAPE = (2112, 7168)  # (N, K) of the weight DeepSeekV2FusedQkvAProjLinear takes the min-latency path for
_ROUTER_MAX_TOKENS = {"hopper": 16, "sm100": 8}  # GateLinear.__init__: self._dsv3_max_batch = 16 if is_hopper else 8


def small_batch_family(device) -> str | None:
    """'hopper' (SM 9.0), 'sm100' (the SM 10.x family) or None, by vLLM's own platform checks."""
    if device.type != "cuda":
        return None
    platforms = require_vllm_module("vllm.platforms")
    platform = vllm_attribute(platforms, "current_platform", _ADAPTER)
    if vllm_attribute(platform, "is_device_capability", _ADAPTER)(90):
        return "hopper"
    if vllm_attribute(platform, "is_device_capability_family", _ADAPTER)(100):
        return "sm100"
    return None


def fused_a_gemm(n: int, k: int, device) -> Callable[[Inputs], object] | None:
    """vLLM's min-latency ``q_a`` op where its model would run it for an ``n`` x ``k`` weight, else None."""
    if (n, k) != _Q_A_SHAPE or small_batch_family(device) is None:
        return None
    import torch

    require_vllm_module("vllm.model_executor.models.deepseek_v2")  # registers the op
    try:
        op = torch.ops.vllm.min_latency_fused_qkv_a_proj
    except (AttributeError, RuntimeError) as exc:
        raise VllmApiMismatch(f"vLLM has no torch.ops.vllm.min_latency_fused_qkv_a_proj ({exc}), which its "
                              f"DeepSeek-V3 q_a projection ran on this GPU; update {_ADAPTER}") from None
    return lambda inp: op(inp["x"], inp["weight"])


def router_gemm(experts: int, hidden: int, tokens: int, device) -> Callable[[Inputs], object] | None:
    """vLLM's ``dsv3_router_gemm`` (fp32 logits) where ``GateLinear`` would run it for ``tokens`` tokens, else None."""
    family = small_batch_family(device)
    if family is None or tokens > _ROUTER_MAX_TOKENS[family]:
        return None
    gate = vllm_attribute(require_vllm_module("vllm.model_executor.layers.fused_moe.router.gate_linear"),
                          "GateLinear", _ADAPTER)
    supported = (experts in vllm_attribute(gate, "DSV3_SUPPORTED_NUM_EXPERTS", _ADAPTER)
                 and hidden in vllm_attribute(gate, "DSV3_SUPPORTED_HIDDEN_SIZES", _ADAPTER)
                 and (hidden, experts) not in vllm_attribute(gate, "DSV3_UNSUPPORTED_SHAPES", _ADAPTER))
    if not supported:
        return None
    ops = require_vllm_module("vllm._custom_ops")
    run = vllm_attribute(ops, "dsv3_router_gemm", _ADAPTER)
    # output_dtype None: GateLinear's out_dtype for a config without moe_router_dtype; the op allocates fp32
    return lambda inp: run(hidden_states=inp["x"], router_weight=inp["weight"], output_dtype=None)
