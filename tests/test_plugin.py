"""The plugin end to end: the RMSNorm benchmarks through pytest-benchmark, baselines keyed by
fingerprint, the comparison table, the gate, and option errors (all on CPU)."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import IN_PROCESS, IN_PROCESS_WARNINGS, REPO, run_session

pytestmark = IN_PROCESS_WARNINGS

RMSNORM = str(REPO / "benchmarks" / "test_rmsnorm.py")
QUICK = ("--budget-ms", "30", "-p", "no:cacheprovider")


def run_bench(pytester, store, *args, own_process=False):
    """A nested session on the RMSNorm benchmarks, by default in this process: no interpreter start
    or torch import (about 5 s each on the 2-core machine, 18 sessions here). A session that runs
    vLLM's backends takes a process of its own: pytester drops what a nested session imported, and
    vLLM (with Triton's extension) would be imported again each time and leak at exit."""
    run = pytester.runpytest_subprocess if own_process else pytester.runpytest_inprocess
    return run(RMSNORM, *IN_PROCESS, f"--benchmark-storage=file://{store}", *QUICK, *args)


def saved_files(store):
    return sorted(store.glob("*/*.json"))


PLAIN = ("-k", "plain-w512-m1 and torch")
ADD = ("-k", "add-w7168-m8 and torch")


@pytest.fixture(scope="module")
def stored_sessions(tmp_path_factory, session_forker):
    """One autosaved session of each one-case selection, made once for the module: a stored
    session is the set-up of most tests here, and each pytest process costs seconds on the CPU
    machine (these two are forked: ``tests/forked.py``). Tests take a copy (:func:`stored`), never
    the original."""
    root = tmp_path_factory.mktemp("stored")
    stores = {}
    for name, select in (("plain", PLAIN), ("add", ADD)):
        store = root / name
        done = run_session(session_forker, [RMSNORM, "--rootdir", str(REPO), f"--benchmark-storage=file://{store}",
                                             *QUICK, *select, "--benchmark-autosave", "-q"], cwd=root, timeout_s=600)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        assert len(saved_files(store)) == 1, done.stdout[-2000:]
        stores[name] = store
    return stores


def stored(stored_sessions, name, tmp_path):
    """A private copy of the module's stored session ``name`` (``plain`` or ``add``)."""
    return Path(shutil.copytree(stored_sessions[name], tmp_path / "store", copy_function=shutil.copy2))


def test_smoke_run_stores_device_samples_under_the_fingerprint(pytester, tmp_path):
    store = tmp_path / "store"
    result = run_bench(pytester, store, "--benchmark-autosave", own_process=True)  # every backend, vLLM's too
    result.assert_outcomes(passed=16)
    (saved,) = saved_files(store)
    document = json.loads(saved.read_text())
    fingerprint = document["machine_info"]["decodebench"]["fingerprint"]
    assert saved.parent.name == fingerprint["key"]
    assert fingerprint["key"].startswith("cpu-")
    assert fingerprint["software"]["torch"].startswith("2.")
    assert document["machine_info"]["decodebench"]["model"] == "kimi-k2.5"
    names = {b["name"] for b in document["benchmarks"]}
    assert "test_rmsnorm[add-w7168-m1-torch]" in names
    assert "test_rmsnorm[plain-w512-m8-vllm]" in names
    bench = next(b for b in document["benchmarks"] if b["name"] == "test_rmsnorm[add-w7168-m8-torch]")
    info = bench["extra_info"]
    assert (info["component"], info["backend"], info["timer"]) == ("rmsnorm", "torch", "wall")
    assert info["shape"] == {"tokens": 8, "width": 7168, "fused_add": True, "eps": 1e-5,
                             "role": "hidden", "dtype": "bfloat16"}
    assert info["bytes_read"] == 2 * 8 * 7168 * 2 + 7168 * 2
    assert info["bytes_written"] == 2 * 8 * 7168 * 2
    assert info["achieved_gbps"] > 0
    assert 0 < info["frac_peak_bw"]
    assert info["reference_error"] < info["tolerance"]
    assert info["stop_reason"] in {"converged", "budget", "max_samples"}
    assert bench["options"]["timer"] == "device_clock"
    assert len(bench["stats"]["data"]) == bench["stats"]["rounds"] >= 10
    assert bench["group"] == "rmsnorm"


def test_second_run_compares_against_the_first(pytester, tmp_path, stored_sessions):
    store = stored(stored_sessions, "plain", tmp_path)
    result = run_bench(pytester, store, *PLAIN, "--benchmark-compare")
    result.assert_outcomes(passed=1)
    for row in ("*plain-w512-m1-torch] (0001_*", "*plain-w512-m1-torch] (NOW)*"):  # table order follows speed
        result.stdout.fnmatch_lines([row])
    result.stdout.fnmatch_lines(["*decodebench verdicts against the baseline*", "* gate off *"])
    assert result.ret == 0


def test_back_to_back_identical_sessions_pass_the_gate_and_an_injected_slowdown_fails_it(pytester, tmp_path,
                                                                                         cpu_hog):
    # the first session is the cold one; every later one gates against what is stored, and a
    # case that is not SAME is re-measured in fresh processes; all of it with a CPU-bound
    # neighbour on the other core. A SLOWER needs the estimate beyond the threshold (and
    # significant), so the threshold is above what this shared 2-core VM does to a whole
    # unchanged session, re-measures included: +35 % and more (+66 % for a 30 ms run; +56 % over
    # three processes at a 50 % gate, 2026-12-02; docs/validation.md). The model's error rate
    # and power at tight thresholds are tested on synthetic runs and measured on the H200.
    select = ("-k", "torch and m8 and w7168", "--budget-ms", "300")
    store, gate = tmp_path / "store", ("--gate", "100%")
    run_bench(pytester, store, *select, "--benchmark-autosave").assert_outcomes(passed=2)
    for _ in range(2):  # against one stored session, then against two
        result = run_bench(pytester, store, *select, "--benchmark-autosave", "--benchmark-compare", *gate)
        result.assert_outcomes(passed=2)
        assert not [line for line in result.outlines if line.startswith("SLOWER")], result.outlines
        result.stdout.fnmatch_lines(["gate passed: 0 of 2 cases significantly slower by more than 100.0%*"])
        assert result.ret == 0
    # judged through whatever load the machine has: the neighbour is the point here. Three times
    # the time clears 100 % through such phases (+30 % once came out UNDECIDED at 10 %: 1.03-1.64)
    result = run_bench(pytester, store, *select, "--benchmark-compare", *gate, "--inject-slowdown", "200%",
                       "--inject-only", "add-", "--benchmark-json", str(tmp_path / "j.json"), "--gate-max-load", "1000")
    document = json.loads((tmp_path / "j.json").read_text())
    gated = {b["extra_info"]["case"]: b["extra_info"]["gate"] for b in document["benchmarks"]}
    assert gated["plain-w7168-m8"]["verdict"] != "slower", gated
    assert gated["add-w7168-m8"]["verdict"] == "slower", gated
    result.stdout.fnmatch_lines(["SLOWER*test_rmsnorm[[]add-w7168-m8-torch[]]*", "gate FAILED: 1 of 2 *"])
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    assert gated["add-w7168-m8"]["ratio"] > 2.0
    assert gated["add-w7168-m8"]["low"] > 1.0
    assert gated["add-w7168-m8"]["calls"] == 122  # Kimi-K2.5 at TP 8: two residual norms per layer
    assert gated["add-w7168-m8"]["cost_us"] > 0


# A baseline no CPU run can match: every run now is a clear regression against it.
IMPOSSIBLY_FAST = [1e-9 * (1 + 0.01 * i) for i in range(20)]


def _doctor_baseline(store, data=IMPOSSIBLY_FAST, fingerprint=None):
    (saved,) = saved_files(store)
    document = json.loads(saved.read_text())
    for bench in document["benchmarks"]:
        bench["stats"]["data"] = data
    if fingerprint:
        document["machine_info"]["decodebench"]["fingerprint"]["key"] = fingerprint
    saved.write_text(json.dumps(document))
    return saved


def _stored_then_doctored(stored_sessions, name, tmp_path, **doctor):
    """A copy of the stored session ``name``, its samples then replaced (:func:`_doctor_baseline`)."""
    store = stored(stored_sessions, name, tmp_path)
    return store, _doctor_baseline(store, **doctor)


def test_gate_fails_a_clear_slowdown(pytester, tmp_path, stored_sessions):
    select = ADD
    store, _ = _stored_then_doctored(stored_sessions, "add", tmp_path)
    # a shared CI machine can be oversubscribed: let the load not hide a 1e5-fold slowdown here
    result = run_bench(pytester, store, *select, "--benchmark-compare", "--gate", "5%", "--gate-max-load", "1000")
    result.stdout.fnmatch_lines(["SLOWER *test_rmsnorm*add-w7168-m8-torch*", "gate FAILED*"])
    assert result.ret == pytest.ExitCode.TESTS_FAILED


def test_baseline_from_other_hardware_is_one_conclusion_and_fails_the_gate(pytester, tmp_path, stored_sessions):
    select = PLAIN
    store, saved = _stored_then_doctored(stored_sessions, "plain", tmp_path,
                                         fingerprint="nvidia-rtx-pro-6000-blackwell-x8-pcie")
    args = (*select, f"--benchmark-compare={saved}", "--benchmark-compare-fail=median:1%", "--gate", "1%")
    result = run_bench(pytester, store, *args)
    result.stdout.fnmatch_lines([
        "gate FAILED: nothing was compared (baseline measured on nvidia-rtx-pro-6000-blackwell-x8-pcie, "
        "this run is cpu-*: timings are not comparable)*",
    ])
    result.stdout.no_fnmatch_line("*gate passed*")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    allowed = run_bench(pytester, store, *args, "--gate-allow-empty")
    allowed.stdout.fnmatch_lines(["gate passed (--gate-allow-empty): nothing was compared (baseline measured on*"])
    assert allowed.ret == 0


def test_a_truncated_stored_file_is_refused_naming_it_before_anything_is_measured(pytester, tmp_path,
                                                                                   stored_sessions):
    # before: skipped ("gate FAILED: nothing was compared" when it was the only one): a gate's failure
    # for unreadable input, or a judgment around a file whose contents nobody knows
    store, select = stored(stored_sessions, "plain", tmp_path), PLAIN
    (good,) = saved_files(store)
    for damaged in (good.with_name("0002_damaged.json"), good):  # the newest, then the only one
        damaged.write_text(good.read_text()[:300])
        result = run_bench(pytester, store, *select, "--benchmark-compare", "--gate", "100%")
        assert result.ret == pytest.ExitCode.USAGE_ERROR
        text = "\n".join(result.outlines + result.errlines)
        assert re.search(rf"{re.escape(str(damaged))} is not valid JSON \(truncated or damaged\?\).*nothing was "
                         "measured", text), text
        assert "gate " not in text
        assert "passed" not in text


def test_no_baseline_at_all_fails_the_gate_unless_allowed(pytester, tmp_path):
    store = tmp_path / "store"
    select = ("-k", "plain-w512-m1 and torch", "--benchmark-compare", "--gate", "5%")
    result = run_bench(pytester, store, *select)
    result.stdout.fnmatch_lines(["gate FAILED: nothing was compared (no stored result in *store/cpu-*"])
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    assert run_bench(pytester, store, *select, "--gate-allow-empty").ret == 0


def test_every_case_skipped_compares_nothing(pytester, tmp_path, stored_sessions):
    store = stored(stored_sessions, "plain", tmp_path)
    result = run_bench(pytester, store, "-k", "plain-w512-m1", "--benchmark-skip", "--benchmark-compare",
                       "--gate", "5%")
    result.stdout.fnmatch_lines(["gate FAILED: nothing was compared (no benchmark ran in this session*"])
    assert result.ret == pytest.ExitCode.TESTS_FAILED


def test_stored_results_are_readable_as_the_umask_allows(stored_sessions):
    (saved,) = saved_files(stored_sessions["plain"])  # the file as the plugin wrote it
    assert saved.stat().st_mode & 0o777 == 0o666 & ~_umask()


def _umask():
    import os

    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@pytest.mark.parametrize(("where", "recorded"), [("fresh", "fresh process"), ("session", "session")])
def test_slower_case_is_remeasured_and_the_runs_are_stored(pytester, tmp_path, stored_sessions, where, recorded):
    select = ADD
    store, _ = _stored_then_doctored(stored_sessions, "add", tmp_path)
    summary = tmp_path / "summary.md"
    result = run_bench(pytester, store, *select, "--benchmark-compare", "--benchmark-autosave", "--gate", "5%",
                       "--gate-max-load", "1000", "--summary-md", str(summary), "--gate-remeasure", where)
    result.stdout.fnmatch_lines(["SLOWER *add-w7168-m8-torch*runs 1 then *"])
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    document = json.loads(saved_files(store)[-1].read_text())
    (bench,) = document["benchmarks"]
    # one stored run and one run now leave no spread to judge by: re-measured before deciding
    resamples = bench["extra_info"]["resamples"]
    assert 1 <= len(resamples) <= 2
    assert bench["extra_info"]["gate"]["verdict"] == "slower"
    assert bench["extra_info"]["gate"]["runs"] == [1, 1 + len(resamples)]
    assert bench["extra_info"]["remeasured_in"] == recorded
    assert len(bench["extra_info"]["resample_kernels"]) == len(resamples)
    text = summary.read_text()
    assert "| **SLOWER** | `benchmarks/test_rmsnorm.py::test_rmsnorm[add-w7168-m8-torch]` |" in text
    assert "SLOWER: 1" in text


def test_gate_step_fails_when_the_predicted_step_is_slower(pytester, tmp_path, stored_sessions):
    select = ADD
    store, _ = _stored_then_doctored(stored_sessions, "add", tmp_path)
    # no --gate: the per-kernel verdict alone would not fail; the step it is part of does
    result = run_bench(pytester, store, *select, "--benchmark-compare", "--gate-step", "1%", "--gate-max-load", "1000")
    result.stdout.fnmatch_lines(["STEP SLOWER*M=8*", "gate FAILED: 1 of 1 cases significantly slower (not gated)*"
                                 "step(s) slower by more than 1.0%"])
    assert result.ret == pytest.ExitCode.TESTS_FAILED


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--timer", "bogus"), "*unknown timer 'bogus'*"),
        (("--sweep", "weekly"), "*unknown sweep level 'weekly'*"),
        (("--tp", "0"), "*'0' must be at least 1*"),
        (("--tp", "3"), "*num_attention_heads = 64 is not divisible by tp = 3*"),
        (("--model", "/no/such/config.json"), "*is neither a config.json*"),
        (("--timer", "kernel", "--device", "cpu"), "*--timer kernel needs a CUDA device*"),
        (("--gate", "lots"), "*threshold 'lots' is not a number*"),
        (("--gate-resamples", "-1"), "*'-1' is not a whole number of 0 or more*"),
        (("--gate-history", "0"), "*'0' must be at least 1*"),
        (("--cpu-threads", "many"), "*--cpu-threads 'many': use a whole number of 1 or more, or all*"),
        (("--gate-remeasure", "elsewhere"), "*unknown re-measure place 'elsewhere'*"),
        (("--gate-confidence", "20%"), "*confidence '20%' must lie in [[]50%, 100%)*"),
        (("--gate-step", "x"), "*threshold 'x' is not a number*"),
    ],
)
def test_bad_options_are_named(pytester, tmp_path, args, message):
    # in this process: a usage error stops the session before anything runs, and a new
    # interpreter (torch, vLLM's import) costs seconds a case on the CPU machine
    result = pytester.runpytest_inprocess(RMSNORM, "--rootdir", str(REPO), f"--benchmark-storage=file://{tmp_path}",
                                          *QUICK, "--collect-only", *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


# --- a baseline folder that cannot be written ---------------------------------------------------


def test_autosave_into_a_folder_that_cannot_be_written_fails_before_measuring(pytester, tmp_path):
    store = tmp_path / "store"
    store.write_text("a file where the storage folder should be")  # as root, a chmod would not stop a write
    result = run_bench(pytester, store, "-k", "plain-w512-m1 and torch", "--benchmark-autosave")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: --benchmark-autosave: cannot write to {store}/cpu-*: Not a directory; "
                                 "nothing was measured"])
    result.stdout.no_fnmatch_line("*test_rmsnorm*")  # nothing ran


def obeying_permissions() -> tuple[str, ...]:
    """An argv prefix under which this user cannot write into a read-only folder: none for a
    plain user; for root (which writes anywhere) setpriv without the capabilities that allow it."""
    if os.geteuid() != 0:
        return ()
    prefix = (shutil.which("setpriv") or "setpriv", "--bounding-set=-dac_override,-dac_read_search", "--")
    try:
        subprocess.run([*prefix, "true"], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("root writes into a read-only folder, and setpriv cannot drop that here")
    return prefix


def test_autosave_into_a_read_only_folder_fails_before_measuring(pytester, tmp_path):
    store = tmp_path / "store"
    store.mkdir(mode=0o555)
    result = pytester.run(*obeying_permissions(), sys.executable, "-mpytest", f"--basetemp={tmp_path / 'tmp'}",
                          RMSNORM, "--rootdir", str(REPO), f"--benchmark-storage=file://{store}", *QUICK,
                          "-k", "plain-w512-m1 and torch", "--benchmark-autosave")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: --benchmark-autosave: cannot write to {store}/cpu-*: Permission denied; "
                                 "nothing was measured"])


# Takes the fingerprint folder away once every test has run, before pytest-benchmark saves.
SABOTAGE = """
import shutil
import pytest

@pytest.hookimpl(hookwrapper=True)
def pytest_runtestloop(session):
    yield
    root = session.config._benchmarksession.storage.path
    shutil.rmtree(root)
    root.write_text("")
"""


def test_a_save_that_fails_at_the_end_still_shows_what_was_measured_in_one_error_line(pytester, tmp_path):
    pytester.makepyfile(sabotage=SABOTAGE)
    pytester.syspathinsert()  # the session runs in this process: `-p sabotage` imports from pytester's folder
    store = tmp_path / "store"
    result = run_bench(pytester, store, "-k", "plain-w512-m1 and torch", "--benchmark-autosave", "-p", "sabotage")
    result.assert_outcomes(passed=1)
    result.stderr.fnmatch_lines([f"decodebench: nothing was stored: cannot write {store}/cpu-*/0001_*.json: Not a "
                                 "directory (this run's results are in the table below)"])
    result.stdout.fnmatch_lines(["*Name (time in *", "*test_rmsnorm[[]plain-w512-m1-torch[]]*"])  # the table
    assert "Traceback" not in result.stdout.str() + result.stderr.str()
    assert result.ret == pytest.ExitCode.TESTS_FAILED


def test_an_injection_that_cannot_reach_a_case_refuses_it_by_name(pytester):
    # a collective has no injection point: measured without the spin, it must not pass for injected
    dispatch = str(REPO / "benchmarks" / "test_dispatch.py")
    result = pytester.runpytest_inprocess(dispatch, "--rootdir", str(REPO), *QUICK, "-k", "a2a-ep8-m8", "-rs",
                                          "--inject-slowdown", "10%")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*--inject-slowdown does not reach *test_dispatch[a2a-ep8-m8-*: only the kernel "
                                 "cases carry the injected spin*"])
