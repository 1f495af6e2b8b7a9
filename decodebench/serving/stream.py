"""One streamed completion, timed the way ``vllm bench serve`` times it.

Per request, as ``vllm/benchmarks/lib/endpoint_request_func.py`` and
``vllm/benchmarks/serve.py`` define them:

* TTFT: first chunk carrying choices, minus the request's start;
* ITL: time between consecutive chunks carrying choices (a chunk may hold several tokens);
* E2EL: last such chunk minus the start;
* TPOT: ``(E2EL - TTFT) / (output_tokens - 1)``, output tokens from ``usage.completion_tokens``.

The body is encoded before the clock starts, and a chunk is timed as its line arrives,
before it is parsed. The stream is read with the standard library's ``http.client``, not
``httpx``: on the same server httpx took twice the client CPU per chunk (124 vs 59 µs),
and a client starved of CPU sees tokens in bursts, which is what TPOT must not measure.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field

from .handle import ServerHandle, body_excerpt

__all__ = ["Connection", "RequestResult", "stream_completion"]


@dataclass
class RequestResult:
    """Timings of one streamed request (seconds, from ``time.perf_counter``).

    >>> round(RequestResult(start=0.0, ttft=0.1, latency=0.73, output_tokens=64).tpot, 6)
    0.01
    """

    start: float
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    latency: float | None = None
    output_tokens: int | None = None
    error: str | None = None
    chunks: int = 0  # chunks that carried a token
    merged: int = 0  # token chunks read together with a later one of this request (stamped late)
    first_merged: bool = False  # the first token chunk among them: the TTFT stamp may be late
    chunk_tokens: list[int] = field(default_factory=list)  # tokens per chunk, where the server counted them
    stalled: bool = False  # the stream received nothing for longer than its stall limit

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft is not None

    @property
    def tpot(self) -> float | None:
        """``(latency - ttft) / (output_tokens - 1)``, None for fewer than 2 tokens."""
        if not self.ok or not self.output_tokens or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


class Connection:
    """One keep-alive HTTP connection (per client thread), reopened after any error; no proxy.

    Example::

        with Connection(handle.base_url, timeout_s=600.0) as conn:
            stream_completion(handle, [11, 12], 16, connection=conn)
    """

    def __init__(self, base_url: str, timeout_s: float) -> None:
        parts = urllib.parse.urlsplit(base_url)
        kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        self.open = lambda: kind(parts.hostname, parts.port, timeout=timeout_s)
        self.prefix = parts.path
        self.conn: http.client.HTTPConnection | None = None

    def post(self, path: str, body: bytes, headers: Mapping[str, str]) -> http.client.HTTPResponse:
        if self.conn is None:
            self.conn = self.open()
        self.conn.request("POST", self.prefix + path, body, {"Content-Type": "application/json", **headers})
        return self.conn.getresponse()

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def stream_completion(handle: ServerHandle, prompt: list[int], output_len: int, *, timeout_s: float = 600.0,
                      connection: Connection | None = None, stall_s: float | None = None,
                      name: str = "the request") -> RequestResult:
    """Stream one completion and time it; a failure is recorded in ``error``, never raised.

    ``timeout_s`` bounds the whole request; ``stall_s`` (default: ``timeout_s``) any wait for data,
    and a stream that stalls longer fails naming ``name`` and the token chunks it received.
    ``connection`` is kept across requests (one per client thread); without it, one is
    opened and closed for this request (with ``stall_s`` as its socket timeout).

    Example::

        result = stream_completion(handle, [11, 12, 13], output_len=16)
        result.ttft, result.tpot, result.output_tokens
    """
    wait_s = min(timeout_s, stall_s or timeout_s)
    conn = connection or Connection(handle.base_url, wait_s)
    body = json.dumps({"model": handle.model, "prompt": prompt, "max_tokens": output_len, "ignore_eos": True,
                       "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}).encode()
    result = RequestResult(start=time.perf_counter())
    try:
        response = conn.post("/v1/completions", body, handle.headers())
        kind = (response.getheader("Content-Type") or "").split(";")[0].strip().lower()
        if response.status != 200:
            text = response.read().decode("utf-8", errors="replace")
            result.error = f"HTTP {response.status} {response.reason}: {body_excerpt(text)}"
        elif kind != "text/event-stream":
            text = response.read().decode("utf-8", errors="replace")
            result.error = f"HTTP 200 but no event stream (Content-Type {kind or 'absent'!r}): {body_excerpt(text)}"
        else:
            _read_stream(response, result, result.start + timeout_s, f"{name} passed its {timeout_s:g} s deadline")
    except TimeoutError:
        result.stalled = True
        result.error = (f"{name} stalled: no data for {wait_s:g} s (after {time.perf_counter() - result.start:.1f} s, "
                        f"{result.chunks} token chunks received)")
    except (OSError, http.client.HTTPException, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    if result.error is not None or connection is None:
        conn.close()
    return result


def _read_stream(response: http.client.HTTPResponse, result: RequestResult, deadline: float, late: str) -> None:
    last, chunks, done = result.start, 0, False
    while line := response.readline():
        now = time.perf_counter()  # before parsing: the chunk arrived now
        if not line.startswith(b"data:"):
            continue  # blank separators and SSE comments (": ping")
        data = line[5:].strip()
        if data == b"[DONE]":
            done = True
            break
        message = json.loads(data)
        if message.get("error"):
            result.error = f"server error in stream: {json.dumps(message['error'])[:1000]}"
            return
        if message.get("choices"):
            if result.ttft is None:
                result.ttft = now - result.start
            else:
                result.itl.append(now - last)
            last, chunks = now, chunks + 1
            result.chunks = chunks
        elif message.get("usage"):
            result.output_tokens = message["usage"].get("completion_tokens")
        if now > deadline:
            result.error = f"{late} after {now - result.start:.1f} s, {chunks} token chunks received"
            return
    if not done:  # the server closed the stream early (it died?): a cut-off request times nothing
        result.error = f"the stream ended without data: [DONE] (token chunks received: {chunks})"
        return
    response.read()  # drain, so the connection can carry the next request
    _finish(result, last, chunks)


def _finish(result: RequestResult, last: float, chunks: int) -> None:
    if result.ttft is None:
        result.error = "the stream ended without a chunk carrying a token"
        return
    result.latency = last - result.start
    result.chunks = chunks
    if result.output_tokens is None:
        result.output_tokens = chunks  # no usage chunk: count chunks (exact without stream batching)
