"""``python -m decodebench.gate`` on stored files: the committed H200 results, bad input, and
the same lines as the live session."""

import copy
import json
import re
import subprocess
import sys

import pytest

from tests.conftest import IN_PROCESS, IN_PROCESS_WARNINGS, REPO

pytestmark = IN_PROCESS_WARNINGS

H200 = REPO / "baselines" / "nvidia-h200-x1-single-cc90-drv580.159.04-cuda13.0-torch2.11.0-cu130"
NIGHTLY, AA = H200 / "0002_h200-vllm-nightly.json", H200 / "0003_h200-vllm-nightly-aa.json"
MOE = "benchmarks/test_moe.py::test_moe[fused-e384-top8-g32-n512k7168-n7168k256-uniform-m64-vllm]"


def gate(*args):
    return subprocess.run([sys.executable, "-m", "decodebench.gate", *map(str, args)], capture_output=True,
                          text=True, cwd=REPO, timeout=120)


def verdict_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if re.match(r"(SLOWER|FASTER|SAME|UNDECIDED|INCOMPARABLE) ", line)]


@pytest.mark.parametrize(("baseline", "current"), [(NIGHTLY, AA), (AA, NIGHTLY)])
def test_the_two_committed_h200_sessions_pass_against_each_other(baseline, current):
    done = gate(baseline, current, "--gate", "5%")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = verdict_lines(done.stdout)
    assert len(lines) == 180
    assert not [line for line in lines if line.startswith("SLOWER")]
    one_a_side = [line for line in lines if "runs 1 then 1" in line]
    assert one_a_side
    assert all(line.startswith(("UNDECIDED", "SAME")) for line in one_a_side)
    assert "one run a side" in next(line for line in one_a_side if line.startswith("UNDECIDED"))
    assert done.stdout.splitlines()[-1].startswith("gate passed: 0 of 180 cases significantly slower by more than 5.0%")


def test_a_ten_percent_slower_moe_case_fails_against_the_whole_folder_and_only_it(tmp_path):
    document = json.loads(AA.read_text())
    scaled = copy.deepcopy(document)
    for bench in scaled["benchmarks"]:
        if bench["fullname"] == MOE:
            bench["stats"]["data"] = [v * 1.10 for v in bench["stats"]["data"]]
            bench["extra_info"]["resamples"] = [[v * 1.10 for v in r] for r in bench["extra_info"].get("resamples", [])]
    current = tmp_path / "0005_scaled.json"
    current.write_text(json.dumps(scaled))
    done = gate(H200, current, "--gate", "5%")
    assert done.returncode == 1, done.stdout + done.stderr
    slower = [line for line in verdict_lines(done.stdout) if line.startswith("SLOWER")]
    assert len(slower) == 1
    assert MOE in slower[0]
    assert "µs/step" in slower[0]
    assert "% of step" in slower[0]
    assert done.stdout.splitlines()[-1].startswith("gate FAILED: 1 of 180 cases")


@pytest.mark.parametrize(("make", "message"), [
    (lambda p: p.write_text("{not json"), "is not valid JSON"),
    (lambda p: p.write_text(json.dumps({"benchmarks": 3})), "is not a pytest-benchmark result"),
    (lambda p: None, "o such file"),
])
def test_bad_input_is_one_line_naming_the_file_and_exit_2(tmp_path, make, message):
    bad = tmp_path / "0009_bad.json"
    make(bad)
    for args in ((H200, bad), (bad, AA)):
        done = gate(*args)
        assert done.returncode == 2, done.stdout + done.stderr
        (line,) = done.stderr.strip().splitlines()
        assert str(bad) in line
        assert message in line


def test_a_baseline_from_other_hardware_compares_nothing_and_fails_the_gate(tmp_path):
    document = json.loads(NIGHTLY.read_text())
    document["machine_info"]["decodebench"]["fingerprint"]["key"] = "nvidia-rtx-pro-6000-blackwell-x8-pcie"
    foreign = tmp_path / "foreign.json"
    foreign.write_text(json.dumps(document))
    done = gate(foreign, AA, "--gate", "5%")
    assert done.returncode == 1
    assert "nothing was compared (baseline measured on nvidia-rtx-pro-6000-blackwell-x8-pcie" in done.stdout


@pytest.mark.parametrize("machine_info", [None, "x", {"decodebench": {"fingerprint": None}}])
def test_a_current_run_without_a_fingerprint_is_refused_not_judged_against_any_machine(tmp_path, machine_info):
    document = json.loads(AA.read_text())
    document["machine_info"] = machine_info
    current = tmp_path / "anonymous.json"
    current.write_text(json.dumps(document))
    for baseline in (H200, NIGHTLY):
        done = gate(baseline, current, "--gate", "5%")
        assert done.returncode == 2, done.stdout + done.stderr
        assert f"{current}: records no machine fingerprint" in done.stderr
        assert not verdict_lines(done.stdout)


def test_a_baseline_of_unusable_entries_says_so_rather_than_that_the_cases_are_missing(tmp_path):
    document = json.loads(NIGHTLY.read_text())
    for bench in document["benchmarks"]:
        bench["stats"]["median"] = 0
    zeros = tmp_path / "zeros.json"
    zeros.write_text(json.dumps(document))
    done = gate(zeros, AA, "--gate", "5%")
    assert done.returncode == 1
    assert f"none of this session's 180 benchmarks has a usable entry in {zeros} (what was skipped" in done.stdout
    assert f"{zeros}: case {MOE}: stats.median is 0, not above 0" in done.stdout


RMSNORM = str(REPO / "benchmarks" / "test_rmsnorm.py")


def test_the_offline_gate_prints_the_live_sessions_verdict_lines(pytester, tmp_path):
    store, out = tmp_path / "store", tmp_path / "now.json"
    common = (RMSNORM, *IN_PROCESS, f"--benchmark-storage=file://{store}", "--budget-ms", "30",
              "-p", "no:cacheprovider", "-k", "torch and w7168")
    pytester.runpytest_inprocess(*common, "--benchmark-autosave").assert_outcomes(passed=4)
    live = pytester.runpytest_inprocess(*common, "--benchmark-compare", "--gate", "10%", "--benchmark-json", str(out),
                                        "--gate-max-load", "1000")
    (folder,) = store.iterdir()
    offline = gate(folder, out, "--gate", "10%", "--gate-max-load", "1000")
    assert verdict_lines(offline.stdout) == verdict_lines("\n".join(live.outlines))
    assert len(verdict_lines(offline.stdout)) == 4
    assert offline.stdout.splitlines()[-1] == next(line for line in live.outlines if line.startswith("gate "))
    assert offline.returncode == live.ret


def test_the_live_gate_skips_a_stored_case_of_zero_samples_and_concludes(pytester, tmp_path):
    # before: every case measured, then a 77-line ValueError (math domain error) and no gate line
    common = (RMSNORM, *IN_PROCESS, f"--benchmark-storage=file://{tmp_path}",
              "--budget-ms", "30", "-p", "no:cacheprovider", "-k", "torch and w7168-m8")
    pytester.runpytest_inprocess(*common, "--benchmark-autosave").assert_outcomes(passed=2)
    (stored,) = tmp_path.glob("*/0001_*.json")
    doc = json.loads(stored.read_text())
    doc["benchmarks"][0]["stats"]["data"] = [0.0] * len(doc["benchmarks"][0]["stats"]["data"])
    stored.write_text(json.dumps(doc))
    live = pytester.runpytest_inprocess(*common, "--benchmark-compare", "--gate", "5%", "--gate-max-load", "1000")
    text = "\n".join(live.outlines + live.errlines)
    assert "Traceback" not in text
    assert "math domain error" not in text
    assert f"skipped stored result: {stored}: case {doc['benchmarks'][0]['fullname']}: sample 1 is 0, not above 0" \
        in text
    (line,) = [line for line in live.outlines if line.startswith("gate ")]
    assert "of 1 cases" in line  # the other case is judged; the skipped one has no baseline
    assert live.ret in (0, 1)


def test_the_offline_gate_and_the_plugin_declare_the_same_gate_options():
    # one declaration (gate/settings.py): names, defaults and parsers alike, so --gate-history 0 is refused in both
    import argparse

    from decodebench.gate.offline import main, parser
    from decodebench.gate.settings import add_gate_options

    shared = argparse.ArgumentParser()
    add_gate_options(shared.add_argument)
    offline = {a.dest: (a.default, a.type) for a in parser()._actions}
    for action in shared._actions[1:]:  # [0] is --help
        assert offline[action.dest] == (action.default, action.type), action.dest
    with pytest.raises(SystemExit):
        main(["a.json", "b.json", "--gate-history", "0"])


