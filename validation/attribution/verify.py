"""A what-if checked against the run it predicts.

Two sessions of ``--breakdown`` on the same model and loads: ``before`` as served today, with
``--what-if LABEL``; ``after`` with the change made for real (the server started with the other
attention backend, say). Per load, the what-if's predicted change of the kernel time per step
is set against the measured change of the profiled kernel time (busy) per step and of the
changed group's own components; the bar is agreement within 25 %::

    python -m validation.attribution.verify BEFORE/attribution.json AFTER/attribution.json \\
        mla_attention=vllm-triton_mla
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from decodebench.registry import group_parts

__all__ = ["TOLERANCE", "compare", "compare_lines", "main"]

TOLERANCE = 0.25


def compare(before: dict, after: dict, label: str, tolerance: float = TOLERANCE) -> dict[str, dict]:
    """Per load in both sessions: predicted vs measured change of the kernel time per step (µs),
    in total (busy) and in the what-if's group; ValueError naming what is missing.

    >>> a = {"c1": {"busy_us": 100.0, "components_us": {"mla_attention": 10.0}, "scenarios": {"what_if": [
    ...     {"label": "mla_attention=x", "change_us": 40.0, "kernel_us": 130.0}], "today": {"kernel_us": 90.0}}}}
    >>> b = {"c1": {"busy_us": 145.0, "components_us": {"mla_attention": 52.0}}}
    >>> row = compare(a, b, "mla_attention=x")["c1"]
    >>> row["predicted_change_us"], row["busy_change_us"], round(row["busy_error"], 3), row["busy_within"]
    (40.0, 45.0, -0.111, True)
    """
    group = label.split("=", 1)[0]
    if group not in group_parts():
        raise ValueError(f"{label}: unknown component {group!r}; choose one of {', '.join(group_parts())}")
    loads = [load for load in before if load in after]
    if not loads:
        raise ValueError(f"no load is in both sessions ({', '.join(before)} vs {', '.join(after)})")
    return {load: _row(before[load], after[load], label, group, tolerance) for load in loads}


def _row(a: dict, b: dict, label: str, group: str, tolerance: float) -> dict:
    scenario = next((w for w in (a.get("scenarios") or {}).get("what_if", []) if w["label"] == label), None)
    if scenario is None:
        raise ValueError(f"the first session has no --what-if {label} (its attribution has "
                         f"{', '.join(w['label'] for w in (a.get('scenarios') or {}).get('what_if', [])) or 'none'})")
    predicted = scenario["change_us"]
    component = lambda info: sum(info["components_us"].get(n, 0.0) for n in group_parts()[group])  # noqa: E731
    row = {"predicted_change_us": predicted, "busy_change_us": b["busy_us"] - a["busy_us"],
           "group_change_us": component(b) - component(a), "before_busy_us": a["busy_us"],
           "after_busy_us": b["busy_us"], "predicted_after_us": scenario["kernel_us"]}
    for key in ("busy", "group"):
        measured = row[f"{key}_change_us"]
        error = predicted / measured - 1 if measured else None
        row[f"{key}_error"] = error
        row[f"{key}_within"] = error is not None and abs(error) <= tolerance
    return row


def compare_lines(rows: dict[str, dict], label: str, tolerance: float = TOLERANCE) -> list[str]:
    """The comparison as text, one block per load."""
    lines = [f"--what-if {label} against the run with the change made (µs of kernel time per step)"]
    for load, r in rows.items():
        lines.append(f"{load}: predicted change {r['predicted_change_us']:+.1f}")
        for key, what in (("busy", "all kernels (busy)"), ("group", f"{label.split('=')[0]} components")):
            error = r[f"{key}_error"]
            verdict = "within" if r[f"{key}_within"] else "NOT within"
            lines.append(f"  measured {what:<28} {r[f'{key}_change_us']:+9.1f}  predicted/measured - 1 = "
                         f"{error * 100:+.1f} %  ({verdict} {tolerance:.0%})" if error is not None else
                         f"  measured {what:<28} {r[f'{key}_change_us']:+9.1f}  (no change measured)")
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 3:
        print("usage: python -m validation.attribution.verify BEFORE.json AFTER.json COMPONENT=VALUE", file=sys.stderr)
        return 2
    try:
        before, after = (json.loads(Path(p).read_text()) for p in argv[:2])
        rows = compare(before, after, argv[2])
    except (OSError, ValueError, KeyError) as exc:
        print(f"python -m validation.attribution.verify: error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(compare_lines(rows, argv[2])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
