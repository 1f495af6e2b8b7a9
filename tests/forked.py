"""Nested pytest sessions forked from a process that has already imported what they import.

Most tests of this suite run a nested pytest session (``pytester.runpytest_subprocess``) on a
benchmark module: a new interpreter that imports pytest, torch, the plugin and, in most of them,
vLLM, before it collects anything. On the 2-core CI machine that start is 5 s of CPU, and 11-12 s
where the session imports vLLM, against a few tenths of a second for what many of those sessions
check (an option refused, a case collected). :class:`SessionForker` keeps a process (a
*zygote*) that imports all of it once and forks a child per session. The child is a
process of its own, as a subprocess is: it gets the test's environment, working directory and
arguments, writes its stdout and stderr to files, runs ``pytest.main`` and exits with its exit
code, running the ``atexit`` handlers a normal exit runs; what it starts (servers, workers, rank
processes) it starts itself. What it does not redo is the interpreter start and the imports.

The zygote's imports read the variables a library reads when it is imported (OpenMP's thread
count, vLLM's and torch's settings): sessions that differ in them go to a zygote of their own,
started with their values, at most three per test process; beyond that, a real subprocess.
``DECODEBENCH_TEST_FORK=0`` runs every nested session as a real subprocess.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from fixtures import PLUGINS

_STARTED = time.monotonic()

__all__ = ["SessionForker", "import_time_env", "serve"]

# environment variables that a library reads when it is imported (or the interpreter at start):
# a session asking for other values than the zygote was started with must start afresh
_IMPORT_TIME_PREFIXES = ("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "TORCH", "PYTORCH", "VLLM_", "CUDA_",
                         "LD_", "PYTHON", "MALLOC_", "HYPOTHESIS", "TRITON", "NCCL_", "GLOO_")
# vLLM reads these when it builds an engine (in the server a session starts), never at import:
# vllm 0.32's only readers are in v1/engine, v1/executor and engine/arg_utils
_READ_WHEN_AN_ENGINE_IS_BUILT = frozenset({"VLLM_ENABLE_V1_MULTIPROCESSING"})
# imported by the zygote: what a benchmark session of this repository imports before it collects
_PRELOAD = ("torch", "pytest", "pytest_benchmark.plugin", *PLUGINS)
# and where vLLM is installed, the modules the suite's vLLM backends look up (decodebench/kernels/)
_PRELOAD_IF_INSTALLED = ("vllm", "vllm._custom_ops", "vllm.platforms", "vllm.config", "vllm.scalar_type",
                         "vllm.model_executor.layers.utils", "vllm.model_executor.layers.linear")
_LOG_TAIL_CHARS = 4000


def import_time_env(env: dict[str, str]) -> dict[str, str]:
    """The variables of ``env`` that an import reads (``PYTHONPATH`` apart: see :meth:`SessionForker.run`).

    >>> import_time_env({"OMP_NUM_THREADS": "1", "HOME": "/root", "PYTHONPATH": "/x", "VLLM_X": "1",
    ...                  "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    {'OMP_NUM_THREADS': '1', 'VLLM_X': '1'}
    """
    return {k: v for k, v in env.items()
            if k.startswith(_IMPORT_TIME_PREFIXES) and k != "PYTHONPATH" and k not in _READ_WHEN_AN_ENGINE_IS_BUILT}


class SessionForker:
    """The test process's side: one zygote per environment the sessions ask for (in what an import
    reads), each started on first use, at most ``max_zygotes``; sessions go to theirs one at a time.

    Most sessions run in the test process's environment; a module that runs its sessions with one
    OpenMP thread (``OMP_NUM_THREADS=1``: ``tests/test_ab.py``, ``tests/test_interrupts.py``) gets a
    zygote of its own. Variables that the imports themselves set (vLLM sets ``TORCHINDUCTOR_*``,
    OpenCV ``LD_LIBRARY_PATH``) are no difference: the test process has them once it has imported
    vLLM, and a zygote has them from its own imports. With one zygote, and these counted, every
    session after the first change ran as a subprocess."""

    def __init__(self, log_dir: Path, max_zygotes: int = 3):
        self.log_dir = log_dir
        self.max_zygotes = max_zygotes
        self.zygotes: list[_Zygote] = []

    def _zygote_for(self, env: dict[str, str]) -> _Zygote | None:
        wanted = import_time_env(env)
        for zygote in self.zygotes:
            if zygote.serves(wanted):
                return zygote
        if len(self.zygotes) >= self.max_zygotes:
            with open(self.log_dir / "session-zygote-none.log", "a") as log:
                print(f"a subprocess: no zygote left for {wanted}", file=log)
            return None
        # the test process's environment with the session's import-time variables, less those an
        # earlier zygote's imports set themselves (PYTHONPATH stays the test process's: a session's
        # extra entries go onto its own sys.path)
        set_by_imports = {k: v for z in self.zygotes for k, v in z.set_by_imports().items()}
        base = {k: v for k, v in os.environ.items() if not import_time_env({k: v})}
        start = base | {k: v for k, v in wanted.items() if set_by_imports.get(k) != v}
        zygote = _Zygote(self.log_dir / f"session-zygote-{len(self.zygotes)}.log", start)
        self.zygotes.append(zygote)
        return zygote

    def can_fork(self, env: dict[str, str]) -> bool:
        """Whether a session with ``env`` can be forked from a zygote (started now if it is not)."""
        if os.environ.get("DECODEBENCH_TEST_FORK", "1") == "0":
            return False
        zygote = self._zygote_for(env)
        if zygote is None:
            return False
        zygote.ensure_started()
        return zygote.serves(import_time_env(env))

    def run(self, args: list[str], *, cwd: Path, env: dict[str, str], stdout: Path, stderr: Path,
            timeout_s: float | None) -> int | None:
        """Run ``pytest.main(args)`` in a child forked from ``env``'s zygote (:meth:`can_fork` first);
        its exit code, or None on a timeout (then killed)."""
        zygote = self._zygote_for(env)
        assert zygote is not None, "can_fork first"
        assert zygote.proc is not None, "can_fork first"
        return zygote.run(args, cwd=cwd, env=env, stdout=stdout, stderr=stderr, timeout_s=timeout_s)

    def start(self, args: list[str], *, cwd: Path, env: dict[str, str], log: Path) -> DetachedSession:
        """Start ``pytest.main(args)`` in a child forked from ``env``'s zygote (:meth:`can_fork`
        first) into a process group of its own, both streams into ``log``; it runs on its own."""
        zygote = self._zygote_for(env)
        assert zygote is not None, "can_fork first"
        assert zygote.proc is not None, "can_fork first"
        return zygote.start(args, cwd=cwd, env=env, log=log)

    def close(self) -> None:
        for zygote in self.zygotes:
            zygote.close()
        self.zygotes.clear()


class _Zygote:
    """One zygote process: started with ``env``, it imports and then forks a child per request."""

    def __init__(self, log: Path, env: dict[str, str]):
        self.log = log
        self.env = env
        self.started_with = import_time_env(env)
        self.after_imports: dict[str, str] | None = None  # the zygote's, once it is ready
        self.proc: subprocess.Popen | None = None

    def set_by_imports(self) -> dict[str, str]:
        """The import-time variables the zygote's imports set that it was not started with."""
        return {k: v for k, v in (self.after_imports or {}).items() if k not in self.started_with}

    def serves(self, wanted: dict[str, str]) -> bool:
        """Whether a session with import-time variables ``wanted`` may fork from this zygote: what
        it was started with, each the same, and beyond that only what its own imports set."""
        extra = {k: v for k, v in wanted.items() if k not in self.started_with}
        return (all(wanted.get(k) == v for k, v in self.started_with.items())
                and all(self.set_by_imports().get(k) == v for k, v in extra.items()))

    def ensure_started(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            return
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-c", "from tests.forked import serve; serve()"],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                         cwd=Path(__file__).resolve().parent.parent, env=self.env)
        ready = self._reply(timeout_s=300)
        if ready.get("ready") is not True:
            raise RuntimeError(f"the session zygote did not start: {ready}; its log: {self._log_tail()}")
        self.after_imports = ready["environment"]

    def _log_tail(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-_LOG_TAIL_CHARS:]
        except OSError as error:
            return f"(unreadable: {error})"

    def _reply(self, timeout_s: float | None) -> dict:
        assert self.proc is not None
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        if not ready:
            raise TimeoutError
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait(timeout=30)
            raise RuntimeError(f"the session zygote exited with code {code}; its log: {self._log_tail()}")
        return json.loads(line)

    def _send(self, request: dict) -> None:
        assert self.proc is not None
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()

    def _fork(self, args: list[str], cwd: Path, env: dict[str, str], stdout: Path, stderr: Path,
              detach: bool) -> int:
        """Fork a session; its pid. ``env["PYTHONPATH"]`` may add entries in front of the zygote's
        (pytester adds the test's directory): the child puts them first on ``sys.path``, as a new
        interpreter would."""
        base = [p for p in self.env.get("PYTHONPATH", "").split(os.pathsep) if p]
        wanted = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        extra = wanted[:len(wanted) - len(base)] if base and wanted[len(wanted) - len(base):] == base else wanted
        self._send({"args": args, "cwd": str(cwd), "env": env, "stdout": str(stdout), "stderr": str(stderr),
                    "path": extra, "detach": detach})
        return self._reply(timeout_s=60)["pid"]

    def start(self, args: list[str], *, cwd: Path, env: dict[str, str], log: Path) -> DetachedSession:
        log.write_bytes(b"")  # there to read from the start, as the file Popen writes into is
        return DetachedSession(self, self._fork(args, cwd, env, log, log, detach=True))

    def exit_code_of(self, pid: int) -> int:
        """The exit code of a detached session that has ended (the zygote reaps it)."""
        self._send({"wait": pid})
        return self._reply(timeout_s=60)["exit"]

    def run(self, args: list[str], *, cwd: Path, env: dict[str, str], stdout: Path, stderr: Path,
            timeout_s: float | None) -> int | None:
        pid = self._fork(args, cwd, env, stdout, stderr, detach=False)
        try:
            return self._reply(timeout_s)["exit"]
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            self._reply(timeout_s=60)
            return None

    def close(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
        self.proc = None


class DetachedSession:
    """A session forked into a process group of its own, driven as a ``subprocess.Popen`` started
    with ``start_new_session=True`` is (``pid``, ``poll``, ``wait``, ``kill``, ``returncode``): for
    the tests that press Ctrl-C on a session's group or kill it. Its parent is the zygote, which
    reaps it when asked for its exit code."""

    def __init__(self, zygote: _Zygote, pid: int):
        self.zygote = zygote
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                ended = psutil.Process(self.pid).status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                ended = True
            if ended:
                self.returncode = self.zygote.exit_code_of(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.05)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


# --- the zygote --------------------------------------------------------------------------------


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the test process that started it ends (prctl PR_SET_PDEATHSIG)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG


def serve() -> None:
    """The zygote's loop: import, say ready, then one session per request line on stdin, in order."""
    import importlib
    import importlib.util

    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # what an import prints goes to the log, not into the replies
    _die_with_parent()
    for name in _PRELOAD:
        importlib.import_module(name)
    for name in _PRELOAD_IF_INSTALLED:
        if importlib.util.find_spec(name.split(".")[0]) is not None:
            importlib.import_module(name)
    # the log says what this zygote is for and what it cost: a start, then a line per session
    print(f"zygote {os.getpid()}: ready in {time.monotonic() - _STARTED:.1f} s ({time.process_time():.1f} s of CPU); "
          f"import-time environment {import_time_env(dict(os.environ))}", file=sys.stderr, flush=True)
    print(json.dumps({"ready": True, "environment": import_time_env(dict(os.environ))}), file=replies)
    detached: dict[int, tuple[float, dict]] = {}  # pid -> (start, request) of the detached sessions

    def reap(pid: int, began: float, request: dict) -> int:
        _, status, usage = os.wait4(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        print(f"session {pid}: exit {code} after {time.monotonic() - began:.1f} s "
              f"({usage.ru_utime + usage.ru_stime:.1f} s of CPU): {' '.join(request['args'][1:4])[:160]}",
              file=sys.stderr, flush=True)
        return code

    try:
        for line in sys.stdin:
            request = json.loads(line) | {"replies_fd": replies.fileno()}
            if "wait" in request:  # a detached session has ended (a zombie): its exit code
                print(json.dumps({"exit": reap(request["wait"], *detached.pop(request["wait"]))}), file=replies)
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            began = time.monotonic()
            pid = os.fork()
            if pid == 0:
                _session(request)  # never returns
            print(json.dumps({"pid": pid}), file=replies)
            if request.get("detach"):
                detached[pid] = (began, request)
            else:
                print(json.dumps({"exit": reap(pid, began, request)}), file=replies)
    finally:
        for pid in detached:  # the test process went away without waiting: nothing outlives it
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)


def _session(request: dict) -> None:
    """In the forked child: become the session's process, run pytest, exit with its code."""
    code = 1
    try:
        os.close(request["replies_fd"])  # the zygote's
        if request.get("detach"):
            os.setsid()  # a process group of its own, as Popen(start_new_session=True) gives
        # otherwise it stays in the test's process group
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(request["cwd"])
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            if fd == 2 and path == request["stdout"]:
                os.dup2(1, 2)  # both streams into one file, in the order written
                continue
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
        os.environ.clear()
        os.environ.update(request["env"])
        sys.path[:0] = request["path"]
        import pytest

        sys.argv = [pytest.__file__, *request["args"]]
        code = int(pytest.main(request["args"]))
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    except BaseException:  # noqa: BLE001 -- whatever it was, it is the session's failure, reported
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        import atexit

        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)
