"""The stored-file reader on generated input (hypothesis): files, entries, folders.

Whatever a stored file holds, reading it ends in a result, a record, or a refusal that names the
file and the problem, never another exception; each run is counted once; the numbering is the
writer's and the reader's alike past 9999. The examples are bounded and derandomized: the same
ones run on every machine. ``tests/test_entry_check.py`` runs generated folders through the gate."""

import json
import math
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from decodebench.baselines import FingerprintStorage, load_history, stored_number, stored_results
from decodebench.entry_check import LONGEST_S, SHORTEST_S, usable_entries
from decodebench.gate.reference import Baseline
from decodebench.results import Result, read_entry, read_result

SETTINGS = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])

TIMES = st.floats(min_value=1e-7, max_value=1e-2, allow_nan=False)
ANYTHING = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
                        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner,
                                                                                     max_size=4), max_leaves=12)


NAMES = st.sampled_from(["t.py::a", "t.py::b", "t.py::c"])


@st.composite
def entries(draw, names=NAMES):
    """A benchmark entry as a file may hold it: mostly sound, now and then anything at all in a field."""
    data = draw(st.one_of(st.lists(TIMES, min_size=0, max_size=8), st.none()))
    entry = {"fullname": draw(names), "stats": {"data": data} if data is not None else {},
             "extra_info": {"timer": "wall", "shape": {"tokens": draw(st.sampled_from([1, 8]))},
                            "resamples": draw(st.lists(st.lists(TIMES, max_size=5), max_size=2))}}
    if draw(st.integers(0, 4)) == 0:
        where = draw(st.sampled_from(["stats", "extra_info", "fullname", "data", "resamples", "timer", "ab",
                                      "other_sessions", "kernels"]))
        value = draw(ANYTHING)
        if where in ("stats", "extra_info", "fullname"):
            entry[where] = value
        elif where == "data":
            entry["stats"]["data"] = value
        else:
            entry["extra_info"][where] = value
    return entry


def _a_time(value) -> bool:
    return isinstance(value, float) and math.isfinite(value) and SHORTEST_S <= value <= LONGEST_S


@SETTINGS
@given(st.one_of(entries(), ANYTHING))
def test_an_entry_is_a_record_of_times_or_a_record_of_its_problem(document):
    record = read_entry(document)
    assert isinstance(record, Result)
    assert record.document is document
    if record.problem:
        assert isinstance(record.problem, str)
        assert record.problem
        assert record.runs == ()
        assert record.paired is None
        return
    assert all(run and all(_a_time(v) for v in run) for run in record.runs)
    assert len(record.kernels) == len(record.runs)
    assert record.timer is None or isinstance(record.timer, str)
    assert all(isinstance(s, str) for s in record.other_sessions)


@SETTINGS
@given(st.lists(st.one_of(entries(), ANYTHING), max_size=6))
def test_every_entry_of_a_file_is_used_once_or_named(benchmarks):
    usable, skipped = usable_entries(benchmarks, "0001_x.json")
    names = [b.get("fullname") for b in benchmarks if isinstance(b, dict)]
    for name, entry in usable.items():
        assert names.count(name) == 1  # a test id twice in one file is never used
        assert (entry.get("stats") or {}).get("data")  # no samples, no run
        assert read_entry(entry).problem is None
    assert all(line.startswith("0001_x.json: ") for line in skipped)
    assert len(usable) + len(skipped) <= len(benchmarks)
    for name in {n for n in names if isinstance(n, str) and n and names.count(n) > 1}:
        assert name not in usable
        assert any(f"case {name}: " in line for line in skipped)


@SETTINGS
@given(st.lists(st.lists(st.tuples(st.sampled_from(["t.py::a", "t.py::b"]), st.integers(0, 3)),
                         max_size=3, unique_by=lambda p: p[0]), min_size=1, max_size=5))
def test_a_run_is_counted_once_however_often_it_is_stored(files):
    """Files of entries whose samples come from four runs per case: each run enters the baseline once."""
    baseline = Baseline("folder")
    for index, content in enumerate(files, 1):
        benchmarks = [{"fullname": name, "stats": {"data": [1e-5 * (1 + run / 100 + (name == "t.py::b") / 10)] * 3}}
                      for name, run in content]
        baseline.add(f"{index:04d}", benchmarks, f"{index:04d}_x.json")
    for name in ("t.py::a", "t.py::b"):
        distinct = {run for content in files for n, run in content if n == name}
        assert len(baseline.entries.get(name, [])) == len(distinct)
        assert len({e.samples for _, e in baseline.entries.get(name, [])}) == len(distinct)
    stored = sum(len(content) for content in files)
    kept = sum(len(v) for v in baseline.entries.values())
    copies = [line for line in baseline.skipped if "a copy, not a run of its own" in line]
    assert kept + sum(1 if "case " in line else len(files[int(line[:4]) - 1]) for line in copies) == stored


@SETTINGS
@given(st.sets(st.integers(1, 10**6), min_size=1, max_size=6))
def test_the_numbering_of_the_reader_and_the_writer_agree(numbers):
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "fp"
        folder.mkdir()
        for number in numbers:
            (folder / f"{number:04d}_run.json").write_text(json.dumps({"benchmarks": []}))
        (folder / "12_short.json").write_text("{}")  # fewer than four digits: not a stored result
        assert [stored_number(p) for p in stored_results(folder)] == sorted(numbers)
        storage = FingerprintStorage(Path(tmp), logger=None, default_machine_id="fp")
        assert int(storage._next_num) == max(numbers) + 1
        assert [r.path for r in load_history(folder).results] == stored_results(folder)


@SETTINGS
@given(st.one_of(st.binary(max_size=200), ANYTHING.map(lambda v: json.dumps(v).encode()),
                 entries().map(lambda e: json.dumps({"benchmarks": [e]})[:-3].encode())))
def test_a_stored_file_is_a_result_or_a_refusal_naming_it(content):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "0001_x.json"
        path.write_bytes(content)
        refusal = None
        try:
            document = read_result(path)
        except ValueError as exc:
            refusal = str(exc)
        if refusal is None:
            assert isinstance(document.get("benchmarks"), list)
        else:
            assert str(path) in refusal
