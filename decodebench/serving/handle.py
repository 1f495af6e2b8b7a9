"""A healthy server seen from the client side: :class:`ServerHandle`, HTTP GET, connect mode.

Every request goes through ``httpx`` without the environment's proxy settings: the
server is on this machine or named by URL, and a proxy in between would be timed too.
"""

from __future__ import annotations

import json
import os
import socket
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import httpx

from .config import redacted, vocab_size
from .errors import ServerError

__all__ = ["LOCALHOST", "RemoteServer", "ServerHandle", "describe_server", "free_port", "healthy", "http_get",
           "normalize_url"]

LOCALHOST = "127.0.0.1"


@dataclass(frozen=True)
class ServerHandle:
    """A healthy server: where it is and what it serves.

    ``argv`` and ``log_path`` are None for a server this process does not manage.
    ``vocab_size`` is known only when the model's config.json is on this machine.

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
    routing: Mapping[str, object] | None = None  # how a started server routes its MoE layers (serving.routing)

    @property
    def managed(self) -> bool:
        return self.argv is not None

    def url(self, path: str) -> str:
        return self.base_url + path

    def headers(self) -> dict[str, str]:
        return _bearer(self.api_key)

    def get_text(self, path: str, timeout_s: float = 10.0) -> str:
        """GET ``path``; the body as text. Raises :class:`ServerError` unless the status is 200."""
        return http_get(self.url(path), timeout_s, self.headers())

    def describe(self) -> dict[str, object]:
        """The facts a stored benchmark records about the server."""
        return {"url": self.base_url, "model": self.model, "version": self.version, "managed": self.managed,
                "argv": redacted(self.argv) if self.argv else None, "max_model_len": self.max_model_len,
                "routing": dict(self.routing) if self.routing else {"mode": "unknown"}}


def _bearer(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def http_get(url: str, timeout_s: float, headers: Mapping[str, str] | None = None) -> str:
    """The body of ``GET url`` as text; :class:`ServerError` naming the URL for anything but 200.

    Example::

        http_get("http://127.0.0.1:8000/version", timeout_s=10.0)  # '{"version":"0.32.0"}'
    """
    try:
        response = httpx.get(url, headers=dict(headers or {}), timeout=timeout_s, trust_env=False)
    except httpx.HTTPError as exc:
        raise ServerError(f"GET {url}: {exc or type(exc).__name__}") from None
    if response.status_code != 200:
        raise ServerError(f"GET {url}: HTTP {response.status_code} {response.reason_phrase}: {response.text[:500]}")
    return response.text


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
