"""The process-group pool on CPU (gloo, 2 ranks): jobs, faults, reaping, torchrun variables.

Every wait here is bounded; a fault test fails rather than hangs when the pool misbehaves.
"""

import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from decodebench.distributed.procgroup import (
    Cluster,
    ClusterError,
    FailureKind,
    Job,
    ProcessGroupPool,
    RankFailure,
    RankInfo,
)
from decodebench.errors import BackendUnavailable
from tests.conftest import REPO
from tests.conftest import start_session as start_forked_or_spawned

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="workers die with their parent "
                                "through a Linux prctl")


# --- jobs (module level, so the ranks can import them by name) ---------------------------------


def whoami(ctx):
    import torch
    import torch.distributed as dist

    total = torch.tensor([ctx.info.rank + 1.0])
    dist.all_reduce(total)
    env = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "NCCL_NVLS_ENABLE")}
    return ctx.info.rank, os.getpid(), total.item(), env


def raise_on(ctx, rank):
    import torch.distributed as dist

    if ctx.info.rank == rank:
        raise ValueError(f"bad input on rank {rank}")
    dist.barrier()  # the other rank waits for the one that raised, as in a real collective


def die_on(ctx, rank, how):
    import torch.distributed as dist

    if ctx.info.rank == rank:
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(3)
    dist.barrier()


def sleep_on(ctx, rank, seconds):
    if ctx.info.rank == rank:
        time.sleep(seconds)
    return ctx.info.rank


def hang_on(ctx, rank):
    import torch.distributed as dist

    if ctx.info.rank == rank:
        time.sleep(600)  # stuck in its own code: never reaches the collective
    dist.barrier()


def freeze_on(ctx, rank):
    import torch.distributed as dist

    if ctx.info.rank == rank:
        os.kill(os.getpid(), signal.SIGSTOP)  # the whole process stops: its probe cannot answer
    dist.barrier()


def hang_declared(ctx, rank):
    if ctx.info.rank == rank:
        time.sleep(600)
    with ctx.collective("waiting for CUDA work"):  # a wait torch.distributed does not show
        time.sleep(600)


def unavailable_everywhere(ctx):
    raise BackendUnavailable("this backend needs a thing no rank has")


# --- helpers -------------------------------------------------------------------------------------


def gone(pid: int) -> bool:
    """No such process, or only a zombie left for init to reap."""
    try:
        return psutil.Process(pid).status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return True


def wait_gone(pids, timeout_s=15.0) -> list[int]:
    """The pids still alive after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    alive = [p for p in pids if not gone(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [p for p in alive if not gone(p)]
    return alive


def new_pool(world_size=2, **kwargs):
    return ProcessGroupPool(Cluster.single_host(world_size), "cpu", **kwargs)


@pytest.fixture(scope="module")
def pool():
    with new_pool() as shared:
        yield shared


# --- jobs that work ------------------------------------------------------------------------------


def test_every_rank_runs_the_job_with_torchrun_variables(pool):
    answers = pool.run(Job(whoami), timeout_s=60)
    assert [a[0] for a in answers] == [0, 1]
    assert [a[2] for a in answers] == [3.0, 3.0]  # 1 + 2 over gloo
    assert [a[1] for a in answers] == pool.pids
    for rank, (_, _, _, env) in enumerate(answers):
        assert env == {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                       "MASTER_ADDR": "127.0.0.1", "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE", "0")}


def test_the_pool_is_started_once_and_reused(pool):
    first = pool.run(Job(whoami), timeout_s=60)
    second = pool.run(Job(whoami), timeout_s=60)
    assert [a[1] for a in first] == [a[1] for a in second]
    assert pool.starts == 1


def test_backend_unavailable_on_every_rank_is_a_skip_and_keeps_the_pool(pool):
    pids = pool.run(Job(whoami), timeout_s=60) and pool.pids
    with pytest.raises(BackendUnavailable, match="needs a thing no rank has"):
        pool.run(Job(unavailable_everywhere), timeout_s=60)
    assert pool.running
    assert pool.pids == pids


def test_close_stops_every_worker():
    with new_pool(world_size=1) as single:
        assert single.run(Job(sleep_on, (1, 0)), timeout_s=60) == [0]
        pids = single.pids
    assert not single.running
    assert wait_gone(pids, timeout_s=0) == []


# --- faults: each names the rank, ends within a bound, and leaves no process ---------------------


def test_a_rank_that_raises_is_named_and_the_next_run_gets_a_fresh_pool():
    with new_pool() as faulty:
        first = faulty.run(Job(whoami), timeout_s=60)
        with pytest.raises(RankFailure) as failure:
            faulty.run(Job(raise_on, (1,)), timeout_s=60)
        cause, waiting = failure.value.problems
        assert (cause.rank, cause.kind) == (1, FailureKind.RAISED)
        assert cause.detail == "raised ValueError: bad input on rank 1"
        assert (waiting.rank, waiting.kind) == (0, FailureKind.STUCK)
        message = str(failure.value)
        assert "rank 1 raised ValueError: bad input on rank 1 while running raise_on" in message
        assert "traceback of rank 1" in message
        assert "in raise_on" in message
        assert not faulty.running
        assert wait_gone([a[1] for a in first], timeout_s=0) == []
        again = faulty.run(Job(whoami), timeout_s=60)
        assert [a[0] for a in again] == [0, 1]
        assert faulty.starts == 2


@pytest.mark.parametrize(("how", "said"), [("exit", "died with exit code 3"),
                                           ("sigkill", "died with exit code -9 (SIGKILL)")])
def test_a_rank_that_dies_is_named_with_its_exit_code(how, said):
    with new_pool() as faulty:
        pids = [a[1] for a in faulty.run(Job(whoami), timeout_s=60)]
        start = time.monotonic()
        with pytest.raises(RankFailure) as failure:
            faulty.run(Job(die_on, (1, how)), timeout_s=60)
        assert time.monotonic() - start < 30  # well inside the job timeout: a death is seen at once
        dead = [p for p in failure.value.problems if p.kind is FailureKind.DIED]
        assert [(p.rank, p.detail) for p in dead] == [(1, said)]
        assert f"rank 1 {said} while running die_on" in str(failure.value).splitlines()[0]
        assert wait_gone(pids, timeout_s=0) == []


def test_a_rank_that_hangs_is_named_after_the_timeout():
    with new_pool() as faulty:
        pids = [a[1] for a in faulty.run(Job(whoami), timeout_s=60)]
        start = time.monotonic()
        with pytest.raises(RankFailure, match=r"rank 1 did not answer within 2 s while running sleep_on"):
            faulty.run(Job(sleep_on, (1, 600)), timeout_s=2)
        assert time.monotonic() - start < 30  # the timeout, a short grace and the reaping
        assert wait_gone(pids, timeout_s=0) == []


def test_a_hang_is_blamed_on_the_rank_outside_the_collective_not_on_the_one_waiting():
    with new_pool() as faulty:
        with pytest.raises(RankFailure) as failure:
            faulty.run(Job(hang_on, (1,)), timeout_s=3)
    cause, waiting = failure.value.problems
    assert (cause.rank, cause.kind) == (1, FailureKind.TIMEOUT)
    assert cause.where.startswith("in its own code at hang_on (test_procgroup.py:")
    assert (waiting.rank, waiting.kind, waiting.detail) == (0, FailureKind.STUCK, "was waiting for rank 1")
    assert waiting.where == "waiting in collective barrier (torch.distributed)"
    first, second = str(failure.value).splitlines()
    assert first.startswith("rank 1 did not answer within 3 s while running hang_on: in its own code at hang_on")
    assert second.startswith("rank 0 was waiting for rank 1 while running hang_on: waiting in collective barrier")


def test_a_frozen_rank_is_blamed_because_its_probe_does_not_answer():
    with new_pool() as faulty:
        pids = faulty.pids or [a[1] for a in faulty.run(Job(whoami), timeout_s=60)]
        with pytest.raises(RankFailure) as failure:
            faulty.run(Job(freeze_on, (1,)), timeout_s=3)
    cause, waiting = failure.value.problems
    assert (cause.rank, cause.kind, cause.where) == \
        (1, FailureKind.TIMEOUT, "its probe did not answer either (frozen, or blocked in native code)")
    assert (waiting.rank, waiting.kind, waiting.detail) == (0, FailureKind.STUCK, "was waiting for rank 1")
    assert wait_gone(pids, timeout_s=0) == []  # a stopped process is killed too


def test_a_declared_collective_counts_as_waiting():
    with new_pool() as faulty:
        with pytest.raises(RankFailure) as failure:
            faulty.run(Job(hang_declared, (0,)), timeout_s=3)
    assert [(p.rank, p.kind) for p in failure.value.problems] == [(0, FailureKind.TIMEOUT), (1, FailureKind.STUCK)]
    assert re.fullmatch(r"waiting in collective waiting for CUDA work for \d+\.\d s", failure.value.problems[1].where)


def test_ranks_that_cannot_join_the_group_are_named():
    # No GPU 1000 anywhere: on a CPU build and on a GPU box alike, every rank fails to join.
    with ProcessGroupPool(Cluster.single_host(2), "cuda", first_device=1000, timeout_s=60) as broken:
        with pytest.raises(RankFailure, match=r"(?s)rank 0 raised .* while joining the nccl process group") as failure:
            broken.start()
        assert failure.value.ranks == [0, 1]
        assert not broken.running


# --- Ctrl-C, a failing session, a killed parent: a real pytest session in a subprocess ------------

INNER_CONFTEST = 'pytest_plugins = ["decodebench.plugin", "fixtures.device", "fixtures.process_group"]\n'

INNER_TEST = '''
import os, pathlib, time
from decodebench.distributed.procgroup import Cluster, Job, ProcessGroupPool

def nap(ctx, seconds):
    time.sleep(seconds)

FORGOTTEN = ProcessGroupPool(Cluster.single_host(1), "cpu")  # never closed: atexit must reap it

def test_holds_workers(process_group):
    process_group.run(Job(nap, (0,)))
    FORGOTTEN.run(Job(nap, (0,)))
    pids = process_group.pids + FORGOTTEN.pids
    pathlib.Path(os.environ["PIDS_FILE"]).write_text(" ".join(map(str, pids)))
    if os.environ["MODE"] == "fail":
        raise AssertionError("failing on purpose")
    process_group.run(Job(nap, (600,)))
'''


def start_session(pytester, tmp_path, mode, forker):
    """The inner session in a process group of its own, forked where it can be (``tests/conftest.py``),
    its output into a file, so a chatty child cannot block on a full pipe."""
    pytester.makeconftest(INNER_CONFTEST)
    test_file = pytester.makepyfile(test_inner=INNER_TEST)
    env = {**os.environ, "PIDS_FILE": str(tmp_path / "pids"), "MODE": mode,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    args = [str(test_file), "-p", "no:cacheprovider", "--device", "cpu", "--world-size", "2",
            "--dist-timeout-s", "900", "--benchmark-disable"]
    return start_forked_or_spawned(forker, args, cwd=pytester.path, env=env, log=tmp_path / "session.log")


def wait_for_pids(process, tmp_path, timeout_s=120.0) -> list[int]:
    pids_file = tmp_path / "pids"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        if pids_file.exists() and pids_file.read_text().strip():
            return [int(p) for p in pids_file.read_text().split()]
        time.sleep(0.2)
    process.kill()
    process.wait(timeout=30)
    pytest.fail(f"the inner session never reported its workers:\n{(tmp_path / 'session.log').read_text()}")


def finish(process, tmp_path, timeout_s=60.0) -> str:
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
        pytest.fail(f"the inner session did not end within {timeout_s:g} s")
    return (tmp_path / "session.log").read_text()


def test_a_failing_session_reaps_its_workers(pytester, tmp_path, session_forker):
    process = start_session(pytester, tmp_path, "fail", session_forker)
    pids = wait_for_pids(process, tmp_path)
    output = finish(process, tmp_path)
    assert process.returncode == 1, output
    assert "failing on purpose" in output
    assert wait_gone(pids) == [], output


def test_ctrl_c_reaps_the_workers(pytester, tmp_path, session_forker):
    process = start_session(pytester, tmp_path, "sigint", session_forker)
    pids = wait_for_pids(process, tmp_path)
    time.sleep(0.5)  # let the session enter the long job
    os.killpg(process.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole process group
    output = finish(process, tmp_path)
    assert "KeyboardInterrupt" in output
    assert wait_gone(pids) == [], output


def test_workers_die_with_a_killed_parent(pytester, tmp_path, session_forker):
    process = start_session(pytester, tmp_path, "sigkill", session_forker)
    pids = wait_for_pids(process, tmp_path)
    process.kill()  # the parent only: no teardown runs, the workers must notice by themselves
    finish(process, tmp_path)
    assert wait_gone(pids) == []


# --- torchrun-style variables ----------------------------------------------------------------------


def test_one_host_by_default():
    cluster = Cluster.from_env({}, default_world_size=2)
    assert cluster == Cluster(2, 2, 0, "127.0.0.1", None)
    assert not cluster.multi_host
    assert [r.rank for r in cluster.local_ranks(29500)] == [0, 1]


def test_two_hosts_give_each_host_its_global_ranks():
    env = {"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "NODE_RANK": "1",
           "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    cluster = Cluster.from_env(env)
    assert (cluster.nnodes, cluster.multi_host, cluster.global_ranks()) == (2, True, range(8, 16))
    second = cluster.local_ranks(29500)[1]
    assert second == RankInfo(9, 1, 16, 8, 1, "10.0.0.1", 29500)
    assert second.environ() == {"RANK": "9", "LOCAL_RANK": "1", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8",
                                "GROUP_RANK": "1", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1",
                                "MASTER_PORT": "29500"}


def test_group_rank_is_read_like_node_rank():
    env = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1", "MASTER_ADDR": "h0", "MASTER_PORT": "1234"}
    assert Cluster.from_env(env).global_ranks() == range(2, 4)


def test_the_option_wins_over_the_default_and_must_agree_with_world_size():
    assert Cluster.from_env({}, world_size=4, default_world_size=2).world_size == 4
    assert Cluster.from_env({"WORLD_SIZE": "4"}, world_size=4).world_size == 4
    with pytest.raises(ClusterError, match="--world-size 2 disagrees with WORLD_SIZE=4"):
        Cluster.from_env({"WORLD_SIZE": "4"}, world_size=2)


@pytest.mark.parametrize(("env", "said"), [
    ({"WORLD_SIZE": "eight"}, "WORLD_SIZE='eight' is not an integer"),
    ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "3"}, "LOCAL_WORLD_SIZE=3 does not divide WORLD_SIZE=8"),
    ({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "NODE_RANK": "2", "MASTER_ADDR": "h0", "MASTER_PORT": "1"},
     r"NODE_RANK=2 is outside 0\.\.1"),
    ({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "NODE_RANK": "1"}, "needs MASTER_ADDR"),
    ({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "MASTER_ADDR": "h0"}, "and MASTER_PORT"),
    ({"WORLD_SIZE": "2", "MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a TCP port"),
    ({"WORLD_SIZE": "2", "RANK": "0"}, "RANK=0 is set: decodebench starts one process per rank itself"),
    ({"LOCAL_RANK": "0"}, "not under torchrun"),
])
def test_a_bad_environment_is_named(env, said):
    with pytest.raises(ClusterError, match=said):
        Cluster.from_env(env, default_world_size=2)


def test_bad_options_and_environment_are_rejected_clearly(pytester, monkeypatch):
    for option, said in (("--world-size=0", "*--world-size: '0' must be at least 1*"),
                         ("--dist-timeout-s=soon", "*--dist-timeout-s: 'soon' is not a number*")):
        result = pytester.runpytest_subprocess(str(REPO / "benchmarks" / "test_allreduce.py"),
                                               "--rootdir", str(REPO), option)
        result.stderr.fnmatch_lines([said])
        assert result.ret == pytest.ExitCode.USAGE_ERROR
    monkeypatch.setenv("RANK", "3")
    result = pytester.runpytest_subprocess(str(REPO / "benchmarks" / "test_allreduce.py"), "--rootdir",
                                           str(REPO), "-k", "m1x7168 and torch", "--benchmark-disable")
    result.stdout.fnmatch_lines(["*process group: RANK=3 is set*"])
    result.assert_outcomes(errors=1)
