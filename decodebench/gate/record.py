"""What the gate writes into a result entry's ``extra_info``: the one writer beside
:mod:`.runs`, its reader.

A re-measure adds a run (``resamples``, ``resample_kernels``, ``remeasured_in``); an A/B case
keeps both sides' rounds (``ab``: ``runs_a``, ``runs_b`` paired by position, the process
``pairs`` they ran in) and a re-measure round adds to them; the verdict is kept as ``gate``.
The plugin hands these functions the live benchmark's ``extra_info``; what they write is what
:mod:`.runs` reads back, live and from a stored file alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..harness import Run
    from .verdict import CaseVerdict

__all__ = ["ab_record", "add_rounds", "add_run", "add_verdict"]


def add_run(info: dict, run: Run, where: str) -> None:
    """Append one more run of the case (its samples and kernels) and say where it ran.

    >>> from decodebench.harness import Run
    >>> from decodebench.results import record_of
    >>> entry = {"stats": {"data": [1.0, 1.0, 1.0]}, "extra_info": {}}
    >>> add_run(entry["extra_info"], Run([2.0, 2.0, 2.0]), "fresh process")
    >>> record_of(entry).runs, entry["extra_info"]["remeasured_in"]
    (((1.0, 1.0, 1.0), (2.0, 2.0, 2.0)), 'fresh process')
    """
    info.setdefault("resamples", []).append(list(run.samples))
    info.setdefault("resample_kernels", []).append(run.kernels)
    info["remeasured_in"] = where


def ab_record(rounds, configured: int, side_a: Mapping, side_b: Mapping) -> dict:
    """The ``ab`` record of an A/B case from its :class:`decodebench.runner.ab.Rounds`: both sides'
    rounds, the pair each ran in, side A's kernels and what each side's interpreter was
    (``configured``: ``--ab-rounds``)."""
    return {"rounds": configured, "runs_a": _lists(rounds.runs_a), "runs_b": _lists(rounds.runs_b),
            "pairs": list(rounds.pairs), "kernels_a": rounds.extra_a.get("kernels"),
            "side_a": dict(side_a), "side_b": dict(side_b)}


def add_rounds(info: dict, rounds) -> None:
    """Append a re-measure round's rounds (a fresh process pair) to the case's ``ab`` record.

    >>> from decodebench.runner.ab import Rounds
    >>> from decodebench.results import record_of
    >>> info = {"ab": ab_record(Rounds(((1.0,),), ((2.0,),), (0,), {}, {}), 1, {}, {})}
    >>> add_rounds(info, Rounds(((1.5,),), ((2.5,),), (1,), {}, {}))
    >>> record_of({"extra_info": info}).paired.runs_b, info["ab"]["pairs"]
    (((2.0,), (2.5,)), [0, 1])
    """
    record = info["ab"]
    # one update: an interrupt never leaves side A's rounds without side B's
    record.update(runs_a=[*record["runs_a"], *_lists(rounds.runs_a)],
                  runs_b=[*record["runs_b"], *_lists(rounds.runs_b)],
                  pairs=[*record["pairs"], *rounds.pairs])


def add_other_sessions(info: dict, sessions: Sequence[str]) -> None:
    """Mark a result that another measuring session overlapped on its device (read back by
    :mod:`decodebench.results`: contention, never evidence of a change)."""
    info["other_sessions"] = list(sessions)


def add_verdict(info: dict, verdict: CaseVerdict) -> None:
    """Keep the case's verdict with its result (``gate``), both modes alike."""
    info["gate"] = verdict.record()


def _lists(runs: Sequence[Sequence[float]]) -> list[list[float]]:
    return [list(r) for r in runs]
