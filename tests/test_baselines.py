import json

import pytest

from decodebench.baselines import load_history, stored_fingerprint, write_json_atomically


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


def test_history_skips_damaged_and_foreign_files_naming_them(tmp_path):
    _stored(tmp_path / "0001_a.json")
    _stored(tmp_path / "0002_b.json", key="gpu-y")
    (tmp_path / "0003_c.json").write_text('{"benchmarks": [')
    (tmp_path / "notes.json").write_text("{}")  # not a stored result: not looked at
    history = load_history(tmp_path, "cpu-x")
    assert [r.path.name for r in history.results] == ["0001_a.json"]
    assert history.skipped[0] == f"{tmp_path / '0002_b.json'} was measured on gpu-y, not cpu-x"
    assert history.skipped[1].startswith(f"{tmp_path / '0003_c.json'} is not valid JSON (truncated or damaged?)")
    assert history.newest(5)[-1].path.name == "0001_a.json"


def test_empty_history_says_why(tmp_path):
    assert load_history(tmp_path, "cpu-x").why_empty() == f"no stored result in {tmp_path} (first run on this machine?)"
    (tmp_path / "0001_a.json").write_text("[]")
    assert load_history(tmp_path, "cpu-x").why_empty() == (
        f"no usable stored result: {tmp_path / '0001_a.json'} is not a pytest-benchmark result (no 'benchmarks' list)")


@pytest.mark.parametrize(("version", "ok"), [("5.1.0", True), ("5.3.1", True), ("6.0.0", False), ("4.0.0", False)])
def test_pytest_benchmark_outside_the_supported_range_is_refused_by_name(version, ok):
    from decodebench.baselines import check_pytest_benchmark

    if ok:
        check_pytest_benchmark(version)
    else:
        wanted = rf"pytest-benchmark {version} is installed; decodebench needs >=5.1,<6.0"
        with pytest.raises(RuntimeError, match=wanted):
            check_pytest_benchmark(version)
