import json

import pytest

from decodebench.baselines import stored_fingerprint, write_json_atomically


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
