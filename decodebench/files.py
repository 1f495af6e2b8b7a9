"""Writing files whole or not at all: a temporary file beside the target, then a rename."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["write_atomic"]


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
