"""Which backends a component has: the built-ins, and those other packages register.

A backend is a factory ``factory(case, device) -> kernel``: the kernel is the callable timed on
the case's inputs, as ``KernelCase.kernel`` returns it. The built-ins (:data:`BUILTIN_BACKENDS`:
``torch``, ``vllm``) are the case's own ``kernel(backend, device)``; a separately installed
package adds one through an entry point in the group :data:`ENTRY_POINT_GROUP` whose object is a
:class:`PluginBackend` (docs/plugins.md). A plug-in that cannot be loaded, or whose factory
misbehaves, is a :class:`BrokenPlugin` naming the entry point; a factory that raises
``BackendUnavailable`` is a skip, as for the built-ins.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points

from ..errors import BackendUnavailable
from .base import BACKENDS

__all__ = ["BUILTIN_BACKENDS", "ENTRY_POINT_GROUP", "BrokenPlugin", "PluginBackend", "backends_for", "kernel_for",
           "plugin_backends"]

ENTRY_POINT_GROUP = "decodebench.backends"
BUILTIN_BACKENDS = BACKENDS
_BACKEND_ID = re.compile(r"[a-z][a-z0-9_]*\Z")  # it goes into test ids and stored results


class BrokenPlugin(RuntimeError):
    """A registered backend that cannot be loaded or built; the message names its entry point."""


@dataclass(frozen=True)
class PluginBackend:
    """A backend ``backend`` for ``component`` (a case's ``component``, e.g. ``"moe"``).

    ``factory(case, device)`` returns the kernel for ``case`` (a callable taking the
    case's inputs), or raises ``BackendUnavailable`` with the reason it cannot run there.
    ``origin`` is filled in by the registry: the entry point it came from.
    """

    component: str
    backend: str
    factory: Callable
    origin: str = ""


@functools.cache
def plugin_backends() -> tuple[PluginBackend, ...]:
    """Every backend registered in :data:`ENTRY_POINT_GROUP`, loaded once per process.

    >>> all(isinstance(p, PluginBackend) for p in plugin_backends())
    True
    """
    loaded = tuple(_load(ep) for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name))
    _check_unique(loaded)
    return loaded


def backends_for(component: str) -> tuple[str, ...]:
    """The backend ids ``component``'s benchmark is parametrized with: built-ins first.

    >>> backends_for("rmsnorm")[:2]
    ('torch', 'vllm')
    """
    return BUILTIN_BACKENDS + tuple(p.backend for p in plugin_backends() if p.component == component)


def kernel_for(case, backend: str, device):
    """The kernel ``backend`` runs for ``case``: the case's own for a built-in (``torch``, ``vllm``,
    or an id the case class lists in ``builtin_backends``, as MLA does for each vLLM backend),
    else the plug-in's.

    Raises ``BackendUnavailable`` (skip) or :class:`BrokenPlugin` (error naming the entry point).
    """
    if backend in BUILTIN_BACKENDS or backend in getattr(case, "builtin_backends", ()):
        return case.kernel(backend, device)
    plugin = _find(case.component, backend)
    try:
        kernel = plugin.factory(case, device)
    except BackendUnavailable:
        raise
    except Exception as exc:
        raise BrokenPlugin(f"backend {backend!r} ({plugin.origin}) failed to build a kernel for "
                           f"{case.component} {case.id}: {type(exc).__name__}: {exc}") from exc
    if not callable(kernel):
        raise BrokenPlugin(f"backend {backend!r} ({plugin.origin}): its factory returned "
                           f"{type(kernel).__name__}, not a callable taking the case's inputs")
    return kernel


def _find(component: str, backend: str) -> PluginBackend:
    for plugin in plugin_backends():
        if (plugin.component, plugin.backend) == (component, backend):
            return plugin
    raise BackendUnavailable(f"{component} has no backend {backend!r} (built-ins: {', '.join(BUILTIN_BACKENDS)}; "
                             f"plug-ins register in the entry-point group {ENTRY_POINT_GROUP!r})")


def _origin(ep: EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    package = f" from {dist.name} {dist.version}" if dist is not None else ""
    return f"entry point {ep.name!r} = {ep.value!r} in {ENTRY_POINT_GROUP!r}{package}"


def _load(ep: EntryPoint) -> PluginBackend:
    origin = _origin(ep)
    try:
        obj = ep.load()
    except Exception as exc:
        raise BrokenPlugin(f"{origin} does not load: {type(exc).__name__}: {exc}") from exc
    if not isinstance(obj, PluginBackend):
        raise BrokenPlugin(f"{origin} is a {type(obj).__name__}, not a decodebench.kernels.backends.PluginBackend")
    if not _BACKEND_ID.match(obj.backend) or obj.backend in BUILTIN_BACKENDS:
        raise BrokenPlugin(f"{origin}: backend id {obj.backend!r} must be lower-case letters, digits and _ "
                           f"and not a built-in ({', '.join(BUILTIN_BACKENDS)})")
    if not callable(obj.factory):
        raise BrokenPlugin(f"{origin}: factory {obj.factory!r} is not callable")
    return PluginBackend(obj.component, obj.backend, obj.factory, origin)


def _check_unique(plugins: tuple[PluginBackend, ...]) -> None:
    seen: dict[tuple[str, str], str] = {}
    for plugin in plugins:
        key = (plugin.component, plugin.backend)
        if key in seen:
            raise BrokenPlugin(f"two plug-ins register backend {plugin.backend!r} for {plugin.component}: "
                               f"{seen[key]} and {plugin.origin}")
        seen[key] = plugin.origin
