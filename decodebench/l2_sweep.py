"""The step timer's L2 sweep as a Triton kernel, imported only where a step-timed call runs.

A read-only pass leaves clean lines in L2 (as the previous layer's weights leave them in a decode
step); its name is one of :data:`decodebench.cache_state.PREPARE_KERNEL_MARKERS`, so the
profiler's figure leaves it out.
"""

import triton
import triton.language as tl

__all__ = ["decodebench_l2_sweep", "cdiv"]

cdiv = triton.cdiv


@triton.jit
def decodebench_l2_sweep(src, out, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offsets = pid * BLOCK + tl.arange(0, BLOCK)
    words = tl.load(src + offsets, mask=offsets < n, other=0)
    tl.store(out + pid, tl.sum(words, axis=0))  # a sum depends on every load: none is elided
