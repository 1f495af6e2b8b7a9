"""How the GPUs are linked, the PCIe-only mode, and which all-reduce vLLM picks over that link.

On a host with NVLink, :attr:`LinkMode.PCIE_ONLY` turns NCCL's peer-to-peer transport off in the
workers, so NCCL's traffic goes through host memory as on the users' PCIe-only box.
:func:`vllm_would_use` is vLLM 0.26's choice between its custom all-reduce and PyNccl for the
machine measured (or the PCIe box it stands in for): docs/multigpu.md ("Which all-reduce vLLM takes").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum

__all__ = ["CUSTOM_AR_MAX_BYTES", "CUSTOM_AR_WORLD_SIZES", "PCIE_ONLY_ENV", "LinkMode", "VllmPath",
           "link_summary", "vllm_would_use"]

# NCCL's P2P transport off (traffic through host memory) and NVLink SHARP off.
PCIE_ONLY_ENV = {"NCCL_P2P_DISABLE": "1", "NCCL_NVLS_ENABLE": "0"}
CUSTOM_AR_WORLD_SIZES = (2, 4, 6, 8)  # CustomAllreduce._SUPPORTED_WORLD_SIZES in vLLM 0.26
CUSTOM_AR_MAX_BYTES = 8 << 20  # its default max_size; should_custom_ar wants messages below it


class LinkMode(str, Enum):
    NATIVE = "native"  # the links the GPUs have (NVLink where present)
    PCIE_ONLY = "pcie-only"  # NCCL peer-to-peer off: through host memory, as on a PCIe-only box


@dataclass(frozen=True)
class VllmPath:
    """The all-reduce vLLM would run, and why."""

    backend: str  # "vllm_custom", "vllm_pynccl" or "none"
    why: str

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


def vllm_would_use(world_size: int, nbytes: int, *, link: str, mode: LinkMode, nnodes: int = 1) -> VllmPath:
    """vLLM's all-reduce for a ``nbytes`` message over ``world_size`` ranks on ``link``.

    >>> vllm_would_use(8, 14336, link="nvlink", mode=LinkMode.PCIE_ONLY).backend
    'vllm_pynccl'
    >>> vllm_would_use(8, 14336, link="nvlink", mode=LinkMode.NATIVE).backend
    'vllm_custom'
    """
    nvlink = link == "nvlink" and mode is LinkMode.NATIVE
    if world_size == 1:
        return VllmPath("none", "one rank: vLLM runs no all-reduce")
    if nnodes > 1:
        return VllmPath("vllm_pynccl", "the group spans hosts: vLLM's custom all-reduce stays off")
    if world_size not in CUSTOM_AR_WORLD_SIZES:
        return VllmPath("vllm_pynccl", f"custom all-reduce supports world sizes {CUSTOM_AR_WORLD_SIZES}")
    if world_size > 2 and not nvlink:
        return VllmPath("vllm_pynccl", "custom all-reduce is off on more than two PCIe-only GPUs")
    if nbytes % 16 or nbytes >= CUSTOM_AR_MAX_BYTES:
        return VllmPath("vllm_pynccl", f"custom all-reduce takes messages under {CUSTOM_AR_MAX_BYTES >> 20} MiB "
                                       "in multiples of 16 bytes")
    if nvlink:
        return VllmPath("vllm_custom", f"custom all-reduce over NVLink at {world_size} ranks")
    return VllmPath("vllm_custom", "custom all-reduce on two PCIe GPUs, if P2P between them works "
                                   "(vLLM tests it at start-up and falls back to PyNccl)")


def link_summary(topology: dict) -> dict[str, object]:
    """The facts of :func:`decodebench.hardware.nvml_topology` that decide an all-reduce's route.

    >>> link_summary({"available": False, "reason": "nvidia-ml-py is not installed"})["link"]
    'unknown'
    """
    if not topology.get("available"):
        return {"link": "unknown", "reason": topology.get("reason")}
    pairs, gpus = topology.get("pairs", []), topology.get("gpus", [])
    return {
        "link": topology.get("link"),
        "gpus": topology.get("count"),
        "p2p_all_pairs": all(p.get("p2p_read") for p in pairs) if pairs else None,
        "nvlink_pairs": sum(bool(p.get("nvlink")) for p in pairs),
        "pcie": sorted({f"gen{g.get('pcie_gen')} x{g.get('pcie_width')}" for g in gpus}),
    }
