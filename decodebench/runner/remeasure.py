"""How each case of a session can be measured again: a typed record per case (:class:`InSession`,
:class:`InFreshProcess`, :class:`InFreshPair`, as ``--gate-remeasure`` and ``--ab-python`` say), kept until
the gate asks (:func:`decodebench.runner.settle.settle`). Each ``measure()`` returns a
:class:`~decodebench.harness.Run` or the A/B :class:`~decodebench.runner.ab.Rounds`; :meth:`Remeasures.end_round`
stops the processes a round started.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ..harness import Run, RunContext, measure_prepared, prepare_kernel_case
from ..kernels.base import KernelCase
from . import ab
from .fresh import FreshProcesses

__all__ = ["InFreshPair", "InFreshProcess", "InSession", "Place", "Remeasures", "Source"]


class Place(Protocol):
    """Where re-measures of a round run, ended once the round is over (its processes stop)."""

    def end_round(self) -> None: ...


class Source(Protocol):
    where: str  # what the result says it was re-measured in
    place: Place | None

    def measure(self) -> Run | ab.Rounds: ...


@dataclass(frozen=True)
class InSession:
    """Check and time the case again in this process, on fresh inputs (only the case is kept between
    runs, never its tensors)."""

    case: KernelCase
    backend: str
    ctx: RunContext
    test_id: str
    where = "session"
    place = None

    def measure(self) -> Run:
        prepared = prepare_kernel_case(self.case, self.backend, self.ctx, self.test_id)
        measurement, extra = measure_prepared(prepared, self.case.traffic(), self.ctx)
        return Run(list(measurement.samples), extra.get("kernels"))


@dataclass(frozen=True)
class InFreshProcess:
    """Check and time the case in this round's fresh worker process."""

    place: FreshProcesses
    request: ab.CaseRequest
    budget_ms: float
    where = "fresh process"

    def measure(self) -> Run:
        return self.place.measure(self.request, self.budget_ms)


class PairPlace(Place, Protocol):
    rounds: int

    def remeasure_pair(self) -> tuple[ab.Pair, int]: ...


@dataclass(frozen=True)
class InFreshPair:
    """Interleaved A/B rounds of the case in this round's fresh process pair."""

    place: PairPlace
    request: ab.CaseRequest
    budget_ms: float
    where = "fresh process pair"

    def measure(self) -> ab.Rounds:
        pair, index = self.place.remeasure_pair()
        rounds = ab.run_ab_case([pair], self.request, self.place.rounds, self.budget_ms, first_index=index)
        ab.drop_case([pair], self.request)
        return rounds


class Remeasures:
    """The session's cases that can be measured again, by test node id (the last registered wins:
    a fresh-process record replaces the in-session one of the same case)."""

    def __init__(self) -> None:
        self._sources: dict[str, Source] = {}
        self._places: list[Place] = []

    def add(self, node_id: str, source: Source) -> None:
        self._sources[node_id] = source
        if source.place is not None and not any(p is source.place for p in self._places):
            self._places.append(source.place)

    def source(self, node_id: str) -> Source | None:
        return self._sources.get(node_id)

    def end_round(self) -> None:
        """Stop every place's processes of this round; the next round's re-measures start new ones."""
        for place in self._places:
            place.end_round()
