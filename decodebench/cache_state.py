"""The L2 state a timed call starts from: what the ``cold`` and ``step`` timers do before each call.

Calling a case again and again on the same tensors times weights that sit in L2 from the second
call on. A decode step never has them there: 61 layers pass between two uses of one layer's
weights, while the activations a kernel reads were written by the kernel just before. At TP 8 a
rank's weights (3.7–33 MB per dense GEMM, ~25 MB for the fused MoE at M = 1) fit in a 50 MB
(H100/H200) or 128 MB (RTX PRO 6000) L2, so the difference is large (docs/benchmarks.md, Timers).

* ``cold`` (:func:`flusher`): before each call, every byte of a scratch buffer of twice the L2
  is read and written (``bitwise_not`` in place). Weights and activations both come from memory,
  and L2 is left full of dirty lines.
* ``step`` (:func:`step_preparer`): before each call, a read-only sweep over a scratch buffer of
  twice the L2 evicts everything and leaves clean lines (as the previous layer's weights leave
  them in a step); then each activation the case names (``KernelCase.activation_inputs``) is
  rewritten in place, two ``bitwise_not`` over its bytes, so its values are unchanged and its
  lines are in L2, dirty, as the kernel before left them. Weights, scales and the KV cache (the
  case's state, every other input and whatever the kernel prepared from them) come from memory.

Both run outside the timed kernels: the profiler drops their kernels by name
(:data:`PREPARE_KERNEL_MARKERS`). Cost of ``step``: a scratch buffer of max(2 x L2, 64 MiB) on the
device (100 MB on an H100/H200, 256 MB on an RTX PRO 6000) and, per timed call, one untimed sweep
of it (about 2 x L2 / memory bandwidth: ~30 µs on an H200, ~170 µs on an RTX PRO 6000) plus two
tiny kernels per activation.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

__all__ = ["PREPARE_KERNEL_MARKERS", "flusher", "scratch_bytes", "step_preparer", "touchable"]

# Kernel names (lower case) of the untimed preparation; no benchmarked kernel contains either.
PREPARE_KERNEL_MARKERS = ("bitwise_not", "decodebench_l2_sweep")

_MIN_SCRATCH = 64 << 20


def scratch_bytes(l2_bytes: int) -> int:
    """The scratch a flush or sweep passes over: twice the L2, at least 64 MiB.

    >>> scratch_bytes(50 << 20) >> 20, scratch_bytes(128 << 20) >> 20, scratch_bytes(4 << 20) >> 20
    (100, 256, 64)
    """
    return max(2 * l2_bytes, _MIN_SCRATCH)


def flusher(device) -> tuple[Callable[[], None], str]:
    """The ``cold`` timer's flush (read and write every byte of the scratch) and its note."""
    import torch

    scratch = torch.empty(scratch_bytes(_l2_bytes(device)), dtype=torch.uint8, device=device)

    def flush() -> None:
        torch.bitwise_not(scratch, out=scratch)

    return flush, f"L2 flushed before each call ({scratch.numel() >> 20} MiB read and written)"


def touchable(name: str, tensor) -> object:
    """``tensor`` as bytes, to be rewritten in place; raises ValueError naming the input if it cannot be.

    >>> import torch
    >>> touchable("x", torch.ones(2, 3, dtype=torch.bfloat16)).shape
    torch.Size([2, 6])
    """
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"activation input {name!r} is a {type(tensor).__name__}, not a tensor: the step "
                         "timer rewrites activations in place")
    try:
        return tensor.view(torch.uint8)
    except RuntimeError as exc:
        raise ValueError(f"activation input {name!r} (shape {tuple(tensor.shape)}, strides {tensor.stride()}) "
                         f"cannot be viewed as bytes to rewrite it in place: {exc}") from None


def step_preparer(device, activations: Sequence[tuple[str, object]]) -> tuple[Callable[[], None], str]:
    """The ``step`` timer's preparation of one call: evict everything with a read-only sweep, then
    rewrite each named activation in place. Returns the callable and its note."""
    sweep, scratch_mib = _sweeper(device)
    views = [touchable(name, tensor) for name, tensor in activations]

    def prepare() -> None:
        sweep()
        for view in views:
            view.bitwise_not_()
            view.bitwise_not_()  # the values are back; the lines are in L2, dirty

    names = ", ".join(name for name, _ in activations) or "none"
    note = (f"step timer: state from memory (L2 swept by reading {scratch_mib} MiB before each call), "
            f"activations in L2 (rewritten before each call: {names})")
    return prepare, note


def _l2_bytes(device) -> int:
    import torch

    return torch.cuda.get_device_properties(device).L2_cache_size


@functools.cache
def _sweep_kernel():
    """The sweep's Triton kernel (:mod:`decodebench.l2_sweep`), imported once per process."""
    try:
        from . import l2_sweep
    except ImportError as exc:
        raise RuntimeError(f"the step timer needs Triton for its L2 sweep ({exc}); install the triton that "
                           "matches this torch, or use --timer kernel or cold") from None
    return l2_sweep.decodebench_l2_sweep, l2_sweep.cdiv


def _sweeper(device) -> tuple[Callable[[], None], int]:
    """A read-only pass over a scratch of twice the L2, and the scratch's size in MiB."""
    import torch

    kernel, cdiv = _sweep_kernel()
    block = 8192
    words = scratch_bytes(_l2_bytes(device)) // 4
    scratch = torch.empty(words, dtype=torch.int32, device=device)  # only read: its values never matter
    grid = (cdiv(words, block),)
    out = torch.empty(grid[0], dtype=torch.int32, device=device)

    def sweep() -> None:
        kernel[grid](scratch, out, words, BLOCK=block)

    return sweep, (words * 4) >> 20
