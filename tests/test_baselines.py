import fcntl
import json
import os
import subprocess
import sys
import time
import types

import pytest

from decodebench.baselines import (
    FingerprintStorage,
    check_writable,
    load_history,
    remove_stale_temporaries,
    stored_fingerprint,
    write_json_atomically,
)
from tests.conftest import REPO


def test_atomic_write_replaces_the_whole_file(tmp_path):
    path = tmp_path / "fp" / "0001_x.json"
    write_json_atomically(path, {"a": 1})
    write_json_atomically(path, {"a": 2})
    assert json.loads(path.read_text()) == {"a": 2}
    assert [p.name for p in path.parent.iterdir()] == ["0001_x.json"]


def test_a_failed_write_leaves_the_old_file_and_no_debris(tmp_path, monkeypatch):
    path = tmp_path / "0001_x.json"
    write_json_atomically(path, {"a": 1})

    def disk_full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("decodebench.baselines.os.fsync", disk_full)
    with pytest.raises(OSError, match="No space left"):
        write_json_atomically(path, {"a": 2})
    assert json.loads(path.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["0001_x.json"]


def test_stored_fingerprint_reads_the_key():
    document = {"machine_info": {"decodebench": {"fingerprint": {"key": "cpu-x-2c-torch2.13.0-cpu"}}}}
    assert stored_fingerprint(document) == "cpu-x-2c-torch2.13.0-cpu"
    assert stored_fingerprint({"machine_info": {"node": "host"}}) is None


def test_written_files_get_the_mode_the_umask_allows(tmp_path):
    import os

    old = os.umask(0o027)
    try:
        path = tmp_path / "0001_x.json"
        write_json_atomically(path, {"a": 1})
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o640


def _stored(path, key="cpu-x"):
    document = {"machine_info": {"decodebench": {"fingerprint": {"key": key}}}, "benchmarks": []}
    write_json_atomically(path, document)


def test_history_skips_foreign_files_and_refuses_a_damaged_one_naming_each(tmp_path):
    _stored(tmp_path / "0001_a.json")
    _stored(tmp_path / "0002_b.json", key="gpu-y")
    (tmp_path / "notes.json").write_text("{}")  # not a stored result: not looked at
    history = load_history(tmp_path, "cpu-x")
    assert [r.path.name for r in history.results] == ["0001_a.json"]
    assert history.skipped == (f"{tmp_path / '0002_b.json'} was measured on gpu-y, not cpu-x",)
    assert history.results[-1].path.name == "0001_a.json"
    (tmp_path / "0003_c.json").write_text('{"benchmarks": [')
    with pytest.raises(ValueError, match=r"0003_c\.json is not valid JSON \(truncated or damaged\?\)"):
        load_history(tmp_path, "cpu-x")


def test_empty_history_says_why(tmp_path):
    assert load_history(tmp_path, "cpu-x").why_empty() == f"no stored result in {tmp_path} (first run on this machine?)"
    _stored(tmp_path / "0001_a.json", key="gpu-y")
    assert load_history(tmp_path, "cpu-x").why_empty() == (
        f"no usable stored result: {tmp_path / '0001_a.json'} was measured on gpu-y, not cpu-x")
    (tmp_path / "0002_a.json").write_text("[]")
    with pytest.raises(ValueError, match=r"0002_a\.json is not a pytest-benchmark result \(no 'benchmarks' list\)"):
        load_history(tmp_path, "cpu-x")


@pytest.mark.parametrize(("version", "ok"), [("5.1.0", True), ("5.3.1", True), ("6.0.0", False), ("4.0.0", False)])
def test_pytest_benchmark_outside_the_supported_range_is_refused_by_name(version, ok):
    from decodebench.baselines import check_pytest_benchmark

    if ok:
        check_pytest_benchmark(version)
    else:
        wanted = rf"pytest-benchmark {version} is installed; decodebench needs >=5.1,<6.0"
        with pytest.raises(RuntimeError, match=wanted):
            check_pytest_benchmark(version)


# --- temporary files a killed save leaves (stale) and the ones being written (kept) ----------

def _temporary(folder, name=".0003_abc_20261201.json.k2j4_p9q.tmp", age_s=60.0):
    path = folder / name
    path.write_text('{"benchmarks": [')
    os.utime(path, (time.time() - age_s, time.time() - age_s))
    return path


def test_only_unlocked_old_temporaries_of_the_suites_naming_are_removed(tmp_path):
    stale = _temporary(tmp_path)
    young = _temporary(tmp_path, ".0004_abc.json.aaaaaaaa.tmp", age_s=1.0)  # its writer may not have locked yet
    locked = _temporary(tmp_path, ".0005_abc.json.bbbbbbbb.tmp")
    others = [_temporary(tmp_path, name) for name in (".notes.json.k2j4_p9q.tmp", ".0006_x.json.tmp",
                                                      "0007_x.json.k2j4_p9q.tmp", ".0008_x.json.k2j4_p9q.tmp.bak")]
    with open(locked) as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # a save in progress holds this
        assert remove_stale_temporaries(tmp_path) == [stale]
    assert not stale.exists()
    assert all(p.exists() for p in (young, locked, *others))


KILLED_SAVE = """
import os, sys, time
from pathlib import Path
from decodebench import baselines
def stall(fd):
    print("writing", flush=True)
    time.sleep(600)
baselines.os.fsync = stall
baselines.write_json_atomically(Path(sys.argv[1]), {"benchmarks": []})
"""


def test_a_save_killed_mid_write_leaves_a_temporary_that_the_next_save_removes(tmp_path):
    folder = tmp_path / "fp"
    writer = subprocess.Popen([sys.executable, "-c", KILLED_SAVE, str(folder / "0001_a.json")],
                              stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert writer.stdout.readline() == "writing\n"
        (left,) = folder.glob(".*.tmp")
        os.utime(left, (time.time() - 60, time.time() - 60))  # older than STALE_AFTER_S
        assert remove_stale_temporaries(folder) == []  # its writer is alive and holds the lock
    finally:
        writer.kill()
        writer.wait()
    assert left.exists()
    assert not (folder / "0001_a.json").exists()
    storage = FingerprintStorage(tmp_path, logger=_Logger(), default_machine_id="fp")
    storage.save({"benchmarks": []}, "next")
    assert [p.name for p in folder.iterdir()] == ["0001_next.json"]
    assert storage.logger.lines == [("info", f"decodebench: removed {left}, left by an interrupted save"),
                                    ("info", f"Saved benchmark data in: {folder / '0001_next.json'}")]


# --- a folder that cannot be written ----------------------------------------------------------

class _Logger:
    def __init__(self):
        self.lines = []

    def info(self, text):
        self.lines.append(("info", text))

    def error(self, text):
        self.lines.append(("error", text))


def test_a_folder_that_cannot_be_written_is_named(tmp_path):
    blocker = tmp_path / "store"
    blocker.write_text("a file where the folder should be")
    with pytest.raises(ValueError, match=f"^cannot write to {blocker / 'fp'}: Not a directory$"):
        check_writable(blocker / "fp")
    check_writable(tmp_path / "new" / "fp")  # a missing folder is made
    assert [p.name for p in (tmp_path / "new" / "fp").iterdir()] == []  # and the probe is gone


def test_a_failed_save_is_one_error_line_and_fails_the_session(tmp_path):
    session = types.SimpleNamespace(exitstatus=pytest.ExitCode.OK)
    storage = FingerprintStorage(tmp_path / "store", logger=_Logger(), default_machine_id="fp", session=session)
    (tmp_path / "store").rmdir()
    (tmp_path / "store").write_text("")  # the folder went away during the run; a file took its name
    storage.save({"benchmarks": []}, "x")  # no exception: pytest-benchmark's table comes after the save
    (line,) = storage.logger.lines
    assert line == ("error", f"decodebench: nothing was stored: cannot write {storage.folder / '0001_x.json'}: "
                             "Not a directory (this run's results are in the table below)")
    assert session.exitstatus == pytest.ExitCode.TESTS_FAILED


# --- numbering past 9999 ------------------------------------------------------------------------


def test_stored_numbering_goes_past_9999_and_the_reader_follows(tmp_path):
    # before: every save after 9999 was 10000_... and no reader loaded it again
    folder = tmp_path / "fp"
    _stored(folder / "9999_old.json", key="fp")
    storage = FingerprintStorage(tmp_path, logger=_Logger(), default_machine_id="fp")
    storage.save(_document("fp"), "next")
    storage.save(_document("fp"), "again")
    assert sorted(p.name for p in folder.iterdir()) == ["10000_next.json", "10001_again.json", "9999_old.json"]
    history = load_history(folder, "fp")
    assert [r.path.name for r in history.results] == ["9999_old.json", "10000_next.json", "10001_again.json"]
    assert history.results[-1].path.name == "10001_again.json"


def _document(key):
    return {"machine_info": {"decodebench": {"fingerprint": {"key": key}}}, "benchmarks": []}


def test_a_file_too_large_to_be_a_result_is_refused_before_it_is_read(tmp_path, monkeypatch):
    # before: skipped with a clear reason, after reading it whole (a 2 GB file took 4.4 GB of memory)
    folder = tmp_path / "fp"
    _stored(folder / "0001_a.json", key="fp")
    huge = folder / "0002_huge.json"
    with open(huge, "wb") as handle:
        handle.truncate(2 * 2**30)  # sparse: 2 GB long, no disk used
    reads = []
    for method in ("read_bytes", "read_text"):  # decodebench's reader, pytest-benchmark's
        real = getattr(type(huge), method)

        def read(path, *args, _real=real, **kwargs):
            assert path.name != huge.name, "the 2 GB file was read"
            reads.append(path.name)
            return _real(path, *args, **kwargs)

        monkeypatch.setattr(type(huge), method, read)
    refusal = f"{huge} is 2,048 MB, larger than a stored result can be (at most 256 MB): not read"
    with pytest.raises(ValueError, match="larger than a stored result can be") as refused:
        load_history(folder, "fp")
    assert str(refused.value) == refusal
    storage = FingerprintStorage(tmp_path, logger=_Logger(), default_machine_id="fp")
    assert [path.name for path, _ in storage.load("fp/0001")] == ["0001_a.json"]  # --benchmark-compare=0001
    with pytest.raises(ValueError, match="larger than a stored result can be") as refused:
        list(storage.load("fp/0002"))
    assert str(refused.value) == refusal
    assert reads == ["0001_a.json", "0001_a.json"]  # the history's reading, then --benchmark-compare's
