"""The gate's evidence: the committed sessions and nights judged again, the simulations and tables the docs
quote regenerated from their raw files, and the scripts that made them."""

import collections
import gzip
import json
import math
import os
import re
import subprocess
import sys

import pytest

from decodebench.files import read_json
from decodebench.gate import CaseInput, Policy, Verdict, judge
from decodebench.gate.reference import SAME_RUN_WITHIN
from validation.tests.evidence import REPO, validation_script

ROOT = REPO
RAW = REPO / "validation/gate/h200"
H200 = REPO / "baselines" / "nvidia-h200-x1-single-cc90-drv580.159.04-cuda13.0-torch2.11.0-cu130"
NIGHTLY, AA = H200 / "0002_h200-vllm-nightly.json", H200 / "0003_h200-vllm-nightly-aa.json"


def _script():
    """validation/gate/short_history.py, the simulation that wrote the committed raw file."""
    return validation_script("validation/gate/short_history.py")


STEP_H100 = [f"validation/gate/h100-2026-12-06-step-{s}/night-{n}.json.gz" for s, nights in (("a", 6), ("b", 4))
             for n in range(1, nights + 1)]
"""The H100 step-timer sequences of ``validation/gate/nights.sh``: nights 1-5 and the injected night 6, then 1-4."""


STEP_H100_INJECTED = "validation/gate/h100-2026-12-06-step-a/night-6.json.gz"


def _sessions(which: str) -> tuple[list[tuple[str, dict]], list[tuple[str, dict]]]:
    """Every committed session of a GPU's nightly kernels: (unchanged build, ``--inject-slowdown 5%``)."""
    module = _script()
    if which == "h200":
        unchanged, injected = module.UNCHANGED, module.INJECTED
    else:
        unchanged, injected = [p for p in STEP_H100 if p != STEP_H100_INJECTED], [STEP_H100_INJECTED]
    return [(p, module.load(p).entries) for p in unchanged], [(p, module.load(p).entries) for p in injected]


@pytest.mark.parametrize("which", ["h200", "h100-step"])
@pytest.mark.parametrize("threshold", [0.03, 0.05])
def test_no_same_on_a_committed_session_has_an_interval_past_the_threshold(threshold, which):
    unchanged, injected = _sessions(which)
    limit = math.log1p(threshold)
    judged = same = 0
    for path, entries in (*unchanged, *injected):
        history = [(p, e) for p, e in unchanged if p != path]
        cases = [CaseInput(n, e, tuple((p, h[n]) for p, h in history if n in h)) for n, e in entries.items()
                 if any(n in h for _, h in history)]
        for v in judge(cases, Policy(threshold=threshold)):
            judged += 1
            if v.verdict is Verdict.SAME:
                same += 1
                assert -limit <= math.log(v.low), f"{path}: {v.name}: {v.reason}"
                assert math.log(v.high) <= limit, f"{path}: {v.name}: {v.reason}"
    sessions = len(unchanged) + len(injected)
    assert judged > 190 * sessions
    assert same > 0


@pytest.mark.parametrize(("folder", "least"), [("h100-2026-12-06-step-a", 300), ("h100-2026-12-06-step-b", 300),
                                               ("h100-2026-12-06-step-c", 100)])
def test_no_same_the_gate_said_on_the_gpu_nights_has_an_interval_past_its_threshold(folder, least):
    """The verdicts the live nights recorded (``extra_info.gate``), each at its night's ``--gate``."""
    said = 0
    for path in sorted((ROOT / "validation/gate" / folder).glob("night-*.json.gz")):
        gate = re.search(r"--gate (\d+)%", path.with_name(path.name.replace(".json.gz", ".log")).read_text())
        limit = math.log1p(int(gate.group(1)) / 100)
        for b in json.loads(gzip.decompress(path.read_bytes()))["benchmarks"]:
            verdict = b["extra_info"].get("gate") or {}
            if verdict.get("verdict") == "same":
                said += 1
                assert -limit <= math.log(verdict["low"]), b["name"]
                assert math.log(verdict["high"]) <= limit, b["name"]
    assert said > least  # the gated nights said SAME on most cases (c: night 2 only)


def test_the_committed_simulation_has_no_same_past_the_threshold_and_its_table_is_its_raw_file():
    module = _script()
    raw = read_json(RAW / "short-history.json.gz")
    assert not [r for r in raw["nights"] if r["same_beyond"]]
    table = (RAW / "short-history.md").read_text()
    assert table == f"$ {raw['command']}\n\n{module.tables(raw['nights'])}{module.LEVELS_HEAD}{raw['level_table']}"
    validation = (ROOT / "validation/reports/gate-first-nights.md").read_text()
    injected_rows = [line for line in module.tables(raw["nights"]).splitlines()
                     if line.startswith("| 3% |") and line.count("|") == 12]
    unchanged_rows = [line for line in module.tables(raw["nights"]).splitlines()
                      if line.startswith(("| 5% |", "| 3% |")) and line.count("|") == 13]
    shown = [*unchanged_rows, *injected_rows]
    assert len(shown) == 8 + 5
    for line in shown:
        assert line in validation, line


def test_the_h100_simulation_is_its_raw_file_and_a_history_longer_than_its_sessions_is_refused(capsys):
    module = _script()
    raw = read_json(ROOT / "validation/gate/h100/short-history.json.gz")
    assert "--unchanged" in raw["command"]
    assert not [r for r in raw["nights"] if r["injected"]]
    table = (ROOT / "validation/gate/h100/short-history.md").read_text()
    assert table == f"$ {raw['command']}\n\n{module.tables(raw['nights'])}{module.LEVELS_HEAD}{raw['level_table']}"
    two = ["validation/gate/h100-2026-12-06/night-1.json.gz", "validation/gate/h100-2026-12-06/night-2.json.gz"]
    with pytest.raises(SystemExit):
        module.main(["--unchanged", *two, "--injected", "--histories", "1,2"])
    assert "at most 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        module.main(["--unchanged", *two, "--injected", *two, "--histories", "1", "--power-histories", "1,3"])
    assert "--power-histories 1,3: more stored runs than the 2 --unchanged sessions" in capsys.readouterr().err


def test_the_h100_step_simulation_is_its_raw_file_and_its_rows_are_in_the_docs():
    """validation/gate/h100-step: the nights of nights.sh (step timer, one H100) judged offline; the table is
    what the script prints from the raw records, and its report shows its rows."""
    module = _script()
    raw = read_json(ROOT / "validation/gate/h100-step/short-history.json.gz")
    assert all(p in raw["command"] for p in STEP_H100)
    assert not [r for r in raw["nights"] if r["same_beyond"]]
    tables = module.tables(raw["nights"])
    table = (ROOT / "validation/gate/h100-step/short-history.md").read_text()
    assert table == f"$ {raw['command']}\n\n{tables}{module.LEVELS_HEAD}{raw['level_table']}"
    validation = (ROOT / "validation/reports/gate-first-nights-h100.md").read_text()
    shown = [line for line in tables.splitlines() if (line.startswith("| 5% |") and line.count("|") == 13)
             or (line.startswith("| 3% |") and line.count("|") == 12)]
    assert len(shown) == 4 + 5
    for line in shown:
        assert line in validation, line


def test_run_clusters_reads_the_committed_h200_sessions(tmp_path):
    # validation/reports/gate-model.md quotes this analysis: do a session's runs sit closer than runs of two sessions?
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
    assert ten["tight_cases"] >= 100
    assert ten["tight_slower"] >= 0.9 * ten["tight_cases"]
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

    sessions = [
        {
            "benchmarks": [
                bench("fused-e384-m1-vllm", "slower", True),
                bench("fused-e384-m8-vllm", "undecided", True),
                bench("down-e384-m1-vllm", "slower", False),
                {"fullname": "t::test_moe[down-x]", "extra_info": {}},
            ]
        },
        {"benchmarks": [bench("fused-e384-m1-vllm", "slower", True)]},
    ]
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
    """validation/gate/h200/power-misses.txt (validation/reports/gate-first-nights.md: the 96 trials lost against
    five stored sessions, each with its reason) is regenerated from the committed sessions."""
    module = validation_script("validation/gate/power_misses.py")
    assert module.main() == 0
    out = capsys.readouterr().out
    assert out == (REPO / "validation/gate/h200/power-misses.txt").read_text()
    assert out.startswith("96 of 1872 trials not SLOWER")
    assert "outside q_a: 43 misses, 39 of them" in out
    assert "\nSAME " not in out  # a miss is UNDECIDED, never SAME


def test_gate_power_cpu_smoke_writes_its_tables(tmp_path):
    out = tmp_path / "power"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, str(REPO / "validation" / "gate_power.py"), str(out), "--cpu-smoke", "--cases", "1",
                    "--trials", "2"], check=True, env=env, cwd=REPO, capture_output=True, timeout=300)
    report = json.loads((out / "power.json").read_text())
    (case,) = report["cases"]
    assert case["name"] == "rmsnorm-add-m8"
    assert case["median_us"] > 0
    assert sorted(t["size"] for t in case["trials"]) == [0.0, 0.0, 0.02, 0.02, 0.05, 0.05, 0.1, 0.1]
    assert set(case["injected"]) == {"0.02", "0.05", "0.1"}
    assert report["rates"]["0.05"]["0.05"]["n"] == 2
    assert set(report["rates"]) == {"0.01", "0.02", "0.03", "0.05"}
    markdown = (out / "power.md").read_text()
    assert "## gate threshold 5%" in markdown
    assert "| 0% | " in markdown
    assert "rmsnorm-add-m8" in markdown


def test_the_committed_near_copy_figures_are_what_the_script_prints_today():
    # docs/stored-results.md and SAME_RUN_WITHIN's comment quote them: the closest separate runs, 3.7e-4
    done = subprocess.run([sys.executable, str(REPO / "validation" / "gate" / "near_copies.py")], capture_output=True,
                          text=True, cwd=REPO, timeout=120)
    committed = (REPO / "validation" / "gate" / "near-copies.txt").read_text().splitlines()
    assert committed[0] == "# python validation/gate/near_copies.py > validation/gate/near-copies.txt"
    assert done.stdout.splitlines() == committed[1:]
    closest = float(committed[4].split()[0])
    assert closest == pytest.approx(3.665e-4)
    assert SAME_RUN_WITHIN < closest / 100


@pytest.mark.parametrize("night", [2, 3, 4, 5, 6])
def test_the_live_gate_and_the_offline_gate_give_the_same_verdicts_on_the_committed_nights(night, tmp_path):
    """A committed H100 night (``nights.sh``, step-a) against the nights stored before it: the live
    session's path (its first run judged, then re-measured round by round with the runs it stored,
    :func:`~decodebench.runner.settle.settle`) and ``python -m decodebench.gate`` on the stored files
    give every case the same verdict, ratio and interval."""
    from decodebench.gate.offline import judge_files

    module = _script()
    folder = ROOT / "validation/gate/h100-2026-12-06-step-a"
    gate = int(re.search(r"--gate (\d+)%", (folder / f"night-{night}.log").read_text()).group(1)) / 100
    policy = Policy(threshold=gate)
    history = [module.load(str((folder / f"night-{n}.json.gz").relative_to(ROOT))) for n in range(1, night)]
    tonight = module.load(str((folder / f"night-{night}.json.gz").relative_to(ROOT)))
    live = {v.name: v for v in module.night(history, tonight, policy)}
    storage = tmp_path / "storage"
    storage.mkdir()
    for n in range(1, night):
        (storage / f"{n:04d}_night-{n}.json").write_bytes(gzip.decompress((folder / f"night-{n}.json.gz").read_bytes()))
    current = tmp_path / f"night-{night}.json"
    current.write_bytes(gzip.decompress((folder / f"night-{night}.json.gz").read_bytes()))
    judgment, _, _ = judge_files(storage, current, policy, gate)
    offline = {v.name: v for v in judgment.verdicts}
    assert len(live) > 190
    assert live.keys() == offline.keys()
    for name, v in live.items():
        w = offline[name]
        assert (v.verdict, v.runs) == (w.verdict, w.runs), f"{name}: live {v.reason} / offline {w.reason}"
        assert (v.ratio, v.low, v.high) == pytest.approx((w.ratio, w.low, w.high)), name


DECISION = ROOT / "validation/gate/decision"


def test_the_decisions_before_and_after_tables_and_change_lists_are_their_raw_files():
    """validation/gate/decision/: the README's tables are what decision_tables.py makes of the committed
    simulations, each change list is what verdict_changes.py makes of the committed verdicts, and the
    simulations' tables are their raw records."""
    tables = validation_script("validation/gate/decision_tables.py")
    assert tables.tables() in (DECISION / "README.md").read_text()
    changes = validation_script("validation/gate/verdict_changes.py")
    pairs = {f"changes-{s}.md{gz}": (DECISION / f"before/{s}-verdicts.tsv.gz", DECISION / f"after/{s}-verdicts.tsv.gz")
             for s, gz in (("h200", ".gz"), ("h100-step-a", ".gz"), ("h100", ""))}
    pairs["changes-offline-power.md"] = (DECISION / "before/offline-power.json",
                                         ROOT / "validation/h200/gate/offline-power.json")
    pairs["changes-ab.md"] = (DECISION / "before/ab.txt", DECISION / "after/ab.txt")
    for name, (before, after) in pairs.items():
        names = [str(p.relative_to(ROOT)) for p in (before, after)]
        committed = gzip.decompress((DECISION / name).read_bytes()).decode() if name.endswith(".gz") else \
            (DECISION / name).read_text()
        assert changes.report(changes.read(before), changes.read(after), names) == committed, name
    module = _script()
    for folder in [DECISION / "after/h100-step-a", *(DECISION / "before" / s for s in ("h200", "h100-step-a", "h100"))]:
        raw = read_json(folder / "short-history.json.gz")
        table = f"$ {raw['command']}\n\n{module.tables(raw['nights'])}{module.LEVELS_HEAD}{raw['level_table']}"
        assert (folder / "short-history.md").read_text() == table, folder


AB_H100 = ROOT / "validation/gate/h100-ab-2026-12-07"
H100 = REPO / "baselines" / "nvidia-h100-80gb-hbm3-x1-single-cc90-drv580.159.04-cuda13.0-torch2.11.0-cu130"


def _verdict_lines(text: str) -> dict[str, str]:
    """Each verdict line's case and verdict, the rest of the line (its ``% of step``, the baseline's) left out."""
    verdict = r"^(SLOWER|FASTER|SAME|UNDECIDED|INCOMPARABLE) .*?  (\S+::\S+)  "
    return {m.group(2): m.group(1) for m in re.finditer(verdict, text, re.M)}


@pytest.mark.parametrize(("gate", "counts"), [(0.05, {"SAME": 69}), (0.03, {"SAME": 66, "UNDECIDED": 3})])
def test_the_held_out_h100_aa_session_judged_offline_is_what_the_decision_readme_reports(gate, counts, tmp_path):
    """The H100 A/A session (both sides one interpreter: every true change is zero), the held-out check of
    the A/B prior: ``python -m decodebench.gate`` on it gives the verdicts committed in
    ``validation/gate/decision/after/ab-h100-PCT.txt`` and counted in the decision README, no SLOWER or
    FASTER; at 5 % the live session's own verdicts (its log)."""
    from decodebench.gate.offline import judge_files

    current = tmp_path / "ab-h100.json"
    current.write_bytes(gzip.decompress((AB_H100 / "ab.json.gz").read_bytes()))
    judgment, _, _ = judge_files(H100, current, Policy(threshold=gate), gate)
    offline = {v.name: v.verdict.name for v in judgment.verdicts}
    assert dict(collections.Counter(offline.values())) == counts
    assert not judgment.conclusion.failed
    pct = round(gate * 100)
    assert offline == _verdict_lines((DECISION / f"after/ab-h100-{pct}.txt").read_text())
    if pct == 5:
        assert offline == _verdict_lines(gzip.decompress((AB_H100 / "ab.log.gz").read_bytes()).decode())


def test_a_verdict_that_changed_is_listed_with_both_reasons_and_a_trial_in_one_run_only_is_refused(tmp_path):
    changes = validation_script("validation/gate/verdict_changes.py")
    before = {("unchanged", "5%", "1", "n", "h", "c1"): ("undecided", "why then"),
              ("unchanged", "5%", "1", "n", "h", "c2"): ("same", "within")}
    after = {**before, ("unchanged", "5%", "1", "n", "h", "c1"): ("slower", "why now")}
    text = changes.report(before, after, ["a", "b"])
    assert "1 of 2 verdicts changed." in text
    assert "| undecided | slower | 1 |" in text
    assert "  - before: why then" in text
    assert "  - after: why now" in text
    with pytest.raises(SystemExit, match="in one file only"):
        changes.changes(before, {k: v for k, v in after.items() if k[-1] == "c1"})
