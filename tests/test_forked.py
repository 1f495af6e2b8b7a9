"""The nested sessions' zygotes (tests/forked.py): a session forks from a zygote started with its
import-time environment, so that what the session's imports read is what it asked for."""

import os
from pathlib import Path

from tests.forked import _Zygote

THREADS_MODULE = """
import os

import torch


def test_threads_as_asked():
    asked = os.environ.get("OMP_NUM_THREADS")
    print("asked", asked, "threads", torch.get_num_threads())
    if asked is not None:
        assert torch.get_num_threads() == int(asked)
"""


def test_sessions_in_two_import_time_environments_each_fork_from_their_own_zygote(pytester, session_forker,
                                                                                  monkeypatch, capsys):
    pytester.makepyfile(test_threads=THREADS_MODULE)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    pytester.runpytest_subprocess("-p", "no:cacheprovider", "-s").assert_outcomes(passed=1)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-s")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*asked 1 threads 1*"])
    assert capsys.readouterr().out.count("running (forked):") == 2  # neither fell back to a subprocess
    threads = {z.started_with.get("OMP_NUM_THREADS") for z in session_forker.zygotes}
    assert {None, "1"} <= threads
    assert all(z.proc is not None and z.proc.poll() is None for z in session_forker.zygotes)
    assert os.environ["OMP_NUM_THREADS"] == "1"  # the test's own environment is untouched


def test_what_a_zygotes_imports_set_is_no_difference_and_what_a_test_sets_is():
    zygote = _Zygote(Path("unused.log"), {"HOME": "/h", "OMP_NUM_THREADS": "2", "PYTHONPATH": "/repo"})
    zygote.after_imports = {"OMP_NUM_THREADS": "2", "TORCHINDUCTOR_COMPILE_THREADS": "1"}  # as its ready line says
    assert zygote.set_by_imports() == {"TORCHINDUCTOR_COMPILE_THREADS": "1"}
    assert zygote.serves({"OMP_NUM_THREADS": "2"})
    # the test process imported vLLM since: it has the same variable, set the same way
    assert zygote.serves({"OMP_NUM_THREADS": "2", "TORCHINDUCTOR_COMPILE_THREADS": "1"})
    assert not zygote.serves({"OMP_NUM_THREADS": "2", "TORCHINDUCTOR_COMPILE_THREADS": "4"})  # set by a test
    assert not zygote.serves({"OMP_NUM_THREADS": "1"})
    assert not zygote.serves({})  # started with a thread count the session does not have
    assert not zygote.serves({"OMP_NUM_THREADS": "2", "VLLM_CPU_KVCACHE_SPACE": "1"})
