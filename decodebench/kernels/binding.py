"""The one way an adapter calls vLLM: bind once against the installed signature, then call.

vLLM's Python entry points gain, rename and drop keyword arguments between releases. An
adapter says which arguments it can offer and which it cannot do without; ``Binding.of``
checks that against ``inspect.signature`` when the backend is built, so a version drift
fails once, naming the function, the parameter and the installed signature, instead of
producing a TypeError (or a silently wrong call) inside the timed loop.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection
from dataclasses import dataclass

from ..hardware import vllm_version


class VllmApiMismatch(TypeError):
    """The installed vLLM no longer has or takes what this adapter uses: a module, a Python name,
    an op every build of its kind registers, or a parameter, renamed or removed. A failure of the
    benchmark (API drift), never a skip."""


def vllm_attribute(owner, name: str, adapter: str = "decodebench/kernels"):
    """``owner.name`` (a vLLM module or class), or :class:`VllmApiMismatch` naming what has gone.

    vLLM's Python API is the same in every build, so a name missing from it is drift, not a
    backend this build lacks.

    >>> import types
    >>> vllm_attribute(types.SimpleNamespace(apply=len), "apply")
    <built-in function len>
    >>> vllm_attribute(types.SimpleNamespace(), "apply", "decodebench/kernels/dense.py")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    decodebench.kernels.binding.VllmApiMismatch: ... has no attribute 'apply' ... decodebench/kernels/dense.py ...
    """
    try:
        return getattr(owner, name)
    except AttributeError as exc:
        where = getattr(owner, "__name__", type(owner).__name__)
        raise VllmApiMismatch(f"{where} in the installed vLLM {vllm_version()} has no attribute {name!r} "
                              f"(renamed or removed?); update {adapter} to this vLLM") from exc


@dataclass(frozen=True)
class Binding:
    """A vLLM function and the keyword arguments of ours it accepts, checked against its signature.

    >>> def repack(b_q_weight, size_k, size_n, num_bits, is_a_8bit=False): return size_k
    >>> b = Binding.of(repack, offers=("b_q_weight", "perm", "size_k", "size_n", "num_bits"),
    ...                needs=("b_q_weight", "size_k", "size_n", "num_bits"))
    >>> sorted(b.accepted), b(b_q_weight=None, perm=None, size_k=7168, size_n=512, num_bits=4)
    (['b_q_weight', 'num_bits', 'size_k', 'size_n'], 7168)
    """

    name: str
    fn: Callable
    accepted: frozenset[str]

    @classmethod
    def of(cls, fn: Callable, *, offers: Collection[str], needs: Collection[str], name: str | None = None,
           adapter: str = "decodebench/kernels") -> Binding:
        """Check ``fn`` takes every name in ``needs`` and requires nothing outside ``offers``."""
        name = name or getattr(fn, "__name__", repr(fn))
        signature = inspect.signature(fn)
        params = signature.parameters
        takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
        problems = [f"it has no parameter {n!r} (renamed or removed?)"
                    for n in needs if n not in params and not takes_any]
        problems += [f"it requires {n!r}, which the adapter does not pass (new or renamed?)"
                     for n, p in params.items() if _is_required(p) and n not in offers]
        if problems:
            raise VllmApiMismatch(
                f"{name} in the installed vLLM {vllm_version()} no longer fits decodebench's adapter: "
                f"{'; '.join(problems)}. Installed signature: {name}{signature}. "
                f"Update the offers and the calls in {adapter} to this vLLM")
        accepted = frozenset(offers) if takes_any else frozenset(n for n in offers if n in params)
        return cls(name, fn, accepted)

    def __call__(self, *positional, **arguments):
        return self.fn(*positional, **{k: v for k, v in arguments.items() if k in self.accepted})


def _is_required(param: inspect.Parameter) -> bool:
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return param.default is inspect.Parameter.empty and param.kind not in variadic
