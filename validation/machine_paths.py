"""Absolute paths of a machine (a checkout, a home) in the tracked tree, members of .gz and .tgz files included, and
their rewrite to neutral placeholders that keep the rest of each path readable.

    python validation/machine_paths.py              # every file holding one, with a count and the first; exit 1 if any
    python validation/machine_paths.py --all        # every one: FILE[:MEMBER]:LINE: PATH
    python validation/machine_paths.py --rewrite    # rewrite them in place (outside KEEP), then list what is left

What a machine's path is, and what it becomes:

- a checkout: a folder of ``/work`` (``main``, ``dev``, ``wt-NAME``, or NAME in ``wt``), the same under ``/check``,
  or reached by a relative path that climbs to the root (``../../work``, then ``main``) -> ``<checkout>``: the
  checkout's interpreter becomes ``<checkout>/.venv/bin/python``, pytest's root ``rootdir: <checkout>``;
- a home: root's (``/root``) and a user's (NAME in ``/home``) -> ``~``: ``tp8/traces`` in root's home becomes
  ``~/tp8/traces``.

Left as they are: ``/tmp`` and what is in it (scratch that every machine has; it names no home and no checkout), the
system paths of an image (``/usr``, ``/opt``, ``/etc``, ``/proc``: the same on every machine of that image), and the
names of the members inside a .tgz (relative: ``root/.cache/vllm/...`` in ``inductor-code.tgz``). This file and its
test hold no machine path themselves (the test builds its examples), so the check covers every tracked file.

Only the path text changes, never a figure: a placeholder holds no quote, backslash, tab or newline, so a line stays
one line, a TSV keeps its columns, and a JSON file (or .json.gz, or a JSON member) stays valid JSON of the same
structure: the rewrite checks that what it wrote loads as the old document with each string rewritten. A .gz is
written as ``gzip -n -9`` writes it (no name, mtime 0), so a rewrite is deterministic; a .tgz keeps its tar format and
its members' names, order, modes, owners and times (and a .gz member inside it is rewritten the same way). A file
with no machine path is left byte for byte.

KEEP: the folders another script regenerates whole (``validation/gate/decision/``, ``validation/projection/``); they
are listed, never rewritten: their script is the place to fix.
"""

from __future__ import annotations

import argparse
import copy
import gzip
import io
import json
import re
import struct
import subprocess
import sys
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEEP = ("validation/gate/decision/", "validation/projection/")

# A path of a machine, for the check: anything in /work, /root or /home (or in /check/work, or a relative path that
# climbs to the root with ../), not inside a word, a file name or a path in ~.
FOUND = re.compile(rb"(?<![\w.~-])(?:/check/|/|(?:\.\./)+)(?:work|root|home)/")
# The same, as the rewrite takes it: the machine-specific prefix only, up to the end of its last component.
PREFIX = re.compile(rb"""(?<![\w.~-])(?:
      (?P<checkout>(?:/check/|/|(?:\.\./)+)work/(?:wt/)?[\w.-]+)(?![\w.-])
    | (?:/check/|/|(?:\.\./)+)(?:root(?=/)|home/[\w.-]+(?![\w.-]))
)""", re.X)
CHECKOUT, HOME = b"<checkout>", b"~"
HINTS = (b"work/", b"root/", b"home/")  # a blob without any of these holds no path: no regex over it


def placeholder(match: re.Match) -> bytes:
    return CHECKOUT if match.group("checkout") else HOME


def rewritten(data: bytes) -> bytes:
    """``data`` with each machine prefix replaced by its placeholder (examples in tests/test_machine_paths.py)."""
    return PREFIX.sub(placeholder, data)


@dataclass(frozen=True)
class Found:
    where: str  # FILE, or FILE:MEMBER (FILE:MEMBER:INNER for a .gz inside a .tgz)
    line: int
    path: bytes

    def __str__(self) -> str:
        return f"{self.where}:{self.line}: {self.path.decode(errors='replace')}"


def found_in(where: str, data: bytes) -> list[Found]:
    """Every machine path of one (uncompressed) blob, with its line."""
    if not any(hint in data for hint in HINTS):
        return []
    out, line, at = [], 1, 0
    for match in FOUND.finditer(data):
        line += data.count(b"\n", at, match.start())
        at = match.start()
        end = re.match(rb"[^\s\"'`,;:)\]}>|]*", data[match.end():]).end() + match.end()
        out.append(Found(where, line, data[match.start():end]))
    return out


def gzip_n(data: bytes) -> bytes:
    """``data`` as ``gzip -n -9`` packs it: no name, mtime 0, best compression, OS Unix; the same bytes each time."""
    packer = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS, 9)
    return (b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\x03" + packer.compress(data) + packer.flush()
            + struct.pack("<II", zlib.crc32(data), len(data) & 0xFFFFFFFF))


def _same_json(old: bytes, new: bytes, where: str) -> None:
    """The new document is the old one with each string rewritten: same structure, same figures."""
    def strings(value):
        if isinstance(value, str):
            return rewritten(value.encode()).decode()
        if isinstance(value, list):
            return [strings(v) for v in value]
        if isinstance(value, dict):
            return {strings(k): strings(v) for k, v in value.items()}
        return value

    if strings(json.loads(old)) != json.loads(new):
        raise ValueError(f"{where}: the rewrite changed the JSON document beyond its path strings")


def walk(where: str, data: bytes, rewrite: bool) -> tuple[bytes, list[Found]]:
    """The machine paths of one file or member (unpacking .gz and .tgz), and its bytes rewritten if ``rewrite``
    (the very same bytes where nothing changed)."""
    if where.endswith((".tgz", ".tar.gz")):
        return _walk_tar(where, data, rewrite)
    if where.endswith(".gz"):
        inner = gzip.decompress(data)
        new, found = walk(where[:-3], inner, rewrite)
        found = [Found(f.where + ".gz" if f.where == where[:-3] else f.where, f.line, f.path) for f in found]
        return (data if new is inner else gzip_n(new)), found
    found = found_in(where, data)
    if not (rewrite and found):
        return data, found
    if b"\0" in data:
        raise ValueError(f"{where}: a binary file holds a machine path; not rewritten")
    new = rewritten(data)
    if new.count(b"\n") != data.count(b"\n"):
        raise ValueError(f"{where}: the rewrite changed the number of lines")
    if where.endswith(".json"):
        _same_json(data, new, where)
    return new, found


def _walk_tar(where: str, data: bytes, rewrite: bool) -> tuple[bytes, list[Found]]:
    raw = gzip.decompress(data)
    fmt = tarfile.GNU_FORMAT if raw[257:265] == b"ustar  \0" else tarfile.PAX_FORMAT
    members, found, changed = [], [], False
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        for info in tar.getmembers():
            body = tar.extractfile(info).read() if info.isfile() else None
            if body is not None:
                new, more = walk(f"{where}:{info.name}", body, rewrite)
                found += more
                changed |= new is not body
                body = new
            members.append((info, body))
    if not changed:
        return data, found
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt) as tar:
        for info, body in members:
            info = copy.copy(info)
            if body is not None:
                info.size = len(body)
            tar.addfile(info, io.BytesIO(body) if body is not None else None)
    return gzip_n(out.getvalue()), found


def tracked(root: Path = ROOT) -> list[str]:
    done = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], capture_output=True, check=True, timeout=60)
    return [n for n in done.stdout.decode().split("\0") if n and (root / n).is_file()]


def scan(root: Path = ROOT, rewrite: bool = False) -> list[Found]:
    """Every machine path in the tracked files under ``root``; with ``rewrite``, each file outside KEEP that holds
    one is rewritten in place first (and what is returned is what was found before)."""
    out = []
    for name in tracked(root):
        path = root / name
        data = path.read_bytes()
        new, found = walk(name, data, rewrite and not name.startswith(KEEP))
        if new is not data:
            path.write_bytes(new)
        out += found
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rewrite", action="store_true", help="rewrite each machine prefix to its placeholder")
    parser.add_argument("--all", action="store_true", help="list every path, not a count per file")
    args = parser.parse_args(argv)
    if args.rewrite:
        before = scan(rewrite=True)
        files = {f.where.split(":")[0] for f in before}
        print(f"rewrote {len(before)} machine paths in {len(files - {n for n in files if n.startswith(KEEP)})} "
              "files", file=sys.stderr)
    left = scan()
    if args.all:
        print("\n".join(map(str, left)))
    else:
        per_file: dict[str, list[Found]] = {}
        for f in left:
            per_file.setdefault(f.where.split(":")[0], []).append(f)
        for name, found in per_file.items():
            print(f"{name}: {len(found)} (first {found[0]})")
    print(f"{len(left)} machine paths in {len({f.where.split(':')[0] for f in left})} tracked files", file=sys.stderr)
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
