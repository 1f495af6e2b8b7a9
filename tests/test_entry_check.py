"""Stored numbers that cannot be times: refused by name, never a traceback, never a pass (issue 25).

The fault tests each failed on the behaviour before :mod:`decodebench.entry_check`; the
property test generates stored folders (damaged, mixed, foreign, huge) and runs them through
the offline gate, the live comparison's functions, the history and the prediction. Its
examples are bounded and derandomized (a fixed seed): the same ones run on every machine.
The same fault through a real pytest session is in ``test_gate_offline.py`` (it takes a minute).
"""

import contextlib
import copy
import io
import json
import math
import re
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from decodebench.attribution.predict.prediction import load_results
from decodebench.baselines import load_history
from decodebench.bridge import record_samples
from decodebench.entry_check import ImpossibleResult, check_recordable, entry_problem, usable_entries
from decodebench.gate import offline
from decodebench.gate.decision import Policy
from decodebench.gate.reference import baseline_from_history, why_nothing
from decodebench.gate.session import assess, conclude
from decodebench.gate.verdict import CaseInput
from decodebench.history import series_of
from decodebench.model import load_model_spec
from decodebench.results import read_entry
from decodebench.shapes import DecodeShapes

KEY = "cpu-test"
MACHINE = {"decodebench": {"fingerprint": {"key": KEY}, "model": "kimi-k2.5", "tp": 8}}
SHAPES = DecodeShapes.for_deployment(load_model_spec("kimi-k2.5"), 8)
VERDICT = re.compile(r"(SLOWER|FASTER|SAME|UNDECIDED|INCOMPARABLE) ")


def entry(case: str, level: float, runs: int = 1, n: int = 10, m: int = 1) -> dict:
    data = [[level * (1 + 0.002 * ((i * 7 + r) % 5)) for i in range(n)] for r in range(runs)]
    return {"name": f"test_x[{case}]", "fullname": f"t.py::test_x[{case}]",
            "stats": {"data": data[0], "median": data[0][n // 2], "min": min(data[0]), "max": max(data[0])},
            "extra_info": {"timer": "wall", "component": "rmsnorm", "backend": "torch",
                           "shape": {"role": "hidden", "fused_add": True, "tokens": m, "width": 7168},
                           "resamples": data[1:], "telemetry_after": {"loadavg_1m": 0.1, "cpus": 2}}}


def document(*entries, key=KEY) -> dict:
    return {"machine_info": {**MACHINE, "decodebench": {**MACHINE["decodebench"], "fingerprint": {"key": key}}},
            "benchmarks": list(entries)}


def write(path: Path, doc) -> Path:
    path.write_text(json.dumps(doc))
    return path


def run_gate(*args) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = offline.main([str(a) for a in args])
    return code, out.getvalue(), err.getvalue()


def verdict_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if VERDICT.match(line)]


@pytest.fixture
def folder(tmp_path):
    """A fingerprint folder of three stored results of cases a and b, and a CURRENT like them."""
    store = tmp_path / KEY
    store.mkdir()
    for i in range(1, 4):
        write(store / f"000{i}_run.json", document(entry("a", 1e-5 * (1 + 0.001 * i), 2),
                                                    entry("b", 2e-5 * (1 + 0.001 * i), 2, m=8)))
    return store


def current(tmp_path, *entries) -> Path:
    return write(tmp_path / "current.json", document(*(entries or (entry("a", 1e-5, 2), entry("b", 2e-5, 2, m=8)))))


# --- the faults of issue 25, each failing before ----------------------------------------------------


@pytest.mark.parametrize("samples", [[0.0] * 10, [-1e-5] * 10], ids=["zero", "negative"])
def test_a_stored_case_of_non_positive_samples_is_skipped_by_name_not_a_traceback(tmp_path, folder, samples):
    doc = json.loads((folder / "0003_run.json").read_text())
    doc["benchmarks"][0]["stats"]["data"] = samples
    write(folder / "0003_run.json", doc)
    code, out, _ = run_gate(folder, current(tmp_path), "--gate", "5%")
    assert code == 0, out
    assert f"skipped stored result: {folder / '0003_run.json'}: case t.py::test_x[a]: sample 1 is " in out
    assert len(verdict_lines(out)) == 2
    assert "runs 4 then 2" in out


def test_a_nan_sample_never_spreads_to_the_other_cases_and_never_passes(tmp_path, folder):
    doc = json.loads((folder / "0002_run.json").read_text())
    doc["benchmarks"][0]["stats"]["data"][2] = math.nan
    write(folder / "0002_run.json", doc)
    slower = current(tmp_path, entry("a", 1e-5, 2), entry("b", 3e-5, 2, m=8))  # b: 1.5x
    code, out, _ = run_gate(folder, slower, "--gate", "5%")
    assert f"{folder / '0002_run.json'}: case t.py::test_x[a]: sample 3 is NaN" in out
    assert len(verdict_lines(out)) == 2
    assert _finite_numbers("\n".join(verdict_lines(out)))
    assert code == 1
    assert "SLOWER" in out


def test_one_negative_sample_among_good_ones_is_not_counted_as_a_sample(tmp_path, folder):
    doc = json.loads((folder / "0001_run.json").read_text())
    doc["benchmarks"][1]["extra_info"]["resamples"][0][4] = -2e-5
    write(folder / "0001_run.json", doc)
    code, out, _ = run_gate(folder, current(tmp_path), "--gate", "5%")
    assert "case t.py::test_x[b]: re-measure 1: sample 5 is -2e-05, not above 0" in out
    assert code == 0


@pytest.mark.parametrize(("doc", "message"), [
    ({"benchmarks": [1, 2]}, "entry 1: is 1, not a benchmark record (and 1 more entries)"),
    (document({**entry("a", 1e-5), "stats": {"data": "1e-5 2e-5"}}), "samples are '1e-5 2e-5', not a list"),
    (document(entry("a", -1e-5)), "case t.py::test_x[a]: sample 1 is -1e-05, not above 0"),
    (document({**entry("a", 1e-5), "extra_info": "x"}), "extra_info is 'x', not an object"),
])
def test_a_current_result_that_cannot_be_judged_is_exit_2_naming_it(tmp_path, folder, doc, message):
    bad = write(tmp_path / "current.json", doc)
    code, out, err = run_gate(folder, bad, "--gate", "5%")
    assert code == 2, out + err
    (line,) = err.strip().splitlines()
    assert str(bad) in line
    assert message in line


def test_an_empty_baseline_folder_is_bad_input_unless_allowed(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = run_gate(empty, current(tmp_path), "--gate", "5%")
    assert code == 2
    assert f"{empty}: no stored result in {empty}" in err
    assert "--gate-allow-empty" in err
    code, out, _ = run_gate(empty, current(tmp_path), "--gate", "5%", "--gate-allow-empty")
    assert code == 0
    assert "gate passed (--gate-allow-empty): nothing was compared" in out


def test_a_copy_of_current_in_the_baseline_folder_is_not_a_run_of_its_own(tmp_path, folder):
    now = current(tmp_path)
    copy_path = folder / "0004_copy.json"
    copy_path.write_bytes(now.read_bytes())
    code, out, _ = run_gate(folder, now, "--gate", "5%")
    assert f"skipped stored result: {copy_path}: the same file as CURRENT {now}" in out
    assert "runs 6 then 2" in out  # the three stored results, two runs each; not 8


def test_a_result_without_its_model_says_so_without_a_raw_key_error(tmp_path, folder):
    doc = document(entry("a", 1e-5, 2))
    del doc["machine_info"]["decodebench"]["model"]
    _, out, _ = run_gate(folder, write(tmp_path / "current.json", doc))
    assert "does not record its model and TP (machine_info.decodebench.model and .tp)" in out
    assert "('model')" not in out


def test_a_session_without_runs_is_named_plainly(tmp_path, folder):
    code, out, _ = run_gate(folder, current(tmp_path, entry("a", 1e-5, 1, n=2)))
    assert "this session has no run with 3+ samples" in out
    assert "the this" not in out


@pytest.mark.parametrize("bad", [math.nan, math.inf, 0.0, -1e-6])
def test_a_measurement_that_is_no_time_is_never_recorded(bad):
    class Bench:  # what record_samples touches of pytest-benchmark's fixture
        fullname, extra_info, calls = "t.py::test_x[a]", {}, []

        def pedantic(self, *args, **kwargs):
            self.calls.append(args)

    bench = Bench()
    with pytest.raises(ImpossibleResult, match=r"t.py::test_x\[a\]: sample 2 is .*not recorded"):
        record_samples(bench, [1e-6, bad, 1e-6])
    with pytest.raises(ImpossibleResult, match="A/B side A round 1: sample 1"):
        record_samples(bench, [1e-6], {"ab": {"runs_a": [[bad]], "runs_b": [[1e-6]]}})
    assert bench.calls == []


def test_the_prediction_leaves_out_an_impossible_median_by_name(tmp_path):
    bad = entry("a", 1e-5)
    bad["stats"]["median"] = -1.0
    path = write(tmp_path / "k.json", document(bad, entry("b", 1e-5)))
    skipped = []
    results, _ = load_results(path, skipped)
    assert [r.name for r in results] == ["test_x[b]"]
    assert skipped == [f"{path}: case t.py::test_x[a]: stats.median is -1, not above 0"]


# --- the faults of issue 47: no samples, a copy, a name twice ----------------------------------------


@pytest.mark.parametrize("data", [[], None], ids=["empty", "absent"])
def test_a_stored_entry_without_samples_is_skipped_by_name(tmp_path, folder, data):
    # before: silent, and the offline gate exited 0 as if the result were whole
    doc = json.loads((folder / "0003_run.json").read_text())
    doc["benchmarks"][0]["stats"]["data"] = data
    if data is None:
        del doc["benchmarks"][0]["stats"]["data"]
    write(folder / "0003_run.json", doc)
    code, out, _ = run_gate(folder, current(tmp_path), "--gate", "5%")
    assert f"skipped stored result: {folder / '0003_run.json'}: case t.py::test_x[a]: no samples" in out
    assert "runs 4 then 2" in out
    assert code == 0


def test_a_current_result_without_samples_is_refused_not_passed(tmp_path, folder):
    # before: "gate passed" with every case undecided, exit 0
    empty = [{**entry(c, 1e-5), "stats": {"data": []}} for c in "ab"]
    for bench in empty:
        bench["extra_info"]["resamples"] = [[]]
    bad = write(tmp_path / "current.json", document(*empty))
    code, out, err = run_gate(folder, bad, "--gate", "5%")
    assert code == 2, out + err
    assert "gate passed" not in out, out + err
    assert f"{bad}: case t.py::test_x[a]: no samples" in err


def test_a_re_measure_that_timed_nothing_is_never_recorded():
    with pytest.raises(ImpossibleResult, match=r"t.py::test_x\[a\], re-measured: no samples"):
        check_recordable("t.py::test_x[a], re-measured", [])


def _verdicts_without_skips(out: str) -> list[str]:
    return verdict_lines(out) + out.splitlines()[-1:]


def test_a_copy_of_an_older_stored_result_is_not_a_second_run(tmp_path, folder):
    # before: the copy counted as a run of its own, and the same data went from UNDECIDED to SLOWER
    now = current(tmp_path, entry("a", 1.04e-5, 2), entry("b", 2e-5, 2, m=8))
    _, before, _ = run_gate(folder, now, "--gate", "5%")
    copied = folder / "0004_copy.json"
    copied.write_bytes((folder / "0001_run.json").read_bytes())
    code, out, _ = run_gate(folder, now, "--gate", "5%")
    assert _verdicts_without_skips(out) == _verdicts_without_skips(before)
    assert f"skipped stored result: {copied}: the same samples as {folder / '0001_run.json'}: a copy" in out
    assert "runs 6 then 2" in out


def test_a_copy_of_a_result_older_than_the_history_window_takes_no_place_in_it(tmp_path, folder):
    copied = folder / "0004_copy.json"
    copied.write_bytes((folder / "0001_run.json").read_bytes())  # 0001 lies outside --gate-history 2
    code, out, _ = run_gate(folder, current(tmp_path), "--gate", "5%", "--gate-history", "2")
    assert f"skipped stored result: {copied}: the same samples as {folder / '0001_run.json'}: a copy" in out
    assert "runs 4 then 2" in out  # 0002 and 0003, two runs each


def test_a_stored_entry_copied_into_another_file_is_named_and_counted_once(tmp_path, folder):
    doc = json.loads((folder / "0003_run.json").read_text())
    doc["benchmarks"][0] = json.loads((folder / "0001_run.json").read_text())["benchmarks"][0]
    write(folder / "0003_run.json", doc)
    _, out, _ = run_gate(folder, current(tmp_path), "--gate", "5%")
    assert (f"skipped stored result: {folder / '0003_run.json'}: case t.py::test_x[a]: the same samples as in "
            f"{folder / '0001_run.json'}: a copy") in out
    assert "runs 4 then 2" in out  # case a: 0001 and 0002; case b: all three


def test_current_stored_again_with_other_bytes_is_not_its_own_baseline(tmp_path, folder):
    now = current(tmp_path)
    again = json.loads(now.read_text())
    again["datetime"] = "later"  # not byte-identical: the same samples all the same
    write(folder / "0004_again.json", again)
    _, out, _ = run_gate(folder, now, "--gate", "5%")
    assert f"{folder / '0004_again.json'}: case t.py::test_x[a]: the same samples as CURRENT {now}" in out
    assert "runs 6 then 2" in out


def test_a_test_id_twice_in_one_file_is_refused_in_the_baseline_and_in_current(tmp_path, folder):
    # before: the last one won, silently, and the spread widened until every case was undecided
    doc = json.loads((folder / "0002_run.json").read_text())
    doc["benchmarks"].append({**doc["benchmarks"][0], "stats": {"data": [3e-5] * 10}})
    write(folder / "0002_run.json", doc)
    code, out, _ = run_gate(folder, current(tmp_path), "--gate", "5%")
    assert (f"skipped stored result: {folder / '0002_run.json'}: case t.py::test_x[a]: named by entries 1 and 3 "
            "of one file") in out
    assert "runs 4 then 2" in out
    twice = write(tmp_path / "twice.json", document(entry("a", 1e-5, 2), entry("b", 2e-5, 2, m=8),
                                                    entry("a", 1.1e-5, 2)))
    code, out, err = run_gate(folder, twice, "--gate", "5%")
    assert code == 2
    assert f"{twice}: case t.py::test_x[a]: named by entries 1 and 3 of one file" in err


# --- generated stored results ------------------------------------------------------------------------

NAN, INF = math.nan, math.inf
NOT_TIMES = [NAN, INF, -INF, 0.0, 0, -1e-6, 1e300, 5e-324, "1e-6", None, True, [], 10**400]
# where an entry can be damaged, and values that are certainly wrong there
DAMAGE = {
    "sample": NOT_TIMES,
    "resample": NOT_TIMES,
    "data": ["x", 3, {"a": 1}, True, [], None],
    "resamples": ["x", 3, [1e-6], {"a": [1e-6]}],
    "median": [NAN, -1.0, "x", 0, 1e9],
    "stats": ["fast", None, [1, 2], 0],
    "extra_info": ["x", 3, [1]],
    "shape": ["x", [1]],
    "tokens": [0, -1, "8", 1.5, True, NAN, 10**400],
    "timer": [3, [], {}],
    "kernels": ["x", [1], {"k": "x"}, {"k": {"calls": "x"}}, {"k": {"calls": 10**400}}],
    "telemetry": ["busy", {"loadavg_1m": "x", "cpus": 2}, {"loadavg_1m": 1.0, "cpus": 0}, {"loadavg_1m": NAN}],
    "entry": [1, "x", None, []],
    "fullname": [None, 3, ""],
}
FILE_DAMAGE = ["truncated", "not a result", "foreign", "unknown machine"]


def _damage(bench: dict, where: str, value) -> dict:
    bench = copy.deepcopy(bench)
    info = bench["extra_info"]
    if where == "entry":
        return value
    if where == "sample":
        bench["stats"]["data"][len(bench["stats"]["data"]) // 2] = value
    elif where == "resample":
        info["resamples"] = info["resamples"] or [list(bench["stats"]["data"])]
        info["resamples"][0][0] = value
    elif where in ("data", "median"):
        bench["stats"][where] = value
    elif where in ("stats", "extra_info", "fullname"):
        bench[where] = value
    elif where == "tokens":
        info["shape"]["tokens"] = value
    elif where == "telemetry":
        info["telemetry_after"] = value
    else:
        info[where] = value
    return bench


@st.composite
def stored_results(draw):
    """A folder's stored results (each: entries, or a file-level damage) and a CURRENT; what is damaged."""
    cases = draw(st.lists(st.sampled_from("abcd"), min_size=1, max_size=4, unique=True))
    level = {c: draw(st.sampled_from([1e-6, 1e-5, 3e-4])) for c in cases}
    huge = draw(st.sampled_from(cases + [None] * 3))  # one case with many samples now and then

    def make(case, scale):
        return entry(case, level[case] * scale, draw(st.integers(1, 3)), 2000 if case == huge else
                     draw(st.integers(2, 12)), m={"a": 1, "b": 8, "c": 64, "d": 1}[case])

    files, damaged = [], set()
    for index in range(draw(st.integers(0, 4))):
        if draw(st.integers(0, 5)) == 0:
            files.append(draw(st.sampled_from(FILE_DAMAGE)))
            continue
        benches = []
        for case in draw(st.lists(st.sampled_from(cases), unique=True)):
            bench, hurt = make(case, draw(st.sampled_from([0.98, 1.0, 1.02]))), False
            if draw(st.integers(0, 3)) == 0:
                where = draw(st.sampled_from(sorted(DAMAGE)))
                bench, hurt = _damage(bench, where, draw(st.sampled_from(DAMAGE[where]))), True
                damaged.add(index)
            benches.append((bench, hurt))
        files.append(benches)
    now = [make(c, draw(st.sampled_from([1.0, 1.5]))) for c in cases]
    bad_now = None
    if draw(st.integers(0, 4)) == 0:
        where = draw(st.sampled_from(sorted(DAMAGE)))
        bad_now = draw(st.integers(0, len(now) - 1))
        now[bad_now] = _damage(now[bad_now], where, draw(st.sampled_from(DAMAGE[where])))
    return files, damaged, now, bad_now


UNREADABLE = ("truncated", "not a result")  # the file-level damages that are no result at all


def _write_folder(folder: Path, files, damaged, clean: bool) -> None:
    folder.mkdir()
    for index, content in enumerate(files):
        path = folder / f"{index + 1:04d}_run.json"
        if isinstance(content, str):  # a damaged or foreign file: the clean folder has none
            if not clean:
                path.write_text({"truncated": json.dumps(document(entry("a", 1e-5)))[:50],
                                 "not a result": json.dumps({"benchmarks": 3}),
                                 "foreign": json.dumps(document(entry("a", 1e-9), key="gpu-other")),
                                 "unknown machine": json.dumps({"benchmarks": [entry("a", 1e-9)]})}[content])
            continue
        write(path, document(*(bench for bench, hurt in content if not (clean and hurt))))


def _live_lines(folder: Path, now: list[dict]) -> list[str]:
    """What the pytest plugin's gate prints for these results: its functions, in its order."""
    baseline = baseline_from_history(load_history(folder, KEY), Policy().history)
    baseline.drop_copies_of({b["fullname"]: read_entry(b) for b in now}, "this session")
    cases = [] if baseline.problem else [CaseInput(b["fullname"], b, tuple(baseline.entries[b["fullname"]]))
                                         for b in now if baseline.entries.get(b["fullname"])]
    judgment = assess(cases, Policy(), shapes=SHAPES, prediction_entries=baseline.records())
    judgment.conclusion = conclude(judgment.verdicts, judgment.steps, Policy(), gate=0.05, allow_empty=False,
                                   nothing_why=why_nothing(baseline, len(now), [v.name for v in judgment.verdicts],
                                                           [v.reason for v in judgment.verdicts]))
    return judgment.lines(Policy())


def _finite_numbers(text: str) -> bool:
    return not re.search(r"\bnan\b|\binf\b", text, re.IGNORECASE)


@settings(max_examples=100, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(stored_results())
def test_generated_results_get_a_verdict_or_a_named_refusal_never_a_traceback(scenario):
    files, damaged, now, bad_now = scenario
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        # (a stored file byte-identical to CURRENT is its copy, which only the offline gate can tell)
        current_path = write(tmp / "current.json", {**document(*now), "datetime": "now"})
        _write_folder(tmp / "damaged", files, damaged, clean=False)
        _write_folder(tmp / "clean", files, damaged, clean=True)
        code, out, err = run_gate(tmp / "damaged", current_path, "--gate", "5%")
        if bad_now is not None:  # CURRENT holds an entry that cannot be judged
            assert code == 2, (out, err)
            assert str(current_path) in err, (out, err)
            assert len(err.strip().splitlines()) == 1, (out, err)
            return
        unreadable = [i for i, content in enumerate(files) if content in UNREADABLE]
        if unreadable:  # a stored file that cannot be read is refused, naming it, whatever else the folder holds
            first = tmp / "damaged" / f"{unreadable[0] + 1:04d}_run.json"
            assert code == 2, (out, err)
            assert str(first) in err, (out, err)
            assert len(err.strip().splitlines()) == 1, (out, err)
            return
        clean_code, clean_out, _ = run_gate(tmp / "clean", current_path, "--gate", "5%")
        # every impossible number skipped: the verdicts are those of the folder without them
        assert (code, verdict_lines(out)) == (clean_code, verdict_lines(clean_out)), (out, clean_out)
        assert code in (0, 1, 2)
        assert _finite_numbers("\n".join([*verdict_lines(out), out.splitlines()[-1:][0]
                                                                if out else ""]))
        for index in damaged:  # each named, file and case
            assert f"skipped stored result: {tmp / 'damaged' / f'{index + 1:04d}_run.json'}: " in out or code == 2
        if code != 2:
            assert verdict_lines("\n".join(_live_lines(tmp / "damaged", now))) == verdict_lines(out)
        assert series_of(load_history(tmp / "damaged", KEY)) == series_of(load_history(tmp / "clean", KEY))
        for path in sorted((tmp / "damaged").glob("*.json")):
            with contextlib.suppress(ValueError):  # a file that is no result at all: refused as before
                skipped: list[str] = []
                results, _ = load_results(path, skipped)
                assert all(0 < r.median_s < math.inf for r in results)


def test_every_damage_the_generator_makes_is_a_refusal():
    """The property test counts on it: each damage of :data:`DAMAGE` makes an entry unusable."""
    for where, values in DAMAGE.items():
        for value in values:
            assert usable_entries([_damage(entry("a", 1e-5, 2), where, value)], "f")[1], (where, value)
    assert entry_problem(entry("a", 1e-5, 2)) is None

