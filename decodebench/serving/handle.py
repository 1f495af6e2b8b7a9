"""A healthy server seen from the client side: :class:`ServerHandle`, HTTP GET, connect mode.

Every request goes through ``httpx`` without the environment's proxy settings: the
server is on this machine or named by URL, and a proxy in between would be timed too.
"""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ServerError
from .config import redacted, vocab_size

__all__ = ["LOCALHOST", "RemoteServer", "ServerHandle", "body_excerpt", "describe_server", "free_port", "healthy",
           "http_get", "normalize_url"]

LOCALHOST = "127.0.0.1"


@dataclass(frozen=True)
class ServerHandle:
    """A healthy server: where it is and what it serves.

    ``argv`` and ``log_path`` are None for a server this process does not manage.
    ``vocab_size`` is known only when the model's config.json is on this machine.
    ``exit_report`` (a managed server only) says why the server process is gone, or None.

    >>> ServerHandle("http://127.0.0.1:8000", "m", "0.32.0", api_key="k").headers()
    {'Authorization': 'Bearer k'}
    """

    base_url: str
    model: str
    version: str | None
    api_key: str | None = None
    argv: tuple[str, ...] | None = None
    log_path: Path | None = None
    max_model_len: int | None = None
    vocab_size: int | None = None
    exit_report: Callable[[str], str | None] | None = field(default=None, repr=False, compare=False)
    routing: Mapping[str, object] | None = None  # how a started server routes its MoE layers (serving.server_routing)

    @property
    def managed(self) -> bool:
        return self.argv is not None

    def gone(self, during: str, wait_s: float = 5.0) -> str | None:
        """Why the server this process started is gone (exit status or signal, the log's error lines
        and tail), or None: it still answers ``/health``, it is not ours, or it is still running.

        Asked after a request failed. A server that no longer answers gets ``wait_s`` to finish
        exiting (one whose engine died shuts down for a few seconds before it exits).
        """
        if self.exit_report is None or healthy(self.base_url):
            return None
        deadline = time.monotonic() + wait_s
        while (report := self.exit_report(during)) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        return report

    def url(self, path: str) -> str:
        return self.base_url + path

    def headers(self) -> dict[str, str]:
        return _bearer(self.api_key)

    def get_text(self, path: str, timeout_s: float = 10.0, absent: str | None = None) -> str:
        """GET ``path``; the body as text within ``timeout_s`` (:func:`http_get`). Raises
        :class:`ServerError` unless the status is 200 (or 404 with ``absent`` given: then ``absent``)."""
        return http_get(self.url(path), timeout_s, self.headers(), absent=absent)

    def describe(self) -> dict[str, object]:
        """The facts a stored benchmark records about the server."""
        return {"url": self.base_url, "model": self.model, "version": self.version, "managed": self.managed,
                "argv": redacted(self.argv) if self.argv else None, "max_model_len": self.max_model_len,
                "routing": dict(self.routing) if self.routing else {"mode": "unknown"}}


def _bearer(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def http_get(url: str, timeout_s: float, headers: Mapping[str, str] | None = None, *,
             absent: str | None = None) -> str:
    """The body of ``GET url`` as text; :class:`ServerError` naming the URL for anything but 200 (a 404
    gives ``absent`` where that is not None), and for an answer not whole within ``timeout_s``.

    ``timeout_s`` is the answer's deadline, not only each read's: a server that trickles its body
    (each byte within the read timeout) is cut off at the first read past it, so the call returns
    within ``2 * timeout_s`` whatever the server sends.

    Example::

        http_get("http://127.0.0.1:8000/version", timeout_s=10.0)  # '{"version":"0.32.0"}'
    """
    import httpx  # optional: only what talks to a server needs it

    deadline = time.monotonic() + timeout_s
    # a plain-http URL needs no TLS context: httpx's default one loads the CA bundle on every
    # call, which made the health polls of a starting server a load of their own
    try:
        with httpx.stream("GET", url, headers=dict(headers or {}), timeout=timeout_s, trust_env=False,
                          verify=not url.startswith("http://")) as response:
            body = _body_by(response, deadline, url, timeout_s)
    except httpx.HTTPError as exc:
        raise ServerError(f"GET {url}: {exc or type(exc).__name__}") from None
    text = body.decode(response.encoding or "utf-8", errors="replace")
    if response.status_code == 404 and absent is not None:
        return absent
    if response.status_code != 200:
        raise ServerError(f"GET {url}: HTTP {response.status_code} {response.reason_phrase}: {body_excerpt(text)}")
    return text


def _body_by(response, deadline: float, url: str, timeout_s: float) -> bytes:
    body = bytearray()
    for chunk in response.iter_bytes():
        body += chunk
        if time.monotonic() > deadline:
            raise ServerError(f"GET {url}: no whole answer within {timeout_s:g} s (the server trickles it: "
                              f"{len(body)} bytes so far)")
    return bytes(body)


_MESSAGE_CHARS = 300  # an error message the server meant for us: keep it readable whole
_BODY_CHARS = 80  # anything else (a proxy's or web server's HTML page): enough to tell what answered


def body_excerpt(body: str) -> str:
    """An error response's body on one line: the server's JSON error message, else its first characters.

    A non-vLLM server (a web server, a proxy's error page) answers with HTML that says
    nothing about vLLM; printing it whole buried the one line that matters.

    >>> body_excerpt('{"error": {"message": "model x does not exist", "code": 404}}')
    'model x does not exist'
    >>> body_excerpt('<!DOCTYPE HTML>\\n<html lang="en">\\n    <head>\\n' + 'x' * 400)
    '<!DOCTYPE HTML> <html lang="en"> <head> xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx… (444 characters)'
    """
    message = _json_error_message(body)
    text, limit = (message, _MESSAGE_CHARS) if message else (" ".join(body.split()), _BODY_CHARS)
    if len(text) <= limit:
        return text or "(empty body)"
    return f"{text[:limit - 1]}… ({len(body)} characters)"


def _json_error_message(body: str) -> str | None:
    """vLLM's (OpenAI's) ``{"error": {"message": ...}}``, or the older ``{"message": ...}``."""
    try:
        document = json.loads(body)
    except ValueError:
        return None
    if not isinstance(document, dict):
        return None
    error = document.get("error")
    message = error.get("message") if isinstance(error, dict) else error or document.get("message")
    return " ".join(message.split()) if isinstance(message, str) and message.strip() else None


def healthy(base_url: str) -> bool:
    """Whether ``GET /health`` answers 200 within 2 s."""
    try:
        http_get(base_url + "/health", timeout_s=2.0)
    except ServerError:
        return False
    return True


def describe_server(base_url: str, api_key: str | None, **known) -> ServerHandle:
    """Ask a healthy server what it serves (``/v1/models``) and its version (``/version``).

    ``known`` fills the handle's remaining fields (``argv``, ``log_path``, ``vocab_size``).
    """
    try:
        model = json.loads(http_get(base_url + "/v1/models", 10.0, _bearer(api_key)))["data"][0]
        name = model["id"]
    except (ServerError, ValueError, LookupError, TypeError) as exc:
        raise ServerError(f"{base_url}/v1/models: no usable model list ({exc})") from None
    try:
        version = json.loads(http_get(base_url + "/version", 10.0)).get("version")
    except (ServerError, json.JSONDecodeError, AttributeError):
        version = None  # not every OpenAI-compatible server has /version
    if known.get("vocab_size") is None and os.path.isabs(str(model.get("root") or "")):
        known["vocab_size"] = vocab_size(model["root"])  # a local server's model directory
    return ServerHandle(base_url, name, version, api_key, max_model_len=model.get("max_model_len"), **known)


class RemoteServer:
    """A server at ``base_url`` that this process does not manage: check it, describe it.

    Example::

        with RemoteServer("http://gpu-box:8000", api_key="secret") as server:
            print(server.model, server.version)
    """

    def __init__(self, base_url: str, *, api_key: str | None = None, timeout_s: float = 10.0) -> None:
        self.base_url = normalize_url(base_url)
        self.api_key = api_key
        self.timeout_s = timeout_s

    def connect(self) -> ServerHandle:
        try:
            http_get(self.base_url + "/health", self.timeout_s)
        except ServerError as exc:
            raise ServerError(f"no healthy vLLM server at {self.base_url}: {exc}") from None
        return describe_server(self.base_url, self.api_key)

    def __enter__(self) -> ServerHandle:
        return self.connect()

    def __exit__(self, *exc_info) -> None:
        return None  # nothing to stop: the server is not ours


def normalize_url(url: str) -> str:
    """``http://host:port`` from what users type (a trailing ``/`` or ``/v1`` is dropped).

    >>> normalize_url("http://gpu-box:8000/v1/")
    'http://gpu-box:8000'
    """
    parts = urllib.parse.urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ServerError(f"{url!r} is not an http(s)://host[:port] URL")
    path = parts.path.rstrip("/")
    path = path[: -len("/v1")] if path.endswith("/v1") else path
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def free_port(host: str = LOCALHOST) -> int:
    """A TCP port nobody listens on right now (the OS picks it; another process could take it first).

    >>> 0 < free_port() < 65536
    True
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
