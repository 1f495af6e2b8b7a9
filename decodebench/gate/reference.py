"""What a session is compared against: stored records per case (``(label, record)``, the label the
file's number, so that a step can say where it started), where they came from, and each file or entry
passed over with why: unusable entries (:mod:`..entry_check`) and copies of a run already counted
(:func:`same_run`; docs/stored-results.md, "One run, stored twice").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..baselines import History
from ..entry_check import usable_entries
from ..results import Result, record_of

__all__ = ["SAME_RUN_WITHIN", "Baseline", "baseline_from_history", "label_of",
           "named", "new_cases", "same_run", "why_nothing"]

# Two runs whose sorted samples differ by at most this, relatively, sample by sample, are one run
# stored twice. Two separate measurements never came within 3.7e-4 of each other over the 14,769
# pairs of runs of one case in the committed sessions (docs/stored-results.md names the file and the
# script); the median pair differs by 2.4e-2. 1e-6 lies far below both.
SAME_RUN_WITHIN = 1e-6


def label_of(path: Path) -> str:
    """A stored result's short name: its number (``0007_x_2026.json`` -> ``0007``).

    >>> label_of(Path("b/0007_abc_2026-12-01.json")), label_of(Path("run.json"))
    ('0007', 'run')
    """
    head = path.name.split("_", 1)[0]
    return head if head.isdigit() else path.stem


def same_run(a: Sequence[float], b: Sequence[float]) -> bool:
    """Whether two runs' samples agree beyond what a timer can repeat (:data:`SAME_RUN_WITHIN`):
    the same count, and each of the sorted samples within that relative distance of the other's.

    >>> same_run([2e-6, 1e-6], [1e-6 * (1 + 1e-12), 2e-6]), same_run([1e-6, 2e-6], [1.0004e-6, 2e-6])
    (True, False)
    """
    if len(a) != len(b) or not a:
        return False
    return all(abs(x - y) <= SAME_RUN_WITHIN * min(abs(x), abs(y)) for x, y in zip(sorted(a), sorted(b), strict=True))


class RunsSeen:
    """The runs met so far, per test id, each with the file it came from: where a run was seen before."""

    def __init__(self) -> None:
        self._runs: dict[str, list[tuple[tuple[float, ...], str]]] = {}

    def add(self, name: str, samples: tuple[float, ...], source: str) -> None:
        if self.where(name, samples) is None:
            self._runs.setdefault(name, []).append((samples, source))

    def where(self, name: str, samples: tuple[float, ...]) -> str | None:
        """The file of an earlier run of ``name`` that is the same run as ``samples``, or None."""
        return next((source for seen, source in self._runs.get(name, ()) if same_run(seen, samples)), None)


@dataclass
class Baseline:
    """Stored entries per test node id, ``(label, record)`` oldest first (each read once,
    :func:`~decodebench.results.record_of`); where they came from."""

    source: str  # the file or folder named in messages
    entries: dict[str, list[tuple[str, Result]]] = field(default_factory=dict)
    problem: str | None = None  # why there is nothing to compare against
    skipped: tuple[str, ...] = ()  # files and entries passed over, with the reason
    _sources: RunsSeen = field(default_factory=RunsSeen, repr=False)  # each run's file

    def add(self, label: str, benchmarks: Iterable, source: Path | str) -> None:
        """The usable entries of one result's ``benchmarks`` list; the others are named in
        :attr:`skipped`, and so are copies of entries already added (one line for a whole copy)."""
        usable, skipped = usable_entries(benchmarks, source)
        records = {name: record_of(e) for name, e in usable.items()}
        copies = {name: there for name, e in records.items()
                  if (there := self._sources.where(name, e.samples)) is not None}
        for name, entry in records.items():
            if name not in copies:
                self.entries.setdefault(name, []).append((label, entry))
                self._sources.add(name, entry.samples, str(source))
        if copies and len(copies) == len(usable) and len(set(copies.values())) == 1:
            skipped.append(f"{source}: the same samples as {next(iter(copies.values()))}: a copy, not a run of its own")
        else:
            skipped += [f"{source}: case {name}: the same samples as in {there}: a copy, not a run of its own"
                        for name, there in copies.items()]
        self._skip(skipped)

    def drop_copies_of(self, current: Mapping[str, Result], source: Path | str) -> None:
        """Leave out the stored entries whose samples are those of ``current``'s entry of the same
        name (the session judged, stored again): a run is never its own baseline."""
        for name, entry in current.items():
            key = entry.samples
            stored = self.entries.get(name, [])
            copies = [label for label, e in stored if same_run(e.samples, key)]
            if copies:
                self.entries[name] = [(label, e) for label, e in stored if label not in copies]
                self._skip([f"{self._sources.where(name, key) or label}: case {name}: the same samples as CURRENT "
                            f"{source}: not a run of its own" for label in copies])
        self.entries = {name: stored for name, stored in self.entries.items() if stored}

    def _skip(self, lines: Iterable[str]) -> None:
        self.skipped = (*self.skipped, *(line for line in lines if line not in self.skipped))

    def records(self) -> list[Result]:
        """Every stored record, newest result last (for the predicted step)."""
        return [entry for stored in self.entries.values() for _, entry in stored]


def baseline_from_history(history: History, count: int) -> Baseline:
    """The newest ``count`` readable results of a fingerprint's folder as one baseline. A result
    whose every entry repeats an older one's samples, anywhere in the folder, is a copy: it is
    named and takes no place among the ``count``; an entry copied from an older result is named
    and left out (:meth:`Baseline.add`).

    >>> baseline_from_history(History(Path("b/fp"), (), ()), 5).problem
    'no stored result in b/fp (first run on this machine?)'
    """
    originals, copies, seen = [], [], RunsSeen()
    for result in history.results:  # oldest first
        keys = [(name, e.samples) for name, e in result.entries().items()]
        where = [seen.where(*key) for key in keys]
        if keys and None not in where:
            there = ", ".join(sorted(set(where)))
            copies.append(f"{result.path}: the same samples as {there}: a copy, not a run of its own")
        else:
            originals.append(result)
        for key in keys:
            seen.add(*key, str(result.path))
    chosen = originals[-count:] if count > 0 else []
    baseline = Baseline(str(chosen[-1].path) if chosen else str(history.folder))
    for result in originals[: len(originals) - len(chosen)]:  # older than the window: their runs are known
        for name, entry in result.entries().items():
            baseline._sources.add(name, entry.samples, str(result.path))
    for result in chosen:
        baseline.add(label_of(result.path), result.document["benchmarks"], result.path)
    baseline.skipped = (*history.skipped, *copies, *baseline.skipped)
    if not chosen:
        baseline.problem = history.why_empty()
    return baseline


def new_cases(baseline: Baseline | None, names: Iterable[str]) -> list[str]:
    """The cases of ``names`` that have no stored run in ``baseline`` (none without a usable baseline).

    >>> new_cases(Baseline("b", {"t::a": [("0001", None)]}), ["t::a", "t::b"])
    ['t::b']
    """
    if baseline is None or baseline.problem:
        return []
    return [name for name in names if not baseline.entries.get(name)]


def named(names: Sequence[str], most: int = 3) -> str:
    """A few test ids, short (``t.py::k[a]`` -> ``k[a]``), and how many more.

    >>> named(["t.py::k[a]", "t.py::k[b]", "t.py::k[c]", "t.py::k[d]"])
    'k[a], k[b], k[c] and 1 more'
    """
    short = [name.split("::", 1)[-1] for name in names]
    return ", ".join(short[:most]) + (f" and {len(short) - most} more" if len(short) > most else "")


def why_nothing(baseline: Baseline | None, ran: int, judged_names: Sequence[str], reasons: Sequence[str],
                new: Sequence[str] = ()) -> str:
    """Why a session compared nothing, naming the file or folder, and the cases that have no stored run.

    >>> why_nothing(None, 3, [], [])
    '--benchmark-compare was not given, so there is no baseline'
    >>> why_nothing(Baseline("b/fp", {"t::x": []}), 1, [], [], new=["t::a"]).split(";")[0]
    'the 1 case of this session has no stored run in b/fp (new here: a)'
    """
    if baseline is None:
        return "--benchmark-compare was not given, so there is no baseline"
    if baseline.problem:
        return baseline.problem
    if not ran:
        return f"no benchmark ran in this session (all skipped or deselected); baseline {baseline.source}"
    if not judged_names and baseline.skipped:
        return (f"none of this session's {ran} benchmarks has a usable entry in {baseline.source} (what was "
                f"skipped there is named above, each with its reason)")
    if not judged_names and new:
        cases = "the 1 case of this session has" if len(new) == 1 else f"the {len(new)} cases of this session have"
        return (f"{cases} no stored run in {baseline.source} (new here: {named(new)}); a run saved with "
                "--benchmark-autosave (ci/bench saves every run) is the baseline of the next")
    if not judged_names:
        return f"none of this session's {ran} benchmarks is in {baseline.source}"
    unique = sorted(set(reasons))
    return f"against {baseline.source}: " + "; ".join(unique[:3]) + (" …" if len(unique) > 3 else "")
