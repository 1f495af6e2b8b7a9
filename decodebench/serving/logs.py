"""The server's log as a failure report: the lines that say what went wrong, then the tail
(without vLLM's listing of its HTTP routes).

For a bad flag, vLLM prints its whole usage text (hundreds of lines) before the one line
that matters (``api_server.py: error: unrecognized arguments: ...``); for a crash, the
exception's last line sits above shutdown noise. The report leads with those lines.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = ["TAIL_LINES", "error_lines", "failure_report", "log_tail"]

TAIL_LINES = 40
_READ_BYTES = 256 * 1024  # enough for a usage text plus a traceback; a long log's start is not read

# "ValueError: ...", "vllm.x.SomeError: ...", also after a process prefix "(EngineCore pid=7) ";
# argparse's "prog: error: ..."; then, weaker, log records at ERROR level.
_EXCEPTION = re.compile(r"^(?:\([^)]*\)\s*)?[A-Za-z_][\w.]*(?:Error|Exception|Exit)(?::|$)")
_ARGPARSE = re.compile(r"^\S+: error: ")
_LOGGED = re.compile(r"\bERROR\b|\bError\b")


# vLLM lists every HTTP route once it is up ("INFO ... [launcher.py:46] Route: /health, Methods: GET"),
# some 40 lines that fill a server's tail when it dies soon after; they never say why it died.
_ROUTE = re.compile(r"\bRoute: \S+, (?:Methods|Endpoint): ")


def log_tail(path: Path, lines: int = TAIL_LINES) -> str:
    """The last ``lines`` lines of a log file (decoded leniently) but vLLM's route listing, or a
    note that there is none.

    Example::

        log_tail(Path("server.log"), 40)  # startup lines, then the crash: no "Route: /v1/..., Methods: POST"
    """
    text = _read_end(path)
    if text.startswith("(no log"):
        return text
    return "\n".join([line for line in text.splitlines() if not _ROUTE.search(line)][-lines:])


def _read_end(path: Path) -> str:
    try:
        with open(path, "rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(0, log.tell() - _READ_BYTES))
            return log.read().decode("utf-8", errors="replace")
    except OSError as exc:
        return f"(no log: {exc})"


def error_lines(text: str, limit: int = 3) -> list[str]:
    """The last ``limit`` distinct lines that say what went wrong, in log order.

    Exception lines and argparse errors win over records logged at ERROR level;
    indented lines (traceback source, usage text) never count.

    >>> error_lines("usage: api_server.py [-h]\\n    [--log-level {ERROR,INFO}]\\n"
    ...             "api_server.py: error: unrecognized arguments: --bogus")
    ['api_server.py: error: unrecognized arguments: --bogus']
    >>> error_lines("ERROR 12-01 core.py: failed\\nTraceback:\\n    raise ValueError(x)\\nValueError: bad\\nbye")
    ['ValueError: bad']
    """
    lines = [line.rstrip() for line in text.splitlines() if line.strip() and not line[0].isspace()]
    for pattern in ((_EXCEPTION, _ARGPARSE), (_LOGGED,)):
        found = [line for line in lines if any(p.search(line) for p in pattern)]
        if found:
            return list(dict.fromkeys(reversed(found)))[:limit][::-1]
    return []


def failure_report(path: Path, context: str = "", lines: int = TAIL_LINES) -> str:
    """What went wrong (when the log says), then ``context``, then the log's last ``lines`` lines.

    Example::

        raise ServerError(f"vLLM server exited with code 2.\\n{failure_report(log_path, '$ vllm ...\\n')}")
    """
    causes = error_lines(_read_end(path))
    head = "what went wrong, from the log:\n" + "".join(f"  {line}\n" for line in causes) if causes else ""
    return f"{head}{context}log {path}, last {lines} lines:\n{log_tail(path, lines)}"
