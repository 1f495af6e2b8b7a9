"""pytest wiring of the injection (a known slowdown, ``--inject-slowdown``) and of the A/B gate.

Registered from the repository's ``conftest.py`` beside :mod:`decodebench.plugin`.
``kernel_bench`` (``fixtures/device.py``) runs a case in this process (with the injection,
if any) or, with ``--ab-python``, on both sides (:func:`run_ab`). The A/B verdicts are the
gate's own, given at the end of the session by :mod:`decodebench.plugin` from the rounds
recorded here; a case they leave undecided gets more rounds in the same workers.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import pytest

from .bridge import record_samples
from .harness import RunContext
from .inject import Injection
from .options import float_up_to, fraction, int_up_to
from .plugin import cpu_thread_count, state_of
from .results import ab_record
from .runner import ab
from .runner.fresh import FreshProcesses
from .runner.remeasure import InFreshPair, InFreshProcess, InSession

__all__ = ["ABSession", "case_request", "local_context", "register_remeasure"]

_AB_KEY = pytest.StashKey["ABSession"]()


def _python(text: str) -> str:
    path = os.path.abspath(os.path.expanduser(text))
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise argparse.ArgumentTypeError(f"{text!r} is not an executable Python interpreter")
    return path


def pytest_addoption(parser):
    add = parser.getgroup("decodebench").addoption
    add("--inject-slowdown", metavar="PCT", type=fraction, default=None,
        help="Injection: add PCT of each case's floor (10th percentile, measured just before) to every "
             "timed call (a calibrated spin on the kernel's stream on CUDA, a busy-wait on CPU). With --ab-python it "
             "applies to side B only. Results carry extra_info['injected_slowdown'] and cannot be saved. "
             "Default: off")
    add("--inject-only", metavar="TEXT", action="append", default=[],
        help="Restrict --inject-slowdown to tests whose id contains TEXT (repeatable). Default: every case")
    add("--ab-python", metavar="PATH", type=_python, default=None,
        help="A/B mode: run every selected kernel case in this interpreter (A) and in PATH (B), each in its "
             "own worker, interleaved, and give one verdict per case for B against A (--gate PCT fails the "
             "run on SLOWER). Default: off")
    add("--ab-rounds", metavar="N", type=int_up_to(1000), default=4,
        help="Interleaved measurement rounds per side in A/B mode (order A B B A ...), the budget split "
             "between them; at most 1000. Default: %(default)r")
    add("--ab-timeout-s", metavar="S", type=float_up_to(86400.0), default=600.0,
        help="Seconds an A/B worker may take for one request (start-up, check, one round); past it the "
             "test fails naming the side and the worker is killed; at most a day (86400). Default: %(default)r")


@dataclass
class ABSession:
    """The A/B workers of a session: :data:`~decodebench.runner.ab.PAIRS` pairs of processes alive
    for the whole session, and the fresh pair of the current re-measure round (if any)."""

    make_pair: Callable[[str], ab.Pair]  # label -> a new, not yet started pair
    rounds: int
    pairs: list = field(default_factory=list)
    fresh: ab.Pair | None = None
    started: int = 0  # pairs made so far: each new pair's label and index

    def __post_init__(self) -> None:
        self.pairs = [self._new() for _ in range(ab.PAIRS)]

    def _new(self) -> ab.Pair:
        self.started += 1
        return self.make_pair(str(self.started))

    def remeasure_pair(self) -> tuple[ab.Pair, int]:
        """This re-measure round's pair of fresh processes (made on first use) and its index."""
        if self.fresh is None:
            self.fresh = self._new()
        return self.fresh, self.started - 1

    def end_round(self) -> None:
        """Stop this round's fresh pair; the next round's re-measures get a new one."""
        fresh, self.fresh = self.fresh, None
        ab.close_all((fresh or {}).values())

    def workers(self) -> list[ab.Worker]:
        return [w for pair in [*self.pairs, self.fresh or {}] for w in pair.values()]

    def close(self) -> None:
        ab.close_all(self.workers())


def _injection(config) -> Injection | None:
    fraction = config.getoption("inject_slowdown")
    return None if fraction is None else Injection(fraction, tuple(config.getoption("inject_only")))


def local_context(config) -> RunContext:
    """The session's RunContext, with the injection when it applies in this process (not in A/B mode)."""
    ctx = state_of(config).run_context
    if config.getoption("ab_python") is not None:
        return ctx
    return dataclasses.replace(ctx, injection=_injection(config))


def pytest_configure(config):
    saving = config.getoption("benchmark_save", None) or config.getoption("benchmark_autosave", None)
    modes = [name for name, on in (("--inject-slowdown", config.getoption("inject_slowdown") is not None),
                                   ("--ab-python", config.getoption("ab_python") is not None)) if on]
    if saving and modes:
        raise pytest.UsageError(f"{' and '.join(modes)} results are not a baseline: drop --benchmark-save "
                                "and --benchmark-autosave (keep --benchmark-json for the record)")
    if config.getoption("inject_only") and config.getoption("inject_slowdown") is None:
        raise pytest.UsageError("--inject-only selects cases for --inject-slowdown, which is not given")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """A case selected for ``--inject-slowdown`` that has no injection point is refused by name:
    only the kernel cases (``kernel_bench``) carry the spin, and a result measured without it must
    not pass for an injected one."""
    injection = _injection(item.config)
    if injection is None or "kernel_bench" in getattr(item, "fixturenames", ()) or \
            not injection.applies_to(item.nodeid):
        return
    pytest.skip(f"--inject-slowdown does not reach {item.nodeid}: only the kernel cases carry the injected "
                "spin, this test times a collective or a live server (narrow with -k or --inject-only)")


def _session_spec(config, injection: Injection | None) -> dict:
    state = state_of(config)
    model = config.getoption("model")
    return {"model": os.path.abspath(model) if os.path.exists(model) else model, "tp": state.shapes.tp,
            "ep": state.shapes.ep, "sweep": state.sweep.level.value,
            "per_request": list(state.verify_tokens), "kv_cache_dtypes": state.kv_cache_dtypes,
            "device": str(state.device), "timer": state.timer.value,
            "cpu_threads": cpu_thread_count(config.getoption("cpu_threads")),
            "budget": dataclasses.asdict(state.budget),
            "injection": dataclasses.asdict(injection) if injection else None}


def _ab_session(config) -> ABSession | None:
    if config.getoption("ab_python") is None:
        return None
    if _AB_KEY not in config.stash:
        timeout, python_b = config.getoption("ab_timeout_s"), config.getoption("ab_python")
        spec_a, spec_b = _session_spec(config, None), _session_spec(config, _injection(config))

        def make_pair(label: str) -> ab.Pair:
            return {"A": ab.Worker("A", sys.executable, spec_a, timeout, label),
                    "B": ab.Worker("B", python_b, spec_b, timeout, label)}

        config.stash[_AB_KEY] = ABSession(make_pair, config.getoption("ab_rounds"))
    return config.stash[_AB_KEY]


@pytest.fixture(scope="session")
def ab_session(pytestconfig):
    """The session's :class:`ABSession` with ``--ab-python``, else None. Its workers outlive the
    tests (the gate adds rounds at the end) and are reaped when the session finishes."""
    return _ab_session(pytestconfig)


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_sessionfinish(session):
    """Stop the workers once the gate (decodebench.plugin's sessionfinish) is done with them,
    on every way out: passed, failed, interrupted."""
    try:
        yield
    finally:
        ab_state = session.config.stash.get(_AB_KEY, None)
        if ab_state is not None:
            ab_state.close()


def case_request(request, case, backend: str) -> ab.CaseRequest | None:
    """How a worker process rebuilds the test's case: its ``cases`` factory, id and backend."""
    marker = request.node.get_closest_marker("cases")
    if marker is None or "factory" not in marker.kwargs:
        return None
    factory = marker.kwargs["factory"]
    return ab.CaseRequest(f"{factory.__module__}:{factory.__qualname__}", case.id, backend, request.node.nodeid)


def register_remeasure(request, benchmark, case, backend: str, ctx: RunContext) -> None:
    """Record how the gate can measure this case again: in new processes (``--gate-remeasure
    fresh``, where a worker can rebuild the case), else in this process."""
    config = request.config
    state = state_of(config)
    if not getattr(benchmark, "fullname", None):
        return
    wanted = case_request(request, case, backend)
    if config.getoption("gate_remeasure") != "fresh" or wanted is None:
        state.remeasures.add(benchmark.fullname, InSession(case, backend, ctx, benchmark.fullname))
        return
    if state.fresh is None:
        state.fresh = FreshProcesses(_session_spec(config, _injection(config)), config.getoption("ab_timeout_s"))
    state.remeasures.add(benchmark.fullname, InFreshProcess(state.fresh, wanted, state.budget.budget_ms))


def run_ab(session: ABSession, benchmark, request, case, backend: str, facts: Mapping | None = None) -> ab.Rounds:
    """Run one case on both sides of every pair, record B's samples into ``benchmark`` with all
    the rounds, and leave the gate a record of how to measure it again in a fresh pair."""
    wanted = case_request(request, case, backend)
    if wanted is None:
        pytest.fail(f"A/B {case.id}: the test has no cases(factory=...) marker, so a worker cannot build "
                    "the case", pytrace=False)
    budget_ms = state_of(request.config).budget.budget_ms
    try:
        rounds = ab.run_ab_case(session.pairs, wanted, session.rounds, budget_ms)
        ab.drop_case(session.pairs, wanted)  # a re-measure runs in a fresh pair: free the tensors now
    except ab.WorkerFailure as exc:
        pytest.fail(f"A/B {case.id} on {backend}: {exc}", pytrace=False)
    info = ab_record(rounds, session.rounds, session.pairs[0]["A"].info, session.pairs[0]["B"].info)
    samples = [s for run in rounds.runs_b for s in run]
    record_samples(benchmark, samples, {**rounds.extra_b, **(facts or {}), "ab": info})
    if getattr(benchmark, "fullname", None):
        state_of(request.config).remeasures.add(benchmark.fullname, InFreshPair(session, wanted, budget_ms))
    return rounds


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter):
    """Which interpreter each side ran (the verdicts follow in the gate's section)."""
    ab_state = terminalreporter.config.stash.get(_AB_KEY, None)
    if ab_state is None:
        return
    for worker in ab_state.pairs[0].values():
        info = worker.info
        terminalreporter.write_line(f"A/B side {worker.side}: {worker.python} (torch {info.get('torch')}, "
                                    f"vllm {info.get('vllm')}); {ab_state.started} process pairs in all")
