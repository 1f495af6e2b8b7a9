"""A/B of two Python environments: each kernel case measured in both, interleaved, one verdict.

Side A is this interpreter, side B another (e.g. the parent commit's vLLM build and the
candidate's). Each side is a long-lived :mod:`decodebench.abworker` process speaking JSON
lines over pipes. A case is checked against its reference on both sides before anything
is timed, then measured in rounds ordered A B B A A B ... so that a drift (clocks warming,
another process) falls on both sides alike; each round of a side is one run of the
session's measurement recipe. The verdict for B against A compares the rounds of the two
sides with the gate's own comparison.

A worker that dies, hangs past the timeout or answers nonsense raises
:class:`WorkerFailure` naming its side, and is killed; the next case starts a fresh one.
"""

from __future__ import annotations

import json
import math
import os
import queue
import subprocess
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from . import compare, stats
from .errors import BackendUnavailable, KernelMismatch

__all__ = ["ABResult", "CaseRequest", "Worker", "WorkerFailure", "ab_verdict", "confirm", "interleave",
           "prepare_case", "run_ab_case", "run_ab_confirmed"]

REPO_ROOT = Path(__file__).resolve().parent.parent
_STDERR_TAIL_CHARS = 2000


class WorkerFailure(RuntimeError):
    """A side's worker died, hung or replied with an error."""


@dataclass(frozen=True)
class CaseRequest:
    """What a worker needs to rebuild a case: its factory (``module:function``), id, backend and test id."""

    factory: str
    case_id: str
    backend: str
    test_id: str


@dataclass(frozen=True)
class ABResult:
    comparison: compare.Comparison
    runs_a: tuple[tuple[float, ...], ...]
    runs_b: tuple[tuple[float, ...], ...]
    extra_a: dict
    extra_b: dict


class Worker:
    """One side's process: ``ask`` sends a request and waits for its reply (``timeout_s`` at most)."""

    def __init__(self, side: str, python: str, session: dict, timeout_s: float):
        self.side, self.python, self.session, self.timeout_s = side, python, session, timeout_s
        self.proc: subprocess.Popen | None = None
        self.info: dict = {}

    @property
    def label(self) -> str:
        who = f"side {self.side}" if self.side in ("A", "B") else f"{self.side} worker"
        return f"{who} ({self.python})"

    def ask(self, message: dict) -> dict:
        self.start()
        return self._roundtrip(message)

    def start(self) -> dict:
        """Start the process unless it runs; its ``setup`` reply (python, pid, versions)."""
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        return self.info

    def _start(self) -> None:
        self.close()
        path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}
        self._stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([self.python, "-m", "decodebench.abworker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._stderr, text=True, env=env, cwd=REPO_ROOT)
        self._replies: queue.Queue = queue.Queue()
        threading.Thread(target=self._read_replies, args=(self.proc.stdout, self._replies), daemon=True).start()
        self.info = self._roundtrip({"op": "setup", "session": self.session})

    @staticmethod
    def _read_replies(stream, replies: queue.Queue) -> None:
        for line in stream:
            replies.put(line)
        replies.put(None)  # end of output: the worker exited

    def _roundtrip(self, message: dict) -> dict:
        try:
            self.proc.stdin.write(json.dumps(message) + "\n")
            self.proc.stdin.flush()
            line = self._replies.get(timeout=self.timeout_s)
        except queue.Empty:
            self._fail(f"no answer to {message['op']!r} within {self.timeout_s:g} s")
        except OSError:  # a broken pipe: the worker is gone
            line = None
        if line is None:
            self._fail(f"exited with status {self._exit_status()} during {message['op']!r}")
        reply = json.loads(line)
        if "error" in reply:
            self._fail(f"{message['op']!r} raised:\n{reply['error']}")
        return reply

    def _exit_status(self) -> int | str:
        try:
            return self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return "unknown (closed its output but still runs)"

    def _fail(self, what: str) -> None:
        tail = self._stderr_tail()
        self.close()
        raise WorkerFailure(f"{self.label}: worker {what}" + (f"\n--- its stderr (tail) ---\n{tail}" if tail else ""))

    def _stderr_tail(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read()[-_STDERR_TAIL_CHARS:].strip()

    def close(self) -> None:
        """Stop the process: quit, then terminate, then kill; never leaves it behind."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            if proc.poll() is None:
                proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                proc.stdin.flush()
        except OSError:
            pass
        _reap(proc)


def _reap(proc: subprocess.Popen) -> None:
    for stop, wait_s in ((lambda: None, 5), (proc.terminate, 5), (proc.kill, 10)):
        stop()
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def interleave(measure_a: Callable[[], Sequence[float]], measure_b: Callable[[], Sequence[float]],
               rounds: int) -> tuple[tuple[tuple[float, ...], ...], tuple[tuple[float, ...], ...]]:
    """``rounds`` runs of each side in the order A B B A A B ...: a linear drift hits both alike.

    >>> order = []
    >>> a, b = interleave(lambda: order.append("A") or [1.0], lambda: order.append("B") or [2.0], 3)
    >>> "".join(order), a, b
    ('ABBAAB', ((1.0,), (1.0,), (1.0,)), ((2.0,), (2.0,), (2.0,)))
    """
    runs: dict[str, list[tuple[float, ...]]] = {"A": [], "B": []}
    sides = {"A": measure_a, "B": measure_b}
    for index in range(rounds):
        for side in ("AB" if index % 2 == 0 else "BA"):
            runs[side].append(tuple(sides[side]()))
    return tuple(runs["A"]), tuple(runs["B"])


def ab_verdict(name: str, runs_a: Sequence[Sequence[float]], runs_b: Sequence[Sequence[float]],
               thresholds: compare.GateThresholds) -> compare.Comparison:
    """The gate's verdict for B (current) against A (baseline), one run per round.

    >>> a = [[10.0, 10.1, 9.9, 10.0]] * 3
    >>> ab_verdict("x", a, [[v * 1.3 for v in r] for r in a], compare.GateThresholds()).verdict
    <Verdict.SLOWER: 'slower'>
    """
    verdict = compare.compare_runs(runs_a, runs_b, thresholds, name)
    paired = len(runs_a) == len(runs_b) >= MIN_PAIRED_ROUNDS
    if verdict.verdict is not compare.Verdict.UNDECIDED or verdict.ratio is None or not paired:
        return verdict
    return _paired_rounds(name, runs_a, runs_b, thresholds, verdict)


MIN_PAIRED_ROUNDS = 5  # fewer can never pass the sign test at 0.05
SIGN_ALPHA = 0.05  # the paired sign test's level; the pooled Mann-Whitney keeps its own


def _paired_rounds(name: str, runs_a, runs_b, thresholds: compare.GateThresholds,
                   unpaired: compare.Comparison) -> compare.Comparison:
    """Round i of A and round i of B ran next to each other, so drift hits both: judge the
    ratios of their floors. SLOWER (FASTER) needs the median ratio beyond the threshold, the
    rounds moving that way by a sign test (p < 0.05), and the pooled samples clear (p < alpha).

    >>> a = [[1.0] * 10, [1.4] * 10, [1.0] * 10, [1.05] * 10, [1.0] * 10]  # a disturbed A round
    >>> b = [[1.3] * 10, [1.8] * 10, [1.31] * 10, [1.36] * 10, [1.3] * 10]
    >>> _paired_rounds("x", a, b, compare.GateThresholds(), compare.compare_runs(a, b)).verdict
    <Verdict.SLOWER: 'slower'>
    """
    ratios = [compare.run_floor(b) / compare.run_floor(a) for a, b in zip(runs_a, runs_b, strict=True)]
    change = stats.median(ratios) - 1
    runs = (len(runs_a), len(runs_b))
    if abs(change) <= thresholds.threshold:
        return compare.Comparison(name, compare.Verdict.SAME, 1 + change, unpaired.p_value,
                                  f"paired rounds within ±{thresholds.threshold:.1%}", runs)
    moved = sum((r > 1) == (change > 0) and r != 1 for r in ratios)
    sign_p = sum(math.comb(len(ratios), k) for k in range(moved, len(ratios) + 1)) / 2 ** len(ratios)
    detail = f"{change:+.1%} over paired rounds, {moved} of {len(ratios)} moved (sign test p={sign_p:.2g})"
    if sign_p < SIGN_ALPHA and unpaired.p_value is not None and unpaired.p_value < thresholds.alpha:
        verdict = compare.Verdict.SLOWER if change > 0 else compare.Verdict.FASTER
        return compare.Comparison(name, verdict, 1 + change, unpaired.p_value, detail, runs)
    return compare.Comparison(name, compare.Verdict.UNDECIDED, 1 + change, unpaired.p_value,
                              f"{detail}: more rounds decide", runs)


def run_ab_case(workers: dict[str, Worker], request: CaseRequest, rounds: int, budget_ms: float,
                thresholds: compare.GateThresholds) -> ABResult:
    """Check the case on both sides, measure it interleaved, and compare B against A.

    Raises BackendUnavailable or KernelMismatch naming the side, or WorkerFailure.
    """
    for worker in workers.values():  # correct on both sides before either is timed
        prepare_case(worker, request)
    per_round_ms = budget_ms / rounds
    last: dict[str, dict] = {}

    def measure(side: str) -> Callable[[], list[float]]:
        def run() -> list[float]:
            last[side] = workers[side].ask({"op": "measure", "budget_ms": per_round_ms})
            return last[side]["samples"]
        return run

    # one untimed round a side first: a worker's first measurement of a case pays page
    # faults and allocator growth (on the 2-core CPU it was the round that broke the pairing)
    measure("A")()
    measure("B")()
    runs_a, runs_b = interleave(measure("A"), measure("B"), rounds)
    comparison = ab_verdict(request.test_id, runs_a, runs_b, thresholds)
    return ABResult(comparison, runs_a, runs_b, last["A"]["extra"], last["B"]["extra"])


def run_ab_confirmed(workers: dict[str, Worker], request: CaseRequest, rounds: int, budget_ms: float,
                     thresholds: compare.GateThresholds) -> ABResult:
    """:func:`run_ab_case`, and a SLOWER measured again in a fresh pair of worker processes.

    A worker process is one draw of the machine (on the H200 one cuBLAS GEMM ran +14.9 % in
    some processes, every call), and each side's rounds all come from its one worker. So a
    SLOWER stands only if a new A and a new B, started for the purpose, show it too; the
    second pair's rounds are kept beside the first's.
    """
    first = run_ab_case(workers, request, rounds, budget_ms, thresholds)
    if first.comparison.verdict is not compare.Verdict.SLOWER:
        return first
    for worker in workers.values():
        worker.close()  # the next request starts a new process
    second = run_ab_case(workers, request, rounds, budget_ms, thresholds)
    return confirm(first, second)


def confirm(first: ABResult, second: ABResult) -> ABResult:
    """One result from a SLOWER and its re-run in fresh workers: SLOWER only if both say so.

    >>> a = [[10.0, 10.1, 9.9, 10.0]] * 3
    >>> slow = ABResult(ab_verdict("x", a, [[v * 1.3 for v in r] for r in a], compare.GateThresholds()), (), (), {}, {})
    >>> same = ABResult(ab_verdict("x", a, a, compare.GateThresholds()), (), (), {}, {})
    >>> confirm(slow, same).comparison.verdict, confirm(slow, slow).comparison.verdict
    (<Verdict.UNDECIDED: 'undecided'>, <Verdict.SLOWER: 'slower'>)
    """
    c1, c2 = first.comparison, second.comparison
    runs = (c1.runs[0] + c2.runs[0], c1.runs[1] + c2.runs[1])
    if c2.verdict is compare.Verdict.SLOWER:
        verdict, ratio = compare.Verdict.SLOWER, min(c1.ratio, c2.ratio)
        reason = f"{c1.reason}; confirmed in a fresh pair of worker processes ({c2.reason})"
    else:
        verdict, ratio = compare.Verdict.UNDECIDED, c2.ratio
        reason = (f"{c1.reason}; {c2.verdict.value.upper()} in a fresh pair of worker processes "
                  f"({c2.reason}): a process-level shift?")
    p_value = c2.p_value if c2.p_value is not None else c1.p_value
    comparison = compare.Comparison(c1.name, verdict, ratio, p_value, reason, runs)
    return ABResult(comparison, first.runs_a + second.runs_a, first.runs_b + second.runs_b,
                    second.extra_a, second.extra_b)


def prepare_case(worker: Worker, request: CaseRequest) -> None:
    """Build the case in ``worker`` and check it against its reference; raises naming the worker."""
    reply = worker.ask({"op": "prepare", "case": request.__dict__})
    if "skip" in reply:
        raise BackendUnavailable(f"{worker.label}: {reply['skip']}")
    if "mismatch" in reply:
        raise KernelMismatch(f"{worker.label}: {reply['mismatch']}")
