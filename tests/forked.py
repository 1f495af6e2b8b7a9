"""Nested pytest sessions forked from a process that has already imported what they import.

Most tests of this suite run a nested pytest session (``pytester.runpytest_subprocess``) on a
benchmark module: a new interpreter that imports pytest, torch, the plugin and, in most of them,
vLLM, before it collects anything. On the 2-core CI machine that start is 5 s of CPU, and 11-12 s
where the session imports vLLM, against a few tenths of a second for what many of those sessions
check (an option refused, a case collected). :class:`SessionForker` keeps one process per test
process (a *zygote*) that imports all of it once and forks a child per session. The child is a
process of its own, as a subprocess is: it gets the test's environment, working directory and
arguments, writes its stdout and stderr to files, runs ``pytest.main`` and exits with its exit
code, running the ``atexit`` handlers a normal exit runs; what it starts (servers, workers, rank
processes) it starts itself. What it does not redo is the interpreter start and the imports.

A session whose environment differs from the zygote's in a variable read when a library is
imported (OpenMP's thread count, vLLM's and torch's settings, the Python path beyond the test's
own directory) runs as a real subprocess: the zygote's imports would have read the old value.
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
from pathlib import Path

__all__ = ["SessionForker", "import_time_env", "serve"]

# environment variables that a library reads when it is imported (or the interpreter at start):
# a session asking for other values than the zygote was started with must start afresh
_IMPORT_TIME_PREFIXES = ("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "TORCH", "PYTORCH", "VLLM_", "CUDA_",
                         "LD_", "PYTHON", "MALLOC_", "HYPOTHESIS", "TRITON", "NCCL_", "GLOO_")
# vLLM reads these when it builds an engine (in the server a session starts), never at import:
# vllm 0.32's only readers are in v1/engine, v1/executor and engine/arg_utils
_READ_WHEN_AN_ENGINE_IS_BUILT = frozenset({"VLLM_ENABLE_V1_MULTIPROCESSING"})
# imported by the zygote: what a benchmark session of this repository imports before it collects
_PRELOAD = ("torch", "pytest", "pytest_benchmark.plugin", "decodebench.plugin", "decodebench.abplugin",
            "fixtures.device", "fixtures.procgroup", "fixtures.attribution", "fixtures.routing", "fixtures.server")
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
    """The test process's side: starts the zygote on first use, sends it one session at a time."""

    def __init__(self, log: Path):
        self.log = log
        self.proc: subprocess.Popen | None = None
        self.env: dict[str, str] = {}

    def _start(self) -> None:
        self.env = dict(os.environ)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-c", "from tests.forked import serve; serve()"],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                         cwd=Path(__file__).resolve().parent.parent, env=self.env)
        ready = self._reply(timeout_s=300)
        if ready.get("ready") is not True:
            raise RuntimeError(f"the session zygote did not start: {ready}; its log: {self._log_tail()}")

    def _log_tail(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-_LOG_TAIL_CHARS:]
        except OSError as error:
            return f"(unreadable: {error})"

    def _reply(self, timeout_s: float | None) -> dict:
        assert self.proc is not None and self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        if not ready:
            raise TimeoutError
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait(timeout=30)
            raise RuntimeError(f"the session zygote exited with code {code}; its log: {self._log_tail()}")
        return json.loads(line)

    def can_fork(self, env: dict[str, str]) -> bool:
        """Whether a session with ``env`` can be forked from the zygote (started now if it is not)."""
        if os.environ.get("DECODEBENCH_TEST_FORK", "1") == "0":
            return False
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        return import_time_env(env) == import_time_env(self.env)

    def run(self, args: list[str], *, cwd: Path, env: dict[str, str], stdout: Path, stderr: Path,
            timeout_s: float | None) -> int | None:
        """Run ``pytest.main(args)`` in a forked child; its exit code, or None on a timeout (then killed).

        ``env["PYTHONPATH"]`` may add entries in front of the zygote's (pytester adds the test's
        directory): the child puts them first on ``sys.path``, as a new interpreter would."""
        assert self.proc is not None and self.proc.stdin is not None
        base = [p for p in self.env.get("PYTHONPATH", "").split(os.pathsep) if p]
        wanted = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        extra = wanted[:len(wanted) - len(base)] if base and wanted[len(wanted) - len(base):] == base else wanted
        request = {"args": args, "cwd": str(cwd), "env": env, "stdout": str(stdout), "stderr": str(stderr),
                   "path": extra}
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        pid = self._reply(timeout_s=60)["pid"]
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
    print(json.dumps({"ready": True}), file=replies)
    for line in sys.stdin:
        request = json.loads(line) | {"replies_fd": replies.fileno()}
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _session(request)  # never returns
        print(json.dumps({"pid": pid}), file=replies)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"exit": os.waitstatus_to_exitcode(status)}), file=replies)


def _session(request: dict) -> None:
    """In the forked child: become the session's process, run pytest, exit with its code."""
    code = 1
    try:
        os.close(request["replies_fd"])  # the zygote's; the child stays in the test's process group
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(request["cwd"])
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
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
