"""Injected slowdown, the A/B gate of two Python environments and the gate-power driver (CPU).

The end-to-end runs use one venv twice (this interpreter as A and B): an A/A run must never
say SLOWER, and a 30 % slowdown injected on side B must be flagged on the case it hits —
the latter with a CPU-bound process running beside it, as on a shared CI machine.
"""

import json
import re
import stat
import sys
from pathlib import Path

import psutil
import pytest

from decodebench.inject import Injection
from decodebench.runner import ab
from tests.test_interrupts import interrupt, session_args

REPO = Path(__file__).resolve().parent.parent
RMSNORM = str(REPO / "benchmarks" / "test_rmsnorm.py")
# the two largest smoke RMSNorm cases, torch backend: tens of µs each on the CPU
PAIR = ("-k", "torch and w7168-m8")
QUICK = ("--budget-ms", "240", "--ab-rounds", "6", "-p", "no:cacheprovider")


@pytest.fixture
def single_thread(monkeypatch):
    # one OpenMP thread per worker: idle OpenMP threads spinning beside the busy-wait of
    # the injection would make a 2-core CI machine far noisier than the effect measured
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def run_ab(pytester, tmp_path, *args):
    return pytester.runpytest_subprocess(
        RMSNORM, "--rootdir", str(REPO), f"--benchmark-storage=file://{tmp_path / 'store'}",
        "--benchmark-json", str(tmp_path / "ab.json"), "--ab-python", sys.executable, *QUICK, *args)


def verdicts(tmp_path) -> dict[str, str]:
    document = json.loads((tmp_path / "ab.json").read_text())
    return {b["extra_info"]["case"]: b["extra_info"]["gate"]["verdict"] for b in document["benchmarks"]}


def test_a_a_run_is_never_slower_and_passes_the_gate(pytester, tmp_path, single_thread):
    # first in the module: its one-thread sessions' zygote (tests/forked.py) starts here, not
    # beside the CPU-bound neighbour of the next test. The threshold is above what this shared
    # 2-core VM does to one side of a paired run while another test runs on the other core: an
    # A/A `add-` case once read +15.5 % (1.06-1.26x) at a 10 % gate, a SLOWER. The model's error
    # rate at tight thresholds is tested on synthetic rounds (test_gate_model) and measured on the H200.
    result = run_ab(pytester, tmp_path, *PAIR, "--gate", "50%")
    result.stdout.fnmatch_lines(["gate passed: 0 of 2 cases significantly slower by more than 50.0%*"])
    assert result.ret == pytest.ExitCode.OK
    found = verdicts(tmp_path)
    assert set(found) == {"add-w7168-m8", "plain-w7168-m8"}
    assert all(v in ("same", "undecided", "faster") for v in found.values()), found


def test_injected_slowdown_on_side_b_is_flagged_and_fails_the_gate(pytester, tmp_path, single_thread, cpu_hog):
    # the neighbour is the point here: judge through it. The spin is a fixed time sized from a
    # pilot's floor, so a slow phase of the VM (+35 % and more, docs/validation.md) shrinks what it
    # adds in relative terms: +30 % came out 1.18x (1.08-1.29, UNDECIDED at 10 %) in one CI run.
    # A doubling stays clear of 10 % through such phases.
    result = run_ab(pytester, tmp_path, *PAIR, "--inject-slowdown", "100%", "--inject-only", "add-", "--gate", "10%",
                    "--gate-max-load", "1000")
    result.stdout.fnmatch_lines(["*decodebench verdicts (A/B: B against A)*", "SLOWER*add-w7168-m8-torch*",
                                 "gate FAILED: 1 of 2 cases significantly slower by more than 10.0%*"])
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    found = verdicts(tmp_path)
    assert found["add-w7168-m8"] == "slower"
    assert found["plain-w7168-m8"] != "slower"
    document = json.loads((tmp_path / "ab.json").read_text())
    injected = {b["extra_info"]["case"]: b["extra_info"].get("injected_slowdown") for b in document["benchmarks"]}
    assert injected["add-w7168-m8"]["fraction"] == pytest.approx(1.0)
    assert injected["plain-w7168-m8"] is None


def test_local_injection_marks_only_the_selected_cases(pytester, tmp_path):
    result = pytester.runpytest_subprocess(
        RMSNORM, "--rootdir", str(REPO), *PAIR, "--budget-ms", "20", "-p", "no:cacheprovider",
        f"--benchmark-storage=file://{tmp_path / 'store'}", "--benchmark-json", str(tmp_path / "run.json"),
        "--inject-slowdown", "20%", "--inject-only", "plain-")
    result.assert_outcomes(passed=2)
    document = json.loads((tmp_path / "run.json").read_text())
    info = {b["extra_info"]["case"]: b["extra_info"].get("injected_slowdown") for b in document["benchmarks"]}
    assert info["add-w7168-m8"] is None
    assert info["plain-w7168-m8"]["fraction"] == pytest.approx(0.2)
    assert info["plain-w7168-m8"]["method"] == "busy-wait on time.perf_counter"


@pytest.mark.parametrize(("args", "message"), [
    (("--inject-slowdown", "5%", "--benchmark-autosave"), "*--inject-slowdown results are not a baseline*"),
    (("--ab-python", sys.executable, "--benchmark-save", "x"), "*--ab-python results are not a baseline*"),
    (("--inject-only", "add-"), "*--inject-only selects cases for --inject-slowdown, which is not given*"),
    (("--ab-python", "/nonexistent/python"), "*'/nonexistent/python' is not an executable Python interpreter*"),
    (("--inject-slowdown", "fast"), "*threshold 'fast' is not a number*"),
])
def test_bad_combinations_are_refused(pytester, tmp_path, args, message):
    # in this process: the usage error comes before any worker or measurement (and saves an interpreter start)
    result = pytester.runpytest_inprocess(RMSNORM, "--rootdir", str(REPO), "--collect-only", "-p", "no:cacheprovider",
                                          f"--benchmark-storage=file://{tmp_path}", *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


def test_side_without_the_backend_skips_naming_the_side(pytester, tmp_path):
    worker = ("import sys, runpy; sys.modules['vllm'] = None; "
              "runpy.run_module('decodebench.runner.case_worker', run_name='__main__')")
    hide_vllm = script(tmp_path / "novllm", f'#!/bin/sh\nexec {sys.executable} -c "{worker}"\n')
    result = pytester.runpytest_subprocess(
        RMSNORM, "--rootdir", str(REPO), "-k", "vllm and plain-w512-m1", "-rs", "-p", "no:cacheprovider",
        f"--benchmark-storage=file://{tmp_path / 'store'}", "--budget-ms", "20", "--ab-python", str(hide_vllm))
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines([f"*side B ({hide_vllm}*not installed*"])


def script(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


SESSION = {"model": "kimi-k2.5", "tp": 8, "sweep": "smoke", "device": "cpu", "timer": "wall",
           "budget": {"budget_ms": 10}, "injection": None}
MEASURE = {"op": "measure", "case": "t", "budget_ms": 5}


@pytest.mark.parametrize(("side", "body", "timeout_s", "message"), [
    ("B", "echo 'cannot start' >&2\nexit 3", 10, r"side B .*exited with status 3 during 'setup'(.|\n)*cannot start"),
    ("A", "exec sleep 60", 0.5, r"side A .*no answer to 'setup' within 0.5 s"),  # hangs: killed
])
def test_worker_that_dies_or_hangs_fails_naming_its_side(tmp_path, side, body, timeout_s, message):
    broken = script(tmp_path / "python", f"#!/bin/sh\n{body}\n")
    worker = ab.Worker(side, str(broken), SESSION, timeout_s=timeout_s)
    with pytest.raises(ab.WorkerFailure, match=message):
        worker.ask({"op": "measure", "case": "t", "budget_ms": 1})
    assert worker.proc is None


def test_worker_rebuilds_and_measures_a_case(tmp_path):
    worker = ab.Worker("A", sys.executable, SESSION, timeout_s=120)
    try:
        request = ab.CaseRequest("decodebench.kernels.rmsnorm:rmsnorm_cases", "plain-w512-m1", "torch", "t")
        assert worker.ask({"op": "prepare", "case": request.__dict__})["ok"]
        reply = worker.ask(MEASURE)
        assert worker.ask(MEASURE)["samples"]  # kept: measured again without a rebuild
        assert worker.ask({"op": "drop", "case": "t"})["ok"]
        assert worker.ask(MEASURE) == {"gone": "t"}
        assert len(reply["samples"]) >= 10
        assert all(s > 0 for s in reply["samples"])
        assert reply["extra"]["case"] == "plain-w512-m1"
        assert reply["extra"]["reference_error"] < 1e-2
        missing = ab.CaseRequest("decodebench.kernels.rmsnorm:rmsnorm_cases", "no-such-case", "torch", "t")
        with pytest.raises(ab.WorkerFailure, match="has no case 'no-such-case'"):
            worker.ask({"op": "prepare", "case": missing.__dict__})
    finally:
        worker.close()


def test_injection_selects_by_substring_of_the_test_id():
    assert Injection(0.1).applies_to("anything")
    only = Injection(0.1, only=("m8-torch", "w512"))
    assert only.applies_to("test_rmsnorm[add-w7168-m8-torch]")
    assert only.applies_to("test_rmsnorm[plain-w512-m1-vllm]")
    assert not only.applies_to("test_rmsnorm[plain-w1536-m1-vllm]")


class _FakeWorker:
    """Answers prepare and measure from a list of samples per measure; counts prepares and starts."""

    def __init__(self, samples):
        self.samples, self.prepares, self.starts, self.proc, self.info = list(samples), 0, 0, None, {}

    def ask(self, message):
        if self.proc is None:
            self.proc, self.starts = object(), self.starts + 1
        if message["op"] == "prepare":
            self.prepares += 1
            return {"ok": True}
        if message["op"] == "drop":
            return {"ok": True}
        return {"samples": list(self.samples.pop(0)), "extra": {}}

    def close(self):
        self.proc = None


def test_a_case_is_checked_and_measured_in_every_pair_once():
    request = ab.CaseRequest("m:f", "c", "torch", "t")
    pairs = [{"A": _FakeWorker([[1.0]] * 9), "B": _FakeWorker([[2.0]] * 9)} for _ in range(2)]
    rounds = ab.run_ab_case(pairs, request, 4, 40)  # checked, one untimed round, 2 rounds a pair
    assert len(rounds.runs_a) == len(rounds.runs_b) == 4
    assert rounds.pairs == (0, 0, 1, 1)
    assert [w.prepares for p in pairs for w in p.values()] == [1, 1, 1, 1]
    again = ab.run_ab_case([{"A": _FakeWorker([[1.0]] * 3), "B": _FakeWorker([[2.0]] * 3)}], request, 2, 40,
                           first_index=2)  # a re-measure: a fresh pair, labelled apart
    assert again.pairs == (2, 2)
    order = []
    ab.interleave(lambda: order.append("A") or [1.0], lambda: order.append("B") or [1.0], 2, first="B")
    assert "".join(order) == "BAAB"


def test_an_interrupted_ab_run_never_passes_and_says_how_much_it_judged(tmp_path, single_thread, session_forker):
    args = ["-k", "torch", "--budget-ms", "400", "--ab-rounds", "4", "--ab-python", sys.executable, "--gate", "10%"]
    code, output, workers = interrupt(session_forker, tmp_path, session_args(tmp_path, *args),
                                      lambda log: log.count(" PASSED") >= 2, ready_within_s=240, end_within_s=60)
    assert code != 0, output
    assert "gate passed" not in output
    (line,) = [line for line in output.splitlines() if line.startswith("gate FAILED: interrupted")]
    judged, selected = map(int, re.search(r"interrupted by SIGINT, (\d+) of (\d+) selected cases judged",
                                          line).groups())
    assert selected == 8, line
    assert 2 <= judged < 8, line
    assert not [pid for pid in workers if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
