"""Other measuring sessions on the same device: two sessions timing at once slow each other (on the
2-core CPU machine one of two autosaving sessions reported a false SLOWER from the other's load).

A session that measures registers (:meth:`Neighbours.enter`): a file under
``<tmp>/decodebench-sessions/<device>/`` (``DECODEBENCH_SESSIONS_DIR`` names another folder) holding its
pid and start, locked (``flock``) while it lives, given its end when it leaves. :meth:`Neighbours.seen`
names every other session whose time overlaps this one's: alive (locked), ended after this one started,
or killed (unlocked without an end: its last write is its end). Records ended over an hour ago go. What
the gate does with them: docs/stored-results.md, "Interrupted sessions and neighbours".
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import tempfile
import time
from pathlib import Path

from .baselines import check_writable

__all__ = ["Neighbours", "device_key"]

KEEP_ENDED_S = 3600.0  # records of ended sessions older than this are removed


def device_key(device) -> str:
    """One name per physical device: ``cpu``, or a GPU's UUID (its index where torch gives none).

    >>> import torch
    >>> device_key(torch.device("cpu"))
    'cpu'
    """
    if device.type != "cuda":
        return "cpu"
    import torch

    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    return re.sub(r"[^A-Za-z0-9_.-]", "_", f"gpu-{uuid}" if uuid else f"cuda-{device.index or 0}")


class Neighbours:
    """This session's record on ``device`` and the other sessions it overlapped."""

    def __init__(self, device: str, folder: Path | None = None) -> None:
        default = os.environ.get("DECODEBENCH_SESSIONS_DIR") or Path(tempfile.gettempdir()) / "decodebench-sessions"
        self.folder = Path(folder or default) / device
        self.start: float | None = None
        self._path: Path | None = None
        self._fd: int | None = None

    def check_writable(self) -> None:
        """Raise ValueError naming the folder and what it is for unless a record can be written there."""
        try:
            check_writable(self.folder)
        except ValueError as exc:
            named = "DECODEBENCH_SESSIONS_DIR" if os.environ.get("DECODEBENCH_SESSIONS_DIR") else "the sessions folder"
            raise ValueError(f"{named}: {exc}; measuring sessions leave a record there so that two sessions on one "
                             "device see each other (name a writable folder in DECODEBENCH_SESSIONS_DIR)") from None

    def enter(self) -> None:
        """Register this session as measuring from now (once; later calls do nothing)."""
        if self._fd is not None:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        self.start = time.time()
        self._path = self.folder / f"{os.getpid()}-{time.time_ns()}.json"
        self._fd = os.open(self._path, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o644)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        self._write({"pid": os.getpid(), "start": self.start})

    def leave(self) -> None:
        """Record this session's end and let its record go (others still see when it ran)."""
        if self._fd is None:
            return
        try:
            self._write({"pid": os.getpid(), "start": self.start, "end": time.time()})
        finally:
            os.close(self._fd)  # drops the lock
            self._fd = None

    def seen(self) -> list[str]:
        """The other sessions whose time overlapped this one's, e.g. ``['pid 4242 (running)']``."""
        if self.start is None or not self.folder.is_dir():
            return []
        now, found = time.time(), []
        for path in sorted(self.folder.glob("*.json")):
            if path == self._path:
                continue
            record = _read(path, now)
            if record is None:
                continue
            pid, start, end, running = record
            if not running and end < now - KEEP_ENDED_S:
                path.unlink(missing_ok=True)
            elif start <= now and (running or end >= self.start):
                found.append(f"pid {pid} ({'running' if running else 'ended'})")
        return found

    def _write(self, record: dict) -> None:
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, json.dumps(record).encode(), 0)


def _read(path: Path, now: float) -> tuple[int, float, float, bool] | None:
    """A session record: pid, start, end (now while it runs) and whether it runs; None if unreadable."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None  # gone meanwhile
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            running = False
        except BlockingIOError:
            running = True
        text = os.read(fd, 4096).decode(errors="replace")
        mtime = os.fstat(fd).st_mtime
    finally:
        os.close(fd)
    try:
        record = json.loads(text)
        pid, start = int(record["pid"]), float(record["start"])
    except (ValueError, KeyError, TypeError):
        return None  # being written, or not ours
    end = now if running else float(record.get("end") or mtime)  # killed: its last write
    return pid, start, end, running
