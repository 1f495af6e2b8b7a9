"""A/B of two Python environments (docs/gate.md, A/B): side A is this interpreter, side B another.

Each side is one :mod:`decodebench.runner.case_worker` process speaking JSON lines over pipes, in
:data:`PAIRS` pairs; a case is checked on every side once, then measured in rounds ordered A B B A ...
in each pair, so that a drift falls on both sides alike. A worker that dies, hangs past the timeout or
answers nonsense raises :class:`WorkerFailure` naming its side and is killed. Workers ignore Ctrl-C:
the session decides, and stops them; an interrupt while one is being stopped kills it at once.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import BackendUnavailable, KernelMismatch

__all__ = ["PAIRS", "CaseRequest", "Pair", "Rounds", "Worker", "WorkerFailure", "close_all", "drop_case",
           "interleave", "measure_case", "prepare_case", "run_ab_case"]

REPO_ROOT = Path(__file__).resolve().parents[2]
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


class Worker:
    """One side's process: ``ask`` sends a request and waits for its reply (``timeout_s`` at most)."""

    def __init__(self, side: str, python: str, session: dict, timeout_s: float, pair: str = ""):
        self.side, self.python, self.session, self.timeout_s, self.pair = side, python, session, timeout_s, pair
        self.proc: subprocess.Popen | None = None
        self.info: dict = {}

    @property
    def label(self) -> str:
        who = f"side {self.side}" if self.side in ("A", "B") else f"{self.side} worker"
        pair = f", pair {self.pair}" if self.pair else ""
        return f"{who} ({self.python}{pair})"

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
        self.proc = subprocess.Popen([self.python, "-m", "decodebench.runner.case_worker"], stdin=subprocess.PIPE,
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
        self._stderr.seek(0)
        tail = self._stderr.read()[-_STDERR_TAIL_CHARS:].strip()
        self.close()
        raise WorkerFailure(f"{self.label}: worker {what}" + (f"\n--- its stderr (tail) ---\n{tail}" if tail else ""))

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
        except KeyboardInterrupt:
            _kill_now(proc)
            raise
        _reap(proc)


def _reap(proc: subprocess.Popen) -> None:
    try:
        for stop, wait_s in ((lambda: None, 5), (proc.terminate, 5), (proc.kill, 10)):
            stop()
            try:
                proc.wait(timeout=wait_s)
                return
            except subprocess.TimeoutExpired:
                continue
    except KeyboardInterrupt:  # Ctrl-C while waiting: no more grace, but never leave it running
        _kill_now(proc)
        raise


def _kill_now(proc: subprocess.Popen) -> None:
    """SIGKILL and wait, however many further interrupts arrive meanwhile."""
    while True:
        try:
            proc.kill()
            proc.wait(timeout=10)
            return
        except KeyboardInterrupt:
            continue
        except subprocess.TimeoutExpired:
            return  # unkillable (in the kernel): nothing more a parent can do


def close_all(workers) -> None:
    """Close every worker; an interrupt during one is raised after the others are closed too."""
    interrupted = None
    for worker in list(workers):
        try:
            worker.close()
        except KeyboardInterrupt as exc:
            interrupted = exc
    if interrupted is not None:
        raise interrupted


def interleave(measure_a: Callable[[], Sequence[float]], measure_b: Callable[[], Sequence[float]],
               rounds: int, first: str = "A") -> tuple[tuple[tuple[float, ...], ...], tuple[tuple[float, ...], ...]]:
    """``rounds`` runs of each side in the order A B B A A B ... (``first="B"``: B A A B ...): a
    linear drift hits both alike, and round i of A and of B ran next to each other.

    >>> order = []
    >>> a, b = interleave(lambda: order.append("A") or [1.0], lambda: order.append("B") or [2.0], 3)
    >>> "".join(order), a, b
    ('ABBAAB', ((1.0,), (1.0,), (1.0,)), ((2.0,), (2.0,), (2.0,)))
    """
    runs: dict[str, list[tuple[float, ...]]] = {"A": [], "B": []}
    sides = {"A": measure_a, "B": measure_b}
    second = "B" if first == "A" else "A"
    for index in range(rounds):
        for side in (first + second if index % 2 == 0 else second + first):
            runs[side].append(tuple(sides[side]()))
    return tuple(runs["A"]), tuple(runs["B"])


PAIRS = 2  # process pairs per case: two, so that a process-level shift shows as spread between them

Pair = dict  # {"A": Worker, "B": Worker}: one process a side


@dataclass(frozen=True)
class Rounds:
    """Interleaved rounds of one case on both sides, the process pair each round ran in, and
    each side's last measurement record."""

    runs_a: tuple[tuple[float, ...], ...]
    runs_b: tuple[tuple[float, ...], ...]
    pairs: tuple[int, ...]
    extra_a: dict
    extra_b: dict


def run_ab_case(pairs: Sequence[Pair], request: CaseRequest, rounds: int, budget_ms: float,
                first_index: int = 0) -> Rounds:
    """Check the case on both sides of every pair, then measure it: ``rounds`` interleaved rounds
    per side in all, shared out over the pairs (at least 2 a pair). Pair ``i`` is labelled
    ``first_index + i`` in :attr:`Rounds.pairs`.

    A process is one draw of the machine (on the 2-core CPU two processes of one interpreter
    differed by up to 16 % on the same core; on the H200 a cuBLAS GEMM by 11–14 %), so the
    rounds of one pair share a process-level offset that no number of rounds removes: the
    verdict's unit is the pair, and two pairs show such an offset as spread.
    Raises BackendUnavailable or KernelMismatch naming the side, or WorkerFailure.
    """
    for pair in pairs:  # correct on every side before anything is timed
        for worker in pair.values():
            prepare_case(worker, request)
    per_pair = max(2, -(-rounds // len(pairs)))
    per_round_ms = budget_ms / (per_pair * len(pairs))
    parts = []
    for index, pair in enumerate(pairs):
        # one untimed round a side first: a worker's first measurement of a case pays page
        # faults and allocator growth (on the 2-core CPU it was the round that broke the pairing)
        for worker in pair.values():
            measure_case(worker, request, per_round_ms / 2)
        parts.append(_rounds(pair, request, per_pair, per_round_ms, "A" if index % 2 == 0 else "B",
                             first_index + index))
    return Rounds(sum((p.runs_a for p in parts), ()), sum((p.runs_b for p in parts), ()),
                  sum((p.pairs for p in parts), ()), parts[-1].extra_a, parts[-1].extra_b)


def _rounds(pair: Pair, request: CaseRequest, rounds: int, per_round_ms: float, first: str, index: int) -> Rounds:
    last: dict[str, dict] = {}

    def measure(side: str) -> Callable[[], list[float]]:
        def run() -> list[float]:
            last[side] = measure_case(pair[side], request, per_round_ms)
            return last[side]["samples"]
        return run

    runs_a, runs_b = interleave(measure("A"), measure("B"), rounds, first)
    return Rounds(runs_a, runs_b, (index,) * rounds, last["A"]["extra"], last["B"]["extra"])


def measure_case(worker: Worker, request: CaseRequest, budget_ms: float) -> dict:
    """One measurement of a case the worker keeps; prepared (and checked) again if it let it go."""
    message = {"op": "measure", "case": request.test_id, "budget_ms": budget_ms}
    reply = worker.ask(message)
    if "gone" in reply:
        prepare_case(worker, request)
        reply = worker.ask(message)
    return reply


def prepare_case(worker: Worker, request: CaseRequest) -> None:
    """Build the case in ``worker`` and check it against its reference; raises naming the worker."""
    reply = worker.ask({"op": "prepare", "case": request.__dict__})
    if "skip" in reply:
        raise BackendUnavailable(f"{worker.label}: {reply['skip']}")
    if "mismatch" in reply:
        raise KernelMismatch(f"{worker.label}: {reply['mismatch']}")


def drop_case(pairs: Sequence[Pair], request: CaseRequest) -> None:
    """Let every worker forget a decided case (its tensors go); a stopped worker is left alone."""
    for pair in pairs:
        for worker in pair.values():
            if worker.proc is not None:
                worker.ask({"op": "drop", "case": request.test_id})
