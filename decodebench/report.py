"""The markdown summary of a session's verdicts, for a CI page a reviewer reads in seconds.

SLOWER rows come first (ratio, change, p-value), then the other unsettled rows, the
counts per verdict, the conclusion, and where the JSON and plots are.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from .compare import ORDER, Comparison, Verdict

__all__ = ["artifact_links", "markdown_summary", "summary_target", "write_summary"]

_SHOWN = (Verdict.SLOWER, Verdict.UNDECIDED, Verdict.INCOMPARABLE)  # rows that need a reader's eye


def _row(c: Comparison) -> str:
    ratio = f"{c.ratio:.3f}x" if c.ratio is not None else "-"
    change = f"{c.change:+.1%}" if c.change is not None else "-"
    p_value = f"{c.p_value:.2g}" if c.p_value is not None else "-"
    reason = c.reason.replace("|", "\\|")
    return f"| **{c.verdict.value.upper()}** | `{c.name}` | {ratio} | {change} | {p_value} | {reason} |"


def markdown_summary(comparisons: Sequence[Comparison], conclusion: str, links: Sequence[str] = ()) -> str:
    """The summary as markdown.

    >>> from decodebench.compare import Comparison, Verdict
    >>> text = markdown_summary([Comparison("k[a]", Verdict.SLOWER, 1.3, 1e-6, "+30.0%")], "gate FAILED: 1")
    >>> "| **SLOWER** | `k[a]` | 1.300x | +30.0% | 1e-06 | +30.0% |" in text
    True
    """
    lines = ["## decodebench verdicts", "", f"**{conclusion}**", ""]
    shown = sorted((c for c in comparisons if c.verdict in _SHOWN), key=lambda c: (ORDER[c.verdict], -(c.ratio or 0)))
    if shown:
        lines += ["| verdict | benchmark | ratio | change | p | why |", "|---|---|---|---|---|---|"]
        lines += [_row(c) for c in shown] + [""]
    counts = Counter(c.verdict for c in comparisons)
    lines.append(" · ".join(f"{v.value.upper()}: {counts[v]}" for v in sorted(Verdict, key=ORDER.get)))
    if links:
        lines += ["", "Results and plots:", *(f"- `{link}`" for link in links)]
    return "\n".join(lines) + "\n"


def summary_target(config) -> Path | None:
    """``--summary-md``, else ``$GITHUB_STEP_SUMMARY``, else beside ``--benchmark-json``, else None."""
    explicit = config.getoption("summary_md", None)
    if explicit:
        return Path(explicit)
    if os.environ.get("GITHUB_STEP_SUMMARY"):
        return Path(os.environ["GITHUB_STEP_SUMMARY"])
    json_out = config.getoption("benchmark_json", None)
    if json_out is not None:
        path = Path(getattr(json_out, "name", json_out))
        return path.with_name(f"{path.stem}.summary.md")
    return None


def artifact_links(config) -> list[str]:
    """Paths of what this session wrote: the JSON files and the histogram plots."""
    links = []
    json_out = config.getoption("benchmark_json", None)
    if json_out is not None:
        links.append(str(getattr(json_out, "name", json_out)))
    storage = getattr(getattr(config, "_benchmarksession", None), "storage", None)
    if getattr(storage, "saved_path", None):
        links.append(str(storage.saved_path))
    histogram = config.getoption("benchmark_histogram", None)
    if histogram:
        links.append(f"{histogram}*.svg")
    return links


def write_summary(target: Path, comparisons: Sequence[Comparison], conclusion: str, links: Sequence[str]) -> None:
    """Append the summary to ``target`` (GitHub's step summary is appended to, never replaced)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target, "a", encoding="utf8") as fh:
        fh.write(markdown_summary(comparisons, conclusion, links))
