"""The gate's words: one line per verdict (slowest first), the markdown summary and where it goes;
the live session and ``python -m decodebench.gate`` print the same lines.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from .cost import StepChange
from .decision import Verdict
from .verdict import CaseVerdict

__all__ = ["ORDER", "artifact_links", "format_verdicts", "markdown_summary", "summary_target", "write_summary"]

ORDER = {Verdict.SLOWER: 0, Verdict.UNDECIDED: 1, Verdict.INCOMPARABLE: 2, Verdict.FASTER: 3, Verdict.SAME: 4}
_SHOWN = (Verdict.SLOWER, Verdict.UNDECIDED, Verdict.INCOMPARABLE)  # rows that need a reader's eye


def _sorted(verdicts: Sequence[CaseVerdict]) -> list[CaseVerdict]:
    return sorted(verdicts, key=lambda v: (ORDER[v.verdict], -(v.ratio or 0), v.name))


def _cost(v: CaseVerdict) -> str:
    if v.cost_us is None:
        return "-"
    share = f" ({v.step_share:+.2%} of step)" if v.step_share is not None else ""
    return f"{v.cost_us:+.2f} µs/step{share}"


def _notes(v: CaseVerdict) -> str:
    return "".join(f"; {note}" for note in v.notes)


def format_verdicts(verdicts: Sequence[CaseVerdict]) -> list[str]:
    """One line per verdict, slowest first.

    >>> v = CaseVerdict("t::k[a]", Verdict.SLOWER, "+30.0%", ratio=1.3, cost_us=12.5, step_share=0.004)
    >>> format_verdicts([v])
    ['SLOWER         1.300x  +12.50 µs/step (+0.40% of step)  t::k[a]  (+30.0%)']
    """
    lines = []
    for v in _sorted(verdicts):
        ratio = f"{v.ratio:7.3f}x" if v.ratio is not None else "      -"
        lines.append(f"{v.verdict.value.upper():<12} {ratio}  {_cost(v)}  {v.name}  ({v.reason}{_notes(v)})")
    return lines


def _row(v: CaseVerdict) -> str:
    ratio = f"{v.ratio:.3f}x" if v.ratio is not None else "-"
    interval = f"{v.low:.3f}–{v.high:.3f}x" if v.low is not None else "-"
    us = f"{v.cost_us:+.2f}" if v.cost_us is not None else "-"
    share = f"{v.step_share:+.2%}" if v.step_share is not None else "-"
    reason = (v.reason + _notes(v)).replace("|", "\\|")
    return (f"| **{v.verdict.value.upper()}** | `{v.name}` | {ratio} | {interval} | {_detectable(v)} | {us} | {share} "
            f"| {reason} |")


def _detectable(v: CaseVerdict) -> str:
    """An UNDECIDED case's minimum detectable change: the smallest slowdown its runs could call."""
    if v.verdict is not Verdict.UNDECIDED:
        return ""
    return f"{v.detectable:+.1%}" if v.detectable is not None else "no spread yet"


def markdown_summary(verdicts: Sequence[CaseVerdict], conclusion: str, links: Sequence[str] = (),
                     steps: Sequence[StepChange] = ()) -> str:
    """The summary as markdown.

    >>> text = markdown_summary([CaseVerdict("k[a]", Verdict.SLOWER, "+30.0%", ratio=1.3)], "gate FAILED: 1")
    >>> "| **SLOWER** | `k[a]` | 1.300x | - |  | - | - | +30.0% |" in text
    True
    >>> noisy = CaseVerdict("k[b]", Verdict.UNDECIDED, "+2.0%", ratio=1.02, detectable=0.081)
    >>> "| **UNDECIDED** | `k[b]` | 1.020x | - | +8.1% |" in markdown_summary([noisy], "gate passed")
    True
    """
    lines = ["## decodebench verdicts", "", f"**{conclusion}**", ""]
    shown = [v for v in _sorted(verdicts) if v.verdict in _SHOWN]
    if shown:
        lines += ["| verdict | benchmark | ratio | interval | smallest slowdown it could call | µs/step | % of step "
                  "| why |", "|---|---|---|---|---|---|---|---|"]
        lines += [_row(v) for v in shown] + [""]
    if steps:
        lines += ["| decode step | M | predicted µs | change µs | % of step | verdict |", "|---|---|---|---|---|---|"]
        lines += [f"| step | {s.tokens} | {s.step_us:.1f} | {s.change_us:+.2f} | {s.share:+.2%} | "
                  f"{s.verdict.value.upper()} |" for s in steps] + [""]
    counts = Counter(v.verdict for v in verdicts)
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
    json_out = _json_report(config)
    return json_out.with_name(f"{json_out.stem}.summary.md") if json_out is not None else None


def _json_report(config) -> Path | None:
    """``--benchmark-json``'s path: pytest-benchmark 5 gives a Path (whose ``.name`` is the file's name
    alone), older ones an open file (whose ``.name`` is the path)."""
    json_out = config.getoption("benchmark_json", None)
    if json_out is None:
        return None
    return Path(json_out if isinstance(json_out, (str, os.PathLike)) else json_out.name)


def artifact_links(config) -> list[str]:
    """Paths of what this session wrote: the JSON files and the histogram plots."""
    links = []
    json_out = _json_report(config)
    if json_out is not None:
        links.append(str(json_out))
    storage = getattr(getattr(config, "_benchmarksession", None), "storage", None)
    if getattr(storage, "saved_path", None):
        links.append(str(storage.saved_path))
    histogram = config.getoption("benchmark_histogram", None)
    if histogram:
        links.append(f"{histogram}*.svg")
    return links


def write_summary(target: Path, text: str) -> None:
    """Append ``text`` to ``target`` (GitHub's step summary is appended to, never replaced)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target, "a", encoding="utf8") as fh:
        fh.write(text)
