"""Two measuring sessions on one device (issue 47, row 14): each sees the other, marks its results,
and the gate never calls them SLOWER; before, one reported a false SLOWER from the other's load
and nothing warned."""

import json
import os
import re
import subprocess
import sys
import time

import psutil

from decodebench.neighbours import Neighbours
from tests.conftest import REPO, run_session, start_session
from tests.test_interrupts import session_args


def test_a_session_sees_one_that_runs_beside_it_and_not_one_that_ended_before(tmp_path):
    before = Neighbours("cpu", tmp_path)
    before.enter()
    before.leave()
    time.sleep(0.01)
    mine = Neighbours("cpu", tmp_path)
    assert mine.seen() == []  # not measuring yet: nothing to mark
    mine.enter()
    assert mine.seen() == []  # the earlier session ended before this one started
    beside = Neighbours("cpu", tmp_path)
    beside.enter()
    assert mine.seen() == [f"pid {os.getpid()} (running)"]
    beside.leave()
    assert mine.seen() == [f"pid {os.getpid()} (ended)"]  # it ran while this one did: still seen
    other_device = Neighbours("gpu-x", tmp_path)
    other_device.enter()
    assert mine.seen() == [f"pid {os.getpid()} (ended)"]
    mine.leave()


def test_a_killed_session_counts_until_its_last_write_and_old_records_go(tmp_path):
    mine = Neighbours("cpu", tmp_path)
    mine.enter()
    killed = subprocess.run([sys.executable, "-c", "import os, sys\nfrom pathlib import Path\n"
                             "from decodebench.neighbours import Neighbours\n"
                             "n = Neighbours('cpu', Path(sys.argv[1])); n.enter(); os._exit(9)", str(tmp_path)],
                            cwd=REPO, timeout=60)
    assert killed.returncode == 9
    (record,) = [p for p in (tmp_path / "cpu").iterdir() if not p.name.startswith(f"{os.getpid()}-")]
    pid = json.loads(record.read_text())["pid"]
    assert mine.seen() == [f"pid {pid} (ended)"]  # no end written, no lock held: its last write is its end
    old = time.time() - 7200
    os.utime(record, (old, old))
    record.write_text(json.dumps({"pid": pid, "start": old - 10, "end": old}))
    assert mine.seen() == []
    assert not record.exists()
    mine.leave()


RMSNORM_M8 = ("-k", "torch and w7168-m8")


def _verdicts(output: str) -> list[str]:
    """The verdict words of a session's report, in its order (slowest first)."""
    words = ("SLOWER", "FASTER", "SAME", "UNDECIDED", "INCOMPARABLE")
    return [line.split()[0] for line in output.splitlines() if line.split()[:1] and line.split()[0] in words]


def test_a_session_measured_beside_another_is_marked_and_never_slower(tmp_path, session_forker):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "DECODEBENCH_SESSIONS_DIR": str(tmp_path / "sessions")}
    stored = run_session(session_forker, session_args(tmp_path, *RMSNORM_M8, "--budget-ms", "30",
                                                       "--benchmark-autosave"), cwd=REPO, env=env, timeout_s=300)
    assert stored.returncode == 0, stored.stdout + stored.stderr
    (first,) = (tmp_path / "store").glob("*/0001_*.json")
    document = json.loads(first.read_text())
    for number, scale in ((2, 1.001), (3, 0.999)):  # a history of three runs: a spread to judge by
        for bench in document["benchmarks"]:
            bench["stats"]["data"] = [v * scale for v in bench["stats"]["data"]]
        (first.parent / f"000{number}_run.json").write_text(json.dumps(document))
    # the same session alone: its injected 100 % slowdown is SLOWER
    judged = (*RMSNORM_M8, "--budget-ms", "30", "--benchmark-compare", "--gate", "10%", "--gate-max-load", "1000",
              "--gate-resamples", "0", "--inject-slowdown", "100%", "--inject-only", "add-")
    alone = run_session(session_forker, session_args(tmp_path, *judged), cwd=REPO, env=env, timeout_s=300)
    assert _verdicts(alone.stdout)[0] == "SLOWER", alone.stdout
    assert "another session measured" not in alone.stdout, alone.stdout
    # now beside a long session measuring on the same CPU
    log = tmp_path / "beside.log"
    beside = start_session(session_forker, session_args(tmp_path / "other", "-k", "torch", "--sweep", "nightly",
                                                        "--budget-ms", "3000"),
                           cwd=REPO, env=env, log=log)
    try:
        deadline = time.monotonic() + 300
        while " PASSED" not in log.read_text():
            assert beside.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        done = run_session(session_forker, session_args(tmp_path, *judged), cwd=REPO, env=env, timeout_s=300)
    finally:
        os.killpg(beside.pid, 15) if beside.poll() is None else None
        beside.wait(timeout=120)
    out = done.stdout
    # the other session may end before this one reports (a busy 2-core machine): "(ended)" then, still marked
    state = r"\((running|ended)\)"
    assert re.search(rf"another session measured on this device during this run \(pid {beside.pid} {state}\)", out), out
    assert _verdicts(out)[0] == "UNDECIDED", out
    assert "SLOWER" not in _verdicts(out), out
    assert "gate passed" in out, out
    assert re.search(rf"another session measured on this device at the same time \(pid {beside.pid} {state}\)"
                     ": contention, not evidence", out), out
    assert not [p for p in psutil.pids() if p == beside.pid and psutil.Process(p).status() != "zombie"]
