"""The rank side of a process group: what a job is and sees, and the worker process's loop.

A worker joins the group, then runs jobs sent over a pipe until told to stop. Beside the job, a
probe thread answers the parent's "where are you?" on a second pipe with a :class:`Whereabouts`:
the job and how long it has run, the collective the job declared (:meth:`RankContext.collective`)
or that the main thread is inside, and the innermost frame; how the parent blames a rank from
them: docs/multigpu.md ("Faults").
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from ..errors import BackendUnavailable
from .cluster import RankInfo

__all__ = ["Job", "RankContext", "Whereabouts"]

_PARENT_POLL_S = 1.0  # how often an idle worker checks that its parent is alive
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
# Frames of these packages are inside a collective (or waiting for one to finish).
_COLLECTIVE_MODULES = ("torch.distributed", "vllm.distributed")


@dataclass(frozen=True)
class Job:
    """``fn(ctx, *args)`` on every rank; ``fn`` must be importable by name (module level).

    >>> Job(print, ("hello",)).name
    'print'
    """

    fn: Callable
    args: tuple = ()

    @property
    def name(self) -> str:
        return getattr(self.fn, "__qualname__", repr(self.fn))


@dataclass
class _Status:
    """What the main thread is doing, written by it and read by the probe thread."""

    job: str | None = None
    job_since: float = 0.0
    collective: str | None = None
    collective_since: float = 0.0


_STATUS = _Status()


@dataclass
class RankContext:
    """What a job gets on its rank: where it runs and a cache that lives as long as the worker."""

    info: RankInfo
    device: object  # torch.device
    backend: str  # "nccl" or "gloo": the default group's
    cache: dict = field(default_factory=dict)

    def cpu_group(self):
        """A gloo group over every rank (the default group on CPU); vLLM's communicators
        want one beside the NCCL group. Every rank must ask for it in the same job."""
        import torch.distributed as dist

        if self.backend == "gloo":
            return dist.group.WORLD
        if "cpu_group" not in self.cache:
            self.cache["cpu_group"] = dist.new_group(backend="gloo")
        return self.cache["cpu_group"]

    @contextlib.contextmanager
    def collective(self, name: str) -> Iterator[None]:
        """Declare that the block waits on the other ranks (a collective, or CUDA work that
        contains one), so that a hang inside it is reported as waiting, not as the cause.

        Calls into ``torch.distributed`` are recognised without it; NCCL kernels queued
        earlier and waited for by a synchronize are not, hence this. Example::

            with ctx.collective("timing all_reduce"):
                measure(...)
        """
        outer = (_STATUS.collective, _STATUS.collective_since)
        _STATUS.collective, _STATUS.collective_since = name, time.time()
        try:
            yield
        finally:
            _STATUS.collective, _STATUS.collective_since = outer


@dataclass(frozen=True)
class Whereabouts:
    """A rank's answer to a probe: its job, and the collective it is in (None: its own code)."""

    job: str | None
    job_s: float  # seconds the job has run
    collective: str | None
    collective_s: float | None  # seconds inside a declared collective (None: not known)
    frame: str  # the main thread's innermost Python frame: "func (file.py:12)"

    def describe(self) -> str:
        """One phrase for a failure message.

        >>> Whereabouts("sleep_on", 2.0, None, None, "sleep_on (t.py:9)").describe()
        'in its own code at sleep_on (t.py:9), not in a collective'
        """
        if self.collective is None:
            return f"in its own code at {self.frame}, not in a collective"
        since = f" for {self.collective_s:.1f} s" if self.collective_s is not None else ""
        return f"waiting in collective {self.collective}{since}"


def locate(main_thread: int, status: _Status | None = None) -> Whereabouts:
    """Where the thread ``main_thread`` is now (read from another thread of the process)."""
    status = status or _STATUS
    now = time.time()
    frames = _stack(sys._current_frames().get(main_thread))
    declared = status.collective
    inside = next((f"{fn} ({mod.split('.')[0]}.distributed)" for mod, fn, _ in reversed(frames)
                   if mod.startswith(_COLLECTIVE_MODULES) and fn != "wrapper"), None)
    innermost = frames[0][2] if frames else "(no Python frame)"
    return Whereabouts(status.job, now - status.job_since if status.job else 0.0, declared or inside,
                       now - status.collective_since if declared else None, innermost)


def _stack(frame) -> list[tuple[str, str, str]]:
    """(module, function, "function (file:line)") from the innermost frame outwards."""
    out = []
    while frame is not None:
        code = frame.f_code
        where = f"{code.co_name} ({os.path.basename(code.co_filename)}:{frame.f_lineno})"
        out.append((frame.f_globals.get("__name__", ""), code.co_name, where))
        frame = frame.f_back
    return out


@dataclass(frozen=True)
class _Reply:
    value: object = None
    error: str | None = None  # "ValueError: boom"
    traceback: str = ""
    unavailable: bool = False  # the error is BackendUnavailable: a skip, not a failure

    @classmethod
    def failed(cls, exc: BaseException) -> _Reply:
        return cls(error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc(),
                   unavailable=isinstance(exc, BackendUnavailable))


# --- the worker process -------------------------------------------------------------------------


def worker_main(info: RankInfo, device_type: str, device_index: int, conn, probe_conn, parent_pid: int,
                env: dict[str, str], timeout_s: float) -> None:
    """Entry point of a worker process: join the group, then serve jobs until told to stop."""
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it reaps us
    os.environ.update(env)
    _start_probe_thread(probe_conn, threading.get_ident())
    _STATUS.job, _STATUS.job_since = "joining the process group", time.time()
    try:
        ctx = _join_group(info, device_type, device_index, timeout_s)
    except BaseException as exc:
        _send(conn, _Reply.failed(exc))
        return
    _STATUS.job = None
    _send(conn, _Reply(value=os.getpid()))
    if not _serve(conn, ctx, parent_pid):
        os._exit(1)  # orphaned: leaving the group could block on peers that are gone too
    _leave_group(ctx)


def _start_probe_thread(probe_conn, main_thread: int) -> None:
    def answer() -> None:
        with contextlib.suppress(EOFError, OSError):
            while probe_conn.recv() is not None:
                probe_conn.send(locate(main_thread))

    threading.Thread(target=answer, name="decodebench-probe", daemon=True).start()


def _die_with_parent(parent_pid: int) -> None:
    # PR_SET_PDEATHSIG fires when the *thread* that spawned us ends, so pools are started from
    # a thread that lives as long as the process (pytest's main thread).
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(1)


def _join_group(info: RankInfo, device_type: str, device_index: int, timeout_s: float) -> RankContext:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    extra = {}
    if device_type == "cuda":
        device = torch.device("cuda", device_index + info.local_rank)
        torch.cuda.set_device(device)
        extra["device_id"] = device  # eager NCCL init: a bad GPU fails here, not in the first job
        backend = "nccl"
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // info.local_world_size))
        backend = "gloo"
    store = dist.TCPStore(info.master_addr, info.master_port, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=info.rank, world_size=info.world_size,
                            timeout=timeout, **extra)
    return RankContext(info, device, backend)


def _serve(conn, ctx: RankContext, parent_pid: int) -> bool:
    """Run jobs until asked to stop (True) or until the parent is gone (False)."""
    while True:
        if not conn.poll(_PARENT_POLL_S):
            if os.getppid() != parent_pid:
                return False
            continue
        try:
            job = conn.recv()
        except EOFError:  # the parent closed its end
            return False
        if job is None:
            return True
        _send(conn, _execute(job, ctx))


def _execute(job: Job, ctx: RankContext) -> _Reply:
    _STATUS.job, _STATUS.job_since = job.name, time.time()
    try:
        return _Reply(value=job.fn(ctx, *job.args))
    except BaseException as exc:  # SystemExit from a job is a failure of the job, not of the worker
        return _Reply.failed(exc)
    finally:
        _STATUS.job = None


def _send(conn, reply: _Reply) -> None:
    try:
        conn.send(reply)
    except (BrokenPipeError, EOFError):
        os._exit(1)  # nobody is listening any more
    except Exception as exc:  # the answer does not pickle: say so instead
        conn.send(_Reply.failed(exc))


def _leave_group(ctx: RankContext) -> None:
    import torch.distributed as dist

    for obj in ctx.cache.values():
        with contextlib.suppress(Exception):
            getattr(obj, "close", lambda: None)()
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
