"""Files whole: written whole or not at all (a temporary file beside the target, then a rename), and
read whole or refused naming the file (:func:`read_json`: every JSON file the package reads back)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

__all__ = ["LARGEST_JSON_BYTES", "UnreadableFile", "read_json", "write_atomic"]

# The largest committed result (a 211-case H200 nightly with its samples) is 3 MB; a file a hundred
# times that is no file of ours, and reading it whole would take memory in proportion (a 2 GB file: 4.4 GB).
LARGEST_JSON_BYTES = 256 * 2**20


class UnreadableFile(ValueError):
    """A file that cannot be read as what it should be; the message names it and why."""


def read_json(path: Path):
    """The JSON value of ``path``, or :class:`UnreadableFile` naming the file: missing or unreadable,
    larger than :data:`LARGEST_JSON_BYTES`, not UTF-8 JSON, or nested deeper than Python's parser
    follows (a few hundred KB of ``[[[[`` raised RecursionError, which no reader caught).

    >>> read_json(Path("/nonexistent/0001_x.json"))
    Traceback (most recent call last):
    decodebench.files.UnreadableFile: cannot read /nonexistent/0001_x.json: No such file or directory
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > LARGEST_JSON_BYTES:
            raise UnreadableFile(f"{path} is {size / 2**20:,.0f} MB, larger than a stored result can be "
                                 f"(at most {LARGEST_JSON_BYTES // 2**20} MB): not read")
        raw = path.read_bytes()
    except OSError as exc:
        raise UnreadableFile(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        return json.loads(raw.decode("utf8"))
    except ValueError as exc:  # a UnicodeDecodeError too
        raise UnreadableFile(f"{path} is not valid JSON (truncated or damaged?): {exc}") from None
    except RecursionError:
        raise UnreadableFile(f"{path} nests its JSON deeper than it can be read: damaged, or not a file "
                             "of ours") from None


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename (never half a file), with the
    mode a plain write gets (0666 less the umask; mkstemp's own 0600 would hide it from the group).

    >>> import tempfile
    >>> target = Path(tempfile.mkdtemp()) / "out" / "a.json"
    >>> write_atomic(target, b"{}"); target.read_bytes()
    b'{}'
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    mask = os.umask(0o022)  # reading the umask means setting it: put it back at once
    os.umask(mask)
    try:
        os.fchmod(fd, 0o666 & ~mask)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
