"""The machine's limits a session must fit in, checked before anything is allocated or started.

A case too large for the device's memory ends in an allocator's traceback (or the kernel's
OOM killer) after minutes of collection and warm-up; a load with more streams than the
process may open files ends in ``Too many open files`` after its prompts are sent. Each check
here compares what a session will need, from its shapes or its load, with the limit, and
names both.
"""

from __future__ import annotations

import math
import resource
from dataclasses import dataclass

from .shapes import DecodeShapes

__all__ = ["MemoryLimit", "fields_of", "file_limit", "format_bytes", "local_ports", "memory_limit", "model_tensors",
           "oversized", "raise_file_limit"]


@dataclass(frozen=True)
class MemoryLimit:
    """The bytes a device can hold now, and what that figure is (``what``, for messages)."""

    bytes: int
    what: str


def format_bytes(count: float) -> str:
    """Bytes in a readable unit.

    >>> format_bytes(32e9), format_bytes(1536)
    ('32.0 GB', '1.5 kB')
    """
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count:.0f} B"


def memory_limit(device) -> MemoryLimit:
    """What ``device`` can allocate: a GPU's total memory, or the host's available memory
    (``MemAvailable``: beyond it the kernel swaps or kills, and other processes hold the rest)."""
    if getattr(device, "type", "cpu") == "cuda":
        import torch

        props = torch.cuda.get_device_properties(device)
        return MemoryLimit(props.total_memory, f"the {format_bytes(props.total_memory)} of {props.name}")
    available = _meminfo("MemAvailable")
    return MemoryLimit(available, f"the {format_bytes(available)} of memory available on this host")


def _meminfo(key: str) -> int:
    try:
        with open("/proc/meminfo") as lines:
            for line in lines:
                name, _, value = line.partition(":")
                if name == key:
                    return int(value.split()[0]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # no /proc: the physical memory


def model_tensors(shapes: DecodeShapes) -> list[tuple[str, tuple[int, ...], int, frozenset[str]]]:
    """The largest tensors one rank of the deployment holds, each named by the config fields it is
    built from, with their values, its bytes per element and the components whose cases allocate it whole.

    >>> from decodebench.model import load_model_spec
    >>> tensors = model_tensors(DecodeShapes.for_deployment(load_model_spec("kimi-k2.5"), 8))
    >>> [format_bytes(_size(t)) for t in tensors if t[0].startswith("the routed experts")]
    ['1.2 GB']
    """
    spec, tp, hidden = shapes.spec, shapes.tp, shapes.hidden
    dense = frozenset({"dense_gemm"})
    return [
        ("the routed experts of one rank: n_routed_experts x 3 x hidden_size x moe_intermediate_size/tp",
         (spec.num_experts, 3, hidden, shapes.expert_intermediate), spec.quant.expert_weight_bytes_per_param,
         frozenset({"moe"})),
        ("lm_head of one rank: vocab_size/tp x hidden_size", (spec.vocab_size // tp, hidden), 2, dense),
        ("the dense MLP of one rank: 3 x intermediate_size/tp x hidden_size",
         (3, spec.dense_intermediate_size // tp, hidden), 2, dense),
        ("q_b_proj of one rank: q_lora_rank x num_attention_heads/tp x (qk_nope_head_dim + qk_rope_head_dim)",
         (spec.q_lora_rank, spec.num_heads // tp, spec.qk_head_dim), 2, dense),
    ]


def _size(tensor) -> int:
    _, dims, per_element, _ = tensor
    return int(math.prod(dims) * per_element)


def oversized(shapes: DecodeShapes, limit: MemoryLimit, components: frozenset[str] | None = None) -> str | None:
    """Why the largest tensor the ``components`` benchmarked (None: all) allocate cannot fit ``limit``,
    naming its config fields, or None.

    >>> from decodebench.model import load_model_spec
    >>> shapes = DecodeShapes.for_deployment(load_model_spec("kimi-k2.5"), 8)
    >>> print(oversized(shapes, MemoryLimit(10**9, "1 GB")))
    the routed experts of one rank: n_routed_experts x 3 x hidden_size x moe_intermediate_size/tp = 384 x 3 x \
7168 x 256 takes 1.2 GB, more than 1 GB
    >>> oversized(shapes, MemoryLimit(10**9, "1 GB"), frozenset({"rmsnorm", "dense_gemm"})) is None
    True
    """
    used = [t for t in model_tensors(shapes) if components is None or t[3] & components]
    if not used:
        return None
    largest = max(used, key=_size)
    if _size(largest) <= limit.bytes:
        return None
    return (f"{largest[0]} = {' x '.join(map(str, largest[1]))} takes {format_bytes(_size(largest))}, "
            f"more than {limit.what}")


def fields_of(spec, shape: dict) -> str:
    """The config fields whose value is the largest dimension of a case's ``shape`` (what to look at when
    the case is too large), or ``""``.

    >>> from decodebench.model import load_model_spec
    >>> print(fields_of(load_model_spec("kimi-k2.5"), {"tokens": 8, "width": 7168}))
    width = 7168 is the config's hidden_size
    """
    sizes = {key: value for key, value in shape.items() if isinstance(value, int) and not isinstance(value, bool)}
    if not sizes:
        return ""
    key = max(sizes, key=sizes.get)
    names = [name for name in _CONFIG_NAMES if getattr(spec, _CONFIG_NAMES[name], None) == sizes[key]]
    return f"{key} = {sizes[key]} is the config's {' or '.join(names)}" if names else ""


# config name -> ModelSpec field, for the dimensions a case's shape carries
_CONFIG_NAMES = {"hidden_size": "hidden_size", "vocab_size": "vocab_size",
                 "intermediate_size": "dense_intermediate_size", "moe_intermediate_size": "moe_intermediate_size",
                 "n_routed_experts": "num_experts", "kv_lora_rank": "kv_lora_rank", "q_lora_rank": "q_lora_rank"}


def file_limit() -> tuple[int, int]:
    """This process's limit on open files (soft, hard); a child process inherits both."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    unlimited = resource.RLIM_INFINITY
    return (soft if soft != unlimited else 1 << 30), (hard if hard != unlimited else 1 << 30)


def raise_file_limit(needed: int) -> tuple[int, int]:
    """Raise this process's soft open-file limit to ``needed`` where the hard limit allows (processes
    started later inherit it); the limits after.

    >>> soft, hard = raise_file_limit(1)
    >>> 1 <= soft <= hard
    True
    """
    soft, hard = file_limit()
    if soft < needed <= hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    return file_limit()


def local_ports() -> int | None:
    """How many local ports the kernel hands out to outgoing connections (``ip_local_port_range``): every
    connection to one server address takes one. None where unknown."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as text:
            low, high = (int(v) for v in text.read().split())
    except (OSError, ValueError):
        return None
    return high - low + 1
