"""A pool of worker processes, one per rank, joined by torch.distributed and reused by every job.

The parent (the pytest process) spawns one worker per local rank with the ``spawn`` start
method. Each worker sets the torchrun variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ...), pins its GPU, joins the process group (NCCL on CUDA, gloo on CPU)
through a TCP store the parent on node 0 hosts, and then waits on a pipe for jobs. A job is
the same picklable call for every rank; :meth:`ProcessGroupPool.run` returns each local
rank's answer or raises :class:`RankFailure` naming the rank and what happened to it.

Faults never hang the caller and never leave a process behind: a failed job kills the whole
pool (the next :meth:`~ProcessGroupPool.run` starts a fresh one), a rank that does not answer
is blamed by where its probe finds it (:mod:`~decodebench.distributed.worker`), and workers are
reaped on Ctrl-C, at exit and when the parent is SIGKILLed (docs/multigpu.md, "Faults"). Several
hosts: :meth:`Cluster.from_env`.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import signal
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from multiprocessing.connection import wait

from ..errors import BackendUnavailable
from .cluster import Cluster, ClusterError, RankInfo
from .worker import Job, RankContext, Whereabouts, _Reply, worker_main

__all__ = ["NO_MULTICAST_ENV", "Cluster", "ClusterError", "FailureKind", "Job", "PoolBroken", "ProcessGroupPool",
           "RankContext", "RankFailure", "RankInfo", "RankProblem", "Whereabouts"]

# Set in every worker unless the user set them: keep NVLink SHARP / multicast paths off, so
# the collectives take the routes a PCIe-only box has, and so they never touch multicast
# objects (which the lent GPU machines must not use).
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

_STOP_GRACE_S = 5.0  # a worker asked to stop leaves the process group within this
_KILL_GRACE_S = 3.0  # after SIGTERM, before SIGKILL
_REPORT_GRACE_S = 2.0  # after a first failure, how long the other ranks get to report theirs
_PROBE_S = 1.0  # how long a rank that did not answer gets to say where it is


# --- what went wrong -------------------------------------------------------------------------


class FailureKind(str, Enum):
    RAISED = "raised"  # the job raised on this rank
    DIED = "died"  # the process ended
    TIMEOUT = "timeout"  # no answer within the timeout, and not waiting in a collective: the cause
    STUCK = "stuck"  # waiting in a collective for a rank that failed or stopped answering


@dataclass(frozen=True)
class RankProblem:
    rank: int
    kind: FailureKind
    detail: str  # "raised ValueError: boom", "died with exit code -9 (SIGKILL)"
    traceback: str = ""
    where: str = ""  # for a rank that did not answer: what its probe said


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
        lines = [f"rank {p.rank} {p.detail} while {what}" + (f": {p.where}" if p.where else "")
                 for p in self.problems]
        for p in self.problems:
            if p.traceback:
                lines.append(f"--- traceback of rank {p.rank} ---\n{p.traceback.rstrip()}")
        super().__init__("\n".join(lines))

    @property
    def ranks(self) -> list[int]:
        return [p.rank for p in self.problems]


class PoolBroken(RuntimeError):
    """A multi-host pool failed earlier; its ranks on the other hosts cannot be re-joined."""


# --- the parent side ---------------------------------------------------------------------------


@dataclass
class _Worker:
    info: RankInfo
    process: multiprocessing.process.BaseProcess
    conn: object  # multiprocessing.connection.Connection
    probe: object  # the pipe to the worker's probe thread

    @property
    def rank(self) -> int:
        return self.info.rank

    def close(self) -> None:
        for conn in (self.conn, self.probe):
            conn.close()

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
            worker.close()
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
            probe_end, child_probe = context.Pipe()
            env = {**self.env, **info.environ()}
            process = context.Process(
                target=worker_main, name=f"decodebench-rank{info.rank}", daemon=True,
                args=(info, self.device_type, self.first_device, child_end, child_probe, os.getpid(), env,
                      self.timeout_s))
            process.start()
            child_end.close()  # so the parent sees EOF when the child goes
            child_probe.close()
            self._workers.append(_Worker(info, process, parent_end, probe_end))

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
    problems += _blame(list(pending.values()), problems, timeout_s)
    return replies, problems


def _blame(unanswered: list[_Worker], problems: list[RankProblem], timeout_s: float) -> list[RankProblem]:
    """Problems of the ranks that did not answer, from what their probes say.

    A rank in its own code, or whose probe does not answer either, stopped answering first;
    ranks inside a collective are waiting, for it or for a rank that already failed.
    """
    where = _probe(unanswered)
    causes = [w.rank for w in unanswered if where.get(w.rank) is None or where[w.rank].collective is None]
    blamed = [p.rank for p in problems] or causes
    out = []
    for worker in unanswered:
        found = where.get(worker.rank)
        said = found.describe() if found else "its probe did not answer either (frozen, or blocked in native code)"
        if worker.rank in causes and not problems:
            out.append(RankProblem(worker.rank, FailureKind.TIMEOUT, f"did not answer within {timeout_s:g} s",
                                   where=said))
        elif blamed and worker.rank not in blamed:
            who = ", ".join(map(str, blamed))
            detail = f"was still busy after rank {who} failed" if problems else f"was waiting for rank {who}"
            out.append(RankProblem(worker.rank, FailureKind.STUCK, detail, where=said))
        else:  # every rank is inside a collective: nobody to single out
            out.append(RankProblem(worker.rank, FailureKind.TIMEOUT, f"did not answer within {timeout_s:g} s",
                                   where=said))
    return out


def _probe(workers: list[_Worker]) -> dict[int, Whereabouts]:
    """Ask every worker's probe thread where its rank is; wait at most ``_PROBE_S`` in all."""
    asked = []
    for worker in workers:
        with contextlib.suppress(OSError, ValueError):
            worker.probe.send(True)
            asked.append(worker)
    answers: dict[int, Whereabouts] = {}
    deadline = time.monotonic() + _PROBE_S
    for worker in asked:
        with contextlib.suppress(EOFError, OSError):
            if worker.probe.poll(max(0.0, deadline - time.monotonic())):
                answers[worker.rank] = worker.probe.recv()
    return answers


def _reap(processes: list, grace_s: float) -> None:
    """Wait ``grace_s`` for the processes to end, then SIGTERM, then SIGKILL; join all."""
    _join_until(processes, time.monotonic() + grace_s)
    for stop in ("terminate", "kill"):
        for process in processes:
            if process.is_alive():
                getattr(process, stop)()
        _join_until(processes, time.monotonic() + _KILL_GRACE_S)


def _join_until(processes: list, deadline: float) -> None:
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))


@atexit.register
def _close_live_pools() -> None:
    """A session that ends without closing its pools (a crash in a fixture, sys.exit) reaps them."""
    for pool in list(_LIVE):
        pool.close(graceful=False)
