"""The all-reduce backends (``torch``, ``vllm_pynccl``, ``vllm_custom``), built once per rank process and
called the way vLLM calls them; what each is and when it skips: docs/multigpu.md ("Backends").

Every builder runs on every rank of a job (they are collectives), inside the rank process.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import BackendUnavailable
from ..hardware import vllm_version
from ..kernels.base import require_vllm_module

__all__ = ["BACKENDS", "Communicator", "build_communicator", "disable_reason"]

BACKENDS = ("torch", "vllm_pynccl", "vllm_custom")

_VLLM_CUSTOM_LOGGER = "vllm.distributed.device_communicators.custom_all_reduce"


@dataclass(frozen=True)
class Communicator:
    """How one backend reduces a tensor on this rank."""

    reduce: Callable  # tensor -> the reduced tensor (the same one where the backend is in place)
    library: str
    notes: tuple[str, ...] = ()
    capture: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext  # around graph capture


def build_communicator(backend: str, ctx, message) -> Communicator:
    """The backend's communicator on this rank (cached in the worker), checked for ``message``.

    Raises :class:`~decodebench.errors.BackendUnavailable` where the backend, or vLLM for
    this message, would not run.
    """
    return _BUILDERS[backend](ctx, message)


def _torch(ctx, message) -> Communicator:
    import torch.distributed as dist

    def reduce(x):
        dist.all_reduce(x)
        return x

    return Communicator(reduce, f"torch.distributed {ctx.backend}{_nccl_version(ctx)}")


def _nccl_version(ctx) -> str:
    if ctx.backend != "nccl":
        return ""
    import torch

    version = torch.cuda.nccl.version()
    return " " + (".".join(map(str, version)) if isinstance(version, tuple) else str(version))


def _pynccl(ctx, message) -> Communicator:
    import torch

    _require_cuda(ctx, "PyNcclCommunicator")
    if "vllm_pynccl" not in ctx.cache:
        module = require_vllm_module("vllm.distributed.device_communicators.pynccl")
        ctx.cache["vllm_pynccl"] = module.PyNcclCommunicator(ctx.cpu_group(), device=ctx.device)
    comm = ctx.cache["vllm_pynccl"]
    if comm.disabled:
        raise BackendUnavailable("vLLM's PyNcclCommunicator disabled itself (world size 1, "
                                 "VLLM_DISABLE_PYNCCL=1, or libnccl could not be loaded)")

    def reduce(x):
        # the current stream: under torch.cuda.graph that is the capture stream
        comm.all_reduce(x, out_tensor=x, stream=torch.cuda.current_stream(x.device))
        return x

    return Communicator(reduce, f"vLLM {vllm_version()} PyNcclCommunicator")


def _custom(ctx, message) -> Communicator:
    _require_cuda(ctx, "custom all-reduce")
    if "vllm_custom" not in ctx.cache:
        ctx.cache["vllm_custom"], ctx.cache["vllm_custom_reason"] = _new_custom(ctx)
    custom = ctx.cache["vllm_custom"]
    if custom.disabled:
        raise BackendUnavailable(f"vLLM disabled its custom all-reduce: {ctx.cache['vllm_custom_reason']}")
    if not custom.should_custom_ar(message):
        nbytes = message.numel() * message.element_size()
        raise BackendUnavailable(
            f"vLLM would not use its custom all-reduce for a {nbytes}-byte message (should_custom_ar is "
            f"False: it takes messages under max_size={custom.max_size} bytes, on more than two ranks only "
            "over NVLink); vLLM falls back to PyNccl")
    note = ("custom all-reduce: eagerly each call copies the input into vLLM's registered IPC buffer; "
            "a CUDA graph reads it in place through the graph buffers vLLM registers after capture")
    return Communicator(custom.custom_all_reduce, f"vLLM {vllm_version()} CustomAllreduce", (note,),
                        capture=custom.capture)


def _new_custom(ctx):
    module = require_vllm_module(_VLLM_CUSTOM_LOGGER)
    with _logged(_VLLM_CUSTOM_LOGGER) as said:
        custom = module.CustomAllreduce(ctx.cpu_group(), ctx.device)
        # newer vLLM defers its P2P check and buffer setup to a collective finalize_p2p()
        finalize = getattr(custom, "finalize_p2p", None)
        if finalize is not None:
            finalize()
    return custom, disable_reason(said)


_BUILDERS = {"torch": _torch, "vllm_pynccl": _pynccl, "vllm_custom": _custom}


def _require_cuda(ctx, what: str) -> None:
    if ctx.device.type != "cuda":
        raise BackendUnavailable(f"vLLM's {what} runs on CUDA GPUs; this rank runs on {ctx.device.type}")


@contextlib.contextmanager
def _logged(name: str):
    """The messages ``logging.getLogger(name)`` emits meanwhile: vLLM only logs why it turns
    its custom all-reduce off, and that reason is what a user needs in the skip."""
    messages: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger(name)
    level = logger.level
    if not logger.isEnabledFor(logging.INFO):  # some reasons are logged at INFO only
        logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def disable_reason(messages: list[str]) -> str:
    """The sentence among vLLM's log messages that says why it disabled its custom all-reduce.

    >>> disable_reason(["vLLM is using nccl==2.27.3", "Custom allreduce is disabled because ..."])
    'Custom allreduce is disabled because ...'
    """
    said = [m for m in messages if "disabled" in m.lower()]
    return (said or messages or ["vLLM logged no reason"])[-1]
