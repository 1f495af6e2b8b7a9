"""A pool of worker processes, one per rank, joined by torch.distributed and reused by every job.

The parent (the pytest process) spawns one worker per local rank with the ``spawn`` start
method. Each worker sets the torchrun variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ...), pins its GPU, joins the process group (NCCL on CUDA, gloo on CPU)
through a TCP store the parent on node 0 hosts, and then waits on a pipe for jobs. A job is
the same picklable call for every rank; :meth:`ProcessGroupPool.run` returns each local
rank's answer or raises :class:`RankFailure` naming the rank and what happened to it.

Faults never hang the caller and never leave a process behind:

* a rank that raises, dies or does not answer within the timeout fails the job; the other
  ranks are most likely stuck in a collective with it, so the whole pool is killed
  (terminate, wait, kill) and the next :meth:`~ProcessGroupPool.run` starts a fresh one;
* Ctrl-C reaches the parent only (workers ignore SIGINT); the parent reaps the workers on
  the way out, and an ``atexit`` hook reaps any pool still open when the interpreter ends;
* workers die with their parent even when it is SIGKILLed (``PR_SET_PDEATHSIG`` on Linux,
  and a ``getppid`` check while idle everywhere).

Several hosts: run one pytest per host with the same command line and the torchrun
variables ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``NODE_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT`` (see :meth:`Cluster.from_env` and docs/multigpu.md).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import multiprocessing
import os
import signal
import sys
import time
import traceback
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from multiprocessing.connection import wait

from ..errors import BackendUnavailable

__all__ = [
    "NO_MULTICAST_ENV",
    "Cluster",
    "ClusterError",
    "FailureKind",
    "Job",
    "PoolBroken",
    "ProcessGroupPool",
    "RankContext",
    "RankFailure",
    "RankInfo",
    "RankProblem",
]

# Set in every worker unless the user set them: keep NVLink SHARP / multicast paths off, so
# the collectives take the routes a PCIe-only box has, and so they never touch multicast
# objects (which the lent GPU machines must not use).
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

_STOP_GRACE_S = 5.0  # a worker asked to stop leaves the process group within this
_KILL_GRACE_S = 3.0  # after SIGTERM, before SIGKILL
_REPORT_GRACE_S = 2.0  # after a first failure, how long the other ranks get to report theirs
_PARENT_POLL_S = 1.0  # how often an idle worker checks that its parent is alive
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


# --- where the ranks run: torchrun-style placement ----------------------------------------


class ClusterError(ValueError):
    """The world size or the torchrun-style environment cannot describe a process group."""


@dataclass(frozen=True)
class RankInfo:
    """One rank's place in the world, as torchrun would describe it to the process."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int

    def environ(self) -> dict[str, str]:
        """The variables a torchrun-launched process of this rank would see.

        >>> RankInfo(9, 1, 16, 8, 1, "10.0.0.1", 29500).environ()["RANK"]
        '9'
        """
        return {
            "RANK": str(self.rank),
            "LOCAL_RANK": str(self.local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "GROUP_RANK": str(self.node_rank),
            "NODE_RANK": str(self.node_rank),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }


@dataclass(frozen=True)
class Cluster:
    """This host's share of a process group: ``local_world_size`` ranks of ``world_size``.

    Global rank of local rank ``i`` is ``node_rank * local_world_size + i``. On one host the
    rendezvous is 127.0.0.1 on a free port; over several hosts ``master_addr`` and
    ``master_port`` name node 0, where the parent hosts the store.

    >>> Cluster.single_host(2).global_ranks()
    range(0, 2)
    """

    world_size: int
    local_world_size: int
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: node 0 binds a free port (one host only)

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.local_world_size < 1:
            raise ClusterError(f"world size {self.world_size} and local world size "
                               f"{self.local_world_size} must both be at least 1")
        if self.world_size % self.local_world_size:
            raise ClusterError(f"LOCAL_WORLD_SIZE={self.local_world_size} does not divide "
                               f"WORLD_SIZE={self.world_size}: every host must run as many ranks")
        if not 0 <= self.node_rank < self.nnodes:
            raise ClusterError(f"NODE_RANK={self.node_rank} is outside 0..{self.nnodes - 1} "
                               f"(WORLD_SIZE={self.world_size} / LOCAL_WORLD_SIZE={self.local_world_size})")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ClusterError(f"MASTER_PORT={self.master_port} is not a TCP port")
        if self.multi_host and (self.master_port is None or _is_loopback(self.master_addr)):
            raise ClusterError(f"a process group over {self.nnodes} hosts needs MASTER_ADDR (node 0's "
                               f"address, not {self.master_addr!r}) and MASTER_PORT (a free port there)")

    @classmethod
    def single_host(cls, world_size: int) -> Cluster:
        return cls(world_size, world_size)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, *, world_size: int | None = None,
                 default_world_size: int = 1) -> Cluster:
        """Read ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``NODE_RANK`` (or torchrun's
        ``GROUP_RANK``), ``MASTER_ADDR`` and ``MASTER_PORT``.

        ``world_size`` (the ``--world-size`` option) wins over ``WORLD_SIZE`` and must agree
        with it when both are given; ``default_world_size`` applies when neither is.
        Without ``LOCAL_WORLD_SIZE`` every rank runs on this host.

        >>> c = Cluster.from_env({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "NODE_RANK": "1",
        ...                       "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"})
        >>> c.nnodes, c.global_ranks()
        (2, range(8, 16))
        """
        env = os.environ if environ is None else environ
        _refuse_torchrun_worker(env)
        env_world = _env_int(env, "WORLD_SIZE")
        if world_size is not None and env_world is not None and world_size != env_world:
            raise ClusterError(f"--world-size {world_size} disagrees with WORLD_SIZE={env_world}; drop one")
        world = world_size or env_world or default_world_size
        local = _env_int(env, "LOCAL_WORLD_SIZE") or world
        node = _env_int(env, "NODE_RANK")
        node = _env_int(env, "GROUP_RANK") if node is None else node
        return cls(world, local, node or 0, env.get("MASTER_ADDR") or "127.0.0.1", _env_int(env, "MASTER_PORT"))

    @property
    def nnodes(self) -> int:
        return self.world_size // self.local_world_size

    @property
    def multi_host(self) -> bool:
        return self.nnodes > 1

    def global_ranks(self) -> range:
        first = self.node_rank * self.local_world_size
        return range(first, first + self.local_world_size)

    def local_ranks(self, master_port: int) -> list[RankInfo]:
        """The :class:`RankInfo` of every rank this host runs, given the store's port."""
        return [RankInfo(rank, local, self.world_size, self.local_world_size, self.node_rank,
                         self.master_addr, master_port)
                for local, rank in enumerate(self.global_ranks())]


def _is_loopback(addr: str) -> bool:
    return addr in ("localhost", "::1") or addr.startswith("127.")


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    text = env.get(name)
    if text is None or text.strip() == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise ClusterError(f"{name}={text!r} is not an integer") from None


def _refuse_torchrun_worker(env: Mapping[str, str]) -> None:
    # Under torchrun every pytest would be one rank *and* spawn ranks of its own; torchrun's
    # agent also already holds MASTER_PORT. Say what to do instead of half-working.
    for name in ("RANK", "LOCAL_RANK"):
        if name in env:
            raise ClusterError(
                f"{name}={env[name]} is set: decodebench starts one process per rank itself, so run one "
                "pytest per host (not under torchrun) with WORLD_SIZE, LOCAL_WORLD_SIZE, NODE_RANK, "
                f"MASTER_ADDR and MASTER_PORT, and unset {name} (docs/multigpu.md)")


# --- what a job is and what it sees ---------------------------------------------------------


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


# --- what went wrong -------------------------------------------------------------------------


class FailureKind(str, Enum):
    RAISED = "raised"  # the job raised on this rank
    DIED = "died"  # the process ended
    TIMEOUT = "timeout"  # no answer within the timeout
    STUCK = "stuck"  # still busy after another rank failed: waiting for it in a collective


@dataclass(frozen=True)
class RankProblem:
    rank: int
    kind: FailureKind
    detail: str  # "raised ValueError: boom", "died with exit code -9 (SIGKILL)"
    traceback: str = ""


# A death usually causes its peers' errors (connection reset), so it is listed first.
_CAUSE_FIRST = {FailureKind.DIED: 0, FailureKind.RAISED: 1, FailureKind.TIMEOUT: 2, FailureKind.STUCK: 3}


class RankFailure(RuntimeError):
    """A job failed on one or more ranks; the message names each rank and why.

    ``problems`` lists causes first (raised, died), then ranks that timed out or were left
    waiting for them. The pool that ran the job has been torn down.
    """

    def __init__(self, what: str, problems: list[RankProblem]):
        self.what = what
        self.problems = tuple(sorted(problems, key=lambda p: (_CAUSE_FIRST[p.kind], p.rank)))
        lines = [f"rank {p.rank} {p.detail} while {what}" for p in self.problems]
        for p in self.problems:
            if p.traceback:
                lines.append(f"--- traceback of rank {p.rank} ---\n{p.traceback.rstrip()}")
        super().__init__("\n".join(lines))

    @property
    def ranks(self) -> list[int]:
        return [p.rank for p in self.problems]


class PoolBroken(RuntimeError):
    """A multi-host pool failed earlier; its ranks on the other hosts cannot be re-joined."""


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


# --- the worker side -------------------------------------------------------------------------


def _worker_main(info: RankInfo, device_type: str, device_index: int, conn, parent_pid: int,
                 env: dict[str, str], timeout_s: float) -> None:
    """Entry point of a worker process: join the group, then serve jobs until told to stop."""
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it reaps us
    os.environ.update(env)
    try:
        ctx = _join_group(info, device_type, device_index, timeout_s)
    except BaseException as exc:
        _send(conn, _Reply.failed(exc))
        return
    _send(conn, _Reply(value=os.getpid()))
    if not _serve(conn, ctx, parent_pid):
        os._exit(1)  # orphaned: leaving the group could block on peers that are gone too
    _leave_group(ctx)


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
    try:
        return _Reply(value=job.fn(ctx, *job.args))
    except BaseException as exc:  # SystemExit from a job is a failure of the job, not of the worker
        return _Reply.failed(exc)


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


# --- the parent side ---------------------------------------------------------------------------


@dataclass
class _Worker:
    info: RankInfo
    process: multiprocessing.process.BaseProcess
    conn: object  # multiprocessing.connection.Connection

    @property
    def rank(self) -> int:
        return self.info.rank

    def send(self, job: Job | None) -> None:
        with contextlib.suppress(OSError, ValueError):  # a dead rank shows up in _gather
            self.conn.send(job)

    def receive(self) -> _Reply | None:
        """The rank's answer, or None when it died; read the pipe first, since a rank may
        answer and then exit."""
        try:
            if self.conn.poll():
                return self.conn.recv()
        except (EOFError, OSError):
            pass
        return None

    def death(self) -> str:
        self.process.join(timeout=1.0)
        code = self.process.exitcode
        if code is None:
            return "closed its pipe but is still running"
        if code < 0:
            with contextlib.suppress(ValueError):
                return f"died with exit code {code} ({signal.Signals(-code).name})"
        return f"died with exit code {code}"


_LIVE: weakref.WeakSet = weakref.WeakSet()


class ProcessGroupPool:
    """One worker process per local rank, joined by torch.distributed and reused by every job.

    The pool starts on the first :meth:`run` (or :meth:`start`), and again after a fault.

    Example::

        def world(ctx):
            return ctx.info.rank, ctx.info.world_size

        with ProcessGroupPool(Cluster.single_host(2)) as pool:
            pool.run(Job(world))           # [(0, 2), (1, 2)]
    """

    def __init__(self, cluster: Cluster, device_type: str = "cpu", *, first_device: int = 0,
                 timeout_s: float = 120.0, env: Mapping[str, str] | None = None):
        self.cluster = cluster
        self.device_type = device_type
        self.first_device = first_device
        self.timeout_s = timeout_s
        # Workers inherit this environment; add what it lacks, then the caller's overrides.
        self.env = {**{k: v for k, v in NO_MULTICAST_ENV.items() if k not in os.environ}, **(env or {})}
        self.starts = 0  # how many times workers were spawned: more than 1 means a fault happened
        self._workers: list[_Worker] = []
        self._store = None
        self._broken: RankFailure | None = None

    @property
    def backend(self) -> str:
        return "nccl" if self.device_type == "cuda" else "gloo"

    @property
    def running(self) -> bool:
        return bool(self._workers)

    @property
    def pids(self) -> list[int]:
        return [w.process.pid for w in self._workers]

    def __enter__(self) -> ProcessGroupPool:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def start(self) -> None:
        """Spawn the workers and wait until every rank joined the group (or raise RankFailure)."""
        if self.running:
            return
        if self._broken is not None and self.cluster.multi_host:
            raise PoolBroken("the process group over several hosts failed earlier and its remote ranks "
                             f"cannot be re-joined; rerun on every host. Earlier failure:\n{self._broken}")
        _LIVE.add(self)
        self.starts += 1
        try:
            self._spawn(self._host_store())
            self._answers(f"joining the {self.backend} process group", self.timeout_s)
        except BaseException:
            self.close(graceful=False)
            raise

    def run(self, job: Job, timeout_s: float | None = None) -> list:
        """Run ``job`` on every rank; return each local rank's value, by local rank.

        Raises :class:`RankFailure` (and tears the pool down) when a rank raises, dies or
        does not answer within ``timeout_s`` (default: the pool's). When every rank raises
        :class:`~decodebench.errors.BackendUnavailable`, that is re-raised and the pool kept.
        """
        self.start()
        try:
            for worker in self._workers:
                worker.send(job)
            return self._answers(f"running {job.name}", timeout_s or self.timeout_s)
        except BackendUnavailable:
            raise
        except BaseException:  # incl. KeyboardInterrupt: ranks may be mid-collective, kill them all
            self.close(graceful=False)
            raise

    def close(self, graceful: bool = True) -> None:
        """Stop every worker: ask (when graceful), then terminate, then kill; always reaps."""
        workers, self._workers = self._workers, []
        if graceful:
            for worker in workers:
                worker.send(None)
        _reap([w.process for w in workers], _STOP_GRACE_S if graceful else 0.0)
        for worker in workers:
            worker.conn.close()
        self._store = None
        _LIVE.discard(self)

    def _host_store(self) -> int:
        """Node 0 hosts the rendezvous store; binding port 0 picks a free port without a race."""
        from datetime import timedelta

        import torch.distributed as dist

        cluster = self.cluster
        if cluster.node_rank != 0:
            return cluster.master_port
        self._store = dist.TCPStore(cluster.master_addr, cluster.master_port or 0, is_master=True,
                                    wait_for_workers=False, timeout=timedelta(seconds=self.timeout_s))
        return self._store.port

    def _spawn(self, master_port: int) -> None:
        context = multiprocessing.get_context("spawn")
        for info in self.cluster.local_ranks(master_port):
            parent_end, child_end = context.Pipe()
            env = {**self.env, **info.environ()}
            process = context.Process(
                target=_worker_main, name=f"decodebench-rank{info.rank}", daemon=True,
                args=(info, self.device_type, self.first_device, child_end, os.getpid(), env, self.timeout_s))
            process.start()
            child_end.close()  # so the parent sees EOF when the child goes
            self._workers.append(_Worker(info, process, parent_end))

    def _answers(self, what: str, timeout_s: float) -> list:
        replies, problems = _gather(self._workers, timeout_s)
        if not problems:
            return [replies[w.rank].value for w in self._workers]
        if all(p.kind is FailureKind.RAISED for p in problems) and all(r.unavailable for r in replies.values()) \
                and len(replies) == len(self._workers):
            raise BackendUnavailable(replies[self._workers[0].rank].error.split(": ", 1)[-1])
        self._broken = RankFailure(what, problems)
        raise self._broken


def _gather(workers: list[_Worker], timeout_s: float) -> tuple[dict[int, _Reply], list[RankProblem]]:
    """Wait for every rank's answer, a death or the deadline; after a first failure wait only
    a short grace for the others, since they are usually blocked in a collective with it."""
    replies: dict[int, _Reply] = {}
    problems: list[RankProblem] = []
    pending = {w.rank: w for w in workers}
    deadline = time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        ready = set(wait([o for w in pending.values() for o in (w.conn, w.process.sentinel)],
                         timeout=max(0.0, deadline - time.monotonic())))
        for worker in [w for w in pending.values() if {w.conn, w.process.sentinel} & ready]:
            del pending[worker.rank]
            reply = worker.receive()
            if reply is None:
                problems.append(RankProblem(worker.rank, FailureKind.DIED, worker.death()))
                continue
            replies[worker.rank] = reply
            if reply.error is not None:
                problems.append(RankProblem(worker.rank, FailureKind.RAISED, f"raised {reply.error}",
                                            reply.traceback))
        if problems:
            deadline = min(deadline, time.monotonic() + _REPORT_GRACE_S)
    problems += [_unanswered(rank, problems, timeout_s) for rank in pending]
    return replies, problems


def _unanswered(rank: int, problems: list[RankProblem], timeout_s: float) -> RankProblem:
    if problems:
        causes = ", ".join(str(p.rank) for p in problems)
        return RankProblem(rank, FailureKind.STUCK, f"was still busy after rank {causes} failed "
                                                    "(most likely waiting for it in a collective)")
    return RankProblem(rank, FailureKind.TIMEOUT, f"did not answer within {timeout_s:g} s")


def _reap(processes: list, grace_s: float) -> None:
    """Wait ``grace_s`` for the processes to end, then SIGTERM, then SIGKILL; join all."""
    deadline = time.monotonic() + grace_s
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + _KILL_GRACE_S
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join(timeout=_KILL_GRACE_S)


@atexit.register
def _close_live_pools() -> None:
    """A session that ends without closing its pools (a crash in a fixture, sys.exit) reaps them."""
    for pool in list(_LIVE):
        pool.close(graceful=False)
