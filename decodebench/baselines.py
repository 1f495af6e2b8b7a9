"""Stored results: pytest-benchmark JSON files under ``baselines/<fingerprint>/``.

pytest-benchmark keys its file storage by a host id (``Linux-CPython-3.11-64bit``)
that knows nothing of GPUs. Here the folder is the hardware fingerprint instead, and
files are written whole or not at all (a temporary file renamed into place), so an
interrupted save never leaves a half-written baseline behind.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

from pytest_benchmark.storage.file import FileStorage
from pytest_benchmark.utils import safe_dumps

__all__ = ["FingerprintStorage", "stored_fingerprint", "write_json_atomically"]


def write_json_atomically(path: Path, document: Mapping) -> None:
    """Write ``document`` to ``path`` so that readers see the old file or the new one, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(safe_dumps(document, ensure_ascii=True, indent=4).encode())
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class FingerprintStorage(FileStorage):
    """pytest-benchmark's file storage with the fingerprint as folder and atomic saves."""

    @property
    def location(self) -> str:
        # pytest-benchmark assumes the storage lies under the working directory
        try:
            return str(self.path.relative_to(Path.cwd()))
        except ValueError:
            return str(self.path)

    def save(self, output_json, save):
        output_file = Path(self.get(f"{self._next_num}_{save}.json"))
        if output_file.exists():
            raise FileExistsError(f"refusing to overwrite stored result {output_file}")
        write_json_atomically(output_file, output_json)
        self.logger.info(f"Saved benchmark data in: {output_file}")


def stored_fingerprint(document: Mapping) -> str | None:
    """The fingerprint key a stored result was measured under, or None for foreign files."""
    info = document.get("machine_info", {}).get("decodebench", {})
    return info.get("fingerprint", {}).get("key") if isinstance(info, Mapping) else None
