"""``python -m decodebench.gate`` on stored files: the committed H200 results, bad input, and
the same lines as the live session."""

import copy
import json
import re
import subprocess
import sys

import pytest

from tests.conftest import IN_PROCESS, IN_PROCESS_WARNINGS, REPO, validation_script

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
    assert one_a_side and all(line.startswith(("UNDECIDED", "SAME")) for line in one_a_side)
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
    assert len(slower) == 1 and MOE in slower[0]
    assert "µs/step" in slower[0] and "% of step" in slower[0]  # priced: calls per step x change per call
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
        assert str(bad) in line and message in line


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
        assert f"{current}: records no machine fingerprint" in done.stderr and not verdict_lines(done.stdout)


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


def test_run_clusters_reads_the_committed_h200_sessions(tmp_path):
    # docs/validation.md quotes this analysis: do a session's runs sit closer than runs of two sessions?
    script = [sys.executable, str(REPO / "validation" / "run_clusters.py")]
    gated = H200 / "0005_h200-vllm-nightly-gated.json"
    done = subprocess.run([*script, str(NIGHTLY), str(AA), str(gated), "--skip", "q_a"], capture_output=True,
                          text=True, cwd=REPO, timeout=120, env={"PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "116 cases over 3 sessions"
    ratio = float(re.search(r"ratio (\d+\.\d+)$", lines[2]).group(1))
    assert 0.5 < ratio < 2  # the stored sessions are no further apart than the runs within them
    assert re.match(r"per case, F test of a session effect: p < 0.05 in \d+\.\d% of 115 cases", lines[3])
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    bad = subprocess.run([*script, str(NIGHTLY), str(broken)], capture_output=True, text=True, cwd=REPO, timeout=120,
                         env={"PYTHONPATH": str(REPO)})
    assert bad.returncode == 2
    assert f"{broken}: not a pytest-benchmark result file" in bad.stderr


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
    assert "Traceback" not in text and "math domain error" not in text
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


@pytest.fixture(scope="module")
def power_rows(tmp_path_factory):
    """``validation/gate_offline_power.py`` run now: its rows by (scale, gate), and the folder it wrote."""
    out = tmp_path_factory.mktemp("power")
    sys.path.insert(0, str(REPO / "validation"))
    try:
        import gate_offline_power as power
    finally:
        sys.path.pop(0)
    assert power.main(["--out", str(out)]) == 0
    return {(r["scale"], r["gate"]): r for r in json.loads((out / "offline-power.json").read_text())}, out


def test_the_committed_power_table_is_what_the_committed_files_give_today(power_rows):
    # an unchanged nightly, judged against the other sessions only, is never SLOWER at 3 % or 5 %;
    # scaled by 1.10, at least 90 % of the cases whose run spread is at most 1 % are SLOWER at 5 %
    rows, out = power_rows
    assert rows[(1.0, 0.03)]["counts"].get("slower", 0) == 0
    assert rows[(1.0, 0.05)]["counts"].get("slower", 0) == 0
    ten = rows[(1.10, 0.05)]
    assert ten["tight_cases"] >= 100 and ten["tight_slower"] >= 0.9 * ten["tight_cases"]
    committed = REPO / "validation" / "h200" / "gate" / "offline-power.md"
    assert (out / "offline-power.md").read_text() == committed.read_text()


def _stored_power():
    """``validation/gpu/stored_power.py``, a script beside the GPU parts, as a module."""
    sys.path.insert(0, str(REPO / "validation" / "gpu"))
    try:
        import stored_power
    finally:
        sys.path.pop(0)
    return stored_power


def test_the_stored_power_tally_counts_caught_false_alarms_and_undecided_per_family():
    stored_power = _stored_power()

    def bench(name, verdict, injected):
        info = {"gate": {"verdict": verdict, "spread": 0.005}}
        if injected:
            info["injected_slowdown"] = {"fraction": 0.05}
        return {"fullname": f"benchmarks/test_moe.py::test_moe[{name}]", "extra_info": info}

    sessions = [{"benchmarks": [bench("fused-e384-m1-vllm", "slower", True), bench("fused-e384-m8-vllm", "undecided", True),
                                bench("down-e384-m1-vllm", "slower", False), {"fullname": "t::test_moe[down-x]",
                                                                             "extra_info": {}}]},
                {"benchmarks": [bench("fused-e384-m1-vllm", "slower", True)]}]
    rows = stored_power.tally(sessions)
    fused, down = rows["test_moe fused"], rows["test_moe down"]
    assert (fused["trials"], fused["injected"], fused["caught"], fused["undecided"]) == (3, 3, 2, 1)
    assert (down["trials"], down["false_alarms"], down["unjudged"]) == (1, 1, 1)
    assert "| `test_moe fused` | 3 | 3 | 2 (67%) | 0 | 1 | 0.50% |" in stored_power.table(rows)


def test_the_stored_power_tally_leaves_out_a_session_that_did_not_finish_and_names_it(tmp_path, capsys):
    stored_power = _stored_power()
    cut = tmp_path / "stored-power-1.json"
    cut.write_text("")  # a session killed by its time limit
    whole = tmp_path / "stored-power-2.json"
    whole.write_text(json.dumps({"benchmarks": [{"fullname": "t::test_moe[fused-m1]", "extra_info": {
        "gate": {"verdict": "slower", "spread": 0.005}, "injected_slowdown": {"fraction": 0.05}}}]}))
    assert stored_power.main([str(cut), str(whole)]) == 0
    out, err = capsys.readouterr()
    assert f"{cut} left out, it is no session result" in err
    assert out.startswith(f"1 sessions: {whole}")
    assert stored_power.main([str(cut)]) == 1


def test_the_power_misses_file_is_what_its_script_prints(capsys):
    """validation/gate/h200/power-misses.txt (docs/validation.md: the 97 trials lost against five stored
    sessions, each with its reason) is regenerated from the committed sessions."""
    module = validation_script("validation/gate/power_misses.py")
    assert module.main() == 0
    out = capsys.readouterr().out
    assert out == (REPO / "validation/gate/h200/power-misses.txt").read_text()
    assert out.startswith("97 of 1872 trials not SLOWER") and "outside q_a: 44 misses, 40 of them" in out
    assert "\nSAME " not in out  # a miss is UNDECIDED, never SAME
