"""The L2 state a timed call starts from, prepared before each call outside the timed kernels: the
``cold`` timer's flush (:func:`flusher`) and the ``step`` timer's sweep and rewritten activations
(:func:`step_preparer`); the profiler drops their kernels by name (:data:`PREPARE_KERNEL_MARKERS`).
Why a step's weights must come from memory, and what the preparation costs: docs/benchmarks.md, Timers.
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
