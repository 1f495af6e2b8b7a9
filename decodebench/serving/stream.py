"""One streamed completion, timed the way ``vllm bench serve`` times it.

Per request, as ``vllm/benchmarks/lib/endpoint_request_func.py`` and
``vllm/benchmarks/serve.py`` define them:

* TTFT: first chunk carrying choices, minus the request's start;
* ITL: time between consecutive chunks carrying choices (a chunk may hold several tokens);
* E2EL: last such chunk minus the start;
* TPOT: ``(E2EL - TTFT) / (output_tokens - 1)``, output tokens from ``usage.completion_tokens``.

A request is sent and read by the load generator's loop (:mod:`.loadgen`), the one reader of
the stream: here it runs in this process for a single request (the warm-up's first), and in
processes of its own for a load. Its deadline and its stall bound hold whatever the server sends
(SSE comments are no progress), and a stream whose count contradicts itself or the request fails.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .handle import ServerHandle, body_excerpt
from .loadgen import Loop, job_for

__all__ = ["RequestResult", "request_result", "stream_completion"]


@dataclass
class RequestResult:
    """Timings of one streamed request (seconds; ``start`` from ``time.time``, arrivals the kernel's stamps).

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


def request_result(fields: dict) -> RequestResult:
    """A load generator's request (:meth:`.loadgen.Request.as_dict`) as a result; an error response's
    body worded in one line.

    >>> request_result({"start": 0.0, "error": "HTTP 500 Internal Server Error", "body": '{"error": "boom"}'}).error
    'HTTP 500 Internal Server Error: boom'
    """
    keys = ("start", "ttft", "itl", "latency", "output_tokens", "error", "chunks", "merged", "first_merged",
            "chunk_tokens", "stalled")
    result = RequestResult(**{k: fields[k] for k in keys if k in fields})
    if fields.get("body") is not None and result.error and result.error.startswith("HTTP "):
        result.error = f"{result.error}: {body_excerpt(fields['body'])}"
    return result


def stream_completion(handle: ServerHandle, prompt: list[int], output_len: int, *, timeout_s: float = 600.0,
                      stall_s: float | None = None, name: str = "the request") -> RequestResult:
    """Stream one completion in this process and time it; a failure is recorded in ``error``, never raised.

    ``timeout_s`` bounds the whole request; ``stall_s`` (default: none) any wait without a data event,
    and a stream that stalls longer fails naming ``name`` and the token chunks it received.

    Example::

        result = stream_completion(handle, [11, 12, 13], output_len=16)
        result.ttft, result.tpot, result.output_tokens
    """
    job = job_for(handle.base_url, handle.model, handle.headers(), [prompt], output_len, 1, timeout_s,
                  stall_s=stall_s or math.inf, label=name)
    job["parent"] = None  # the loop runs here: there is no other process to outlive
    loop = Loop(job)
    loop.run()
    return request_result(loop.results[0])
