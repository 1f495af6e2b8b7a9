"""Kernel (or CPU op) name -> decode component: the rules as data, in one place.

A kernel belongs to the first rule whose pattern matches its name (a case-insensitive
regular-expression search), so specific rules sit above general ones: MoE kernels and
attention kernels before the catch-all GEMM and elementwise patterns. A name no rule
matches is counted under ``other`` *and* listed by name with its time, never dropped.

The names come from vLLM's CUDA build (cuBLAS ``nvjet_*``/``gemv``/cutlass GEMMs, Marlin
MoE, ``moe_align_block_size``, FlashAttention/FlashMLA/Triton MLA, custom and NCCL
all-reduce) and its CPU build, where a "kernel" is a leaf CPU op of the model step
(``_C::cpu_fused_moe``, ``_C::decode_attention_cpu``, ``aten::addmm``, ...).

Limit: on CUDA the router GEMM runs the same cuBLAS kernels as every other bf16 GEMM, so
by name it lands in ``dense_gemm``; the routing component then holds only top-k.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from functools import cache, lru_cache

__all__ = ["RULES", "Component", "Rule", "classify"]


class Component(str, Enum):
    """The parts of a decode step, in display order."""

    MOE_GEMM = "moe_gemm"
    MOE_GLUE = "moe_glue"
    ROUTING = "routing"
    ATTENTION = "mla_attention"
    DENSE_GEMM = "dense_gemm"
    ALLREDUCE = "allreduce"
    RMSNORM = "rmsnorm"
    ROTARY = "rotary"
    SAMPLING = "sampling"
    COPIES = "copies_casts"
    OTHER = "other"


@dataclass(frozen=True)
class Rule:
    """Kernels whose name matches ``pattern`` belong to ``component``; ``why`` names the kernels meant."""

    component: Component
    pattern: str
    why: str


C = Component
RULES: tuple[Rule, ...] = (
    Rule(C.ALLREDUCE, r"cross_device_reduce|allreduce|all_reduce|AllReduce|one_?shot|two_?shot|nccl",
         "vLLM custom all-reduce, NCCL/PyNccl kernels, shm/gloo all-reduce on CPU"),
    Rule(C.MOE_GEMM, r"marlin_moe|moe_wna16|fused_moe_kernel|cpu_fused_moe|fused_experts|moe_gemm|grouped_gemm",
         "Marlin WNA16 MoE GEMMs, Triton fused MoE, the CPU fused MoE op"),
    Rule(C.MOE_GLUE, r"moe_align|count_and_sort|moe_sum|act_and_mul|silu_and_mul|moe_permute|moe_unpermute"
                     r"|shuffle_rows|moe_lora_align|compute_expert_offsets",
         "token-to-expert sort, SiLU-and-mul activation, sum over top-k"),
    Rule(C.ROUTING, r"grouped_topk|topk_softmax|topk_sigmoid|fused_topk|noaux_tc|topkgating|topKPerRow",
         "DeepSeek-V3 grouped top-k with correction bias, fused top-k"),
    Rule(C.ATTENTION, r"flash_fwd|flashmla|flash_mla|mla|_fwd_grouped_kernel|_fwd_kernel_stage|decode_attention"
                      r"|attention|fmha|merge_attn_states|reshape_and_cache|concat_and_cache|flash_attn",
         "FlashAttention/FlashMLA/Triton/CPU MLA decode and the KV-cache write"),
    Rule(C.RMSNORM, r"rms_?norm|layernorm", "RMSNorm and fused add + RMSNorm"),
    Rule(C.ROTARY, r"rotary|rope", "rotary embedding"),
    Rule(C.SAMPLING, r"sampl|argmax|top_?k|top_?p|softmax|gumbel|exponential|multinomial|logits|penalt",
         "the sampler: logits processing, softmax, argmax/top-k"),
    Rule(C.DENSE_GEMM, r"nvjet|gemv|gemm|cublas|cutlass|xmma|splitkreduce|ampere_|sm\d+_|aten::(mm|addmm|bmm"
                       r"|linear|matmul)$|_linear|mkldnn|onednn|dnnl",
         "cuBLAS/cutlass bf16 GEMMs (projections, shared expert, dense MLP, lm_head, router), CPU linears"),
    Rule(C.COPIES, r"copy|memcpy|memset|cast|_to_copy|elementwise|fill|index|gather|scatter|embedding|cat\b"
                   r"|aten::(cat|add|mul|sub|div|neg|where|clamp|exp|pow|rsqrt|sigmoid|silu|sum|mean|max|min"
                   r"|masked_fill|zero_|zeros|ones|arange|full|repeat|flatten|stack|to|ge|gt|le|lt|eq|ne|all|any|bitwise_not"
                   r"|logical_not|new_empty|new_zeros|zeros_like|repeat_interleave|_reshape_alias)_?$|reduce_kernel",
         "copies, casts, fills, gathers, elementwise arithmetic"),
    Rule(C.OTHER, r"aten::(empty|empty_like|empty_strided|view|as_strided|slice|select|reshape|unsqueeze|squeeze"
                  r"|permute|transpose|expand|detach|t|alias|narrow|split|split_with_sizes|unbind|chunk"
                  r"|_unsafe_view|resolve_conj|resolve_neg|lift_fresh|contiguous|item|_local_scalar_dense"
                  r"|set_|result_type|is_nonzero|numpy_T|view_as|unflatten|clone)$",
         "tensor bookkeeping that moves no data (views, allocations)"),
    Rule(C.OTHER, r"CompiledFxGraph|Pregraph bytecode|AOTDispatcher|slot_mapping",
         "torch.compile regions on CPU (norms, rotary and elementwise fused into generated code), their "
         "wrappers, and KV-cache slot bookkeeping"),
)


@cache
def _compiled() -> tuple[tuple[Component, re.Pattern[str]], ...]:
    return tuple((rule.component, re.compile(rule.pattern, re.IGNORECASE)) for rule in RULES)


@lru_cache(maxsize=4096)
def classify(name: str) -> Component | None:
    """The component of the kernel or op called ``name``; None when no rule matches.

    >>> classify("nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT").value
    'dense_gemm'
    >>> classify("void marlin_moe_wna16::Marlin<...>(...)").value
    'moe_gemm'
    >>> classify("some_new_kernel") is None
    True
    """
    for component, pattern in _compiled():
        if pattern.search(name):
            return component
    return None
