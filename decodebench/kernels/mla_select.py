"""Which MLA decode backend vLLM dispatches here, and which backends a run benchmarks.

:func:`ask_vllm_dispatch` puts vLLM's own question to vLLM: the platform's
``get_attn_backend_cls`` with the selector config an MLA layer of this model builds
(docs/benchmarks.md, "MLA backends and vLLM's choice"; the KV-cache dtype the deployment's). The
answer is a :class:`Dispatch`; when vLLM cannot be asked (not installed, another device's build)
or its selector finds no backend for the layer, its ``backend`` is None and ``reason`` says why.
A selector API that has moved raises :class:`~decodebench.kernels.binding.VllmApiMismatch`:
drift fails, it never turns into "run every backend". :func:`select_backends` turns
``--mla-backends`` into backend ids.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..errors import BackendUnavailable
from .base import require_vllm_module
from .binding import Binding
from .mla_vllm import MLA_BACKENDS, backend_id

__all__ = ["MLA_SELECTIONS", "Dispatch", "ask_vllm_dispatch", "parse_mla_backends", "select_backends"]

MLA_SELECTIONS = ("auto", "dispatched", "all")
_SELECTOR_NEEDS = ("head_size", "dtype", "kv_cache_dtype", "block_size", "use_mla")


@dataclass(frozen=True)
class Dispatch:
    """vLLM's answer: the backend name it dispatches (None when it could not be asked) and why."""

    backend: str | None
    reason: str
    candidates: tuple[str, ...] = ()

    @property
    def id(self) -> str | None:
        return backend_id(self.backend) if self.backend else None

    def facts(self, backend: str) -> dict[str, object]:
        """What every MLA result stores about the dispatch; ``dispatched`` is True on vLLM's choice only."""
        return {"dispatched": backend == self.id, "mla_backend": _name_of(backend),
                "vllm_dispatch": self.backend, "vllm_dispatch_reason": self.reason}


def _name_of(backend: str) -> str:
    return backend.removeprefix("vllm-").upper() if backend.startswith("vllm-") else backend


def ask_vllm_dispatch(head_size: int, heads: int, device, kv_cache_dtype: str = "auto") -> Dispatch:
    """The MLA backend vLLM would dispatch for ``heads`` heads per rank of width ``head_size`` on ``device``,
    its KV cache stored as ``kv_cache_dtype`` (vLLM's spelling).

    Example (on a CUDA H200 with vLLM 0.26)::

        >>> ask_vllm_dispatch(576, 8, torch.device("cuda"))  # doctest: +SKIP
        Dispatch(backend='FLASH_ATTN_MLA', reason='vLLM 0.26.0 CudaPlatform.get_attn_backend_cls chose ...')
    """
    try:
        return _ask(head_size, heads, device, kv_cache_dtype)
    except BackendUnavailable as exc:
        return Dispatch(None, f"could not ask vLLM: {exc}")
    except ValueError as exc:  # vLLM's selector: no backend fits this layer here
        return Dispatch(None, f"vLLM's selector failed: {type(exc).__name__}: {exc}")


def _ask(head_size: int, heads: int, device, kv_cache_dtype: str) -> Dispatch:
    import torch

    platform = require_vllm_module("vllm.platforms").current_platform
    if platform.device_type != device.type:
        raise BackendUnavailable(f"this vLLM build runs on {platform.device_type!r}, the device is {device.type!r}")
    selector = require_vllm_module("vllm.v1.attention.selector")
    make = Binding.of(selector.AttentionSelectorConfig, offers=_SELECTOR_NEEDS, needs=_SELECTOR_NEEDS,
                      name="AttentionSelectorConfig", adapter="decodebench/kernels/mla_select.py")
    config = make(head_size=head_size, dtype=torch.bfloat16, kv_cache_dtype=kv_cache_dtype, block_size=None,
                  use_mla=True)
    path = platform.get_attn_backend_cls(None, attn_selector_config=config, num_heads=heads)
    name = _enum_name(path)
    candidates, rejected = _candidates(platform, config, heads)
    return Dispatch(name, _reason(platform, name, candidates, rejected), candidates)


def _enum_name(path: str) -> str:
    """``AttentionBackendEnum`` member whose class path is ``path`` (else the class name)."""
    registry = require_vllm_module("vllm.v1.attention.backends.registry")
    for member in registry.AttentionBackendEnum:
        try:
            if member.get_path() == path:
                return member.name
        except ValueError:  # a member without a registered path (CUSTOM): get_path's documented refusal
            continue
    return str(path).rsplit(".", 1)[-1]


def _candidates(platform, config, heads: int) -> tuple[tuple[str, ...], dict[str, str]]:
    """Valid candidates in priority order and the rejected ones with vLLM's reasons (CUDA platforms only)."""
    valid_backends = getattr(type(platform), "get_valid_backends", None)  # the class: no warning from __getattr__
    if valid_backends is None:
        return (), {}
    valid, invalid = valid_backends(device_capability=platform.get_device_capability(),
                                    attn_selector_config=config, num_heads=heads)
    names = tuple(c.backend.name for c in sorted(valid, key=lambda c: c.priority))
    return names, {b.name: ", ".join(reasons) for b, (_, reasons) in invalid.items()}


def _reason(platform, name: str, candidates: tuple[str, ...], rejected: dict[str, str]) -> str:
    from ..hardware import vllm_version

    text = f"vLLM {vllm_version()} {type(platform).__name__}.get_attn_backend_cls chose {name}"
    if candidates:
        text += f" out of {', '.join(candidates)}"
    if rejected:
        text += "; rejected: " + "; ".join(f"{b} ({why})" for b, why in rejected.items())
    return text


def parse_mla_backends(text: str) -> str:
    """Check a ``--mla-backends`` value: auto, dispatched, all, or a comma list of backend ids.

    >>> parse_mla_backends("vllm-triton_mla,torch")
    'vllm-triton_mla,torch'
    """
    if text in MLA_SELECTIONS:
        return text
    known = ("torch", *(b.id for b in MLA_BACKENDS))
    unknown = [name for name in text.split(",") if name not in known]
    if unknown or not text:
        raise ValueError(f"unknown MLA backend(s) {', '.join(unknown) or repr(text)}; use auto, dispatched, all "
                         f"or a comma-separated list of {', '.join(known)}")
    return text


def select_backends(option: str, full_sweep: bool, dispatch: Callable[[], Dispatch]) -> list[str]:
    """Backend ids to run: torch always, then the vLLM ones ``option`` names.

    ``auto`` is ``all`` on the full sweep and ``dispatched`` otherwise; when vLLM cannot say
    what it dispatches (not installed here, no backend fits), ``dispatched`` runs every backend
    (each skips or runs), so a nightly sweep never loses its vLLM rows silently. A selector
    whose API moved raises :class:`~decodebench.kernels.binding.VllmApiMismatch` from ``dispatch``.

    >>> select_backends("dispatched", False, lambda: Dispatch("TRITON_MLA", "asked"))
    ['torch', 'vllm-triton_mla']
    """
    everything = ["torch", *(b.id for b in MLA_BACKENDS)]
    if option == "auto":
        option = "all" if full_sweep else "dispatched"
    if option == "all":
        return everything
    if option == "dispatched":
        chosen = dispatch().id
        return ["torch", chosen] if chosen else everything
    return [name for name in everything if name in option.split(",")]
