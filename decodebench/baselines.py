"""Stored results: pytest-benchmark JSON files under ``baselines/<fingerprint>/`` (the hardware
fingerprint, not pytest-benchmark's host id), written whole or not at all (a temporary file renamed into
place; one a killed save leaves is removed by a later save, :func:`remove_stale_temporaries`). What is
read, refused or passed over, and why: docs/stored-results.md.
"""

from __future__ import annotations

import fcntl
import os
import re
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest
from pytest_benchmark.storage.file import FileStorage
from pytest_benchmark.utils import safe_dumps

from .entry_check import usable_entries
from .files import write_atomic
from .results import Result, not_a_baseline, read_result, record_of, stored_fingerprint

__all__ = [
    "FingerprintStorage",
    "History",
    "StoredResult",
    "check_can_save",
    "check_writable",
    "load_history",
    "remove_stale_temporaries",
    "stored_number",
    "stored_results",
    "write_json_atomically",
]

RESULT_GLOB = "[0-9]*_*.json"  # pytest-benchmark's NNNN_<name>.json; stored_number() decides
_NUMBERED = re.compile(r"([0-9]{4,})_.*\.json")


def stored_number(path: Path) -> int | None:
    """A stored result's number (``0007_x.json`` -> 7), None for another file. The reader and the
    writer (:attr:`FingerprintStorage._next_num`) agree past 9999: ``10000_x.json`` is number 10000.

    >>> stored_number(Path("b/0007_x.json")), stored_number(Path("10000_x.json")), stored_number(Path("7_x.json"))
    (7, 10000, None)
    """
    match = _NUMBERED.fullmatch(Path(path).name)
    return int(match.group(1)) if match else None


def stored_results(folder: Path) -> list[Path]:
    """The stored results of ``folder``, in the order of their numbers (oldest first)."""
    found = [p for p in Path(folder).glob(RESULT_GLOB) if stored_number(p) is not None]
    return sorted(found, key=lambda p: (stored_number(p), p.name))


def write_json_atomically(path: Path, document: Mapping) -> None:
    """Write ``document`` to ``path`` as pytest-benchmark writes it, whole or not at all
    (:func:`decodebench.files.write_atomic`)."""
    write_atomic(path, safe_dumps(document, ensure_ascii=True, indent=4).encode())


def _unlocked(fd: int) -> bool:
    """Whether no process holds a lock on ``fd``'s file (taking it, until ``fd`` is closed)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        return True  # no flock here: the age rule alone decides
    return True


# write_atomic's temporary files for stored results (NNNN_<name>.json), and no other name.
_TEMPORARY = re.compile(r"\.[0-9]{4,}_.*\.json\.[a-z0-9_]{8}\.tmp")
# Younger temporaries are left alone even when unlocked: a writer locks its file microseconds
# after creating it, and a writer without the lock (an older decodebench) saves in milliseconds.
STALE_AFTER_S = 10.0


def remove_stale_temporaries(folder: Path, now: float | None = None) -> list[Path]:
    """Remove the temporary files that killed saves left in ``folder``; the paths removed.

    Only files of :func:`~decodebench.files.write_atomic`'s naming for stored results, that no
    process has locked (the kernel drops a writer's lock when it dies, ``kill -9``
    included) and that are older than :data:`STALE_AFTER_S`, e.g. ``baselines/cpu-x/.0003_x.json.k2j4_p9q.tmp``.
    """
    now = time.time() if now is None else now
    removed = []
    for path in sorted(Path(folder).glob(".*.tmp")):
        if _TEMPORARY.fullmatch(path.name) and _stale(path, now):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def _stale(path: Path, now: float) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False  # gone meanwhile, or not ours to read
    try:
        return os.fstat(fd).st_mtime < now - STALE_AFTER_S and _unlocked(fd)
    finally:
        os.close(fd)  # releases the probe's lock; the file is removed by name right after


def check_writable(folder: Path) -> None:
    """Raise ValueError naming ``folder`` unless a file can be created in it (it is made if missing).

    It creates and removes a file, as a save does: permissions alone (``os.access``) miss
    read-only mounts and root's exemptions.

    >>> check_writable(Path("/proc/no-such-folder"))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: cannot write to /proc/no-such-folder: ...
    """
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".decodebench-write-probe.", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ValueError(f"cannot write to {folder}: {exc.strerror or exc}") from None


def check_can_save(bench_session) -> None:
    """At session start: fail at once (a usage error naming the folder) when results are to be
    saved (``--benchmark-save``/``--benchmark-autosave``) where they cannot be written, rather than
    after every case has been measured."""
    flag = "--benchmark-save" if bench_session.save else "--benchmark-autosave" if bench_session.autosave else None
    if flag is None:
        return
    try:
        check_writable(bench_session.storage.folder)
    except ValueError as exc:
        raise pytest.UsageError(f"{flag}: {exc}; nothing was measured") from None


# The releases whose internals decodebench uses (check_pytest_benchmark's message names them); ci/env.sh
# and pyproject.toml pin the same range.
PYTEST_BENCHMARK_SUPPORTED = ((5, 1), (6, 0))  # at least 5.1, below 6.0


def check_pytest_benchmark(version: str) -> None:
    """Refuse a pytest-benchmark release outside the range decodebench's internals use.

    >>> check_pytest_benchmark("5.3.1")
    >>> check_pytest_benchmark("6.0.0")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    RuntimeError: pytest-benchmark 6.0.0 is installed; decodebench needs >=5.1,<6.0 ...
    """
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    low, high = PYTEST_BENCHMARK_SUPPORTED
    if not low <= parts < high:
        wanted = f">={low[0]}.{low[1]},<{high[0]}.{high[1]}"
        raise RuntimeError(f"pytest-benchmark {version} is installed; decodebench needs {wanted} (it uses "
                           "FileStorage._next_num and config._benchmarksession, which are not public API): "
                           f"pip install 'pytest-benchmark{wanted}'")


class FingerprintStorage(FileStorage):
    """pytest-benchmark's file storage with the fingerprint as folder and atomic saves.

    A save that fails (the folder became unwritable, the disk is full) is one error line and
    fails the ``session`` given (exit status 1); the session's table is still shown.
    """

    def __init__(self, path, logger, default_machine_id=None, session=None):
        super().__init__(path, logger, default_machine_id)
        self.session = session

    @property
    def folder(self) -> Path:
        """Where this fingerprint's results are saved."""
        return self.path / self.default_machine_id if self.default_machine_id else self.path

    @property
    def location(self) -> str:  # pytest-benchmark assumes the storage lies under the working directory
        return str(_relative(self.path, Path.cwd()))

    def load(self, *globs_or_files):
        """The results the user named (``--benchmark-compare=NUM``), each without the entries that
        cannot be used (its comparison table never sees an impossible number; they are named in
        :attr:`skipped`). ValueError naming a file that cannot be read or is no baseline."""
        self.skipped: list[str] = getattr(self, "skipped", [])
        for path in self.query(*globs_or_files or ("[0-9][0-9][0-9][0-9]_",)):
            document = read_result(path)  # ValueError naming the file (pytest-benchmark warned and went on)
            why = not_a_baseline(path, document)
            if why:
                raise ValueError(f"--benchmark-compare: {why}")
            usable, skipped = usable_entries(document["benchmarks"], path)
            self.skipped += [line for line in skipped if line not in self.skipped]
            yield _relative(path, self.path), {**document, "benchmarks": list(usable.values())}

    @property
    def _next_num(self) -> str:
        """The number of the next save: one past the highest stored (pytest-benchmark's own reads four
        digits only, so that after ``9999`` every save was ``10000`` and never loaded again)."""
        numbers = [stored_number(p) for p in stored_results(self.folder)] if self.folder.is_dir() else []
        return f"{max(numbers, default=0) + 1:04d}"

    def save(self, output_json, save):
        for path in remove_stale_temporaries(self.folder):
            self.logger.info(f"decodebench: removed {path}, left by an interrupted save")
        output_file = Path(self.get(f"{self._next_num}_{save}.json"))
        if output_file.exists():
            raise FileExistsError(f"refusing to overwrite stored result {output_file}")
        try:
            write_json_atomically(output_file, output_json)
        except OSError as exc:
            self._failed(f"cannot write {output_file}: {exc.strerror or exc}")
            return
        self.saved_path = output_file  # the summary links to it
        self.logger.info(f"Saved benchmark data in: {output_file}")

    def _failed(self, why: str) -> None:
        # pytest-benchmark computes the table after saving: raising here would lose it behind a traceback
        self.logger.error(f"decodebench: nothing was stored: {why} (this run's results are in the table below)")
        if self.session is not None and self.session.exitstatus == pytest.ExitCode.OK:
            self.session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _relative(path: Path, root: Path) -> Path:
    """``path`` under ``root`` as pytest-benchmark names a loaded file (itself where it lies elsewhere)."""
    try:
        return path.relative_to(root)
    except ValueError:
        return path


@dataclass(frozen=True)
class StoredResult:
    path: Path
    document: Mapping

    def entries(self) -> dict[str, Result]:
        """The usable benchmark entries by test node id (``fullname``), each as its record; :meth:`skipped`
        names the others."""
        return {name: record_of(e) for name, e in usable_entries(self.document["benchmarks"], self.path)[0].items()}

    def skipped(self) -> list[str]:
        """One line per entry that cannot be used (``PATH: case X: sample 3 is NaN``)."""
        return usable_entries(self.document["benchmarks"], self.path)[1]


@dataclass(frozen=True)
class History:
    """The readable results of one fingerprint (oldest first) and the files passed over."""

    folder: Path
    results: tuple[StoredResult, ...]
    skipped: tuple[str, ...]  # "<path>: <why>", one per file that was not used

    def why_empty(self) -> str:
        """Why nothing here can be compared against (for a history without results)."""
        if self.skipped:
            return "no usable stored result: " + "; ".join(self.skipped)
        return f"no stored result in {self.folder} (first run on this machine?)"


def load_history(folder: Path, fingerprint: str | None = None) -> History:
    """Every result in ``folder`` (oldest first) that can be a baseline, of ``fingerprint`` when given.

    A file that cannot be read as a result raises ValueError naming it (:func:`read_result`);
    results of another fingerprint and those that are no baseline (:func:`not_a_baseline`) are
    skipped and named.
    """
    results, skipped = [], []
    for path in stored_results(folder):
        document = read_result(path)
        theirs = stored_fingerprint(document)
        if fingerprint is not None and theirs != fingerprint:
            skipped.append(f"{path} was measured on {theirs or 'an unknown machine'}, not {fingerprint}")
            continue
        why = not_a_baseline(path, document)
        if why:
            skipped.append(why)
            continue
        results.append(StoredResult(path, document))
    return History(Path(folder), tuple(results), tuple(skipped))
