"""Absorbed-MLA decode attention over a paged latent KV cache, as vLLM runs it on SM120.

Per rank and decode step: ``heads`` query rows of width ``kv_lora_rank + rope_dim``
(512 + 64 = 576 for Kimi) per request attend to that request's cached latent rows
(keys: all 576 columns; values: the first 512), stored in pages of ``page_size`` (16)
rows listed by a block table. The output is ``[B, heads, kv_lora_rank]``.

Backends: ``torch`` (gather + two batched matmuls per distinct context length, fp32 scores)
and one ``vllm-<name>`` per vLLM MLA decode backend (:mod:`decodebench.kernels.mla_vllm`), each
at the KV page size vLLM gives it (:func:`for_backend`); :mod:`decodebench.kernels.mla_select`
asks vLLM which one it dispatches. A speculative verification step gives every request
``q_len`` causal query tokens; the cache is stored at each of the deployment's KV-cache dtypes
(docs/benchmarks.md, ``test_mla.py``; docs/options.md, ``--verify-tokens``).

Which (B, L) points run: every batch B of ``sweep.tokens`` with every context L of
``sweep.contexts`` whose single-layer KV cache, ``B * L * 576 * 2`` bytes, fits in
:data:`MAX_KV_CACHE_BYTES` (4 GiB), plus one mixed-length batch per sweep
(:func:`mixed_context_lengths`), the largest batch of the sweep whose cache fits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from ..errors import BackendUnavailable, ShapeError
from ..registry import ComponentSpec, Per, StepCase
from ..roofline import Traffic
from ..shapes import BF16_BYTES, KV_DTYPE_BYTES, DecodeShapes, KVCacheDtype, Sweep
from .base import Inputs, KernelCase
from .mla_vllm import MLA_BACKENDS, build_vllm_kernel, vllm_page_size

__all__ = ["COMPONENT", "MAX_KV_CACHE_BYTES", "MLADecodeCase", "for_backend", "mixed_context_lengths", "mla_cases"]

# Grid rule: leave out points whose KV cache exceeds this. It keeps the torch backend
# (which gathers the cache and upcasts it for fp32 scores: ~3x the cache in memory) to a
# few ms per call on an H200, and the nightly sweep to a few minutes.
MAX_KV_CACHE_BYTES = 4 * 2**30


@dataclass(frozen=True)
class MLADecodeCase(KernelCase):
    """One decode step of absorbed MLA for ``len(seq_lens)`` requests on one rank."""

    component: ClassVar[str] = "mla_decode"
    # the KV cache is state; the step writes q, the page table and lengths, and reuses the output buffer
    activation_inputs: ClassVar[tuple[str, ...]] = ("q", "block_table", "seq_lens", "out")
    builtin_backends: ClassVar[tuple[str, ...]] = tuple(b.id for b in MLA_BACKENDS)  # one id per vLLM backend

    def for_backend(self, backend: str) -> MLADecodeCase:
        return for_backend(self, backend)

    seq_lens: tuple[int, ...]
    heads: int
    kv_lora_rank: int
    rope_dim: int
    page_size: int
    scale: float
    nope_dim: int  # the model's per-head query/key width before absorption (128 for Kimi)
    v_head_dim: int  # the model's per-head value width (128); the kernel writes kv_lora_rank, W_UV maps it here
    q_len: int = 1  # query tokens per request: K + 1 in a speculative verification step
    kv_cache_dtype: KVCacheDtype = KVCacheDtype()  # the cache as the deployment stores it (--kv-cache-dtype)

    def __post_init__(self):
        if not self.seq_lens or min(self.seq_lens) < 1:
            raise ShapeError(f"MLA decode needs at least one request, each with context >= 1; got {self.seq_lens!r}")
        if self.q_len < 1 or min(self.seq_lens) < self.q_len:
            raise ShapeError(f"MLA decode with {self.q_len} query tokens per request needs q_len >= 1 and every "
                             f"context >= q_len; got {self.seq_lens!r}")

    @property
    def mixed(self) -> bool:
        return len(set(self.seq_lens)) > 1

    @property
    def batch(self) -> int:
        return len(self.seq_lens)

    @property
    def head_dim(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    @property
    def query_rows(self) -> int:
        """Query tokens of the step: requests x query tokens per request."""
        return self.batch * self.q_len

    @property
    def pages_per_request(self) -> tuple[int, ...]:
        return tuple(-(-length // self.page_size) for length in self.seq_lens)

    @property
    def num_pages(self) -> int:
        return sum(self.pages_per_request)

    @property
    def id(self) -> str:
        batch = f"b{self.batch}" + (f"x{self.q_len}" if self.q_len > 1 else "")
        kv = self.kv_cache_dtype.id_suffix
        if self.mixed:
            return f"mixed-h{self.heads}-{batch}-l{min(self.seq_lens)}to{max(self.seq_lens)}{kv}"
        return f"uniform-h{self.heads}-{batch}-l{self.seq_lens[0]}{kv}"

    @property
    def tolerance(self) -> float:
        """bf16's 1e-2, or the fp8 cache's rounding where that is larger."""
        return max(KernelCase.tolerance, self.kv_cache_dtype.roundoff)

    @property
    def metric(self) -> str:
        if not self.kv_cache_dtype.quantized:
            return KernelCase.metric
        return (f"relative_l2 against attention over the dequantized {self.kv_cache_dtype.torch_name} cache; "
                f"tolerance {self.kv_cache_dtype.roundoff:g}, its rounding (the query may be quantized too)")

    def shape(self) -> dict[str, object]:
        shape = {"batch": self.batch, "heads": self.heads, "head_dim": self.head_dim,
                 "kv_lora_rank": self.kv_lora_rank, "rope_dim": self.rope_dim, "out_dim": self.kv_lora_rank,
                 "nope_dim": self.nope_dim, "v_head_dim": self.v_head_dim,
                 "page_size": self.page_size, "kv_dtype": self.kv_cache_dtype.torch_name, "softmax_scale": self.scale,
                 "context_total": sum(self.seq_lens), "context_max": max(self.seq_lens), "mixed": self.mixed}
        if self.mixed:
            shape["seq_lens"] = list(self.seq_lens)
        if self.q_len > 1:
            shape["q_len"] = self.q_len
        if self.kv_cache_dtype.spelling != "auto":
            shape["kv_cache_dtype"] = self.kv_cache_dtype.spelling
        return shape

    def traffic(self) -> Traffic:
        """Every cached row once (576 wide: values are its first 512 columns), queries in, outputs out;
        FLOPs over the rows each query attends to (causal within a verification step's tokens)."""
        tokens = sum(self.seq_lens)
        attended = sum(self.q_len * length - self.q_len * (self.q_len - 1) // 2 for length in self.seq_lens)
        read = (tokens * self.head_dim * self.kv_cache_dtype.bytes
                + self.query_rows * self.heads * self.head_dim * BF16_BYTES)
        written = self.query_rows * self.heads * self.kv_lora_rank * BF16_BYTES
        return Traffic(read, written, 2 * self.heads * attended * (self.head_dim + self.kv_lora_rank))

    def make_inputs(self, device, seed: int) -> Inputs:
        import torch

        gen = torch.Generator(device=device).manual_seed(seed)
        bf16 = torch.bfloat16
        q = torch.randn(self.query_rows, self.heads, self.head_dim, generator=gen, device=device, dtype=bf16)
        cache = torch.randn(self.num_pages, self.page_size, self.head_dim, generator=gen, device=device, dtype=bf16)
        k_scale = torch.ones((), device=device)
        if self.kv_cache_dtype.quantized:  # stored as vLLM's cache write stores it: fp8(x / k_scale)
            # at least 1.5, so a kernel that ignores the scale is off by a third or more and fails the check
            k_scale.uniform_(1.5, 3.0, generator=gen)
            cache = (cache / k_scale).to(self.kv_cache_dtype.torch_dtype())
        return {
            "q": q,
            "kv_cache": cache,
            "k_scale": k_scale,
            "block_table": self._block_table(gen, device),
            "seq_lens": torch.tensor(self.seq_lens, dtype=torch.int32, device=device),
            # poisoned: a kernel that does not write every element fails the check
            "out": torch.full((self.query_rows, self.heads, self.kv_lora_rank), float("nan"), dtype=bf16,
                              device=device),
        }

    def _block_table(self, gen, device):
        """Int32 ``[B, max pages]``: a random permutation of all pages, dealt to the requests in
        order; the unused tail of a row holds random real pages, so a kernel reading past a
        request's length reads other data and fails the check."""
        import torch

        pages = torch.tensor(self.pages_per_request, device=device)
        width = max(self.pages_per_request)
        table = torch.randint(0, self.num_pages, (self.batch, width), generator=gen, device=device, dtype=torch.int32)
        used = torch.arange(width, device=device) < pages[:, None]
        table[used] = torch.randperm(self.num_pages, generator=gen, device=device).to(torch.int32)
        return table

    def reference(self, inputs: Inputs):
        """Per request and query token in float64, on the rows its block table lists (query t of a
        verification step sees the context up to its own position)."""
        import torch

        cache, table, q = inputs["kv_cache"], inputs["block_table"], inputs["q"]
        # an fp8 cache's values are the stored ones times k_scale
        k_scale = inputs["k_scale"].double() if self.kv_cache_dtype.quantized else 1.0
        outputs = []
        for b, length in enumerate(inputs["seq_lens"].tolist()):
            rows = _request_rows(cache, table[b], length, self.page_size).double() * k_scale
            for t in range(self.q_len):
                seen = rows[: length - self.q_len + 1 + t]
                probs = ((q[b * self.q_len + t].double() @ seen.T) * self.scale).softmax(dim=-1)
                outputs.append(probs @ seen[:, : self.kv_lora_rank])
        return torch.stack(outputs)

    def kernel(self, backend: str, device):
        if backend == "torch":
            return self._torch_kernel(device)
        return build_vllm_kernel(self, backend, device)

    def _torch_kernel(self, device):
        import torch

        groups = {}  # requests of one length attend as one batch: no padding to the longest
        for b, length in enumerate(self.seq_lens):
            groups.setdefault(length, []).append(b)
        index = {length: torch.tensor(rows, device=device) for length, rows in groups.items()}
        q_len = self.q_len
        # a request's query rows: b * q_len + t
        query_rows = {length: (rows[:, None] * q_len + torch.arange(q_len, device=device)).flatten()
                      for length, rows in index.items()}

        def run(inp):
            out = inp["out"]
            for length, rows in index.items():
                q = inp["q"][query_rows[length]].unflatten(0, (len(rows), q_len)).flatten(1, 2)  # [b, q_len*H, D]
                part = _attend_batch(q, inp["kv_cache"], inp["block_table"][rows], length,
                                     self.page_size, self.kv_lora_rank, self.scale, q_len, inp.get("k_scale"))
                out.index_copy_(0, query_rows[length], part.unflatten(1, (q_len, -1)).flatten(0, 1))
            return out
        return run


def for_backend(case: MLADecodeCase, backend: str) -> MLADecodeCase:
    """``case`` paged as vLLM pages the cache for ``backend`` (FlashMLA: 64 rows; torch keeps the case's).

    >>> c = MLADecodeCase((5,), heads=2, kv_lora_rank=8, rope_dim=4, page_size=16, scale=0.3, nope_dim=4, v_head_dim=4)
    >>> for_backend(c, "torch") is c
    True
    """
    if backend == "torch":
        return case
    try:
        return dataclasses.replace(case, page_size=vllm_page_size(backend))
    except BackendUnavailable:  # a backend without an adapter: kernel() skips, naming it
        return case


def _request_rows(cache, table_row, length: int, page_size: int):
    """The ``length`` cached rows of one request, gathered from its pages in block-table order."""
    pages = -(-length // page_size)
    return cache[table_row[:pages].long()].flatten(0, 1)[:length]


def _attend_batch(q, cache, table, length: int, page_size: int, values: int, scale: float, q_len: int = 1,
                  k_scale=None):
    """Attention of ``q [b, q_len*H, D]`` (token-major per request) over ``b`` requests that all hold
    ``length`` rows; query token t sees the first ``length - q_len + 1 + t`` of them. An fp8 cache's
    rows are dequantized (times ``k_scale``) to the query's dtype once gathered."""
    import torch

    pages = -(-length // page_size)
    keys = cache[table[:, :pages].long()].flatten(1, 2)[:, :length]  # [b, length, D]
    if keys.dtype != q.dtype:
        keys = (keys.float() * k_scale).to(q.dtype)
    # fp32 scores: bf16 ones cost ~1% relative error at these logit sizes
    scores = torch.bmm(q.float(), keys.transpose(1, 2).float()) * scale
    if q_len > 1:
        heads = q.shape[1] // q_len
        visible = length - q_len + 1 + torch.arange(q_len, device=q.device).repeat_interleave(heads)
        hidden = torch.arange(length, device=q.device)[None, :] >= visible[:, None]  # [q_len*H, length]
        scores = scores.masked_fill(hidden, float("-inf"))
    probs = scores.softmax(dim=-1).to(keys.dtype)
    return torch.bmm(probs, keys[..., :values])


def mixed_context_lengths(batch: int, longest: int) -> tuple[int, ...]:
    """Log-uniform context lengths from 1 to ``longest``: equally many requests per decade,
    so short requests (partial first page) and the longest context share one batch.

    >>> mixed_context_lengths(8, 256)
    (1, 2, 5, 11, 24, 53, 116, 256)
    """
    if batch == 1:
        return (longest,)
    return tuple(max(1, round(longest ** (i / (batch - 1)))) for i in range(batch))


def _fits(lengths, head_dim: int) -> bool:
    return sum(lengths) * head_dim * BF16_BYTES <= MAX_KV_CACHE_BYTES  # bf16 at every dtype: one grid for all


def mla_cases(shapes: DecodeShapes, sweep: Sweep) -> list[MLADecodeCase]:
    """Uniform batches over the (B, L) grid of ``sweep`` within :data:`MAX_KV_CACHE_BYTES`, plus one mixed batch.

    >>> from decodebench.model import load_model_spec
    >>> from decodebench.shapes import sweep_for
    >>> [c.id for c in mla_cases(DecodeShapes.for_deployment(load_model_spec("kimi-k2.5"), 8), sweep_for("smoke"))]
    ['uniform-h8-b1-l256', 'uniform-h8-b8-l256', 'mixed-h8-b8-l1to256']
    """
    mla = shapes.mla
    dims = {"heads": mla.heads, "kv_lora_rank": mla.kv_lora_rank, "rope_dim": mla.rope_dim,
            "page_size": mla.page_size, "scale": mla.softmax_scale, "nope_dim": mla.nope_dim,
            "v_head_dim": mla.v_head_dim}
    return [case for kv in shapes.kv_cache_dtypes
            for case in _grid(sweep, mla.head_dim, {**dims, "kv_cache_dtype": kv})]


def _grid(sweep: Sweep, head_dim: int, dims: dict) -> list[MLADecodeCase]:
    cases = [MLADecodeCase(seq_lens=(length,) * batch, q_len=sweep.per_request, **dims)
             for length in sweep.contexts for batch in sweep.tokens
             if _fits((length,) * batch, head_dim)]
    if sweep.per_request > 1:  # verification steps: the uniform grid only
        return cases
    longest = max(sweep.contexts)
    fitting = [b for b in sweep.tokens if b > 1 and _fits(mixed_context_lengths(b, longest), head_dim)]
    if fitting:
        cases.append(MLADecodeCase(seq_lens=mixed_context_lengths(max(fitting), longest), **dims))
    return cases


COMPONENT = ComponentSpec(
    name="mla_decode", group="mla_attention", case=MLADecodeCase, identity=("heads", "mixed", "q_len", "kv_dtype"),
    per=Per.LAYER, parts=("mla_attention",),
    calls=lambda shapes, s: shapes.spec.num_layers,
    # the KV cache the requests attend to; q, the page table and the output are activations
    state_bytes=lambda s, info: s["context_total"] * s["head_dim"] * KV_DTYPE_BYTES[s["kv_dtype"]],
    tokens=lambda s: s.get("batch", 0) * s.get("q_len", 1),  # query rows: requests x query tokens each
    fits=lambda shapes, s, info: s.get("heads", shapes.mla.heads) == shapes.mla.heads,
    launches=2,  # Triton MLA: stage 1 and 2
    # a uniform batch, one query per request (a verification step's q_len > 1 is speculative.py's), the cache at
    # the deployment's (first) KV-cache dtype (a shape that names none was a bf16 cache)
    step_cases=lambda shapes: (StepCase({"mixed": False, "q_len": 1, "kv_dtype": shapes.kv_cache_dtypes[0].torch_name},
                                        absent={"mixed": False, "q_len": 1, "kv_dtype": "bfloat16"},
                                        at_context=True),),
)
