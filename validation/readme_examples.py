"""Regenerate the gate examples of README.md and docs/gate.md from the committed H200 results, and check them.

Every line of gate output these pages show (a verdict line, a conclusion line) must be one that
this script regenerates from committed files, and the figures of the inline offline example
must be the ones the command prints today. The pages are read as one text. The examples:

- ``regression``: ``python -m decodebench.gate`` with the whole committed H200 folder as the
  baseline and, as CURRENT, a copy of ``0003`` whose one fused MoE case (uniform, M=64) has its
  samples and re-measures scaled by 1.10;
- ``sessions``: the committed sessions ``0002`` against ``0003`` (one stored result each);
- ``qa``: how far each vLLM ``q_a`` GEMM shape's floor moves across the committed sessions, both
  directions (docs/gate.md quotes the ranges and the M = 8 steps);
- ``nightly``: the verdict lines of the unchanged nightly of H200 lease 5 (``validation/h200/gate/
  stored-power-lease5/inject0-gate5/``, gated against the committed baselines at 5 %) as the session
  printed them (rebuilt from each result's ``extra_info["gate"]`` with the report's own line
  format), and its conclusion, from the session's markdown summary.

Usage: ``python validation/readme_examples.py [--check README.md docs/gate.md]``: without ``--check`` it
prints every example's lines; with it, it exits 1 naming each line of the pages no example produces
(0: all match).
"""

from __future__ import annotations

import argparse
import copy
import gzip
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from decodebench.gate.decision import Verdict  # noqa: E402 - after the checkout is on the path
from decodebench.gate.summary import format_verdicts  # noqa: E402
from decodebench.gate.verdict import CaseVerdict  # noqa: E402

H200 = REPO / "baselines" / "nvidia-h200-x1-single-cc90-drv580.159.04-cuda13.0-torch2.11.0-cu130"
AA = H200 / "0003_h200-vllm-nightly-aa.json"
NIGHTLY = H200 / "0002_h200-vllm-nightly.json"
NIGHTLY_LIVE = REPO / "validation" / "h200" / "gate" / "stored-power-lease5" / "inject0-gate5"
GATED, GATED_SUMMARY = NIGHTLY_LIVE / "stored-power-1.json.gz", NIGHTLY_LIVE / "stored-power-1.summary.md"
MOE = "benchmarks/test_moe.py::test_moe[fused-e384-top8-g32-n512k7168-n7168k256-uniform-m64-vllm]"
FACTOR = 1.10

VERDICT_LINE = re.compile(r"^(SLOWER|FASTER|SAME|UNDECIDED|INCOMPARABLE) +\d")
CONCLUSION_LINE = re.compile(r"^gate (passed|FAILED): ")
# the inline example of docs/gate.md's *Offline* section:
# `... --gate 5%` → `gate passed: 0 of 180 cases …; 180 undecided, 180 of them too noisy to gate at 5.0%`
INLINE = re.compile(r"`(gate (?:passed|FAILED):\s+\d+\s+of\s+\d+\s+cases)\s+…;\s+(\d+\s+undecided"
                    r"(?:,\s+\d+\s+of\s+them\s+too\s+noisy\s+to\s+gate\s+at\s+[\d.]+%)?)`")


@dataclass(frozen=True)
class Example:
    """One example: its name, how it was made, and the lines it prints."""

    name: str
    command: str
    lines: tuple[str, ...]


def gate_lines(baseline: Path, current: Path) -> list[str]:
    """What ``python -m decodebench.gate BASELINE CURRENT --gate 5%`` prints, line by line."""
    done = subprocess.run([sys.executable, "-m", "decodebench.gate", str(baseline), str(current), "--gate", "5%"],
                          capture_output=True, text=True, cwd=REPO, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    if done.returncode not in (0, 1):
        raise SystemExit(f"python -m decodebench.gate {baseline} {current} failed ({done.returncode}): {done.stderr}")
    return done.stdout.splitlines()


def scaled_copy(source: Path, case: str, factor: float, dest: Path) -> Path:
    """``source`` with one case's samples and re-measures multiplied by ``factor``, written to ``dest``."""
    document = json.loads(source.read_text())
    scaled = copy.deepcopy(document)
    found = [b for b in scaled["benchmarks"] if b["fullname"] == case]
    if len(found) != 1:
        raise SystemExit(f"{source}: expected one result of {case}, found {len(found)}")
    scale_entry(found[0], factor)
    dest.write_text(json.dumps(scaled))
    return dest


def scale_entry(bench: dict, factor: float) -> None:
    """Multiply a stored entry's samples and re-measured samples by ``factor``, in place."""
    bench["stats"]["data"] = [v * factor for v in bench["stats"]["data"]]
    info = bench.setdefault("extra_info", {})
    info["resamples"] = [[v * factor for v in r] for r in info.get("resamples") or []]


def regression(tmp: Path) -> Example:
    current = scaled_copy(AA, MOE, FACTOR, tmp / "0005_scaled.json")
    lines = gate_lines(H200, current)
    shown = [line for line in lines if line.startswith("SLOWER") or CONCLUSION_LINE.match(line)]
    return Example("regression", f"python -m decodebench.gate {H200.relative_to(REPO)} <0003 with {MOE} x {FACTOR}> "
                   "--gate 5%", tuple(shown))


def sessions() -> Example:
    lines = gate_lines(NIGHTLY, AA)
    command = f"python -m decodebench.gate {NIGHTLY.relative_to(REPO)} {AA.relative_to(REPO)} --gate 5%"
    return Example("sessions", command,
                   tuple(line for line in lines if CONCLUSION_LINE.match(line)))


def stored_verdict(name: str, record: dict) -> CaseVerdict:
    """A result's ``extra_info["gate"]`` back as the verdict it records."""
    return CaseVerdict(name, Verdict(record["verdict"]), record["reason"], ratio=record["ratio"],
                       low=record["low"], high=record["high"], runs=tuple(record["runs"]),
                       paired=record["paired"], step=record["step"], kernels=record["kernels"],
                       tokens=record["tokens"], calls=record["calls"], cost_us=record["cost_us"],
                       step_share=record["step_share"])


def nightly() -> Example:
    document = json.loads(gzip.decompress(GATED.read_bytes()))
    verdicts = [stored_verdict(b["fullname"], b["extra_info"]["gate"]) for b in document["benchmarks"]
                if (b.get("extra_info") or {}).get("gate")]
    conclusions = re.findall(r"^\*\*(gate (?:passed|FAILED): .*)\*\*$", GATED_SUMMARY.read_text(), re.MULTILINE)
    return Example("nightly", f"extra_info['gate'] of {GATED.relative_to(REPO)}; conclusion from "
                   f"{GATED_SUMMARY.relative_to(REPO)}", (*format_verdicts(verdicts), *conclusions))


def floor(samples: list[float]) -> float:
    """The gate's statistic of a run: the 10th percentile of its samples (nearest rank below).

    >>> floor([5.0, 1.0, 2.0, 3.0, 4.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0])
    2.0
    """
    ordered = sorted(samples)
    return ordered[int(0.1 * (len(ordered) - 1))]


def qa_moves() -> Example:
    """How far each vLLM ``q_a`` shape's floor moves across the committed sessions that hold it."""
    sessions = [path for path in sorted(H200.glob("0*.json"))]
    floors: dict[str, dict[str, float]] = {}
    for path in sessions:
        for bench in json.loads(path.read_text())["benchmarks"]:
            if bench["name"].startswith("test_dense_gemm[q_a-") and bench["name"].endswith("-vllm]"):
                floors.setdefault(bench["name"], {})[path.name[:4]] = floor(bench["stats"]["data"])
    lines = []
    for name, by_file in sorted(floors.items(), key=lambda kv: int(re.search(r"-m(\d+)-", kv[0]).group(1))):
        low, high = min(by_file.values()), max(by_file.values())
        pairs = zip(by_file, list(by_file)[1:], strict=False)
        steps = ", ".join(f"{a}→{b} {by_file[b] / by_file[a] - 1:+.1%}" for a, b in pairs)
        lines.append(f"{name}: floors {' / '.join(f'{v * 1e6:.2f}' for v in by_file.values())} µs "
                     f"({' / '.join(by_file)}), max/min {high / low - 1:.1%}; {steps}")
    moved = sorted(high for high in (max(f.values()) / min(f.values()) - 1 for f in floors.values()))
    big = [m for m in moved if m > 0.10]
    lines.append(f"q_a: {len(big)} of {len(moved)} shapes move {min(big):.1%}–{max(big):.1%}, "
                 f"the others {min(moved):.1%}–{max(m for m in moved if m <= 0.10):.1%}")
    return Example("qa", f"floors of test_dense_gemm[q_a-*-vllm] in {H200.relative_to(REPO)}/0*.json", tuple(lines))


def examples() -> list[Example]:
    with tempfile.TemporaryDirectory() as tmp:
        return [regression(Path(tmp)), sessions(), nightly(), qa_moves()]


def readme_output_lines(text: str) -> list[str]:
    """Every line of gate output inside the pages' fenced blocks."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    return [line for block in blocks for line in block.splitlines()
            if VERDICT_LINE.match(line) or CONCLUSION_LINE.match(line)]


def problems(readme: str, made: list[Example]) -> list[str]:
    """What the pages show that no example prints today (empty: all of it is regenerated)."""
    produced = {line for ex in made for line in ex.lines}
    found = [f"the pages show a line no committed file produces: {line}"
             for line in readme_output_lines(readme) if line not in produced]
    by_name = {ex.name: ex for ex in made}
    for ex in ("regression",):  # its every printed line is in a fenced block
        found += [f"the pages lack the {ex} example's line: {line}" for line in by_name[ex].lines
                  if line not in readme]
    found += qa_problems(readme, by_name["qa"].lines)
    (conclusion,) = by_name["sessions"].lines
    inline = [tuple(" ".join(part.split()) for part in match) for match in INLINE.findall(readme)]
    if not inline:
        found.append("the pages have no inline offline example (`gate passed: N of M cases …; K undecided`)")
    found += [f"the inline example says `{head} …; {tail}`; the command prints: {conclusion}"
              for head, tail in inline if not (conclusion.startswith(head) and conclusion.endswith(tail))]
    return found


def qa_problems(readme: str, lines: tuple[str, ...]) -> list[str]:
    """The pages' ``q_a`` figures: both ranges of the summary line, and the M = 8 steps."""
    big, rest = re.findall(r"(\d+\.\d)%–(\d+\.\d)%", lines[-1])
    wanted = [f"{big[0]}–{big[1]} %", f"{rest[0]}–{rest[1]} %"]
    m8 = next(line for line in lines if "-m8-" in line)
    wanted += [f"{step.replace('-', '−')} %" for step in re.findall(r"→\d{4} ([+-]\d+\.\d)%", m8)]
    text = " ".join(readme.split())
    return [f"the pages lack the q_a figure {w!r} ({lines[-1]}; {m8})" for w in wanted if w not in text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", type=Path, nargs="+", metavar="PAGE",
                        help="compare the gate lines of these pages (read as one) with the examples")
    args = parser.parse_args(argv)
    made = examples()
    if args.check is None:
        for ex in made:
            print(f"## {ex.name}: {ex.command}", *ex.lines, sep="\n")
        return 0
    found = problems("\n".join(page.read_text() for page in args.check), made)
    for line in found:
        print(line)
    names = ", ".join(map(str, args.check))
    print(f"{names}: {'stale' if found else 'every gate line regenerated from committed files'}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
