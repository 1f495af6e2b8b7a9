"""Re-measuring until decided: more runs for UNDECIDED cases, round by round.

A case the model cannot decide is measured again, at most ``Policy.resamples`` times; each
round re-measures every still-undecided case once, so that the runs of one case lie apart in
time, then the whole session is judged again (the pooled spread moves with the new runs).
The looks are paid for in the error rate (:func:`decodebench.gate.decision.per_test_alpha`).

A SLOWER that rests on one run now is looked at again too (:data:`CONFIRM_RUNS`): the model's
spread is the history's, and a process can be slow as a whole in a way no quiet history
foresees. On the 2-core CI machine with a CPU-bound neighbour, 2 of 30 identical sessions had a
case at 1.60–1.66× on its one 30 ms run, which against a quiet history is a slowdown at 8
spreads; a regression is a change that holds in a second process (PyTorch's regression policy
asks for two violating points in a row for the same reason). What is stored
is judged as stored: the offline gate has no second process to ask.

Stored mode re-measures in a **fresh process** per round (:class:`FreshProcesses`): a process
carries state for its whole life that no re-measure inside it can see — where the OpenMP
threads landed (on the 2-core CI machine a 2-thread RMSNorm ran +60 % in 3 of 8 processes),
the algorithm a cuBLAS handle settled on (two H200 processes moved one GEMM by +12.6 %) — so
a session that drew a slow process would otherwise look like a regression. A/B mode adds
rounds in its two long-lived workers, in a new interleaving (:mod:`decodebench.gate.ab`).

Example::

    fresh = FreshProcesses(session_spec, timeout_s=600)
    fresh.add(node_id, case_request)
    run = fresh.remeasurer(node_id, budget_ms=300)
    run()                # starts this round's process on first use; checked, warmed, timed
    fresh.end_round()    # the next round's re-measures get a new process
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from ..harness import Run
from . import ab
from .decision import Policy, Verdict
from .verdict import CaseInput, CaseVerdict, judge

__all__ = ["FreshProcesses", "Run", "settle"]

WARM_FRACTION = 0.25  # the discarded first measurement's share of the budget
CONFIRM_RUNS = 2  # runs now (processes, or process pairs in A/B) a SLOWER must rest on, where a session can re-measure


def settle(inputs: Callable[[], Sequence[CaseInput]], remeasure: Mapping[str, Callable[[], None]], policy: Policy,
           end_round: Callable[[], None] = lambda: None) -> list[CaseVerdict]:
    """Judge, then re-measure the UNDECIDED cases that can be, round by round, and judge again.

    ``inputs`` builds the session's cases from their current entries (each ``remeasure[name]()``
    adds a run to its entry). A re-measure that fails is noted on its verdict and not retried.
    ``end_round`` runs after each round and once at the end, whatever happened.

    >>> runs = [[1.3e-5] * 5]  # one run now, one stored: no spread to judge by yet
    >>> stored = (("0001", {"stats": {"data": [1e-5] * 5}, "extra_info": {}}),)
    >>> now = lambda: [CaseInput("a", {"stats": {"data": runs[0]}, "extra_info": {"resamples": runs[1:]}}, stored)]
    >>> judge(now(), Policy())[0].verdict.value
    'undecided'
    >>> settle(now, {"a": lambda: runs.append([1.301e-5] * 5)}, Policy())[0].verdict.value, len(runs)
    ('slower', 2)
    """
    verdicts = judge(inputs(), policy)
    failed: dict[str, str] = {}
    try:
        for _ in range(policy.resamples):
            todo = [v.name for v in verdicts if _open(v) and v.name in remeasure and v.name not in failed]
            if not todo:
                break
            for name in todo:
                try:
                    remeasure[name]()
                except Exception as exc:  # a failing re-measure must not hide the verdict it was to settle
                    failed[name] = f"re-measure failed: {type(exc).__name__}: {exc}"
            end_round()
            verdicts = judge(inputs(), policy)
    finally:
        end_round()
    return [replace(v, notes=(*v.notes, failed[v.name])) if v.name in failed else v for v in verdicts]


def _open(verdict: CaseVerdict) -> bool:
    """Whether another run may change ``verdict``: UNDECIDED, or SLOWER on fewer than CONFIRM_RUNS runs now."""
    return verdict.verdict is Verdict.UNDECIDED or (verdict.verdict is Verdict.SLOWER
                                                    and verdict.runs[1] < CONFIRM_RUNS)


class FreshProcesses:
    """Re-measures in new worker processes of ``python`` (this interpreter), one per round."""

    def __init__(self, session: dict, timeout_s: float, python: str = sys.executable):
        self._session, self._timeout_s, self._python = session, timeout_s, python
        self._requests: dict[str, ab.CaseRequest] = {}
        self._worker: ab.Worker | None = None
        self.pids: list[int] = []  # the processes started, one per round that re-measured

    def add(self, node_id: str, request: ab.CaseRequest) -> None:
        self._requests[node_id] = request

    def knows(self, node_id: str) -> bool:
        return node_id in self._requests

    def remeasurer(self, node_id: str, budget_ms: float) -> Callable[[], Run]:
        """A closure that measures the case again in this round's process (checked first)."""
        request = self._requests[node_id]

        def run() -> Run:
            worker = self._round_worker()
            ab.prepare_case(worker, request)
            worker.ask({"op": "measure", "case": request.test_id, "budget_ms": budget_ms * WARM_FRACTION})
            reply = worker.ask({"op": "measure", "case": request.test_id, "budget_ms": budget_ms})
            worker.ask({"op": "drop", "case": request.test_id})
            return Run(list(reply["samples"]), reply["extra"].get("kernels"))

        return run

    def _round_worker(self) -> ab.Worker:
        if self._worker is None:
            self._worker = ab.Worker("re-measure", self._python, self._session, self._timeout_s)
        if self._worker.proc is None:  # not started yet, or closed after a failure: start it now
            self.pids.append(self._worker.start()["pid"])
        return self._worker

    def end_round(self) -> None:
        """Stop this round's process (if one was started); the next re-measure starts a new one."""
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.close()
