"""Faults of stored results, of the gate's input and of a second session (issue 61): each through the
public interface (``python -m decodebench gate``, a nested benchmark session), each ending in one
clear error naming its cause with the bad-input exit code, or in a conclusion that counts it; nothing
stored that should not be.

Bad input: exit 2 offline, pytest's usage error (4) live. Each example of the issue, and a second
instance of its class."""

import json
import re
import subprocess
import sys

import pytest

from decodebench.gate.reference import SAME_RUN_WITHIN
from decodebench.neighbours import Neighbours
from decodebench.registry import group_components
from tests.conftest import IN_PROCESS, IN_PROCESS_WARNINGS, REPO

pytestmark = IN_PROCESS_WARNINGS

H200 = REPO / "baselines" / "nvidia-h200-x1-single-cc90-drv580.159.04-cuda13.0-torch2.11.0-cu130"
NIGHTLY, AA = H200 / "0002_h200-vllm-nightly.json", H200 / "0003_h200-vllm-nightly-aa.json"
MOE = "benchmarks/test_moe.py::test_moe[fused-e384-top8-g32-n512k7168-n7168k256-uniform-m64-vllm]"
RMSNORM = str(REPO / "benchmarks" / "test_rmsnorm.py")
DEEP = "[" * 200_000 + "]" * 200_000  # 400 KB nested past Python's JSON parser (RecursionError)


def run(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "decodebench", *map(str, args)], capture_output=True, text=True,
                          cwd=REPO, timeout=timeout)


def verdict_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if re.match(r"(SLOWER|FASTER|SAME|UNDECIDED|INCOMPARABLE) ", line)]


def one_error_line(done) -> str:
    assert "Traceback" not in done.stderr + done.stdout, done.stderr
    (line,) = done.stderr.strip().splitlines()
    return line


def session(pytester, store, *args):
    """A nested rmsnorm session (4 torch cases at w7168) on the storage ``store``."""
    return pytester.runpytest_inprocess(RMSNORM, *IN_PROCESS, f"--benchmark-storage=file://{store}", "--budget-ms",
                                        "30", "-p", "no:cacheprovider", "--gate-max-load", "1000", *args)


def text_of(result) -> str:
    return "\n".join(result.outlines + result.errlines)


@pytest.fixture
def stored(pytester, tmp_path):
    """A storage holding one session of the 4 rmsnorm cases (w7168, torch); its fingerprint folder."""
    store = tmp_path / "store"
    session(pytester, store, "-k", "torch and w7168", "--benchmark-autosave").assert_outcomes(passed=4)
    (folder,) = store.iterdir()
    return folder


# --- class 2: what cannot be read is refused, naming it, exit 2 offline and 4 live -----------------------------

def test_a_deeply_nested_file_in_the_baseline_folder_is_refused_offline_with_exit_2(tmp_path):
    folder = tmp_path / "fp"
    folder.mkdir()
    (folder / "0001_nightly.json").write_bytes(NIGHTLY.read_bytes())
    (folder / "0002_deep.json").write_text(DEEP)
    done = run("gate", folder, AA, "--gate", "5%")
    assert done.returncode == 2, done.stdout + done.stderr  # before: RecursionError, exit 1 ("gate failed")
    line = one_error_line(done)
    assert f"{folder / '0002_deep.json'} nests its JSON deeper than it can be read" in line
    assert not verdict_lines(done.stdout)


def test_a_deeply_nested_file_in_the_baseline_folder_is_a_usage_error_live_before_any_work(pytester, stored):
    (stored / "0002_deep.json").write_text(DEEP)
    live = session(pytester, stored.parent, "-k", "torch and w7168", "--benchmark-compare", "--gate", "5%",
                   "--benchmark-autosave")
    assert live.ret == pytest.ExitCode.USAGE_ERROR, text_of(live)  # before: INTERNALERROR
    assert f"{stored / '0002_deep.json'} nests its JSON deeper than it can be read" in text_of(live)
    assert "INTERNALERROR" not in text_of(live)
    assert "gate FAILED" not in text_of(live)
    assert sorted(p.name for p in stored.iterdir())[-1] == "0002_deep.json"  # nothing measured, nothing stored


def test_a_result_file_nested_past_the_parser_is_refused_by_the_prediction_verbs(tmp_path):
    deep = tmp_path / "kernels.json"
    deep.write_text(DEEP)
    done = run("scenarios", deep, "--batch", "1")
    assert done.returncode == 2
    assert f"{deep} nests its JSON deeper than it can be read" in one_error_line(done)


def test_a_prediction_input_nested_past_the_parser_is_a_usage_error_before_any_work(pytester, tmp_path):
    deep = tmp_path / "kernels.json"
    deep.write_text(DEEP)
    live = session(pytester, tmp_path / "store", "-k", "torch and w7168", "--predict-from", str(deep))
    assert live.ret == pytest.ExitCode.USAGE_ERROR, text_of(live)  # refused before anything runs
    assert f"--predict-from {deep} nests its JSON deeper than it can be read" in text_of(live)
    assert "passed" not in text_of(live)


@pytest.mark.parametrize("url", ["elasticsearch+http://127.0.0.1:9/bench/run", "s3://bucket/results"])
def test_a_storage_other_than_files_is_refused_by_name_before_any_work(pytester, url):
    live = pytester.runpytest_inprocess(RMSNORM, *IN_PROCESS, f"--benchmark-storage={url}", "-k", "torch and m1",
                                        "-p", "no:cacheprovider", "--benchmark-compare")
    assert live.ret == pytest.ExitCode.USAGE_ERROR, text_of(live)  # before: a 36-line INTERNALERROR
    assert f"--benchmark-storage {url}: decodebench stores and reads results as files" in text_of(live)
    assert "INTERNALERROR" not in text_of(live)
    assert "passed" not in text_of(live)


@pytest.mark.parametrize("where", ["a-file/sessions", "/proc/decodebench-sessions"])
def test_an_unwritable_sessions_folder_is_refused_once_naming_it_and_its_purpose(pytester, tmp_path, monkeypatch,
                                                                                 where):
    (tmp_path / "a-file").write_text("")  # a folder under a file cannot be made, even by root
    folder = tmp_path / where
    monkeypatch.setenv("DECODEBENCH_SESSIONS_DIR", str(folder))
    live = session(pytester, tmp_path / "store", "-k", "torch and w7168", "--benchmark-autosave")
    text = text_of(live)
    assert live.ret == pytest.ExitCode.USAGE_ERROR, text  # before: every test erred, "all skipped or deselected"
    assert text.count(f"DECODEBENCH_SESSIONS_DIR: cannot write to {folder}/cpu") == 1, text
    assert "so that two sessions on one device see each other" in text
    assert "nothing was measured" in text
    assert not (tmp_path / "store").exists() or not list((tmp_path / "store").rglob("*.json"))


# --- class 3: nothing suspect is compared against -------------------------------------------------------

def _scaled(document: dict, factor: float, names=None) -> dict:
    copy = json.loads(json.dumps(document))
    for bench in copy["benchmarks"]:
        if names is None or bench["fullname"] in names:
            bench["stats"]["data"] = [v * factor for v in bench["stats"]["data"]]
    return copy


def test_a_near_copy_of_a_stored_run_is_one_run_and_is_named(tmp_path):
    factor = 1 + 1e-12
    assert factor - 1 < SAME_RUN_WITHIN
    folder = tmp_path / "fp"
    folder.mkdir()
    (folder / "0001_nightly.json").write_bytes(NIGHTLY.read_bytes())
    alone = run("gate", folder, AA, "--gate", "5%")
    (folder / "0002_near-copy.json").write_text(json.dumps(_scaled(json.loads(NIGHTLY.read_text()), factor)))
    done = run("gate", folder, AA, "--gate", "5%")
    assert done.returncode == alone.returncode == 0, done.stdout + done.stderr
    assert (f"skipped stored result: {folder / '0002_near-copy.json'}: the same samples as "
            f"{folder / '0001_nightly.json'}: a copy, not a run of its own") in done.stdout
    assert verdict_lines(done.stdout) == verdict_lines(alone.stdout)  # before: decided cases went from 1 to 5
    assert done.stdout.splitlines()[-1] == alone.stdout.splitlines()[-1]


def test_a_near_copy_of_the_run_judged_is_not_its_own_baseline(tmp_path):
    folder = tmp_path / "fp"
    folder.mkdir()
    (folder / "0001_nightly.json").write_bytes(NIGHTLY.read_bytes())
    (folder / "0002_aa-again.json").write_text(json.dumps(_scaled(json.loads(AA.read_text()), 1 - 1e-12, {MOE})))
    done = run("gate", folder, AA, "--gate", "5%")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{folder / '0002_aa-again.json'}: case {MOE}: the same samples as CURRENT {AA}" in done.stdout
    moe = next(line for line in verdict_lines(done.stdout) if MOE in line)
    assert "runs 1 then 1" in moe  # the nightly's run only


def _injected(document: dict) -> dict:
    copy = _scaled(document, 1.05, {MOE})
    for bench in copy["benchmarks"]:
        if bench["fullname"] == MOE:
            bench["extra_info"]["injected_slowdown"] = {"fraction": 0.05, "base_floor_s": 1e-4, "extra_s": 5e-6,
                                                        "method": "spin", "every": 1}
    return copy


def test_a_result_made_with_an_injected_slowdown_is_never_a_baseline(tmp_path):
    folder = tmp_path / "fp"
    folder.mkdir()
    (folder / "0001_nightly.json").write_bytes(NIGHTLY.read_bytes())
    injected = folder / "0002_injected.json"
    injected.write_text(json.dumps(_injected(json.loads(AA.read_text()))))
    done = run("gate", folder, AA, "--gate", "5%")
    assert done.returncode == 0, done.stdout + done.stderr
    assert (f"skipped stored result: {injected} was measured with --inject-slowdown (case {MOE}): a test of the gate, "
            "never a baseline") in done.stdout
    assert "runs 1 then 1" in next(line for line in verdict_lines(done.stdout) if MOE in line)
    named = run("gate", injected, AA, "--gate", "5%")  # named as the baseline: refused
    assert named.returncode == 2
    assert "was measured with --inject-slowdown" in one_error_line(named)


@pytest.mark.parametrize("mark", ["ab", "interrupted"])
def test_an_ab_or_interrupted_result_named_as_the_baseline_is_refused(tmp_path, mark):
    document = json.loads(NIGHTLY.read_text())
    if mark == "ab":
        document["benchmarks"][0]["extra_info"]["ab"] = {"runs_a": [[1e-5]], "runs_b": [[1e-5]]}
    else:
        document["machine_info"]["decodebench"]["interrupted"] = "SIGTERM"
    named = tmp_path / "0001_named.json"
    named.write_text(json.dumps(document))
    done = run("gate", named, AA, "--gate", "5%")  # before (interrupted): judged against, as if whole
    assert done.returncode == 2, done.stdout + done.stderr
    assert str(named) in one_error_line(done)
    assert "baseline" in one_error_line(done)


def test_a_result_made_with_an_injected_slowdown_copied_into_the_storage_is_refused_live(pytester, stored, tmp_path):
    out = tmp_path / "injected.json"
    session(pytester, stored.parent, "-k", "torch and w7168", "--inject-slowdown", "50%", "--benchmark-json", str(out))
    copied = stored / "0002_copied.json"
    copied.write_text(out.read_text())
    live = session(pytester, stored.parent, "-k", "torch and w7168", "--benchmark-compare", "--gate", "5%")
    assert f"skipped stored result: {copied} was measured with --inject-slowdown" in text_of(live)
    named = session(pytester, stored.parent, "-k", "torch and w7168", "--benchmark-compare=0002", "--gate", "5%")
    assert named.ret == pytest.ExitCode.USAGE_ERROR, text_of(named)
    assert f"--benchmark-compare: {copied} was measured with --inject-slowdown" in text_of(named)


def test_scenarios_on_an_empty_result_file_names_the_components_it_lacks(tmp_path):
    empty = tmp_path / "empty.json"
    empty.write_text('{"benchmarks": []}')
    done = run("scenarios", empty, "--batch", "1")
    assert done.returncode == 2, done.stdout  # before: exit 0, "0.0 µs of kernels"
    line = one_error_line(done)
    assert f"{empty}: no kernel result of any component the step of kimi-k2.5 at TP 8, M=1 needs" in line
    assert "moe" in line
    assert "rmsnorm" in line
    assert "mla_attention" in line


def test_scenarios_on_results_of_no_component_names_what_it_lacks(tmp_path):
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"benchmarks": [{"name": "t", "fullname": "t.py::t", "stats": {
        "median": 1e-5, "data": [1e-5]}, "extra_info": {"component": "tokenizer", "shape": {"tokens": 1}}}]}))
    done = run("scenarios", other, "--batch", "64")
    assert done.returncode == 2
    assert "no kernel result of any component" in one_error_line(done)


# --- class 4: every case that ran is counted -----------------------------------------------------------

def test_the_offline_conclusion_counts_and_names_the_cases_with_no_stored_run(tmp_path):
    document = json.loads(NIGHTLY.read_text())
    document["benchmarks"] = [b for b in document["benchmarks"] if b["fullname"] == MOE]
    one = tmp_path / "0001_moe.json"
    one.write_text(json.dumps(document))
    done = run("gate", one, AA, "--gate", "5%")
    ran = len(json.loads(AA.read_text())["benchmarks"])
    last = done.stdout.splitlines()[-1]
    assert last.startswith("gate passed: 0 of 1 cases significantly slower"), last
    assert f"; {ran - 1} new (no stored run here: " in last
    assert " more)" in last


def test_the_live_conclusion_counts_and_names_the_cases_with_no_stored_run(pytester, tmp_path):
    store = tmp_path / "store"
    session(pytester, store, "-k", "torch and w7168-m1 and not add", "--benchmark-autosave").assert_outcomes(passed=1)
    live = session(pytester, store, "-k", "torch and w7168", "--benchmark-compare", "--gate", "5%")
    live.assert_outcomes(passed=4)
    (last,) = [line for line in live.outlines if line.startswith("gate ")]
    assert "of 1 cases" in last, last
    assert "; 3 new (no stored run here: test_rmsnorm[" in last, last  # before: unnamed


# --- class 6: a newcomer's first run of other cases --------------------------------------------------------

def test_cases_with_no_stored_run_on_a_storage_of_other_cases_say_so_and_how_to_store_one(pytester, stored):
    live = session(pytester, stored.parent, "-k", "torch and w512", "--benchmark-compare", "--gate", "5%")
    (last,) = [line for line in live.outlines if line.startswith("gate ")]
    assert live.ret == pytest.ExitCode.TESTS_FAILED
    assert re.search(r"gate FAILED: nothing was compared \(the \d+ cases of this session have no stored run in "
                     rf"{re.escape(str(stored))}/\S+ \(new here: test_rmsnorm\[", last), last
    assert "a run saved with --benchmark-autosave (ci/bench saves every run) is the baseline of the next" in last


def test_a_share_of_a_step_predicted_from_some_components_says_which(pytester, stored):
    live = session(pytester, stored.parent, "-k", "torch and w7168", "--benchmark-compare", "--gate", "5%")
    text = text_of(live)
    assert re.search(r"µs/step \([+-]\d+\.\d+% of step\)", text), text  # priced (before: a step of rmsnorm alone)
    lacking = ", ".join(sorted(set(group_components()) - {"rmsnorm"}))  # every step group the registry knows
    assert "% of step: a share of the step predicted from the kernel results at hand (rmsnorm in part), which lacks " \
           f"{lacking}" in text, text


# --- class 5: a session that starts while this one re-measures ------------------------------------------------

def test_a_session_that_starts_during_the_re_measure_rounds_is_seen_by_the_first(pytester, stored, tmp_path,
                                                                                 monkeypatch):
    (first,) = stored.glob("0001_*.json")
    document = json.loads(first.read_text())
    for number, scale in ((2, 1.001), (3, 0.999)):  # a history of three runs: a spread to judge by
        (stored / f"000{number}_run.json").write_text(json.dumps(_scaled(document, scale)))
    import decodebench.plugin as plugin

    other = Neighbours("cpu")
    rounds = []

    def round_starts(number, *args):  # a second session starts measuring after this one's first look
        rounds.append(number)
        other.enter()
        return describe(number, *args)

    describe = plugin.describe_round
    monkeypatch.setattr(plugin, "describe_round", round_starts)
    out = tmp_path / "first.json"
    try:
        live = session(pytester, stored.parent, "-k", "torch and w7168-m8", "--benchmark-compare", "--gate", "10%",
                       "--gate-resamples", "1", "--gate-remeasure", "session", "--inject-slowdown", "100%",
                       "--inject-only", "add-", "--benchmark-json", str(out))
    finally:
        other.leave()
    text = text_of(live)
    assert rounds == [1], text
    assert "SLOWER" not in [line.split()[0] for line in verdict_lines(text)], text  # before: SLOWER, unmarked
    (last,) = [line for line in live.outlines if line.startswith("gate ")]
    assert "measured beside another session on this device (pid " in last, last
    for bench in json.loads(out.read_text())["benchmarks"]:
        assert bench["extra_info"]["other_sessions"], bench["fullname"]


