"""Ctrl-C in every phase of a gated session: one conclusion line, exit non-zero, no worker left (issue 25).

Each test starts a real session in its own process group, waits until it is in the phase,
presses Ctrl-C there (SIGINT to the group, as a terminal does), once or several times, and reads
what the session printed. The phases: measuring (stored mode), the A/B rounds, the A/B
re-measures of undecided cases, and the confirmation of a SLOWER that rests on one run (stored
mode, in a fresh process).
"""

import json
import os
import re
import signal
import sys
import time
import types
from pathlib import Path

import psutil
import pytest

from decodebench.baselines import load_history
from tests.conftest import run_session, start_session

REPO = Path(__file__).resolve().parent.parent
RMSNORM = str(REPO / "benchmarks" / "test_rmsnorm.py")
CONCLUSION = re.compile(r"^gate FAILED: interrupted by (SIG[A-Z]+), (\d+) of (\d+) selected cases judged; "
                        r"no conclusion$")


def session_args(tmp_path, *args) -> list[str]:
    """The arguments of a session (``python -m pytest`` less its first three words)."""
    return [RMSNORM, "--rootdir", str(REPO), "-p", "no:cacheprovider", "-v",
            f"--benchmark-storage=file://{tmp_path / 'store'}", *args]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def interrupt(forker, tmp_path, args, ready, presses: int = 1, *, ready_within_s: float = 300,
              end_within_s: float = 120, signum: int = signal.SIGINT) -> tuple[int, str, list[int]]:
    """Start a session with ``args`` in a process group of its own (forked where it can be:
    ``tests/conftest.py``, ``start_session``), press Ctrl-C ``presses`` times once ``ready(log)``
    (within ``ready_within_s``); exit status, output (the session ends within ``end_within_s``),
    and the session's descendants seen just before the first press. Another ``signum`` (SIGTERM,
    SIGHUP) goes to the session's process alone, as ``kill PID`` or a closed terminal's does."""
    log_path = tmp_path / "session.log"
    process = start_session(forker, args, cwd=REPO, env=_env(), log=log_path)
    try:
        deadline = time.monotonic() + ready_within_s
        while not ready(log_path.read_text()):
            assert process.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        children = [p.pid for p in psutil.Process(process.pid).children(recursive=True)]
        for _ in range(presses):
            if signum == signal.SIGINT:
                os.killpg(process.pid, signal.SIGINT)  # Ctrl-C in a terminal: the whole process group
            else:
                os.kill(process.pid, signum)
            time.sleep(0.3)
        process.wait(timeout=end_within_s)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
    return process.returncode, log_path.read_text(), children


def check_concluded(code: int, output: str, children: list[int], signum: int = signal.SIGINT) -> tuple[int, int]:
    """One conclusion line saying it was interrupted by ``signum``; exit non-zero; no traceback; no
    process left."""
    assert code != 0, output
    assert "gate passed" not in output, output
    assert "Traceback" not in output, output
    lines = [line for line in output.splitlines() if line.startswith("gate ")]
    assert len(lines) == 1, output
    assert CONCLUSION.match(lines[0]), output
    assert not [pid for pid in children if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
    by, judged, selected = CONCLUSION.match(lines[0]).groups()
    assert by == signal.Signals(signum).name, lines[0]
    return int(judged), int(selected)


def _store(forker, tmp_path, *args) -> Path:
    done = run_session(forker, session_args(tmp_path, "--budget-ms", "30", "--benchmark-autosave", *args), cwd=REPO,
                       env=_env(), timeout_s=300)
    assert done.returncode == 0, done.stdout + done.stderr
    (stored,) = (tmp_path / "store").glob("*/0001_*.json")
    return stored


def test_ctrl_c_while_measuring_against_stored_results(tmp_path, session_forker):
    _store(session_forker, tmp_path, "-k", "torch")
    command = session_args(tmp_path, "-k", "torch", "--budget-ms", "400", "--benchmark-compare", "--gate", "10%")
    code, output, children = interrupt(session_forker, tmp_path, command, lambda log: log.count(" PASSED") >= 2)
    judged, selected = check_concluded(code, output, children)
    assert selected == 8
    assert 2 <= judged < 8


def test_ctrl_c_three_times_during_the_ab_rounds(tmp_path, session_forker):
    command = session_args(tmp_path, "-k", "torch", "--budget-ms", "400", "--ab-rounds", "4", "--ab-python",
                       sys.executable, "--gate", "10%")
    code, output, children = interrupt(session_forker, tmp_path, command, lambda log: log.count(" PASSED") >= 2,
                                       presses=3)
    judged, selected = check_concluded(code, output, children)
    assert selected == 8
    assert 2 <= judged < 8
    assert children  # the A/B workers were there, and are gone


def test_ctrl_c_twice_during_the_ab_re_measures(tmp_path, session_forker):
    # side B 100 % slower: a SLOWER is confirmed only on the last look, so the session
    # re-measures it at its end, round after round
    command = session_args(
        tmp_path,
        "-k",
        "torch and w7168-m8",
        "--budget-ms",
        "200",
        "--ab-rounds",
        "4",
        "--ab-python",
        sys.executable,
        "--gate",
        "10%",
        "--gate-resamples",
        "3",
        "--gate-max-load",
        "1000",
        "--inject-slowdown",
        "100%",
        "--inject-only",
        "add-",
    )  # a busy shared machine is no reason here
    code, output, children = interrupt(session_forker, tmp_path, command, _re_measuring("slower so far"), presses=2)
    assert check_concluded(code, output, children) == (2, 2)


def test_ctrl_c_twice_while_confirming_a_slower_case_in_a_fresh_process(tmp_path, session_forker):
    stored = _store(session_forker, tmp_path, "-k", "torch and w7168-m8")
    document = json.loads(stored.read_text())
    for number, scale in ((2, 1.001), (3, 0.999)):  # a history of three runs: a spread to judge by
        for bench in document["benchmarks"]:
            bench["stats"]["data"] = [v * scale for v in bench["stats"]["data"]]
        (stored.parent / f"000{number}_copy.json").write_text(json.dumps(document))
    command = session_args(tmp_path, "-k", "torch and w7168-m8", "--budget-ms", "200", "--benchmark-compare",
                       "--gate", "10%", "--gate-max-load", "1000", "--inject-slowdown", "100%", "--inject-only", "add-")
    code, output, children = interrupt(session_forker, tmp_path, command, _re_measuring("slower so far"), presses=2)
    assert check_concluded(code, output, children)[1] == 2


def test_sigterm_during_the_ab_rounds_ends_like_ctrl_c_with_the_workers_gone(tmp_path, session_forker):
    # before: exit 143, no conclusion line, and an A/B worker outlived the session by about a second;
    # then a conclusion that did not name the signal
    command = session_args(tmp_path, "-k", "torch", "--budget-ms", "400", "--ab-rounds", "4", "--ab-python",
                           sys.executable, "--gate", "10%")
    code, output, children = interrupt(session_forker, tmp_path, command, lambda log: log.count(" PASSED") >= 2,
                                       signum=signal.SIGTERM)
    judged, selected = check_concluded(code, output, children, signal.SIGTERM)
    assert selected == 8
    assert 2 <= judged < 8
    assert children  # the A/B workers were there, and are gone


@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGINT], ids=["SIGHUP", "SIGINT"])
def test_an_interrupted_sessions_autosave_is_marked_and_never_a_baseline(tmp_path, session_forker, signum):
    # before: the partial run was autosaved like a whole one, and the next session compared against it
    first = _store(session_forker, tmp_path, "-k", "torch")
    command = session_args(tmp_path, "-k", "torch", "--budget-ms", "400", "--benchmark-compare", "--gate", "10%",
                           "--benchmark-autosave")
    code, output, children = interrupt(session_forker, tmp_path, command, lambda log: log.count(" PASSED") >= 2,
                                       signum=signum)
    check_concluded(code, output, children, signum)
    (partial,) = sorted(first.parent.glob("0002_*.json"))
    stored = json.loads(partial.read_text())
    assert stored["machine_info"]["decodebench"]["interrupted"] == signal.Signals(signum).name
    history = load_history(first.parent, stored["machine_info"]["decodebench"]["fingerprint"]["key"])
    assert [r.path for r in history.results] == [first]
    assert history.skipped == (f"{partial} is a session interrupted by {signal.Signals(signum).name}: a partial "
                               "run, not a baseline",)


SIGTERM_WHILE_COLLECTING = """
import os
import signal

import pytest


@pytest.hookimpl(tryfirst=True)  # before -k deselects
def pytest_collection_modifyitems(config, items):
    os.kill(os.getpid(), signal.SIGTERM)
"""


def test_a_signal_while_collecting_names_no_selection(pytester, tmp_path):
    # pytest finishes a collection even when interrupted, with every item collected: the conclusion
    # counted those as the selection ("0 of 16 selected" for the 8 that -k selects)
    pytester.makepyfile(sigterm_while_collecting=SIGTERM_WHILE_COLLECTING)
    result = pytester.runpytest_subprocess(*session_args(tmp_path, "-k", "torch", "--gate", "10%"),
                                           "-p", "sigterm_while_collecting")
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines(["gate FAILED: interrupted by SIGTERM, 0 cases judged; no conclusion"])


def _re_measuring(what: str):
    """Ready once a re-measure round of ``what`` has started and had a moment to start its processes."""
    seen: list[float] = []

    def ready(log: str) -> bool:
        if not re.search(rf"^decodebench gate: re-measure round 1 of \d+: .*{what}", log, re.MULTILINE):
            return False
        seen.append(time.monotonic())
        return time.monotonic() - seen[0] > 1.0

    return ready


@pytest.fixture(autouse=True)
def _single_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


LINELESS = """
import types

def test_interrupted_where_no_line_is():
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt as exc:
        # what Python 3.11 leaves when Ctrl-C lands on an instruction without a source location
        lineless = types.TracebackType(None, exc.__traceback__.tb_frame, 10**6, -1)
        assert lineless.tb_lineno is None
        raise exc.with_traceback(lineless)
"""


LINELESS_CONTEXT = """
import types

def test_interrupted_while_handling_an_error_whose_traceback_has_no_line():
    try:
        raise ValueError("first")
    except ValueError as exc:
        exc.__traceback__.tb_next = types.TracebackType(None, exc.__traceback__.tb_frame, 10**6, -1)
        raise KeyboardInterrupt  # its __context__ is the error: pytest formats both
"""


@pytest.mark.parametrize("module", [LINELESS, LINELESS_CONTEXT], ids=["interrupt", "its-context"])
def test_an_interrupt_that_landed_where_no_line_is_is_reported_not_crashed_on(pytester, module):
    # pytest alone fails here with TypeError (None - 1) in TracebackEntry.lineno: the plugin
    # numbers the entry before the terminal reporter formats it
    pytester.makepyfile(test_lineless=module)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "decodebench.plugin")
    assert result.ret == pytest.ExitCode.INTERRUPTED
    assert "Traceback" not in result.stdout.str() + result.stderr.str()
    result.stdout.fnmatch_lines(["*!!! KeyboardInterrupt !!!*", "*test_lineless.py:*: KeyboardInterrupt"])


def test_numbering_lineless_frames_keeps_the_chain():
    from decodebench.plugin import number_lineless_frames

    def inner():
        raise KeyboardInterrupt

    try:
        inner()
    except KeyboardInterrupt as exc:
        head = exc.__traceback__
    frames = []
    tb = head
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    head.tb_next = types.TracebackType(head.tb_next.tb_next, head.tb_next.tb_frame, 10**6, -1)
    assert number_lineless_frames(head) == 1
    assert head.tb_next.tb_lineno == inner.__code__.co_firstlineno
    tb, seen = head, []
    while tb is not None:
        assert tb.tb_lineno is not None
        seen.append(tb.tb_frame)
        tb = tb.tb_next
    assert seen == frames
    assert number_lineless_frames(head) == 0


LATE_PRESS = """
import os
import signal

import pytest


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    os.kill(os.getpid(), signal.SIGINT)  # the second Ctrl-C, after the conclusion, where pytest collects garbage
"""


def test_a_second_ctrl_c_after_the_conclusion_is_counted_not_a_traceback(pytester):
    # seen in a fresh-clone CI run: the second press landed in pytest's gc.collect() in its unconfigure, after the
    # plugin had given Ctrl-C back, and printed a KeyboardInterrupt traceback under the conclusion
    pytester.makepyfile(
        test_pressed="import os, signal\n\ndef test_pressed():\n    os.kill(os.getpid(), signal.SIGINT)\n"
    )
    pytester.makepyfile(late_press=LATE_PRESS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "decodebench.plugin", "-p", "late_press",
                                           "--gate", "5%", "--benchmark-storage", f"file://{pytester.path / 'store'}")
    output = result.stdout.str() + result.stderr.str()
    assert "Traceback" not in output, output
    assert result.ret != 0, output
    assert [line for line in result.stdout.lines if line.startswith("gate ")], output
