"""The gate's fresh-process re-measures: a new worker per round, checked cases, nothing left behind."""

import sys

import psutil
import pytest

from decodebench.errors import BackendUnavailable
from decodebench.gate.decision import Policy, Verdict
from decodebench.gate.verdict import CaseInput, judge
from decodebench.harness import Run
from decodebench.runner import ab
from decodebench.runner.fresh import FreshProcesses
from decodebench.runner.remeasure import InFreshProcess, Remeasures
from decodebench.runner.settle import Remeasured, settle

SESSION = {"model": "kimi-k2.5", "tp": 8, "sweep": "smoke", "device": "cpu", "timer": "wall",
           "cpu_threads": 1, "budget": {"budget_ms": 20}}
CASE = ab.CaseRequest("decodebench.kernels.rmsnorm:rmsnorm_cases", "plain-w512-m1", "torch", "t::plain")


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def test_each_round_measures_in_a_new_process_and_stops_it():
    before = _children()
    fresh = FreshProcesses(SESSION, timeout_s=120)
    remeasures = Remeasures()
    remeasures.add("t::plain", InFreshProcess(fresh, CASE, budget_ms=20))
    assert remeasures.source("t::other") is None
    run = remeasures.source("t::plain").measure
    try:
        first = run()
        assert run()  # a second case (here the same one) of the round shares its process
        remeasures.end_round()
        second = run()
    finally:
        remeasures.end_round()
    assert len(first.samples) >= 10
    assert len(second.samples) >= 10
    assert min(first.samples + second.samples) > 0
    assert len(fresh.pids) == 2
    assert len(set(fresh.pids)) == 2
    assert sys.modules["os"].getpid() not in fresh.pids
    assert _children() == before  # every round's worker is gone


def test_a_case_the_fresh_process_cannot_run_or_build_fails_the_remeasure_naming_the_worker():
    # one process for both refusals (a worker start is the slow part): a backend it cannot run is
    # a skip the worker survives, a case it cannot build fails it, and either names the worker
    fresh = FreshProcesses(SESSION, timeout_s=120)
    no_backend = ab.CaseRequest("decodebench.kernels.rmsnorm:rmsnorm_cases", "plain-w512-m1", "no-such-backend", "t::v")
    no_case = ab.CaseRequest("decodebench.kernels.rmsnorm:rmsnorm_cases", "no-such-case", "torch", "t::x")
    try:
        with pytest.raises(BackendUnavailable, match="re-measure worker .*no-such-backend"):
            fresh.measure(no_backend, budget_ms=20)
        with pytest.raises(ab.WorkerFailure, match="(?s)re-measure worker .*has no case 'no-such-case'"):
            fresh.measure(no_case, budget_ms=20)
    finally:
        fresh.end_round()
    assert len(fresh.pids) == 1


def _history(level):
    """Three quiet stored runs of one case (seconds per call)."""
    return tuple((f"000{i}", {"stats": {"data": [level * (1 + 0.002 * i + 0.0001 * k) for k in range(10)]},
                              "extra_info": {"timer": "wall"}}) for i in range(1, 4))


def _settle_with(first, later):
    """One case whose run now is ``first`` x the history, every re-measure ``later`` x; the verdict and runs now."""
    now = [CaseInput("c", {"stats": {"data": [first * 1e-5 * (1 + 0.0001 * k) for k in range(10)]},
                           "extra_info": {"timer": "wall"}}, _history(1e-5))]
    assert judge(now, Policy(threshold=0.10))[0].verdict is Verdict.SLOWER  # one run now says SLOWER
    kept = Remeasured()
    verdict = settle(lambda: now, {"c": lambda: Run([later * 1e-5 * (1 + 0.0001 * k) for k in range(10)])},
                     Policy(threshold=0.10), kept=kept)[0]
    return verdict.verdict, 1 + len(kept.runs.get("c", []))


def test_a_slower_on_one_run_now_is_confirmed_on_every_re_measure_round():
    # a process slow as a whole (+60 %, the CI machine with a neighbour did it): the next ones are not
    verdict, runs = _settle_with(1.60, 1.0)
    assert verdict is not Verdict.SLOWER
    assert runs == 3  # open on both rounds: SLOWER is called on the last look only
    # a real slowdown holds over every round
    assert _settle_with(1.60, 1.60) == (Verdict.SLOWER, 3)
