"""Decode load on a live server, measured the way ``vllm bench serve`` measures it.

C client threads each keep one streaming ``/v1/completions`` request in flight until
the run's prompts are used up (``--max-concurrency C`` at an infinite request rate).
Prompts are token-id lists of exactly the input length, drawn at random per request
(so prefix caching finds nothing to reuse); ``max_tokens`` is the output length with
``ignore_eos``. Per request, as ``vllm/benchmarks/lib/endpoint_request_func.py`` and
``vllm/benchmarks/serve.py`` define them:

* TTFT: first chunk carrying choices, minus the request's start;
* ITL: time between consecutive chunks carrying choices (a chunk may hold several tokens);
* E2EL: last such chunk minus the start;
* TPOT: ``(E2EL - TTFT) / (output_tokens - 1)``, output tokens from ``usage.completion_tokens``;

and per run, output throughput: all output tokens over the run's wall time. The server's
own ``/metrics`` histograms over the same window are read for a cross-check.
"""

from __future__ import annotations

import http.client
import json
import queue
import random
import re
import statistics
import threading
import time
import urllib.parse
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from ..shapes import SweepLevel
from ..stats import median, quantile
from .server import ServerError, ServerHandle

__all__ = [
    "CONCURRENCY",
    "DecodeLoad",
    "DecodeRun",
    "MIN_PROMPTS",
    "PREEMPTIONS",
    "RequestResult",
    "SERVER_HISTOGRAMS",
    "decode_loads",
    "kv_cache_tokens",
    "measure_decode",
    "parse_prometheus",
    "prompt_token_ids",
    "stream_completion",
]

# Client concurrencies per sweep level (the smoke and nightly sets).
CONCURRENCY: dict[SweepLevel, tuple[int, ...]] = {
    SweepLevel.SMOKE: (1, 4),
    SweepLevel.NIGHTLY: (1, 64, 256),
    SweepLevel.FULL: (1, 8, 16, 32, 64, 128, 256),
}
MIN_PROMPTS = 8  # TPOT samples per benchmark at C = 1, enough for a median and its interval

# Server-side histograms (vllm/v1/metrics/loggers.py) and the client statistic each checks.
SERVER_HISTOGRAMS = {
    "ttft": "vllm:time_to_first_token_seconds",
    "itl": "vllm:inter_token_latency_seconds",
    "tpot": "vllm:request_time_per_output_token_seconds",
    "e2el": "vllm:e2e_request_latency_seconds",
    "queue": "vllm:request_queue_time_seconds",  # no client twin: time waiting for a batch slot
}
PREEMPTIONS = "vllm:num_preemptions_total"  # above 0: the KV cache could not hold C requests


@dataclass(frozen=True)
class DecodeLoad:
    """One point of the e2e decode axis: C concurrent clients, fixed input and output lengths.

    >>> DecodeLoad(concurrency=4, input_len=128, output_len=64).id
    'c4-in128-out64'
    >>> DecodeLoad(4, 128, 64).num_prompts
    8
    """

    concurrency: int
    input_len: int
    output_len: int
    num_prompts: int = 0  # 0: max(MIN_PROMPTS, 2 * concurrency)

    def __post_init__(self) -> None:
        if min(self.concurrency, self.input_len) < 1 or self.output_len < 2:
            raise ValueError(f"{self}: needs concurrency >= 1, input_len >= 1 and output_len >= 2 (TPOT)")
        if self.num_prompts == 0:
            object.__setattr__(self, "num_prompts", max(MIN_PROMPTS, 2 * self.concurrency))

    @property
    def id(self) -> str:
        return f"c{self.concurrency}-in{self.input_len}-out{self.output_len}"


def decode_loads(concurrencies: Sequence[int], input_len: int, output_len: int) -> list[DecodeLoad]:
    """The loads of one session, in the order given.

    >>> [load.id for load in decode_loads((1, 4), 128, 64)]
    ['c1-in128-out64', 'c4-in128-out64']
    """
    return [DecodeLoad(c, input_len, output_len) for c in concurrencies]


def prompt_token_ids(count: int, length: int, vocab_size: int | None, seed: int = 0) -> list[list[int]]:
    """``count`` random prompts of ``length`` token ids, reproducible from ``seed``.

    Ids stay clear of both ends of the vocabulary, where special tokens live. With the
    vocabulary unknown (a remote server's config is not on this machine) they are drawn
    from 100..999, ordinary tokens in any vocabulary of 1024 or more.

    >>> prompts = prompt_token_ids(2, 3, vocab_size=1024)
    >>> [len(p) for p in prompts], all(128 <= t < 896 for p in prompts for t in p)
    ([3, 3], True)
    """
    margin = min(1000, vocab_size // 8) if vocab_size else 0
    low, high = (margin, vocab_size - margin) if vocab_size else (100, 1000)
    rng = random.Random(seed)
    return [[rng.randrange(low, high) for _ in range(length)] for _ in range(count)]


# --- one request ---------------------------------------------------------------------------


@dataclass
class RequestResult:
    """Timings of one streamed request (seconds, from ``time.perf_counter``)."""

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


class _Connection:
    """One keep-alive HTTP connection per client thread, reopened after any error."""

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


def stream_completion(handle: ServerHandle, prompt: list[int], output_len: int, *,
                      timeout_s: float = 600.0, connection: _Connection | None = None,
                      on_first_token: Callable[[], None] | None = None) -> RequestResult:
    """Stream one completion and time it; a failure is recorded in ``error``, never raised.

    Example::

        result = stream_completion(handle, [11, 12, 13], output_len=16)
        result.ttft, result.tpot, result.output_tokens
    """
    conn = connection or _Connection(handle.base_url, timeout_s)
    body = json.dumps({"model": handle.model, "prompt": prompt, "max_tokens": output_len, "ignore_eos": True,
                       "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}).encode()
    result = RequestResult(start=time.perf_counter())
    try:
        response = conn.post("/v1/completions", body, handle.headers())
        if response.status != 200:
            text = response.read().decode("utf-8", errors="replace")[:1000]
            result.error = f"HTTP {response.status} {response.reason}: {text}"
        else:
            _read_stream(response, result, result.start + timeout_s, on_first_token)
    except (OSError, http.client.HTTPException, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    if result.error is not None or connection is None:
        conn.close()
    return result


def _read_stream(response: http.client.HTTPResponse, result: RequestResult, deadline: float,
                 on_first_token: Callable[[], None] | None = None) -> None:
    last = result.start
    chunks = 0
    while line := response.readline():
        now = time.perf_counter()  # before parsing: the chunk arrived now
        data = line.strip()
        if not data.startswith(b"data:"):
            continue  # blank separators and SSE comments (": ping")
        data = data[5:].strip()
        if data == b"[DONE]":
            break
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
            last = now
            chunks += 1
        elif message.get("usage"):
            result.output_tokens = message["usage"].get("completion_tokens")
        if now > deadline:
            result.error = f"timed out after {now - result.start:.0f} s"
            return
    response.read()  # drain, so the connection can carry the next request
    _finish(result, last, chunks)


def _finish(result: RequestResult, last: float, chunks: int) -> None:
    if result.ttft is None:
        result.error = "the stream ended without a chunk carrying a token"
        return
    result.latency = last - result.start
    if result.output_tokens is None:
        result.output_tokens = chunks  # no usage chunk: count chunks (exact without stream batching)


# --- a run ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeRun:
    """The requests of one load, the run's wall time, and the server's histogram deltas."""

    load: DecodeLoad
    requests: tuple[RequestResult, ...]
    duration_s: float
    server_means_s: dict[str, float] = field(default_factory=dict)
    server_preemptions: int | None = None
    server_kv_tokens: int | None = None
    during_decode_result: object = None  # what ``measure_decode``'s ``during_decode`` returned

    @property
    def completed(self) -> list[RequestResult]:
        return [r for r in self.requests if r.ok]

    @property
    def failed(self) -> list[RequestResult]:
        return [r for r in self.requests if not r.ok]

    @property
    def tpot_samples(self) -> list[float]:
        return [r.tpot for r in self.completed if r.tpot is not None]

    @property
    def output_throughput(self) -> float:
        """Output tokens per second over the whole run."""
        return sum(r.output_tokens for r in self.completed) / self.duration_s

    def failure_report(self, limit: int = 3) -> str:
        errors = "\n".join(f"- {r.error}" for r in self.failed[:limit])
        return f"{len(self.failed)} of {len(self.requests)} requests failed ({self.load.id}); first errors:\n{errors}"

    def summary(self) -> dict[str, object]:
        """Statistics under ``vllm bench serve``'s result keys (``mean_tpot_ms``, ``p99_itl_ms``, ...)."""
        done = self.completed
        info: dict[str, object] = {
            "completed": len(done), "failed": len(self.failed), "duration": self.duration_s,
            "max_concurrency": self.load.concurrency, "input_len": self.load.input_len,
            "output_len": self.load.output_len, "total_output_tokens": sum(r.output_tokens for r in done),
            "output_throughput": self.output_throughput, "request_throughput": len(done) / self.duration_s,
        }
        samples = {"ttft": [r.ttft for r in done], "tpot": self.tpot_samples,
                   "itl": [x for r in done for x in r.itl], "e2el": [r.latency for r in done]}
        for name, values in samples.items():
            info.update(_stats_ms(name, values))
        for name, mean_s in self.server_means_s.items():
            info[f"server_mean_{name}_ms"] = mean_s * 1e3
        info["server_preemptions"] = self.server_preemptions
        info["server_kv_tokens"] = self.server_kv_tokens
        return info


def _stats_ms(name: str, values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {f"{k}_{name}_ms": None for k in ("mean", "median", "std", "p99")}
    return {
        f"mean_{name}_ms": statistics.fmean(values) * 1e3,
        f"median_{name}_ms": median(values) * 1e3,
        f"std_{name}_ms": statistics.pstdev(values) * 1e3,  # numpy's std, as vllm bench serve reports
        f"p99_{name}_ms": quantile(values, 0.99) * 1e3,
    }


def measure_decode(handle: ServerHandle, load: DecodeLoad, *, seed: int = 0,
                   request_timeout_s: float = 600.0,
                   during_decode: Callable[[], object] | None = None) -> DecodeRun:
    """Warm up with one request, then run ``load`` and read the server's histograms around it.

    ``during_decode`` (e.g. a profiler window) is called once, in its own thread, as soon as
    the first C requests have all received their first token; the run waits for it and keeps
    its return value (or the exception it raised) as ``DecodeRun.during_decode_result``.

    A failed warm-up raises :class:`~decodebench.serving.server.ServerError` with the server's
    error text; failures during the run are counted in the result.

    Example::

        run = measure_decode(handle, DecodeLoad(concurrency=4, input_len=128, output_len=64))
        run.tpot_samples, run.summary()["median_tpot_ms"]
    """
    prompts = prompt_token_ids(load.num_prompts + 1, load.input_len, handle.vocab_size, seed)
    warmup = stream_completion(handle, prompts.pop(), load.output_len, timeout_s=request_timeout_s)
    if not warmup.ok:
        raise ServerError(f"warm-up request to {handle.base_url} failed: {warmup.error}")
    text = _scrape(handle)
    before, kv_tokens = parse_prometheus(text), kv_cache_tokens(text)
    _warn_if_kv_short(load, kv_tokens)
    hook = _DecodeHook(during_decode, load.concurrency)
    started = time.perf_counter()
    requests = _run_clients(handle, prompts, load, request_timeout_s, hook.first_token)
    duration = time.perf_counter() - started
    after = _scrape_settled(handle, before, sum(r.ok for r in requests))
    preemptions = int(_delta(after, before, PREEMPTIONS)) if PREEMPTIONS in after else None
    return DecodeRun(load, tuple(requests), duration, _server_means(after, before), preemptions, kv_tokens,
                     hook.join())


class _DecodeHook:
    """Runs a callable once, in a thread, when the first ``count`` requests have their first token."""

    def __init__(self, fn: Callable[[], object] | None, count: int) -> None:
        self.fn, self.remaining, self.result = fn, count, None
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None

    def first_token(self) -> None:
        with self.lock:
            self.remaining -= 1
            if self.remaining != 0 or self.fn is None:
                return
            self.thread = threading.Thread(target=self._run, name="decode-hook", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.result = self.fn()
        except Exception as exc:  # noqa: BLE001 - handed to the caller, who decides
            self.result = exc

    def join(self) -> object:
        if self.thread is not None:
            self.thread.join()
        return self.result


def _warn_if_kv_short(load: DecodeLoad, kv_tokens: int | None) -> None:
    needed = load.concurrency * (load.input_len + load.output_len)
    if kv_tokens is not None and needed > kv_tokens:
        warnings.warn(f"{load.id} needs {needed} KV-cache tokens, the server holds {kv_tokens}: requests "
                      f"will queue, and TPOT is measured at a lower concurrency than {load.concurrency}",
                      stacklevel=3)


def _run_clients(handle: ServerHandle, prompts: list[list[int]], load: DecodeLoad,
                 timeout_s: float, on_first_token: Callable[[], None]) -> list[RequestResult]:
    pending: queue.SimpleQueue[list[int]] = queue.SimpleQueue()
    for prompt in prompts:
        pending.put(prompt)
    results: list[RequestResult] = []
    lock = threading.Lock()

    def client() -> None:
        conn = _Connection(handle.base_url, timeout_s)
        first = True
        try:
            while True:
                try:
                    prompt = pending.get_nowait()
                except queue.Empty:
                    return
                result = stream_completion(handle, prompt, load.output_len, timeout_s=timeout_s, connection=conn,
                                           on_first_token=on_first_token if first else None)
                first = False
                with lock:
                    results.append(result)
        finally:
            conn.close()

    threads = [threading.Thread(target=client, name=f"decode-client-{i}", daemon=True)
               for i in range(load.concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()  # every request is bounded by timeout_s, so this ends
    return results


# --- the server's own view: /metrics ---------------------------------------------------------


def parse_prometheus(text: str) -> dict[str, float]:
    """Sample name -> value summed over label sets (engines, models), from Prometheus text.

    >>> parse_prometheus('# HELP x\\nvllm:x_count{engine="0"} 2.0\\nvllm:x_count{engine="1"} 3.0\\nup 1')
    {'vllm:x_count': 5.0, 'up': 1.0}
    """
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, rest = line[: line.index("{")], line[line.rindex("}") + 1:]
        else:
            name, _, rest = line.partition(" ")
        try:
            value = float(rest.split()[0])
        except (IndexError, ValueError):
            continue
        totals[name] = totals.get(name, 0.0) + value
    return totals


def kv_cache_tokens(text: str) -> int | None:
    """Tokens the server's KV cache holds, from the labels of ``vllm:cache_config_info``.

    >>> kv_cache_tokens('vllm:cache_config_info{block_size="16",num_gpu_blocks="100"} 1.0')
    1600
    """
    for line in text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            if labels.get("kv_cache_size_tokens", "").isdigit():
                return int(labels["kv_cache_size_tokens"])
            if labels.get("num_gpu_blocks", "").isdigit() and labels.get("block_size", "").isdigit():
                return int(labels["num_gpu_blocks"]) * int(labels["block_size"])
    return None


def _scrape(handle: ServerHandle) -> str:
    try:
        return handle.get_text("/metrics")
    except ServerError:
        return ""  # a server without /metrics: no cross-check


def _scrape_settled(handle: ServerHandle, before: dict[str, float], completed: int) -> dict[str, float]:
    """``/metrics`` once the server has counted every completed request (or after 5 s).

    The server records a request's histograms as it finishes it, which can trail the
    last streamed chunk a little.
    """
    if not before:
        return {}
    deadline = time.monotonic() + 5.0
    while True:
        after = parse_prometheus(_scrape(handle))
        counted = _delta(after, before, SERVER_HISTOGRAMS["e2el"] + "_count")
        if counted >= completed or time.monotonic() > deadline:
            return after
        time.sleep(0.1)


def _server_means(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """Mean of each server histogram over the run, from its ``_sum``/``_count`` deltas."""
    means = {}
    for name, metric in SERVER_HISTOGRAMS.items():
        count = _delta(after, before, metric + "_count")
        if count > 0:
            means[name] = _delta(after, before, metric + "_sum") / count
    return means


def _delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)
