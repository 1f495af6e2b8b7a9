"""One streamed completion in this process (the warm-up's first request), read by the load
generator's loop (:mod:`.loadgen`) as a load's are; TTFT, ITL, E2EL and TPOT are ``vllm bench
serve``'s (docs/e2e.md, "What is measured")."""

from __future__ import annotations

import math

from .handle import ServerHandle, body_excerpt
from .loadgen import Loop, job_for
from .loadgen import Request as RequestResult

__all__ = ["RequestResult", "request_result", "stream_completion"]


def request_result(fields: dict) -> RequestResult:
    """A load generator's request (a :class:`.loadgen.Request` as JSON) as a result; an error response's
    body worded in one line.

    >>> request_result({"start": 0.0, "error": "HTTP 500 Internal Server Error", "body": '{"error": "boom"}'}).error
    'HTTP 500 Internal Server Error: boom'
    """
    result = RequestResult(**fields)
    if result.error and result.error.startswith("HTTP "):
        result.error = f"{result.error}: {body_excerpt(result.body)}"
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
