"""A server's process tree, signalled and waited for as one, and cleanup when the session ends abnormally.

The tree is the server's session (a child that left the process group with ``setpgrp``
stays in it) plus every descendant of a member, remembered once seen, so that a child
re-parented to init after its parent died is still found. Processes are ``psutil``
handles: one that exits and whose pid is reused is not mistaken for a member.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Protocol

import psutil

from ..errors import ServerError

__all__ = ["ProcessTree", "describe_exit", "forget_at_exit", "stop_at_exit"]


class ProcessTree:
    """A leader process and everything it spawned; :meth:`terminate` ends them all.

    Example::

        tree = ProcessTree(subprocess.Popen(argv, start_new_session=True))
        tree.pids()        # {leader, engine core, workers, ...}
        tree.terminate(grace_s=30.0)
    """

    def __init__(self, leader: subprocess.Popen) -> None:
        self.leader = leader
        self.seen: dict[int, psutil.Process] = {}

    def pids(self) -> set[int]:
        """The live (not zombie) members, after adding any new ones."""
        for proc in self._members():
            known = self.seen.get(proc.pid)
            if known is None or not known.is_running():  # a pid reused by a new member
                self.seen[proc.pid] = proc
        return {pid for pid, proc in self.seen.items() if _alive(proc)}

    def _members(self) -> list[psutil.Process]:
        root = self.leader.pid
        members = [proc for proc in psutil.process_iter() if _session(proc.pid) == root]
        for proc in [*members, *(p for p in self.seen.values() if _alive(p))]:
            try:
                members += proc.children(recursive=True)  # in case one started a session of its own
            except psutil.Error:
                pass  # gone meanwhile
        return members

    def signal(self, signum: int) -> None:
        try:
            os.killpg(self.leader.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass  # group already empty
        for pid in self.pids():
            try:
                self.seen[pid].send_signal(signum)  # psutil checks it is still the same process
            except psutil.Error:
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


def describe_exit(returncode: int) -> str:
    """How a process ended, from its ``Popen.returncode`` (negative: the signal that killed it).

    >>> describe_exit(3)
    'exited with code 3'
    >>> describe_exit(-9)
    'was killed by SIGKILL (signal 9)'
    """
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = "an unknown signal"
    return f"was killed by {name} (signal {-returncode})"


def _session(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None  # gone, or not ours to ask


def _alive(proc: psutil.Process) -> bool:
    """Running and not a zombie (a zombie holds no memory, GPU memory included)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


# --- cleanup when the session ends abnormally ----------------------------------------------


class Stoppable(Protocol):
    def stop(self) -> None: ...


_LIVE: set[Stoppable] = set()
_CLEANUP_LOCK = threading.Lock()
_cleanup_installed = False


def stop_at_exit(owner: Stoppable) -> None:
    """Stop ``owner`` at interpreter exit, and on SIGTERM/SIGHUP where nobody else handles them."""
    _install_cleanup()
    _LIVE.add(owner)


def forget_at_exit(owner: Stoppable) -> None:
    """``owner`` has stopped: nothing left to do for it at exit."""
    _LIVE.discard(owner)


def _stop_all() -> None:
    for owner in list(_LIVE):
        try:
            owner.stop()
        except Exception as exc:  # keep going: the next server must still be stopped
            print(f"decodebench: stopping {owner!r}: {exc}", file=sys.stderr)


def _stop_all_then_die(signum, frame) -> None:
    _stop_all()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)  # die of the signal as if we had not caught it


def _install_cleanup() -> None:
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
