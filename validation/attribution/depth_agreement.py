"""The full-depth estimate checked across depths: two ``--breakdown`` sessions of one model served at
different ``--server-layers`` (2 and 4) give, per component, the same full-depth µs per step when the
per-layer components scale as :mod:`decodebench.attribution.depth` says::

    python -m validation.attribution.depth_agreement L4/attribution.json L2/attribution.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

__all__ = ["depth_agreement"]


def depth_agreement(a: dict, b: dict) -> dict[str, tuple[float, float, float | None]]:
    """Full-depth µs per component estimated from two runs of different depth, and their relative gap.

    When per-layer components scale, a 2-layer and a 4-layer run give the same estimate.

    >>> four, two = ({"full_depth_components_us": {"moe_gemm": us}} for us in (100.0, 95.0))
    >>> depth_agreement(four, two)
    {'moe_gemm': (100.0, 95.0, 0.05)}
    """
    first, second = a.get("full_depth_components_us") or {}, b.get("full_depth_components_us") or {}
    return {name: (us, second.get(name, 0.0), (us - second.get(name, 0.0)) / us if us else None)
            for name, us in first.items() if us or second.get(name)}


def _print_depth_agreement(path_a: str, path_b: str) -> None:
    runs_a, runs_b = (json.loads(Path(p).read_text()) for p in (path_a, path_b))
    for load, info in runs_a.items():
        if load not in runs_b:
            continue
        other = runs_b[load]
        print(f"{load}: full-depth estimate from {info.get('layers')} vs {other.get('layers')} layers (µs/step)")
        for name, (x, y, gap) in depth_agreement(info, other).items():
            print(f"  {name:<16}{x:10.1f}{y:10.1f}  " + (f"{gap * 100:+6.1f}%" if gap is not None else "   n/a"))


if __name__ == "__main__":
    _print_depth_agreement(*sys.argv[1:3])
