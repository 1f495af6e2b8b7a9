"""Stored results: pytest-benchmark JSON files under ``baselines/<fingerprint>/``.

pytest-benchmark keys its file storage by a host id (``Linux-CPython-3.11-64bit``)
that knows nothing of GPUs. Here the folder is the hardware fingerprint instead, and
files are written whole or not at all (a temporary file renamed into place), so an
interrupted save never leaves a half-written baseline behind. Reading is forgiving:
a damaged or foreign file is named and skipped, so it cannot hide the good ones.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pytest_benchmark.storage.file import FileStorage
from pytest_benchmark.utils import safe_dumps

__all__ = [
    "FingerprintStorage",
    "History",
    "StoredResult",
    "load_history",
    "read_result",
    "stored_fingerprint",
    "write_json_atomically",
]

RESULT_GLOB = "[0-9][0-9][0-9][0-9]_*.json"  # pytest-benchmark's NNNN_<name>.json


def _umask() -> int:
    """The process umask (reading it means setting it; it is put back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_json_atomically(path: Path, document: Mapping) -> None:
    """Write ``document`` to ``path`` so that readers see the old file or the new one, never a part.

    The file gets the mode a plain ``open()`` would give it (0666 less the umask):
    the temporary file it starts as is private to this user.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(safe_dumps(document, ensure_ascii=True, indent=4).encode())
            fh.flush()
            os.fchmod(fh.fileno(), 0o666 & ~_umask())
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# decodebench reaches into pytest-benchmark where it has no public API: FileStorage's
# numbering (``_next_num``) and the session object pytest-benchmark keeps on the config
# (``config._benchmarksession``: its storage, comparison and save flags). These are the
# releases it was built and tested against; ci/env.sh and pyproject.toml pin the same range.
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
        self.saved_path = output_file  # the summary links to it
        self.logger.info(f"Saved benchmark data in: {output_file}")


def stored_fingerprint(document: Mapping) -> str | None:
    """The fingerprint key a stored result was measured under, or None for foreign files."""
    info = document.get("machine_info", {}).get("decodebench", {})
    return info.get("fingerprint", {}).get("key") if isinstance(info, Mapping) else None


@dataclass(frozen=True)
class StoredResult:
    path: Path
    document: Mapping

    def entries(self) -> dict[str, Mapping]:
        """Benchmark entries by test node id (``fullname``)."""
        return {b["fullname"]: b for b in self.document["benchmarks"] if "fullname" in b}


@dataclass(frozen=True)
class History:
    """The readable results of one fingerprint (oldest first) and the files passed over."""

    folder: Path
    results: tuple[StoredResult, ...]
    skipped: tuple[str, ...]  # "<path>: <why>", one per file that was not used

    def newest(self, count: int) -> tuple[StoredResult, ...]:
        return self.results[-count:] if count > 0 else ()

    def why_empty(self) -> str:
        """Why nothing here can be compared against (for a history without results)."""
        if self.skipped:
            return "no usable stored result: " + "; ".join(self.skipped)
        return f"no stored result in {self.folder} (first run on this machine?)"


def read_result(path: Path) -> Mapping:
    """A stored result's JSON, or ValueError naming what is wrong with it.

    >>> read_result(Path("/nonexistent/0001_x.json"))
    Traceback (most recent call last):
    ValueError: cannot read /nonexistent/0001_x.json: No such file or directory
    """
    try:
        document = json.loads(path.read_text(encoding="utf8"))
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ValueError(f"{path} is not valid JSON (truncated or damaged?): {exc}") from None
    if not isinstance(document, Mapping) or not isinstance(document.get("benchmarks"), list):
        raise ValueError(f"{path} is not a pytest-benchmark result (no 'benchmarks' list)")
    return document


def load_history(folder: Path, fingerprint: str | None = None) -> History:
    """Every readable result in ``folder`` (oldest first), of ``fingerprint`` when given.

    Damaged files and results of another fingerprint are skipped and named.
    """
    results, skipped = [], []
    for path in sorted(Path(folder).glob(RESULT_GLOB)):
        try:
            document = read_result(path)
        except ValueError as exc:
            skipped.append(str(exc))
            continue
        theirs = stored_fingerprint(document)
        if fingerprint is not None and theirs != fingerprint:
            skipped.append(f"{path} was measured on {theirs or 'an unknown machine'}, not {fingerprint}")
            continue
        results.append(StoredResult(path, document))
    return History(Path(folder), tuple(results), tuple(skipped))
