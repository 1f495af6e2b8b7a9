"""The KV-cache write of MLA decode: each step's new latent row copied into the paged cache.

Per layer and decode step, vLLM's MLA layer writes every token's normalised latent ``kv_c``
(``kv_lora_rank`` = 512 wide) and its rotated ``k_pe`` (``rope_dim`` = 64) side by side into the
token's slot of the latent cache, ``[pages, page_size, 576]``, at the deployment's KV-cache dtype:
copied at bf16 (``auto``), stored as ``e4m3(x / k_scale)`` at fp8. On CUDA that is
``concat_and_cache_mla`` (``torch.ops._C_cache_ops``), the kernel the profiled step launches; on the
CPU build, ``concat_and_cache_mla_cpu`` (AMX_MLA's write; bf16 caches only, vLLM's own limit).

Every token writes one row of its own page (a decode step's requests hold distinct pages), at a
random row of it; the rest of the cache holds random bytes, which the write must leave alone.
The check compares the written rows, dequantized, with the float64 input at the dtype's rounding
(0 for bf16: an exact copy; 2^-4 for e4m3) and fails on any other byte of the cache changed.

Backends: ``torch`` (index assignment, the reference path) and ``vllm``.

Registered (:data:`COMPONENT`) as the step group and profile part ``kv_cache_write``, once per layer
at the deployment's (first) KV-cache dtype; its own rule gives it the cache-write kernels, which
the general rules would count as copies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from ..errors import BackendUnavailable
from ..registry import ComponentSpec, Per, Rule, StepCase, tokens_of
from ..roofline import Traffic
from ..shapes import KV_DTYPE_BYTES, DecodeShapes, KVCacheDtype, Sweep, per_request_shape, token_label
from .base import Inputs, KernelCase, relative_error, require_cpu_op, require_op, require_vllm_ops

__all__ = ["COMPONENT", "KVCacheWriteCase", "kv_cache_write_cases"]

_BF16_BYTES = 2
_SLOT_BYTES = 8  # int64 slot mapping


@dataclass(frozen=True)
class KVCacheWriteCase(KernelCase):
    """``cache.view(-1, 576)[slot[t]] = store(cat(kv_c[t], k_pe[t]))`` for ``tokens`` tokens."""

    component: ClassVar[str] = "kv_cache_write"
    # the step has just written kv_c, k_pe and the slot mapping; the cache is state
    activation_inputs: ClassVar[tuple[str, ...]] = ("kv_c", "k_pe", "slot_mapping")

    tokens: int
    kv_lora_rank: int
    rope_dim: int
    page_size: int
    kv_cache_dtype: KVCacheDtype = KVCacheDtype()
    per_request: int = 1  # K + 1 in a speculative verification step (tokens = requests x per_request)

    @property
    def width(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    @property
    def id(self) -> str:
        return f"w{self.width}-{token_label(self.tokens, self.per_request)}{self.kv_cache_dtype.id_suffix}"

    @property
    def tolerance(self) -> float:
        """0 for a bf16 copy (exact), the dtype's rounding for fp8 (2^-4 for e4m3)."""
        return self.kv_cache_dtype.roundoff

    @property
    def metric(self) -> str:
        return (f"relative_l2 of the written rows, dequantized, against the inputs (inf where any other byte "
                f"changed); tolerance {self.kv_cache_dtype.roundoff:g}, {self.kv_cache_dtype.torch_name} rounding")

    def shape(self) -> dict[str, object]:
        return {"tokens": self.tokens, "kv_lora_rank": self.kv_lora_rank, "rope_dim": self.rope_dim,
                "page_size": self.page_size, "kv_dtype": self.kv_cache_dtype.torch_name,
                "kv_cache_dtype": self.kv_cache_dtype.spelling, **per_request_shape(self.per_request)}

    def traffic(self) -> Traffic:
        read = self.tokens * (self.width * _BF16_BYTES + _SLOT_BYTES)
        return Traffic(read, self.tokens * self.width * self.kv_cache_dtype.bytes)

    def make_inputs(self, device, seed: int) -> Inputs:
        import torch

        gen = torch.Generator(device=device).manual_seed(seed)
        bf16 = torch.bfloat16
        pages = self.tokens  # one page per token, as a step's requests hold their own
        rows = torch.randint(0, self.page_size, (self.tokens,), generator=gen, device=device)
        slots = torch.randperm(pages, generator=gen, device=device) * self.page_size + rows
        dtype = torch.uint8 if self.kv_cache_dtype.quantized else bf16  # vLLM allocates fp8 caches as bytes
        cache = torch.randint(0, 256, (pages, self.page_size, self.width * self.kv_cache_dtype.bytes),
                              generator=gen, device=device, dtype=torch.uint8).view(dtype)  # random bf16 bits
        # may be NaN: compared as bytes, never as values
        return {
            "kv_c": torch.randn(self.tokens, self.kv_lora_rank, generator=gen, device=device).to(bf16),
            "k_pe": torch.randn(self.tokens, self.rope_dim, generator=gen, device=device).to(bf16),
            "kv_cache": cache,
            "slot_mapping": slots.to(torch.int64),
            # at least 1.5, so a kernel that ignores the scale is off by a third or more and fails the check
            "k_scale": torch.empty((), device=device).uniform_(1.5, 3.0, generator=gen),
        }

    def reference(self, inputs: Inputs):
        """The rows the write must hold (float64, before storing), the slots, the cache as it was and the
        scale its fp8 values are read back with."""
        import torch

        rows = torch.cat([inputs["kv_c"], inputs["k_pe"]], dim=-1).double()
        return rows, inputs["slot_mapping"].clone(), inputs["kv_cache"].clone(), inputs["k_scale"].double()

    def error(self, output, expected) -> float:
        import torch

        rows, slots, before, scale = expected
        after = output.view(-1, self.width)  # one row per slot, in the cache's own elements
        untouched = torch.ones(after.shape[0], dtype=torch.bool, device=after.device)
        untouched[slots] = False
        if not torch.equal(after[untouched].view(torch.uint8),
                           before.view(-1, self.width)[untouched].view(torch.uint8)):
            return math.inf  # the write changed a row it was not given
        return relative_error(self._stored(after[slots], scale), rows)

    def _stored(self, raw, scale):
        """Written rows as the values they stand for: the bf16 ones, or the fp8 ones times ``k_scale``."""
        import torch

        if not self.kv_cache_dtype.quantized:
            return raw.view(torch.bfloat16)
        return raw.view(self.kv_cache_dtype.torch_dtype()).double() * scale

    def kernel(self, backend: str, device):
        if backend == "torch":
            return self._torch_kernel()
        if backend == "vllm":
            return self._vllm_kernel(device)
        raise BackendUnavailable(f"kv_cache_write has no backend {backend!r}")

    def _torch_kernel(self):
        import torch

        spec, width = self.kv_cache_dtype, self.width

        def write(inp):
            rows = torch.cat([inp["kv_c"], inp["k_pe"]], dim=-1)
            if spec.quantized:
                rows = (rows.float() / inp["k_scale"]).to(spec.torch_dtype()).view(torch.uint8)
            inp["kv_cache"].view(-1, width)[inp["slot_mapping"]] = rows
            return inp["kv_cache"]
        return write

    def _vllm_kernel(self, device):
        require_vllm_ops(device)
        if device.type == "cpu":
            return self._cpu_kernel()
        op = require_op("_C_cache_ops", "concat_and_cache_mla", ("cuda",))
        spelling = self.kv_cache_dtype.spelling

        def write(inp):  # as MLAAttention.do_kv_cache_update calls it (ops.concat_and_cache_mla)
            op(inp["kv_c"], inp["k_pe"], inp["kv_cache"], inp["slot_mapping"], spelling, inp["k_scale"])
            return inp["kv_cache"]
        return write

    def _cpu_kernel(self):
        if self.kv_cache_dtype.quantized:
            raise BackendUnavailable(f"vLLM's CPU MLA cache write takes bf16 caches only (AMXMLAImpl asserts "
                                     f"kv_cache_dtype == 'auto'); this case stores {self.kv_cache_dtype.spelling}")
        op = require_cpu_op("concat_and_cache_mla_cpu")  # in the AVX512-BF16 library only

        def write(inp):
            op(inp["kv_c"], inp["k_pe"], inp["kv_cache"], inp["slot_mapping"])
            return inp["kv_cache"]
        return write


def kv_cache_write_cases(shapes: DecodeShapes, sweep: Sweep) -> list[KVCacheWriteCase]:
    """One write per layer of a step, at every token count of ``sweep`` and every KV-cache dtype.

    >>> from decodebench.model import load_model_spec
    >>> from decodebench.shapes import sweep_for
    >>> shapes = DecodeShapes.for_deployment(load_model_spec("kimi-k2.5"), 8, kv_cache_dtypes=("auto", "fp8"))
    >>> [c.id for c in kv_cache_write_cases(shapes, sweep_for("smoke"))]
    ['w576-m1', 'w576-m8', 'w576-m1-kvfp8', 'w576-m8-kvfp8']
    """
    mla = shapes.mla
    return [KVCacheWriteCase(tokens=m, kv_lora_rank=mla.kv_lora_rank, rope_dim=mla.rope_dim, page_size=mla.page_size,
                             kv_cache_dtype=kv, per_request=sweep.per_request)
            for kv in shapes.kv_cache_dtypes for m in sweep.step_tokens]


COMPONENT = ComponentSpec(
    name="kv_cache_write", group="kv_cache_write", case=KVCacheWriteCase, identity=("kv_dtype",), per=Per.LAYER,
    parts=("kv_cache_write",),
    rules=(Rule("kv_cache_write", r"concat_and_cache|reshape_and_cache",
                "the KV-cache write: concat_and_cache_mla (the step's new latent rows into the paged cache) and "
                "its non-MLA twin reshape_and_cache", "kv_cache_write"),),
    calls=lambda shapes, s: shapes.spec.num_layers,
    # the rows it stores into the cache, which is in memory; kv_c, k_pe and the slots are activations
    state_bytes=lambda s, info: s["tokens"] * (s["kv_lora_rank"] + s["rope_dim"]) * KV_DTYPE_BYTES[s["kv_dtype"]],
    tokens=tokens_of,
    fits=lambda shapes, s, info: (s["kv_lora_rank"], s["rope_dim"]) == (shapes.mla.kv_lora_rank, shapes.mla.rope_dim),
    launches=1,
    step_cases=lambda shapes: (StepCase({"kv_dtype": shapes.kv_cache_dtypes[0].torch_name}),),
)
