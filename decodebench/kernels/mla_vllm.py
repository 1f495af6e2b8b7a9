"""vLLM's MLA decode backends, each called as its ``forward_mqa`` calls its kernel.

One backend id per vLLM attention backend (``vllm-`` + the lower-case name of vLLM's
``AttentionBackendEnum`` member): FlashAttention MLA (FA3 through ``vllm_flash_attn``,
SM90), FlashMLA (dense, SM90, pages of 64), Triton (``decode_attention_fwd``, any GPU),
FlashInfer MLA (TRT-LLM kernel, SM100, where FlashInfer is installed), and on the CPU
build ``mla_decode_kvcache`` (CPU_MLA) and ``cpu_mla_decode`` (AMX_MLA, AMX hosts). Every vLLM function is bound through
:class:`~decodebench.kernels.binding.Binding`; anything the installed vLLM or the device
cannot do, found by a probe that does not call the kernel (device kind and capability,
vLLM's own support check, an op or package missing), is a
:class:`~decodebench.errors.BackendUnavailable` naming why, so the case skips; an error in
building or calling a backend fails the case. Per-step metadata (split counts, schedulers, workspaces) is
built once per case, as vLLM's metadata builder builds it once per step for all layers; only the kernel
is timed.

A case whose cache is fp8 (``case.kv_cache_dtype``) runs on a backend only where vLLM's backend class
lists that dtype (``supports_kv_cache_dtype``); elsewhere it skips, naming vLLM's list. The fp8 paths
are vLLM's: Triton dequantizes the cache on load with ``k_scale`` (bf16 queries), FlashMLA and
FlashInfer take fp8 queries (quantized in the timed call with ``q_scale``, as the MLA layer does just
before the kernel) and their descales.

Verification steps (``case.q_len`` > 1 query tokens per request, causal within them) run as the
backends' decode paths take them (vLLM 0.32's sources): FlashAttention MLA through
``cu_seqlens_q`` / ``max_seqlen_q``, FlashMLA with ``[B, q_len, H, 576]`` queries, FlashInfer MLA
likewise, Triton with each query row its own KV extent (the block table repeated per row, the
row's length ``L - q_len + 1 + t``, as ``TritonMLAImpl.forward_mqa`` expands it). The CPU kernels
decode one query token per request: vLLM runs longer queries through its prefill path, so they skip.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import BackendUnavailable
from . import fallbacks
from .base import EVERY_CPU_LIBRARY, has_module, import_failure, require_cpu_op, require_vllm_module, require_vllm_ops
from .binding import Binding, VllmApiMismatch, vllm_attribute

__all__ = ["MLA_BACKENDS", "VllmMLABackend", "backend_id", "build_vllm_kernel", "vllm_page_size"]

_ADAPTER = "decodebench/kernels/mla_vllm.py"
_DEFAULT_PAGE = 16  # vLLM's CacheConfig.DEFAULT_BLOCK_SIZE: what a backend keeps when it can
# vLLM's split heuristic (triton_mla.py), used when its private helper cannot be imported
_MIN_WORK_PER_SPLIT = 512
_SPLIT_OCCUPANCY_MULTIPLIER = 2
_DECODE_MODULES = ("vllm.v1.attention.ops.triton_decode_attention", "vllm.attention.ops.triton_decode_attention")
_TRITON_OFFERS = ("q", "k_buffer", "v_buffer", "o", "lse", "req_to_token", "b_seq_len", "attn_logits",
                  "num_kv_splits", "sm_scale", "page_size", "k_scale", "v_scale", "is_mla")
_TRITON_NEEDS = ("q", "k_buffer", "v_buffer", "o", "req_to_token", "b_seq_len", "attn_logits",
                 "num_kv_splits", "sm_scale", "page_size")
_FA_OFFERS = ("q", "k", "v", "q_v", "max_seqlen_q", "cu_seqlens_q", "max_seqlen_k", "seqused_k", "block_table",
              "softmax_scale", "causal", "return_softmax_lse", "fa_version", "scheduler_metadata", "num_splits")
_FA_SCHED_OFFERS = ("batch_size", "max_seqlen_q", "max_seqlen_k", "num_heads_q", "num_heads_kv", "headdim",
                    "cache_seqlens", "qkv_dtype", "headdim_v", "page_size", "cu_seqlens_q", "causal", "num_splits")
_FLASHMLA_OFFERS = ("q", "k_cache", "block_table", "cache_seqlens", "head_dim_v", "tile_scheduler_metadata",
                    "num_splits", "softmax_scale", "causal", "is_fp8_kvcache")
_FLASHMLA_FP8_OFFERS = ("q", "k_cache", "block_table", "cache_seqlens", "head_dim_v", "tile_scheduler_metadata",
                        "num_splits", "softmax_scale", "causal", "descale_q", "descale_k")
_FI_OFFERS = ("query", "kv_cache", "workspace_buffer", "qk_nope_head_dim", "kv_lora_rank", "qk_rope_head_dim",
              "block_tables", "seq_lens", "max_seq_len", "bmm1_scale", "bmm2_scale", "return_lse")
_CPU_OFFERS = ("out", "query", "kv_cache", "scale", "block_tables", "seq_lens")
_AMX_OFFERS = ("query", "k_buffer", "v_buffer", "output", "key", "value", "loc", "attn_logits", "req_to_token",
               "req_pool_indices", "seq_lens", "sm_scale", "logit_cap", "is_cross_attn", "sliding_window_size",
               "encoder_lens", "sinks")


def backend_id(name: str) -> str:
    """The benchmark backend id of a vLLM attention backend name.

    >>> backend_id("FLASH_ATTN_MLA")
    'vllm-flash_attn_mla'
    """
    return f"vllm-{name.lower()}"


@dataclass(frozen=True)
class VllmMLABackend:
    """One vLLM MLA decode backend: its enum name and the page size it keeps when vLLM cannot be asked."""

    name: str  # AttentionBackendEnum member, e.g. FLASH_ATTN_MLA
    device_type: str  # "cuda" or "cpu"
    page_size: int  # get_preferred_block_size(16) in vLLM 0.26 / 0.32

    @property
    def id(self) -> str:
        return backend_id(self.name)


MLA_BACKENDS = (
    VllmMLABackend("FLASH_ATTN_MLA", "cuda", 16),
    VllmMLABackend("FLASHMLA", "cuda", 64),
    VllmMLABackend("FLASHINFER_MLA", "cuda", 32),
    VllmMLABackend("TRITON_MLA", "cuda", 16),
    VllmMLABackend("CPU_MLA", "cpu", 16),
    VllmMLABackend("AMX_MLA", "cpu", 32),
)
_BY_ID = {b.id: b for b in MLA_BACKENDS}


def backend_of(backend: str) -> VllmMLABackend:
    """The :class:`VllmMLABackend` of a backend id, or BackendUnavailable naming the known ones."""
    if backend not in _BY_ID:
        raise BackendUnavailable(f"mla_decode has no backend {backend!r}; known: torch, {', '.join(_BY_ID)}")
    return _BY_ID[backend]


def vllm_page_size(backend: str) -> int:
    """KV page size vLLM gives ``backend`` (its ``get_preferred_block_size(16)``), else the 0.26 value.

    Example::

        >>> vllm_page_size("vllm-flashmla")  # doctest: +SKIP
        64
    """
    known = backend_of(backend)
    try:
        registry = require_vllm_module("vllm.v1.attention.backends.registry")
        return int(registry.AttentionBackendEnum[known.name].get_class().get_preferred_block_size(_DEFAULT_PAGE))
    except Exception as exc:  # no vLLM, a backend whose module does not import here, or a renamed API
        fallbacks.note(f"MLA page size of {backend}: {known.page_size}, decodebench's table (vLLM's "
                       f"get_preferred_block_size could not be asked: {type(exc).__name__}: {str(exc)[:200]})")
        return known.page_size


def build_vllm_kernel(case, backend: str, device) -> Callable:
    """The kernel of vLLM backend ``backend`` for ``case`` (an MLADecodeCase) on ``device``.

    A skip only for what a probe finds missing without calling the kernel (the device kind or
    capability, vLLM's own support check, an op or package not installed); an error while the
    backend is built or called fails the case: a kernel that no longer runs is drift.
    """
    known = backend_of(backend)
    if device.type != known.device_type:
        raise BackendUnavailable(f"{known.name} runs on {known.device_type}, the benchmark device is {device.type}")
    require_vllm_ops(device)
    if case.kv_cache_dtype.spelling != "auto":
        _require_kv_cache_dtype(known, case.kv_cache_dtype.spelling)
    return _BUILDERS[known.name](case, device)


def _require_kv_cache_dtype(known: VllmMLABackend, spelling: str) -> None:
    """Skip, with vLLM's own list, where its backend class does not take ``spelling``."""
    from ..hardware import vllm_version

    registry = require_vllm_module("vllm.v1.attention.backends.registry")
    try:
        backend = registry.AttentionBackendEnum[known.name].get_class()
    except KeyError as exc:
        raise VllmApiMismatch(f"vLLM {vllm_version()} has no attention backend {known.name} "
                              f"(AttentionBackendEnum); update {_ADAPTER}") from exc
    except ModuleNotFoundError as exc:  # the class's module imports a package this install lacks (FlashInfer)
        raise import_failure(f"vLLM's {known.name} backend class", exc) from exc
    supports = vllm_attribute(backend, "supports_kv_cache_dtype", _ADAPTER)
    if not supports(spelling):
        raise BackendUnavailable(f"vLLM {vllm_version()} {backend.__name__} does not take --kv-cache-dtype "
                                 f"{spelling} (its supported_kv_cache_dtypes: "
                                 f"{', '.join(getattr(backend, 'supported_kv_cache_dtypes', []))})")


def _fp8_query(case, device):
    """A query quantizer for the backends that take fp8 queries: ``e4m3(q / q_scale)``, with vLLM's
    per-tensor ``q_scale`` (1.0 where a checkpoint brings none), and the scale to descale with."""
    import torch

    q_scale = torch.ones((), dtype=torch.float32, device=device)
    dtype = case.kv_cache_dtype.torch_dtype()
    return (lambda q: (q.float() / q_scale).to(dtype)), q_scale


# --- Triton (TritonMLAImpl.forward_mqa) ----------------------------------------------------------


def _triton(case, device):
    """``decode_attention_fwd`` with TritonMLAImpl's arguments; scratch made once, as vLLM's workspace is."""
    import torch

    decode = Binding.of(import_decode_attention(), offers=_TRITON_OFFERS, needs=_TRITON_NEEDS,
                        name="decode_attention_fwd", adapter="decodebench/kernels/mla_vllm.py")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    splits = num_kv_splits(max(case.seq_lens), sms)
    rows = case.query_rows
    fixed = {
        "attn_logits": torch.empty(rows, case.heads, splits, case.kv_lora_rank + 1,
                                   dtype=torch.float32, device=device),
        "lse": torch.empty(rows, case.heads, dtype=torch.bfloat16, device=device),
        "num_kv_splits": splits, "sm_scale": case.scale, "page_size": case.page_size, "is_mla": True,
    }

    per_row: dict = {}  # a verification step's per-row block table and extents, made once per block table

    def run(inp):
        keys = inp["kv_cache"].unsqueeze(2)  # [pages, page, 1 kv head, 576]
        table, lengths = inp["block_table"], inp["seq_lens"]
        if case.q_len > 1:
            if per_row.get("table") is not table:
                per_row.update(table=table, rows=_per_query_rows(table, lengths, case.q_len))
            table, lengths = per_row["rows"]
        # the scales are the case's inputs (a device tensor: CUDA-graph capture never copies from the host);
        # the kernel dequantizes an fp8 cache with them and ignores them for bf16, as TritonMLAImpl passes them
        decode(q=inp["q"], k_buffer=keys, v_buffer=keys[..., : case.kv_lora_rank], o=inp["out"],
               req_to_token=table, b_seq_len=lengths, k_scale=inp["k_scale"], v_scale=inp["k_scale"], **fixed)
        return inp["out"]
    return run


def _per_query_rows(table, seq_lens, q_len: int):
    """TritonMLAImpl's causal multi-token decode: one block-table row per query token, row t of a
    request attending to ``L - q_len + 1 + t`` rows."""
    import torch

    offsets = torch.arange(1 - q_len, 1, device=seq_lens.device, dtype=seq_lens.dtype)
    return table.repeat_interleave(q_len, dim=0), (seq_lens.unsqueeze(1) + offsets).flatten()


def import_decode_attention():
    """vLLM's Triton ``decode_attention_fwd`` from wherever this release keeps it (found by
    ``importlib.util.find_spec``; every release has it in one of them, so none is drift)."""
    if not has_module("vllm"):
        raise BackendUnavailable("vLLM is not installed in this environment (importlib finds no 'vllm' package)")
    for module in _DECODE_MODULES:
        if has_module(module):
            return vllm_attribute(require_vllm_module(module), "decode_attention_fwd", _ADAPTER)
    raise VllmApiMismatch(f"this vLLM has no Triton decode attention module (looked for {', '.join(_DECODE_MODULES)}); "
                          f"update {_ADAPTER}")


def num_kv_splits(max_seq_len: int, sm_count: int) -> int:
    """KV splits per request, from vLLM's own heuristic when it is importable."""
    try:
        from vllm.v1.attention.backends.mla.triton_mla import _compute_num_kv_splits

        return _compute_num_kv_splits(max_seq_len, sm_count)
    except (ImportError, AttributeError, TypeError) as exc:  # moved, renamed, or Triton without a GPU backend
        splits = split_heuristic(max_seq_len, sm_count)
        fallbacks.note(f"Triton MLA KV splits: {splits}, decodebench's copy of vLLM's heuristic (vLLM's "
                       f"_compute_num_kv_splits: {type(exc).__name__}: {str(exc)[:200]})")
        return splits


def split_heuristic(max_seq_len: int, sm_count: int) -> int:
    """vLLM's rule: the next power of two of ``max_seq_len / 512``, at most two splits per SM.

    >>> split_heuristic(131072, 132)
    256
    """
    ideal = 1 << max(0, math.ceil(math.log2(max(1, max_seq_len // _MIN_WORK_PER_SPLIT))))
    return min(ideal, sm_count * _SPLIT_OCCUPANCY_MULTIPLIER)


# --- FlashAttention MLA (FlashAttnMLAImpl.forward_mqa, FA3) --------------------------------------


def _flash_attn(case, device):
    """``flash_attn_varlen_func`` with the rope part as q/k, the latent as v and ``q_v``.

    The split bound is vLLM's CUDA-graph one (decode steps replay full graphs on Hopper), and
    the FA3 scheduler metadata is computed once, as the metadata builder does once per step.
    """
    import torch

    fa_utils = require_vllm_module("vllm.v1.attention.backends.fa_utils")
    if not fa_utils.flash_attn_supports_mla():
        raise BackendUnavailable(f"FlashAttention MLA needs FA3 on an SM90 GPU (vLLM's flash_attn_supports_mla() "
                                 f"says no): {_fa3_reason()}")
    fa = require_vllm_module("vllm.vllm_flash_attn")
    varlen = Binding.of(fa.flash_attn_varlen_func, offers=_FA_OFFERS, needs=_FA_OFFERS,
                        adapter="decodebench/kernels/mla_vllm.py")
    schedule = Binding.of(fa.get_scheduler_metadata, offers=_FA_SCHED_OFFERS, needs=_FA_SCHED_OFFERS,
                          adapter="decodebench/kernels/mla_vllm.py")
    splits = _fa_graph_splits()
    seq_lens = torch.tensor(case.seq_lens, dtype=torch.int32, device=device)
    q_len = case.q_len  # query tokens per request (causal: FA aligns them to the end of the context)
    cu_q = torch.arange(0, case.query_rows + 1, q_len, dtype=torch.int32, device=device)
    meta = schedule(batch_size=case.batch, max_seqlen_q=q_len, max_seqlen_k=max(case.seq_lens), num_heads_q=case.heads,
                    num_heads_kv=1, headdim=case.rope_dim, cache_seqlens=seq_lens, qkv_dtype=torch.bfloat16,
                    headdim_v=case.kv_lora_rank, page_size=case.page_size, cu_seqlens_q=cu_q, causal=True,
                    num_splits=splits)

    def run(inp):
        q_nope, q_pe = torch.split(inp["q"], [case.kv_lora_rank, case.rope_dim], dim=-1)
        cache = inp["kv_cache"]
        return varlen(q=q_pe, k=cache[..., case.kv_lora_rank:].unsqueeze(-2),
                      v=cache[..., : case.kv_lora_rank].unsqueeze(-2), q_v=q_nope, max_seqlen_q=q_len,
                      cu_seqlens_q=cu_q, max_seqlen_k=max(case.seq_lens), seqused_k=inp["seq_lens"],
                      block_table=inp["block_table"], softmax_scale=case.scale, causal=True,
                      return_softmax_lse=False, fa_version=3, scheduler_metadata=meta, num_splits=splits)
    return run


def _fa3_reason() -> str:
    try:
        interface = require_vllm_module("vllm.vllm_flash_attn.flash_attn_interface")
        return interface.fa_version_unsupported_reason(3) or "FA3 is built but the device is not SM90"
    except (BackendUnavailable, AttributeError) as exc:
        return str(exc)


def _fa_graph_splits() -> int:
    """``flash_attn_max_num_splits_for_cuda_graph`` (32 in 0.26), the bound vLLM sets for graph decode."""
    try:
        attention = require_vllm_module("vllm.config.attention")
        return int(attention.AttentionConfig.__dataclass_fields__["flash_attn_max_num_splits_for_cuda_graph"].default)
    except (BackendUnavailable, AttributeError, KeyError, TypeError, ValueError) as exc:
        fallbacks.note(f"FlashAttention MLA splits: 0 (FA3's own heuristic, as in eager decode), decodebench's "
                       f"choice (vLLM's flash_attn_max_num_splits_for_cuda_graph: {type(exc).__name__}: {exc})")
        return 0


# --- FlashMLA (FlashMLAImpl.forward_mqa, dense bf16) ---------------------------------------------


def _flashmla(case, device):
    """``flash_mla_with_kvcache`` on ``[B, 1, H, 576]`` queries; one scheduler object per case."""
    import torch

    ops = require_vllm_module("vllm.v1.attention.ops.flashmla")
    supported, reason = ops.is_flashmla_dense_supported()
    if not supported:
        raise BackendUnavailable(f"FlashMLA (dense) cannot run here (vLLM's is_flashmla_dense_supported()): {reason}")
    kernel = Binding.of(ops.flash_mla_with_kvcache, offers=_FLASHMLA_OFFERS,
                        needs=("q", "k_cache", "block_table", "cache_seqlens", "head_dim_v"),
                        adapter="decodebench/kernels/mla_vllm.py")
    seq_lens = torch.tensor(case.seq_lens, dtype=torch.int32, device=device)
    if case.kv_cache_dtype.quantized:
        return _flashmla_fp8(case, ops, seq_lens, device)
    # heads * query tokens per request, one KV head (MQA): the builder's arguments
    meta, splits = ops.get_mla_metadata(seq_lens, case.heads * case.q_len, 1)

    def run(inp):
        q = inp["q"].unflatten(0, (case.batch, case.q_len))  # [B, q_len, H, 576]
        out, _ = kernel(q=q, k_cache=inp["kv_cache"].unsqueeze(-2),
                        block_table=inp["block_table"], cache_seqlens=inp["seq_lens"], head_dim_v=case.kv_lora_rank,
                        tile_scheduler_metadata=meta, num_splits=splits, softmax_scale=case.scale, causal=True,
                        is_fp8_kvcache=False)
        return out.flatten(0, 1)  # [B, q_len, H, 512] -> [B * q_len, H, 512]
    return run


def _flashmla_fp8(case, ops, seq_lens, device):
    """``flash_mla_with_kvcache_fp8`` as FlashMLAImpl calls it at an fp8 cache: fp8 queries, both descales."""
    kernel = Binding.of(ops.flash_mla_with_kvcache_fp8, offers=_FLASHMLA_FP8_OFFERS, needs=_FLASHMLA_FP8_OFFERS,
                        adapter=_ADAPTER)
    meta, splits = ops.get_mla_metadata_dense_fp8(seq_lens, case.heads * case.q_len, 1)
    quantize, q_scale = _fp8_query(case, device)

    def run(inp):
        q = quantize(inp["q"]).unflatten(0, (case.batch, case.q_len))
        out, _ = kernel(q=q, k_cache=inp["kv_cache"].unsqueeze(-2), block_table=inp["block_table"],
                        cache_seqlens=inp["seq_lens"], head_dim_v=case.kv_lora_rank, tile_scheduler_metadata=meta,
                        num_splits=splits, softmax_scale=case.scale, causal=True, descale_q=q_scale.reshape(1),
                        descale_k=inp["k_scale"].reshape(1))
        return out.flatten(0, 1)
    return run


# --- FlashInfer MLA (FlashInferMLAImpl.forward_mqa, TRT-LLM kernel) ------------------------------


def _flashinfer(case, device):
    import torch

    if torch.cuda.get_device_capability(device)[0] != 10:
        raise BackendUnavailable("FlashInfer MLA (TRT-LLM decode) runs on SM100 only; this GPU is "
                                 f"SM{''.join(map(str, torch.cuda.get_device_capability(device)))}")
    module = require_vllm_module("vllm.v1.attention.backends.mla.flashinfer_mla")  # imports flashinfer
    kernel = Binding.of(module.trtllm_batch_decode_with_kv_cache_mla, offers=_FI_OFFERS,
                        needs=_FI_OFFERS[:8], adapter="decodebench/kernels/mla_vllm.py")
    workspace = module._get_workspace_buffer(False)
    quantized = case.kv_cache_dtype.quantized
    # an fp8 cache: fp8 queries, the scales folded into the two GEMMs' (FlashInferMLAImpl's bmm1/bmm2_scale)
    quantize, q_scale = _fp8_query(case, device) if quantized else ((lambda q: q), None)

    scales: dict = {}  # the GEMMs take floats: read once per inputs, as vLLM reads its layer's scales once

    def run(inp):
        if scales.get("of") is not inp["k_scale"]:
            k = inp["k_scale"].item() if quantized else 1.0
            scales.update(of=inp["k_scale"], k=k, bmm1=case.scale * (q_scale.item() * k if quantized else 1.0))
        k_scale, bmm1 = scales["k"], scales["bmm1"]
        out = kernel(query=quantize(inp["q"]).unflatten(0, (case.batch, case.q_len)),
                     kv_cache=inp["kv_cache"].unsqueeze(1), workspace_buffer=workspace,
                     qk_nope_head_dim=case.nope_dim, kv_lora_rank=case.kv_lora_rank, qk_rope_head_dim=case.rope_dim,
                     block_tables=inp["block_table"], seq_lens=inp["seq_lens"], max_seq_len=max(case.seq_lens),
                     bmm1_scale=bmm1, bmm2_scale=k_scale, return_lse=False)
        return out.view(-1, out.shape[-2], out.shape[-1])
    return run


# --- CPU (CPUMLAImpl.forward_mqa) ----------------------------------------------------------------


def _one_query_token(case, name: str) -> None:
    if case.q_len > 1:
        raise BackendUnavailable(f"{name} decodes one query token per request; vLLM runs {case.q_len} (a "
                                 "verification step) through its MLA prefill path")


def _cpu(case, device):
    _one_query_token(case, "CPU_MLA")
    if (case.head_dim, case.kv_lora_rank, case.page_size) != (576, 512, 16):
        raise BackendUnavailable(f"the CPU MLA kernel supports head 576, values 512, page 16; this case has "
                                 f"{case.head_dim}, {case.kv_lora_rank}, {case.page_size}")
    ops = require_vllm_module("vllm._custom_ops")
    require_cpu_op("mla_decode_kvcache", EVERY_CPU_LIBRARY)  # in every x86 library: absent is drift
    op = Binding.of(vllm_attribute(ops, "mla_decode_kvcache_cpu", _ADAPTER), offers=_CPU_OFFERS, needs=_CPU_OFFERS,
                    adapter=_ADAPTER)

    def run(inp):
        op(out=inp["out"], query=inp["q"], kv_cache=inp["kv_cache"], scale=case.scale,
           block_tables=inp["block_table"], seq_lens=inp["seq_lens"])
        return inp["out"]
    return run


# --- AMX (AMXMLAImpl.forward_mqa, x86 CPUs with AMX tiles) ---------------------------------------


def _amx(case, device):
    """``ops.cpu_mla_decode`` on the flat cache, with the per-step tensors AMXMLAMetadataBuilder makes.

    The flat row index (``_expand_block_table``) is made once per block table, as the
    builder makes it once per step for every layer.
    """
    import torch

    _one_query_token(case, "AMX_MLA")
    if not torch.cpu._is_amx_tile_supported():
        raise BackendUnavailable("AMX_MLA needs a CPU with AMX tiles (torch.cpu._is_amx_tile_supported() is False; "
                                 "vLLM picks CPU_MLA without them)")
    ops = require_vllm_module("vllm._custom_ops")
    require_cpu_op("decode_attention_cpu")  # built into the AVX512-BF16 library only
    amx = require_vllm_module("vllm.v1.attention.backends.mla.amx_mla")
    decode = Binding.of(ops.cpu_mla_decode, offers=_AMX_OFFERS, needs=_AMX_OFFERS,
                        adapter="decodebench/kernels/mla_vllm.py")
    splits = amx._compute_num_kv_splits(max(case.seq_lens), torch.get_num_threads())
    logits = torch.empty(case.batch, case.heads, splits, case.kv_lora_rank + 1, dtype=torch.float32)
    pool = torch.arange(case.batch, dtype=torch.int64)
    seq_lens = torch.tensor(case.seq_lens, dtype=torch.int64)
    step: dict = {}

    def run(inp):
        if step.get("table") is not inp["block_table"]:
            step.update(table=inp["block_table"], rows=amx._expand_block_table(inp["block_table"], case.page_size))
        flat = inp["kv_cache"].view(-1, 1, case.head_dim)
        decode(query=inp["q"], k_buffer=flat, v_buffer=flat[..., : case.kv_lora_rank], output=inp["out"], key=None,
               value=None, loc=None, attn_logits=logits, req_to_token=step["rows"], req_pool_indices=pool,
               seq_lens=seq_lens, sm_scale=case.scale, logit_cap=0.0, is_cross_attn=False, sliding_window_size=0,
               encoder_lens=None, sinks=None)
        return inp["out"]
    return run


_BUILDERS = {
    "FLASH_ATTN_MLA": _flash_attn,
    "FLASHMLA": _flashmla,
    "FLASHINFER_MLA": _flashinfer,
    "TRITON_MLA": _triton,
    "CPU_MLA": _cpu,
    "AMX_MLA": _amx,
}
