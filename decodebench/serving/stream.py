"""One streamed completion, timed the way ``vllm bench serve`` times it.

Per request, as ``vllm/benchmarks/lib/endpoint_request_func.py`` and
``vllm/benchmarks/serve.py`` define them:

* TTFT: first chunk carrying choices, minus the request's start;
* ITL: time between consecutive chunks carrying choices (a chunk may hold several tokens);
* E2EL: last such chunk minus the start;
* TPOT: ``(E2EL - TTFT) / (output_tokens - 1)``, output tokens from ``usage.completion_tokens``.

The body is encoded before the clock starts, and a chunk is timed as its line arrives,
before it is parsed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import httpx

from .handle import ServerHandle

__all__ = ["RequestResult", "open_client", "stream_completion"]


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

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft is not None

    @property
    def tpot(self) -> float | None:
        """``(latency - ttft) / (output_tokens - 1)``, None for fewer than 2 tokens."""
        if not self.ok or not self.output_tokens or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def open_client(timeout_s: float) -> httpx.Client:
    """A keep-alive HTTP client for one client thread; every read waits at most ``timeout_s``.

    The environment's proxy settings are ignored: a proxy would be timed with the server.
    """
    return httpx.Client(timeout=httpx.Timeout(timeout_s), trust_env=False)


def stream_completion(handle: ServerHandle, prompt: list[int], output_len: int, *, timeout_s: float = 600.0,
                      client: httpx.Client | None = None,
                      on_first_token: Callable[[], None] | None = None) -> RequestResult:
    """Stream one completion and time it; a failure is recorded in ``error``, never raised.

    ``client`` keeps the connection across requests (one per client thread); without it,
    one is opened and closed for this request. ``on_first_token`` is called once, right
    after the first token's arrival is timed.

    Example::

        result = stream_completion(handle, [11, 12, 13], output_len=16)
        result.ttft, result.tpot, result.output_tokens
    """
    http = client or open_client(timeout_s)
    body = json.dumps({"model": handle.model, "prompt": prompt, "max_tokens": output_len, "ignore_eos": True,
                       "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}).encode()
    headers = {"Content-Type": "application/json", **handle.headers()}
    result = RequestResult(start=time.perf_counter())
    try:
        with http.stream("POST", handle.url("/v1/completions"), content=body, headers=headers) as response:
            if response.status_code != 200:
                text = response.read().decode("utf-8", errors="replace")[:1000]
                result.error = f"HTTP {response.status_code} {response.reason_phrase}: {text}"
            else:
                _read_stream(response.iter_lines(), result, result.start + timeout_s, on_first_token)
    except httpx.TimeoutException:
        result.error = f"timed out after {time.perf_counter() - result.start:.1f} s without data"
    except (httpx.HTTPError, OSError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        if client is None:
            http.close()
    return result


def _read_stream(lines: Iterator[str], result: RequestResult, deadline: float,
                 on_first_token: Callable[[], None] | None) -> None:
    last, chunks, done = result.start, 0, False
    for line in lines:
        now = time.perf_counter()  # before parsing: the chunk arrived now
        if done or not line.startswith("data:"):
            continue  # blank separators, SSE comments (": ping"), and the close of a finished stream
        data = line[5:].strip()
        if data == "[DONE]":
            done = True  # read on to the end, so the connection can carry the next request
            continue
        message = json.loads(data)
        if message.get("error"):
            result.error = f"server error in stream: {json.dumps(message['error'])[:1000]}"
            return
        if message.get("choices"):
            if result.ttft is None:
                result.ttft = now - result.start
                if on_first_token is not None:
                    on_first_token()
            else:
                result.itl.append(now - last)
            last, chunks = now, chunks + 1
        elif message.get("usage"):
            result.output_tokens = message["usage"].get("completion_tokens")
        if now > deadline:
            result.error = f"timed out after {now - result.start:.0f} s"
            return
    _finish(result, last, chunks)


def _finish(result: RequestResult, last: float, chunks: int) -> None:
    if result.ttft is None:
        result.error = "the stream ended without a chunk carrying a token"
        return
    result.latency = last - result.start
    if result.output_tokens is None:
        result.output_tokens = chunks  # no usage chunk: count chunks (exact without stream batching)
