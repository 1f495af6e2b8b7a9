"""Kernel (or CPU op) name -> decode component: the rules as data, in one place.

A kernel belongs to the first rule whose pattern matches its name (a case-insensitive
regular-expression search), so specific rules sit above general ones; a name no rule matches is
counted under ``other`` *and* listed by name with its time, never dropped (docs/attribution.md,
"Rules: kernel name → component"). The names come from vLLM's CUDA build and its CPU build, where
a "kernel" is a leaf CPU op of the model step (``_C::cpu_fused_moe``, ``aten::addmm``, ...).

Limits: every bf16 sum reduction of the step counts as MoE glue (the MoE sum over top_k is one),
and the router GEMM lands in ``dense_gemm`` by name (cuBLAS, or ``dsv3_router_gemm``), so the
routing component holds only top-k.
"""

from __future__ import annotations

import re
from functools import cache, lru_cache

from .registry import Component, Rule, parts

__all__ = ["RULES", "Component", "Rule", "classify", "in_launch_order", "launched_names", "misclassified", "parts",
           "rule_for", "rules"]


C = Component
# Order matters: the first match wins, so every rule that names a backend's own kernels sits above
# the catch-all GEMM (cutlass, sm90_) and elementwise/reduction patterns. docs/attribution.md says
# which benchmark launches which names; tests/data/h200_kernel_names.json holds the ones seen.
RULES: tuple[Rule, ...] = (
    Rule(C.ALLREDUCE, r"cross_device_reduce|allreduce|all_reduce|AllReduce|one_?shot|two_?shot|nccl",
         "vLLM custom all-reduce, NCCL/PyNccl kernels, shm/gloo all-reduce on CPU", "allreduce"),
    Rule(C.MOE_GEMM, r"marlin_moe|moe_wna16", "Marlin WNA16 MoE GEMMs (gate_up and down of fused_marlin_moe)",
         "marlin_moe"),
    Rule(C.MOE_GEMM, r"fused_moe_kernel|cpu_fused_moe|fused_experts|moe_gemm|grouped_gemm",
         "Triton fused MoE, the CPU fused MoE op, grouped GEMMs", "moe_gemm"),
    Rule(C.MOE_GLUE, r"moe_align|count_and_sort|sort_expert|moe_permute|moe_unpermute|shuffle_rows|moe_lora_align"
                     r"|compute_expert_offsets",
         "token-to-expert sort of the fused MoE call", "moe_align"),
    Rule(C.MOE_GLUE, r"act_and_mul|silu_and_mul|triton_\w*fused\w*silu",
         "SiLU-and-mul of the routed experts (vLLM's act_and_mul_kernel) and of the shared expert / dense MLP "
         "(the same, or compiled by torch.compile as triton_poi_fused_mul_silu_slice_*)", "moe_activation"),
    Rule(C.MOE_GLUE, r"moe_sum|reduce_kernel.*sum_functor<c10::BFloat16",
         "the weighted sum over top_k: vLLM's moe_sum(_vec)_kernel, or the bf16 torch sum of a bare fused_marlin_moe "
         "(any other bf16 sum of the step lands here too)", "moe_sum"),
    Rule(C.ROUTING, r"grouped_topk|topk_softmax|topk_sigmoid|fused_topk|noaux_tc|topkgating|topKPerRow",
         "DeepSeek-V3 grouped top-k with correction bias, fused top-k", "topk"),
    Rule(C.ATTENTION, r"FlashAttnFwd|flash_?attn|flash_fwd|flashmla|flash_mla",
         "FlashAttention-3 MLA decode (cutlass::device_kernel<flash::...FlashAttnFwdSm90...> and its split-KV "
         "FlashAttnFwdCombine, which the generic cutlass rule would take) and FlashMLA", "flash_mla"),
    Rule(C.ATTENTION, r"mla|_fwd_grouped_kernel|_fwd_kernel_stage|decode_attention|attention|fmha"
                      r"|merge_attn_states",
         "Triton/CPU MLA decode and merges of attention states", "mla"),
    Rule(C.RMSNORM, r"rms_?norm|layernorm", "RMSNorm and fused add + RMSNorm", "rmsnorm"),
    Rule(C.ROTARY, r"rotary|rope", "rotary embedding", "rotary"),
    Rule(C.SAMPLING, r"sampl|argmax|top_?k|top_?p|softmax|gumbel|exponential|multinomial|logits|penalt",
         "the sampler: logits processing, softmax, argmax/top-k", "sampling"),
    Rule(C.DENSE_GEMM, r"nvjet|gemv|gemm|cublas|cutlass|xmma|splitkreduce|ampere_|sm\d+_|aten::(mm|addmm|bmm"
                       r"|linear|matmul)$|_linear|mkldnn|onednn|dnnl",
         "cuBLAS/cutlass bf16 GEMMs (projections, shared expert, dense MLP, lm_head, router), CPU linears",
         "gemm"),
    Rule(C.COPIES, r"copy|memcpy|memset|cast|_to_copy|elementwise|fill|index|gather|scatter|embedding|cat\b"
                   r"|aten::(cat|add|mul|sub|div|neg|where|clamp|exp|pow|rsqrt|sigmoid|silu|sum|mean|max|min"
                   r"|masked_fill|zero_|zeros|ones|arange|full|repeat|flatten|stack|to|ge|gt|le|lt|eq|ne|all|any"
                   r"|bitwise_not|logical_not|new_empty|new_zeros|zeros_like|repeat_interleave|_reshape_alias"
                   r"|remainder)_?$"
                   r"|reduce_kernel",
         "copies, casts, fills, gathers, elementwise arithmetic", "copies"),
    Rule(C.OTHER, r"aten::(empty|empty_like|empty_strided|view|as_strided|slice|select|reshape|unsqueeze|squeeze"
                  r"|permute|transpose|expand|detach|t|alias|narrow|split|split_with_sizes|unbind|chunk"
                  r"|_unsafe_view|resolve_conj|resolve_neg|lift_fresh|contiguous|item|_local_scalar_dense"
                  r"|set_|result_type|is_nonzero|numpy_T|view_as|unflatten|clone)$",
         "tensor bookkeeping that moves no data (views, allocations)", "bookkeeping"),
    Rule(C.OTHER, r"CompiledFxGraph|Pregraph bytecode|AOTDispatcher|slot_mapping",
         "torch.compile regions on CPU (norms, rotary and elementwise fused into generated code), their "
         "wrappers, and KV-cache slot bookkeeping", "compiled_region"),
)
@cache
def rules() -> tuple[Rule, ...]:
    """Every rule in the order they are tried: the registered components' own, then :data:`RULES`."""
    from .registry import own_rules

    return own_rules() + RULES


@cache
def _compiled() -> tuple[tuple[Rule, re.Pattern[str], re.Pattern[str] | None], ...]:
    return tuple((rule, re.compile(rule.pattern, re.IGNORECASE), re.compile(rule.after, re.IGNORECASE)
                  if rule.after else None) for rule in rules())


@lru_cache(maxsize=4096)
def rule_for(name: str, previous: str = "") -> Rule | None:
    """The first rule whose pattern matches the kernel or op called ``name``, launched right after
    ``previous`` (a rule with ``after`` needs it); None when none does.

    >>> rule_for("void vllm::moe::moe_sum_kernel<c10::BFloat16, 8>(...)").kind
    'moe_sum'
    >>> fill = "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<int>, ...>"
    >>> rule_for(fill).kind, rule_for(fill, "void vllm::moe::count_and_sort_expert_tokens_kernel<int>").kind
    ('copies', 'moe_workspace')
    """
    for rule, pattern, after in _compiled():
        if pattern.search(name) and (after is None or after.search(previous)):
            return rule
    return None


def classify(name: str, previous: str = "") -> str | None:
    """The part of the step the kernel or op called ``name`` (launched right after ``previous``)
    belongs to; None when no rule matches.

    >>> classify("nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT")
    'dense_gemm'
    >>> classify("void marlin_moe_wna16::Marlin<...>(...)")
    'moe_gemm'
    >>> classify("void cutlass::device_kernel<flash::FlashAttnFwdCombine<...>>(...)")
    'mla_attention'
    >>> classify("some_new_kernel") is None
    True
    """
    rule = rule_for(name, previous)
    return None if rule is None else _part(rule)


def in_launch_order(names) -> list[tuple[str, str]]:
    """Each name of a launch sequence with the one launched before it ("" for the first).

    >>> in_launch_order(["a", "b"])
    [('a', ''), ('b', 'a')]
    """
    names = list(names)
    return list(zip(names, [""] + names[:-1], strict=True))


def _part(rule: Rule) -> str:
    return str(getattr(rule.component, "value", rule.component))


def misclassified(component: str, kernel_names) -> dict[str, str]:
    """The kernels a ``component`` benchmark launched (in launch order) that the rules put elsewhere:
    name -> where they land. A kernel that one of the component's own rules places by what runs before
    it counts as its own wherever it comes: the benchmark launches it without the step around it.

    >>> misclassified("mla_decode", ["void cutlass::device_kernel<flash::FlashAttnFwdSm90<...>>(...)"])
    {}
    >>> misclassified("rmsnorm", ["nvjet_sm90_tst_64x8"])
    {'nvjet_sm90_tst_64x8': 'dense_gemm'}
    """
    from .registry import get

    spec = get(component)
    expected = set(spec.parts)
    placed = [re.compile(rule.pattern, re.IGNORECASE) for rule in spec.rules if rule.after]
    out = {}
    for name, previous in in_launch_order(kernel_names):
        found = classify(name, previous)
        if found not in expected and not any(p.search(name) for p in placed):
            out[name] = found if found is not None else "unmatched"
    return out


def launched_names(results) -> list[dict]:
    """Fixture entries (``tests/data/h200_kernel_names.json``) for the kernels each kernel result
    (:class:`decodebench.results.Result`) launched, with the part the rules give them.

    >>> from decodebench.results import Result
    >>> launched_names([Result("t", "rmsnorm", "vllm", {}, 1e-6, {"kernels": {"rms_norm_kernel": {}}})])
    [{'name': 'rms_norm_kernel', 'component': 'rmsnorm', 'launched_by': 'rmsnorm', 'source': 't'}]
    """
    entries, seen = [], set()
    for result in results:
        for name in result.launched:
            if (name, result.component) in seen:
                continue
            seen.add((name, result.component))
            entries.append({"name": name, "component": classify(name), "launched_by": result.component,
                            "source": result.name})
    return entries


def main(argv: list[str]) -> int:
    """``python -m decodebench kernel-rules RESULTS.json... [--entries]``: where the rules put every
    kernel the benchmarks launched; exit 1 when one lands outside its benchmark's component, 2 when a
    file or an entry of it cannot be read."""
    import argparse
    import json
    import sys

    from .registry import registered
    from .results import read_file

    parser = argparse.ArgumentParser(prog="python -m decodebench kernel-rules",
                                     description="Where the kernel-name rules put every kernel the stored "
                                                 "benchmarks launched; exit 1 when one lands outside its "
                                                 "benchmark's component.")
    parser.add_argument("results", nargs="+", metavar="RESULTS.json", help="pytest-benchmark JSON files")
    parser.add_argument("--entries", action="store_true", help="print every kernel name and its component as JSON")
    args = parser.parse_args(argv)
    results = []
    for path in args.results:
        try:
            stored = read_file(path)
        except ValueError as error:
            print(f"kernel-rules: {error}", file=sys.stderr)
            return 2
        for line in stored.skipped or ([] if stored.results else [f"{path}: no kernel results"]):
            print(f"kernel-rules: {line}", file=sys.stderr)
        if stored.skipped or not stored.results:
            return 2
        results += stored.results
    entries = launched_names(results)
    if args.entries:
        print(json.dumps(entries, indent=1))
    known = {spec.name for spec in registered()}
    wrong = [e for e in entries if e["launched_by"] in known and misclassified(e["launched_by"], [e["name"]])]
    for e in wrong:
        print(f"MISCLASSIFIED {e['launched_by']} kernel -> {e['component'] or 'unmatched'}: {e['name']}",
              file=sys.stderr)
    unchecked = sorted({str(e["launched_by"]) for e in entries if e["launched_by"] not in known})
    if unchecked:
        print(f"not checked: the kernels of {', '.join(unchecked)} (no component rules for such a benchmark)",
              file=sys.stderr)
    print(f"{len(entries)} kernel names from {len(results)} results; {len(wrong)} outside their benchmark's "
          "component", file=sys.stderr)
    return 1 if wrong else 0
