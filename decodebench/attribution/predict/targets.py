"""Machines a decode step can be projected to: target files and the link table.

A target is a JSON file (``targets/*.json``, named by their file name, or a path): the GPU, the GPU
count and TP size, the link its all-reduces cross, the backends vLLM runs there where they differ, and
optionally all-reduce results measured on it; docs/projection.md, "What-if, Amdahl, projection", has
its fields and the shipped targets. A link's all-reduce of ``b`` bytes over ``n`` ranks takes
``alpha + b / beta`` with ``beta = busbw * n / (2 (n - 1))``, nccl-tests' relation between bus and
algorithm bandwidth.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ...files import read_json
from ...hardware import DeviceSpec, device_spec
from ...registry import group_parts
from ...roofline import Peaks
from .step import KernelResult, WhatIfError

__all__ = ["TARGETS_DIR", "Link", "LinkFit", "Target", "TargetBackend", "fit_link", "fit_points", "link_table",
           "load_target", "shipped_targets"]

TARGETS_DIR = Path(__file__).resolve().parent / "targets"
_LINKS = TARGETS_DIR / "links.json"
ALLREDUCE = "allreduce"


@dataclass(frozen=True)
class Link:
    """A link's all-reduce model: small-message latency and large-message bus bandwidth, with sources."""

    id: str
    kind: str  # "pcie" or "nvlink"
    alpha_us: float
    busbw_gbps: float
    source: str
    name: str = ""

    def beta_bytes_per_s(self, ranks: int) -> float:
        """Algorithm bandwidth of an all-reduce over ``ranks`` (bytes of the message per second).

        >>> round(Link("l", "pcie", 24.0, 41.1, "s").beta_bytes_per_s(8) / 1e9, 2)
        23.49
        """
        return self.busbw_gbps * 1e9 * ranks / (2 * (ranks - 1))

    def allreduce_us(self, nbytes: int, ranks: int) -> float:
        """One all-reduce of ``nbytes`` over ``ranks``: alpha + bytes / beta, in µs.

        >>> round(Link("l", "pcie", 24.0, 41.1, "s").allreduce_us(14336, 8), 2)
        24.61
        """
        return self.alpha_us + nbytes / self.beta_bytes_per_s(ranks) * 1e6


@dataclass(frozen=True)
class TargetBackend:
    """The backend vLLM runs for a group on the target, where the measured machine ran another."""

    group: str
    backend: str
    why: str


@dataclass(frozen=True)
class Target:
    id: str
    name: str
    device: DeviceSpec
    gpus: int
    tp: int
    link: Link | None
    backends: tuple[TargetBackend, ...]
    allreduce_results: tuple[Path, ...]
    memory_bytes: int | None
    path: Path

    @property
    def peaks(self) -> Peaks:
        return self.device.peaks


def shipped_targets() -> list[str]:
    """Ids of the targets shipped in ``targets/``.

    >>> shipped_targets()
    ['h200-x1', 'h200-x8-nvlink', 'rtx-pro-6000-x8-pcie']
    """
    return sorted(p.stem for p in TARGETS_DIR.glob("*.json") if p != _LINKS)


def link_table() -> dict[str, Link]:
    """The shipped link table, by id.

    >>> link_table()["pcie5-switch"].alpha_us
    24.1
    """
    raw = json.loads(_LINKS.read_text())
    return {key: _link(key, entry) for key, entry in raw.items() if not key.startswith("_")}


def load_target(text: str) -> Target:
    """A shipped target by id, or a target file by path; :class:`WhatIfError` naming what is wrong.

    >>> t = load_target("rtx-pro-6000-x8-pcie")
    >>> t.tp, t.link.id, t.device.mem_bytes_per_s
    (8, 'pcie5-switch', 1792000000000.0)
    """
    path = TARGETS_DIR / f"{text}.json" if text in shipped_targets() else Path(text)
    if not path.is_file():
        raise WhatIfError(f"{text}: no such target file, nor a shipped target "
                          f"({', '.join(shipped_targets())})")
    try:
        raw = read_json(path)
    except (OSError, ValueError) as exc:
        raise WhatIfError(f"{text}: not a readable JSON target file ({exc})") from None
    if not isinstance(raw, dict):
        raise WhatIfError(f"{text}: holds no JSON object")
    return _target(text, path, raw)


def _target(text: str, path: Path, raw: dict) -> Target:
    def need(key, kind):
        value = raw.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise WhatIfError(f"{text}: needs {key!r} ({kind.__name__}), got {value!r}")
        return value

    gpus, tp = need("gpus", int), need("tp", int)
    if not 1 <= tp <= gpus:
        raise WhatIfError(f"{text}: tp {tp} must be between 1 and its {gpus} GPUs")
    link = _target_link(text, path, raw.get("link"), tp)
    memory = raw.get("memory_gib")
    if memory is not None and (isinstance(memory, bool) or not isinstance(memory, (int, float))
                               or not 0 < memory < math.inf):
        raise WhatIfError(f"{text}: memory_gib {memory!r} must be a GPU's memory in GiB, above 0 (or left out)")
    return Target(path.stem, str(raw.get("name") or path.stem), _device(text, path, raw), gpus, tp, link,
                  _backends(text, path, raw.get("backends") or {}),
                  tuple(path.parent / p for p in raw.get("allreduce_results") or ()),
                  int(memory * 2**30) if isinstance(memory, (int, float)) else None, path)


def _device(text: str, path: Path, raw: dict) -> DeviceSpec:
    peaks = raw.get("peaks")
    if isinstance(peaks, dict):
        try:
            return DeviceSpec(str(raw.get("device", path.stem)), str(raw.get("device", path.stem)),
                              float(peaks["mem_bytes_per_s"]), float(peaks["bf16_dense_flops"]),
                              str(peaks["source"]))
        except (KeyError, TypeError, ValueError):
            raise WhatIfError(f"{text}: 'peaks' needs mem_bytes_per_s, bf16_dense_flops "
                              f"and source, got {peaks!r}") from None
    spec = device_spec(str(raw.get("device", "")))
    if spec is None:
        raise WhatIfError(f"{text}: device {raw.get('device')!r} is not in the device table "
                          "(decodebench/hardware.py); name one or give 'peaks'")
    return spec


def _target_link(text: str, path: Path, value, tp: int) -> Link | None:
    if value is None:
        if tp > 1:
            raise WhatIfError(f"{text}: has no 'link' (TP {tp} all-reduces over one): name one "
                              f"of {', '.join(link_table())} or give alpha_us, busbw_gbps and source")
        return None
    if isinstance(value, str):
        table = link_table()
        if value not in table:
            raise WhatIfError(f"{text}: unknown link {value!r}; choose one of "
                              f"{', '.join(table)} or give alpha_us, busbw_gbps and source")
        return table[value]
    return _link(f"{path.stem} link", value, text)


def _link(key: str, entry, text: str | None = None) -> Link:
    try:
        link = Link(key, str(entry.get("kind", "pcie")), float(entry["alpha_us"]), float(entry["busbw_gbps"]),
                    str(entry["source"]), str(entry.get("name", key)))
    except (AttributeError, KeyError, TypeError, ValueError):
        raise WhatIfError(f"{text or key}: a link needs alpha_us, busbw_gbps and source, "
                          f"got {entry!r}") from None
    if link.alpha_us < 0 or link.busbw_gbps <= 0:
        raise WhatIfError(f"{text or key}: link alpha_us {link.alpha_us} must be >= 0 and "
                          f"busbw_gbps {link.busbw_gbps} > 0")
    return link


def _backends(text: str, path: Path, raw) -> tuple[TargetBackend, ...]:
    if not isinstance(raw, dict):
        raise WhatIfError(f"{text}: 'backends' must map a component to a backend, got {raw!r}")
    out = []
    for group, entry in raw.items():
        if group not in group_parts() or not isinstance(entry, dict) or not entry.get("backend"):
            raise WhatIfError(f"{text}: backends entry {group!r}: {entry!r} is not "
                              f"{{'backend': ID, 'why': TEXT}} for one of {', '.join(group_parts())}")
        out.append(TargetBackend(group, str(entry["backend"]), str(entry.get("why", ""))))
    return tuple(out)


@dataclass(frozen=True)
class LinkFit:
    """``alpha + bytes / beta`` fitted to measured all-reduce results."""

    alpha_us: float
    beta_bytes_per_s: float
    points: int
    worst_error: float  # the largest relative miss of the fit over its points

    def allreduce_us(self, nbytes: int) -> float:
        return self.alpha_us + nbytes / self.beta_bytes_per_s * 1e6


def fit_link(results: Sequence[KernelResult], ranks: int) -> LinkFit | None:
    """Fit ``alpha + bytes / beta`` to the all-reduce results over ``ranks`` ranks (CUDA-graph figures
    where there are any: what a decode step under graphs pays), weighting every message size alike
    (least squares of the relative error). None with fewer than two sizes, or a fit without
    positive latency and bandwidth.

    >>> rs = [KernelResult(f"ar{b}", "allreduce", "torch", {"tokens": 1}, (20 + b / 1e4) * 1e-6,
    ...                    {"world_size": 8, "message_bytes": b}) for b in (14336, 917504, 3670016)]
    >>> fit = fit_link(rs, 8)
    >>> round(fit.alpha_us, 3), round(fit.beta_bytes_per_s / 1e9, 3), fit.points
    (20.0, 10.0, 3)
    """
    mine = [r for r in results if r.component == ALLREDUCE and r.info.get("world_size") == ranks
            and r.info.get("message_bytes")]
    graphs = [r for r in mine if r.info.get("timer") == "graph"]
    return fit_points([(float(r.info["message_bytes"]), r.median_s * 1e6) for r in graphs or mine])


def fit_points(points: Sequence[tuple[float, float]]) -> LinkFit | None:
    """``alpha + bytes / beta`` fitted to (bytes, µs) points, each size weighted alike; None with fewer
    than two sizes, or a fit without positive latency and bandwidth.

    >>> fit = fit_points([(0.0, 20.0), (1e4, 21.0)])
    >>> round(fit.alpha_us, 3), round(fit.beta_bytes_per_s / 1e9, 3)
    (20.0, 10.0)
    """
    if len({b for b, _ in points}) < 2:
        return None
    # minimise sum(((alpha + gamma * b) - t) / t)^2: the normal equations of rows (1/t, b/t) -> 1
    s11 = sum(1 / t**2 for _, t in points)
    s12 = sum(b / t**2 for b, t in points)
    s22 = sum(b * b / t**2 for b, t in points)
    r1, r2 = sum(1 / t for _, t in points), sum(b / t for b, t in points)
    det = s11 * s22 - s12 * s12
    alpha, gamma = (r1 * s22 - r2 * s12) / det, (s11 * r2 - s12 * r1) / det
    if alpha < 0 or gamma <= 0:
        return None
    worst = max(abs(alpha + gamma * b - t) / t for b, t in points)
    return LinkFit(alpha, 1e6 / gamma, len(points), worst)
