"""Files whole: written whole or not at all (a temporary file beside the target, then a rename), and
read whole or refused naming the file (:func:`read_json`: every JSON file the package reads back, gzipped
or not: large stored results are kept as ``.json.gz``)."""

from __future__ import annotations

import fcntl
import gzip
import json
import os
import tempfile
import zlib
from pathlib import Path

__all__ = ["LARGEST_JSON_BYTES", "UnreadableFile", "read_json", "write_atomic"]

# The largest committed result (a 211-case H200 nightly with its samples) is 3 MB; a file a hundred
# times that is no file of ours, and reading it whole would take memory in proportion (a 2 GB file: 4.4 GB).
LARGEST_JSON_BYTES = 256 * 2**20


class UnreadableFile(ValueError):
    """A file that cannot be read as what it should be; the message names it and why."""


def read_json(path: Path):
    """The JSON value of ``path`` (decompressed first when its name ends in ``.gz``), or
    :class:`UnreadableFile` naming the file: missing or unreadable, larger than :data:`LARGEST_JSON_BYTES`
    (compressed or not), a damaged archive, not UTF-8 JSON, or nested deeper than Python's parser follows
    (a few hundred KB of ``[[[[`` raised RecursionError, which no reader caught).

    >>> read_json(Path("/nonexistent/0001_x.json"))
    Traceback (most recent call last):
    decodebench.files.UnreadableFile: cannot read /nonexistent/0001_x.json: No such file or directory
    >>> import tempfile
    >>> stored = Path(tempfile.mkdtemp()) / "0001_x.json.gz"
    >>> _ = stored.write_bytes(gzip.compress(b'{"benchmarks": []}'))
    >>> read_json(stored)
    {'benchmarks': []}
    >>> _ = stored.write_bytes(b"{}")
    >>> read_json(stored)
    Traceback (most recent call last):
    decodebench.files.UnreadableFile: ...0001_x.json.gz is not a readable gzip file: Not a gzipped file (b'{}')
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > LARGEST_JSON_BYTES:
            raise UnreadableFile(f"{path} is {size / 2**20:,.0f} MB, larger than a stored result can be "
                                 f"(at most {LARGEST_JSON_BYTES // 2**20} MB): not read")
        raw = _unzipped(path) if path.suffix == ".gz" else path.read_bytes()
    except OSError as exc:
        raise UnreadableFile(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        return json.loads(raw.decode("utf8"))
    except ValueError as exc:  # a UnicodeDecodeError too
        raise UnreadableFile(f"{path} is not valid JSON (truncated or damaged?): {exc}") from None
    except RecursionError:
        raise UnreadableFile(f"{path} nests its JSON deeper than it can be read: damaged, or not a file "
                             "of ours") from None


def _unzipped(path: Path) -> bytes:
    """A gzipped file's bytes, read no further than :data:`LARGEST_JSON_BYTES` (a small archive can hold a
    huge file); UnreadableFile naming it when it is damaged or too large."""
    try:
        with gzip.open(path) as handle:
            raw = handle.read(LARGEST_JSON_BYTES + 1)
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
        raise UnreadableFile(f"{path} is not a readable gzip file: {exc}") from None
    if len(raw) > LARGEST_JSON_BYTES:
        raise UnreadableFile(f"{path} holds more than {LARGEST_JSON_BYTES // 2**20} MB of JSON, more than a stored "
                             "result can be: not read")
    return raw


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename (readers see the old file or the
    new one, never a part), with the mode a plain write gets (0666 less the umask; mkstemp's own 0600
    would hide it from the group). The temporary file (``.<name>.XXXXXXXX.tmp``) is locked (``flock``)
    until it has its final name, so that :func:`decodebench.baselines.remove_stale_temporaries` can tell
    it from one a killed write left.

    >>> import tempfile
    >>> target = Path(tempfile.mkdtemp()) / "out" / "a.json"
    >>> write_atomic(target, b"{}"); target.read_bytes()
    b'{}'
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    mask = os.umask(0o022)  # reading the umask means setting it: put it back at once
    os.umask(mask)
    try:
        with os.fdopen(fd, "wb") as handle:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
            except OSError:
                pass  # a file system without flock (some network mounts): the age rule alone protects it
            handle.write(data)
            handle.flush()
            os.fchmod(handle.fileno(), 0o666 & ~mask)
            os.fsync(handle.fileno())
            os.replace(tmp, path)  # still locked: never seen unlocked under the temporary name
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
