"""Decode load on a live server, measured the way ``vllm bench serve`` measures it.

C client threads each keep one streaming ``/v1/completions`` request in flight until
the run's prompts are used up (``--max-concurrency C`` at an infinite request rate).
Prompts are token-id lists of exactly the input length, drawn at random per request
(so prefix caching finds nothing to reuse); ``max_tokens`` is the output length with
``ignore_eos``. Per-request timings are defined in :mod:`.stream`; per run, output
throughput is all output tokens over the run's wall time. The server's own
``/metrics`` histograms over the same window (:mod:`.metrics`) are read beside them,
and a client TPOT that the server's contradicts marks the run invalid.
"""

from __future__ import annotations

import queue
import statistics
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..stats import dispersion, median, median_precision, quantile
from .errors import ServerError
from .handle import ServerHandle
from .load import CONCURRENCY, MIN_PROMPTS, DecodeLoad, decode_loads, prompt_token_ids
from .metrics import (
    PREEMPTIONS,
    SERVER_HISTOGRAMS,
    delta,
    kv_cache_tokens,
    parse_prometheus,
    scrape,
    scrape_settled,
    server_means,
)
from .stream import Connection, RequestResult, stream_completion

__all__ = [
    "CONCURRENCY",
    "DecodeLoad",
    "DecodeRun",
    "MIN_PROMPTS",
    "PREEMPTIONS",
    "RequestResult",
    "SERVER_HISTOGRAMS",
    "TPOT_TOLERANCE",
    "decode_loads",
    "kv_cache_tokens",
    "measure_decode",
    "parse_prometheus",
    "prefills_during_decode",
    "prompt_token_ids",
    "stream_completion",
    "core_info",
    "tpot_disagreement",
]

# How far the client's mean or median TPOT may stray from the server's /metrics mean
# before the run is refused. Healthy runs agree within a few percent on GPU and within
# about 13 % on a loaded 2-core CPU; a stream coalesced into few chunks is off by ~100 %.
TPOT_TOLERANCE = 0.25


@dataclass(frozen=True)
class DecodeRun:
    """The requests of one load, the run's wall time, and the server's histogram deltas.

    ``during_decode_result`` is what :func:`measure_decode`'s ``during_decode`` returned.
    """

    load: DecodeLoad
    requests: tuple[RequestResult, ...]
    duration_s: float
    server_means_s: dict[str, float] = field(default_factory=dict)
    server_preemptions: int | None = None
    server_kv_tokens: int | None = None
    during_decode_result: object = None
    tpot_tolerance: float = TPOT_TOLERANCE
    metrics_text: tuple[str, str] = ("", "")  # /metrics before and after the run, for counters read elsewhere

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

    @property
    def invalid(self) -> str | None:
        """Why the client's TPOT cannot be trusted (it contradicts the server's), or None."""
        return tpot_disagreement(self.tpot_samples, self.server_means_s.get("tpot"), self.tpot_tolerance)

    def failure_report(self, limit: int = 3) -> str:
        errors = "\n".join(f"- {r.error}" for r in self.failed[:limit])
        return f"{len(self.failed)} of {len(self.requests)} requests failed ({self.load.id}); first errors:\n{errors}"

    def summary(self) -> dict[str, object]:
        """Statistics under ``vllm bench serve``'s result keys (``mean_tpot_ms``, ``p99_itl_ms``, ...).

        ``invalid`` is present only when the client's TPOT contradicts the server's.
        """
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
        overlaps = prefills_during_decode(done)
        info["mean_prefills_during_decode"] = statistics.fmean(overlaps) if overlaps else None
        info["num_prompts"] = self.load.num_prompts
        for name, mean_s in self.server_means_s.items():
            info[f"server_mean_{name}_ms"] = mean_s * 1e3
        info["server_preemptions"] = self.server_preemptions
        info["server_kv_tokens"] = self.server_kv_tokens
        if self.invalid:
            info["invalid"] = self.invalid
        return info


def prefills_during_decode(requests: Sequence[RequestResult]) -> list[int]:
    """Per request, how many other requests got their first token while it was decoding (between
    its first and last token): each is a prefill the server ran inside this request's decode steps.

    A request's TPOT is its decode steps' mean wall time, so every such prefill adds to it; with
    C clients and N prompts, requests admitted while others decode are what set ``vllm bench
    serve``'s TPOT apart from pure decode (docs/e2e.md). Requests without a first token are left out.

    >>> a = RequestResult(0.0, ttft=0.1, latency=1.0, output_tokens=9)
    >>> b = RequestResult(0.2, ttft=0.1, latency=0.5, output_tokens=9)  # first token at 0.3: inside a's decode
    >>> prefills_during_decode([a, b])
    [1, 0]
    """
    firsts = [r.start + r.ttft for r in requests if r.ok]
    counts = []
    for r in requests:
        if not r.ok:
            continue
        begin, end = r.start + r.ttft, r.start + r.latency
        counts.append(sum(1 for t in firsts if begin < t <= end))
    return counts


def core_info(run: DecodeRun, *, seed: int = 0, telemetry_before: dict | None = None,
              telemetry_after: dict | None = None) -> dict[str, object]:
    """The ``extra_info`` fields every decodebench result carries, for an end-to-end run.

    The samples are per-request TPOTs (timer ``client``); there is no kernel reference, so
    ``reference_error`` is None and the check that stands in for it is the server's own
    TPOT (``tolerance`` = the allowed relative gap of the means, ``invalid`` when beyond).
    """
    tpot = run.tpot_samples
    return {
        "component": "decode_e2e", "backend": "vllm-server", "case": run.load.id,
        "shape": {"concurrency": run.load.concurrency, "input_len": run.load.input_len,
                  "output_len": run.load.output_len, "num_prompts": run.load.num_prompts},
        "device": "server", "timer": "client", "samples": len(tpot), "calls_per_sample": 1,
        "stop_reason": "prompts_done",  # a load runs its prompts; there is no convergence loop
        "median_precision": median_precision(tpot) if len(tpot) > 1 else None,
        "dispersion_iqr": dispersion(tpot) if tpot else None, "measure_wall_s": run.duration_s,
        "notes": [f"invalid: {run.invalid}"] if run.invalid else [],
        "reference_error": None, "tolerance": TPOT_TOLERANCE, "check_seed": None, "timing_seed": seed,
        "telemetry_before": telemetry_before or {}, "telemetry_after": telemetry_after or {},
    }


def _stats_ms(name: str, values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {f"{k}_{name}_ms": None for k in ("mean", "median", "std", "p99")}
    return {
        f"mean_{name}_ms": statistics.fmean(values) * 1e3,
        f"median_{name}_ms": median(values) * 1e3,
        f"std_{name}_ms": statistics.pstdev(values) * 1e3,  # numpy's std, as vllm bench serve reports
        f"p99_{name}_ms": quantile(values, 0.99) * 1e3,
    }


def tpot_disagreement(samples: Sequence[float], server_mean_s: float | None,
                      tolerance: float = TPOT_TOLERANCE) -> str | None:
    """Why client TPOT samples contradict the server's mean TPOT, or None when they agree.

    The client's mean must lie within ``tolerance`` (a fraction) of the server's mean: the
    server gives only a mean, and a skewed distribution legitimately puts the median far
    from it (on the H200, requests whose steps fell in a profiler window: client mean
    19.56 ms vs server 19.48 ms, median 8.3 ms). A stream coalesced into few chunks drives
    the affected requests' TPOT to ~0, and so the mean, by their share of the requests.
    Without a server figure nothing can be checked.

    >>> tpot_disagreement([3.8e-3, 4.1e-3, 4.0e-3], server_mean_s=4.0e-3) is None
    True
    >>> tpot_disagreement([2e-3, 2e-3, 16e-3], server_mean_s=6.6e-3) is None  # skewed, means agree
    True
    >>> print(tpot_disagreement([1e-5, 1e-5, 4.0e-3], server_mean_s=3.9e-3))
    client TPOT mean 1.340 ms (median 0.010 ms) vs the server's /metrics mean 3.900 ms: off by -66%, \
beyond the 25% tolerance (tokens reached the client in bursts, so client TPOT is no decode time)
    """
    if not samples or not server_mean_s:
        return None
    mean, mid = statistics.fmean(samples), median(samples)
    off = mean / server_mean_s - 1
    if abs(off) <= tolerance:
        return None
    return (f"client TPOT mean {mean * 1e3:.3f} ms (median {mid * 1e3:.3f} ms) vs the server's /metrics mean "
            f"{server_mean_s * 1e3:.3f} ms: off by {off:+.0%}, beyond the {tolerance:.0%} tolerance "
            f"(tokens reached the client in bursts, so client TPOT is no decode time)")


# --- a run ---------------------------------------------------------------------------------


def measure_decode(handle: ServerHandle, load: DecodeLoad, *, seed: int = 0, request_timeout_s: float = 600.0,
                   during_decode: Callable[[], object] | None = None,
                   tpot_tolerance: float = TPOT_TOLERANCE) -> DecodeRun:
    """Warm up with one request, then run ``load`` and read the server's histograms around it.

    A failed warm-up raises :class:`~decodebench.serving.errors.ServerError` with the server's
    error text; failures during the run are counted in the result. If the server this process
    started has died (warm-up or run), the ServerError says so instead: its exit status or
    signal, the log's error lines and its tail. ``during_decode``, if
    given, is called once in a thread of its own as soon as the first request of each of
    the C clients has its first token (all C in decode); the run waits for it (at most
    ``request_timeout_s`` after the last request), keeps its return value as
    ``during_decode_result``, and re-raises what it raises. A run whose client TPOT strays
    from the server's beyond ``tpot_tolerance`` is warned about and marked ``invalid``.

    Example::

        run = measure_decode(handle, DecodeLoad(concurrency=4, input_len=128, output_len=64))
        run.tpot_samples, run.summary()["median_tpot_ms"]
    """
    prompts = prompt_token_ids(load.num_prompts + 1, load.input_len, handle.vocab_size, seed, load.repeat_span)
    warmup = stream_completion(handle, prompts.pop(), load.output_len, timeout_s=request_timeout_s)
    if not warmup.ok:
        raise ServerError(handle.gone(f"at the warm-up request of {load.id} ({warmup.error})")
                          or f"warm-up request to {handle.base_url} failed: {warmup.error}")
    text = scrape(handle)
    before, kv_tokens = parse_prometheus(text), kv_cache_tokens(text)
    _warn_if_kv_short(load, kv_tokens)
    hook = _DecodeHook(during_decode, load.concurrency)
    started = time.perf_counter()
    requests = _run_clients(handle, prompts, load, request_timeout_s, hook)
    duration = time.perf_counter() - started
    _raise_if_gone(handle, load, requests)  # before the hook and /metrics, which would fail on a dead server
    hook_result = hook.wait(request_timeout_s)
    after = scrape_settled(handle, before, sum(r.ok for r in requests))
    preemptions = int(delta(after, before, PREEMPTIONS)) if PREEMPTIONS in after else None
    run = DecodeRun(load, tuple(requests), duration, server_means(after, before), preemptions, kv_tokens,
                    hook_result, tpot_tolerance, (text, scrape(handle) if text else ""))
    if run.invalid and not run.failed:
        warnings.warn(f"{load.id}: result invalid: {run.invalid}", stacklevel=2)
    return run


def _raise_if_gone(handle: ServerHandle, load: DecodeLoad, requests: list[RequestResult]) -> None:
    """A run whose requests failed because the server died is no result: say that it died."""
    failed = [r for r in requests if not r.ok]
    if not failed:
        return
    gone = handle.gone(f"during {load.id} ({len(failed)} of {len(requests)} requests failed, first: {failed[0].error})")
    if gone:
        raise ServerError(gone)


def _warn_if_kv_short(load: DecodeLoad, kv_tokens: int | None) -> None:
    needed = load.concurrency * (load.input_len + load.output_len)
    if kv_tokens is not None and needed > kv_tokens:
        warnings.warn(f"{load.id} needs {needed} KV-cache tokens, the server holds {kv_tokens}: requests "
                      f"will queue, and TPOT is measured at a lower concurrency than {load.concurrency}",
                      stacklevel=3)


class _DecodeHook:
    """Calls ``fn`` once, in its own thread, when ``expected`` clients have signalled their first token."""

    def __init__(self, fn: Callable[[], object] | None, expected: int) -> None:
        self.fn, self.remaining = fn, expected
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.outcome: tuple[bool, object] = (True, None)  # (returned normally, value or exception)

    def arrived(self) -> None:
        with self.lock:
            self.remaining -= 1
            fire = self.remaining == 0 and self.fn is not None
        if fire:
            self.thread = threading.Thread(target=self._call, name="during-decode", daemon=True)
            self.thread.start()

    def _call(self) -> None:
        try:
            self.outcome = (True, self.fn())
        except BaseException as exc:  # handed to the run, which re-raises it
            self.outcome = (False, exc)

    def wait(self, timeout_s: float) -> object:
        if self.thread is None:
            return None
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            raise ServerError(f"during_decode did not return within {timeout_s:.0f} s after the last request")
        returned, value = self.outcome
        if not returned:
            raise value
        return value


def _run_clients(handle: ServerHandle, prompts: list[list[int]], load: DecodeLoad, timeout_s: float,
                 hook: _DecodeHook) -> list[RequestResult]:
    pending: queue.SimpleQueue[list[int]] = queue.SimpleQueue()
    for prompt in prompts:
        pending.put(prompt)
    results: list[RequestResult] = []
    lock = threading.Lock()

    def client() -> None:
        signal = _once(hook.arrived)  # this client's first request, at its first token (or its end)
        with Connection(handle.base_url, timeout_s) as conn:
            while True:
                try:
                    prompt = pending.get_nowait()
                except queue.Empty:
                    break
                result = stream_completion(handle, prompt, load.output_len, timeout_s=timeout_s, connection=conn,
                                           on_first_token=signal)
                signal()  # a first request that failed before its first token still counts as arrived
                with lock:
                    results.append(result)
        signal()  # a client that got no prompt at all

    threads = [threading.Thread(target=client, name=f"decode-client-{i}", daemon=True)
               for i in range(load.concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()  # every request is bounded by timeout_s, so this ends
    return results


def _once(fn: Callable[[], None]) -> Callable[[], None]:
    """``fn`` wrapped so that only its first call does anything (each client thread owns one)."""
    called = False

    def call() -> None:
        nonlocal called
        if not called:
            called = True
            fn()

    return call
