"""Re-measures in a fresh process per round, for the stored-mode gate (:class:`FreshProcesses`).

A process carries state for its whole life that no re-measure inside it can see (where the OpenMP
threads landed: on the 2-core CI machine a 2-thread RMSNorm ran +60 % in 3 of 8 processes; the
algorithm a cuBLAS handle settled on: two H200 processes moved one GEMM by +12.6 %), so a session
that drew a slow process would otherwise look like a regression.
"""

from __future__ import annotations

import sys

from ..harness import Run
from . import ab

__all__ = ["FreshProcesses"]

WARM_FRACTION = 0.25  # the discarded first measurement's share of the budget


class FreshProcesses:
    """Re-measures in new worker processes of ``python`` (this interpreter), one per round."""

    def __init__(self, session: dict, timeout_s: float, python: str = sys.executable):
        self._session, self._timeout_s, self._python = session, timeout_s, python
        self._worker: ab.Worker | None = None
        self.pids: list[int] = []  # the processes started, one per round that re-measured

    def measure(self, request: ab.CaseRequest, budget_ms: float) -> Run:
        """The case measured again in this round's process (started on first use): checked
        against its reference, warmed, timed, then let go."""
        worker = self._round_worker()
        ab.prepare_case(worker, request)
        worker.ask({"op": "measure", "case": request.test_id, "budget_ms": budget_ms * WARM_FRACTION})
        reply = worker.ask({"op": "measure", "case": request.test_id, "budget_ms": budget_ms})
        worker.ask({"op": "drop", "case": request.test_id})
        return Run(list(reply["samples"]), reply["extra"].get("kernels"))

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
