"""Values an adapter takes from its own table because the installed vLLM no longer says them.

An adapter that falls back (a page size, a split count, a Marlin constant) calls :func:`note`
each time it uses the value; the harness builds every case inside :func:`recording` and puts
what was noted into the result's ``notes``, so a figure measured with a value of ours says so.

>>> with recording() as noted:
...     note("MLA page size of vllm-flashmla: 64, decodebench's table (vLLM's answer: KeyError)")
>>> noted
["MLA page size of vllm-flashmla: 64, decodebench's table (vLLM's answer: KeyError)"]
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["note", "recording"]

_recordings: list[list[str]] = []


@contextmanager
def recording() -> Iterator[list[str]]:
    """The fallbacks noted while the block runs, each once."""
    noted: list[str] = []
    _recordings.append(noted)
    try:
        yield noted
    finally:
        _recordings.remove(noted)


def note(text: str) -> None:
    """Say that a value of ours stands in for vLLM's (outside :func:`recording`: nothing to keep)."""
    for noted in _recordings:
        if text not in noted:
            noted.append(text)
