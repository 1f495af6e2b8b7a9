"""Decode load on a live server, measured the way ``vllm bench serve`` measures it (docs/e2e.md).

C streams each keep one streaming ``/v1/completions`` request in flight until the run's prompts
are used up (``--max-concurrency C`` at an infinite request rate), in load-generator processes
(:mod:`.loadgen`). A run is a warm-up at the load, then ``rounds`` measured rounds, each with the
server's ``/metrics`` read around it (:mod:`.metrics`); a client TPOT that the server's
contradicts, or a client that fell behind the stream, marks the run invalid.
"""

from __future__ import annotations

import functools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from ..errors import ServerError
from ..stats import dispersion, median, median_precision, quantile
from .handle import ServerHandle
from .load import DecodeLoad, prompt_token_ids
from .loadgen import job_for
from .metrics import (
    PREEMPTIONS,
    check_tpot_record,
    delta,
    kv_cache_tokens,
    parse_prometheus,
    scrape,
    scrape_settled,
    server_means,
)
from .stream import RequestResult, request_result, stream_completion

__all__ = ["DecodeLoad", "DecodeRun", "RoundWindow", "TPOT_TOLERANCE", "core_info", "load_limit_problem",
           "measure_decode", "prefills_during_decode", "tpot_disagreement"]  # DecodeLoad: docs/e2e.md's import

# How far the client's mean or median TPOT may stray from the server's /metrics mean
# before the run is refused. Healthy runs agree within a few percent on GPU and within
# about 13 % on a loaded 2-core CPU; a stream coalesced into few chunks is off by ~100 %.
TPOT_TOLERANCE = 0.25
# How far a late client may have moved a round's mean TPOT (an upper bound, from the requests
# whose first token chunk it read together with the second) before the round is refused.
STAMP_TOLERANCE = 0.01
# Beyond this gap between the pace tokens reached a prompt client and vLLM's own TPOT, a result
# says that the server's API process set the delivered pace (docs/e2e.md: 15.7 tokens a chunk at
# C = 64 on the H200's 4-layer model).
FRONTEND_NOTE = 0.10
STAMPED_SHARE = 0.9  # reads with the kernel's stamp for a round to count as kernel-stamped
STREAMS_PER_PROCESS = 64  # one epoll loop keeps up with 64 streams at a few ms a step (docs/e2e.md)
REQUEST_TIMEOUT_S = 600.0  # one request's deadline (--e2e-request-timeout-s)
STALL_S = 60.0  # the longest a stream may receive nothing (--e2e-stall-s): a queued request's first token
PROGRESS_AFTER_S = 60.0  # a load running longer says how it goes, this often
_PROGRESS_REPORT_S = 1.0  # how often a load generator reports to this process
LOADGEN = Path(__file__).with_name("loadgen.py")


@dataclass(frozen=True)
class ClientLag:
    """What the client cost itself over a round: how late it read the socket, and its CPU per read.

    ``lag_*``: time from a read's data reaching the socket (the kernel's stamp) to the client
    reading it; ``cpu_*``: the client's time handling one read; ``merged``: token chunks read
    together with a later chunk of the same stream (stamped at the later one's arrival).
    ``kernel_stamps`` is False where the kernel stamped fewer than ``STAMPED_SHARE`` of the reads
    (the others are stamped when read, with a lag of 0 by construction).
    """

    lag_p50_s: float | None = None
    lag_p99_s: float | None = None
    lag_max_s: float | None = None
    cpu_p50_s: float | None = None
    cpu_p99_s: float | None = None
    reads: int = 0
    kernel_stamps: bool = False
    processes: int = 0
    client: str = "processes"

    def fields_ms(self) -> dict[str, object]:
        """``extra_info`` keys: ``client_lag_p99_ms`` and the like."""
        ms = lambda v: None if v is None else v * 1e3  # noqa: E731
        return {"client": self.client, "client_processes": self.processes, "client_reads": self.reads,
                "client_kernel_stamps": self.kernel_stamps, "client_lag_p50_ms": ms(self.lag_p50_s),
                "client_lag_p99_ms": ms(self.lag_p99_s), "client_lag_max_ms": ms(self.lag_max_s),
                "client_cpu_p50_us": None if self.cpu_p50_s is None else self.cpu_p50_s * 1e6,
                "client_cpu_p99_us": None if self.cpu_p99_s is None else self.cpu_p99_s * 1e6}


@dataclass(frozen=True)
class Round:
    """One measured pass over the load's prompts, with the server's histogram means over it."""

    requests: tuple[RequestResult, ...]
    duration_s: float
    server_means_s: dict[str, float] = field(default_factory=dict)
    lag: ClientLag = ClientLag()

    @property
    def tpot_samples(self) -> list[float]:
        return [r.tpot for r in self.requests if r.ok and r.tpot is not None]

    @property
    def mean_tpot(self) -> float | None:
        samples = self.tpot_samples
        return statistics.fmean(samples) if samples else None


@dataclass(frozen=True)
class DecodeRun:
    """The measured rounds of one load and the server's histogram deltas over all of them.

    ``window_result`` is what :func:`measure_decode`'s ``window`` returned when closed.
    A run of one round can be built directly from its requests (``rounds`` then holds none).
    """

    load: DecodeLoad
    requests: tuple[RequestResult, ...]
    duration_s: float
    server_means_s: dict[str, float] = field(default_factory=dict)
    server_preemptions: int | None = None
    server_kv_tokens: int | None = None
    window_result: object = None
    tpot_tolerance: float = TPOT_TOLERANCE
    rounds: tuple[Round, ...] = ()
    profiled: tuple[RequestResult, ...] = ()  # the requests of the ``window``'s round of its own (no samples)
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
        """Output tokens per second over the measured rounds."""
        return sum(r.output_tokens for r in self.completed) / self.duration_s

    @property
    def invalid(self) -> str | None:
        """Why the client's TPOT cannot be trusted (it contradicts the server's, or the client fell
        behind the stream), or None."""
        checked = self._checked_rounds()
        for number, one in enumerate(checked):
            reason = client_behind(one.requests, one.lag)
            if reason is None and not one.lag.kernel_stamps:  # lateness unmeasured: the server must vouch
                reason = tpot_disagreement(one.tpot_samples, one.server_means_s.get("tpot"), self.tpot_tolerance)
            if reason:
                return f"round {number}: {reason}" if len(checked) > 1 else reason
        return None

    def _checked_rounds(self) -> tuple[Round, ...]:
        return self.rounds or (Round(self.requests, self.duration_s, self.server_means_s),)

    @property
    def tpot_source(self) -> str:
        """Where the figure of record comes from: ``"server"`` (vLLM's own per-request TPOT, the mean of
        its ``/metrics`` histogram over each round) where every round has it, else ``"client"``."""
        rounds = self._checked_rounds()
        return "server" if all(r.server_means_s.get("tpot") for r in rounds) else "client"

    @property
    def figure_samples(self) -> list[float]:
        """The samples a result stores: each round's server mean TPOT (source ``server``), else the
        client's per-request TPOTs."""
        if self.tpot_source == "server":
            return [r.server_means_s["tpot"] for r in self._checked_rounds()]
        return self.tpot_samples

    @property
    def tpot_s(self) -> float | None:
        """The figure of record: the median over rounds of each round's mean TPOT (the server's, where
        it has one; else the client's)."""
        if self.tpot_source == "server":
            return median([r.server_means_s["tpot"] for r in self._checked_rounds()])
        return self.delivered_tpot_s

    @property
    def delivered_tpot_s(self) -> float | None:
        """The client's figure: the median over rounds of each round's mean TPOT as tokens reached it."""
        values = [r.mean_tpot for r in self._checked_rounds() if r.mean_tpot is not None]
        return median(values) if values else None

    @property
    def frontend_note(self) -> str | None:
        """Where the client kept up but tokens reached it at another pace than the engine made them: the
        server's API process (between the engine and the socket) set the delivered TPOT."""
        engine, delivered = self.tpot_s, self.delivered_tpot_s
        if self.tpot_source != "server" or not engine or delivered is None or self.invalid:
            return None
        off = delivered / engine - 1
        if abs(off) <= FRONTEND_NOTE:
            return None
        chunks = sum(r.chunks for r in self.completed)
        per_chunk = sum(r.output_tokens for r in self.completed) / chunks if chunks else float("nan")
        lag = _worst_lag([r.lag for r in self.rounds]).lag_p99_s if self.rounds else None
        lag_text = f", its read lag p99 {lag * 1e3:.2f} ms" if lag is not None else ""
        return (f"tokens reached the client {off:+.0%} off the engine's pace (delivered TPOT {delivered * 1e3:.2f} ms, "
                f"vLLM's own {engine * 1e3:.2f} ms; {per_chunk:.1f} tokens per chunk{lag_text}): the client kept up, "
                f"so vLLM's API server process, not decode, set the delivered pace (more API server processes: "
                f"--api-server-count; docs/e2e.md)")

    def round_figures(self) -> dict[str, object]:
        """Per round: the client's mean TPOT and the server's; the server's median over rounds."""
        client = [r.mean_tpot for r in self.rounds]
        server = [r.server_means_s.get("tpot") for r in self.rounds]
        info: dict[str, object] = {
            "rounds": len(self.rounds),
            "round_mean_tpot_ms": [None if v is None else v * 1e3 for v in client],
            "server_round_mean_tpot_ms": [None if v is None else v * 1e3 for v in server]}
        if server and None not in server:
            info["server_tpot_ms"] = median(server) * 1e3
        return info

    def failure_report(self, limit: int = 3) -> str:
        errors = "\n".join(f"- {r.error}" for r in self.failed[:limit])
        return f"{len(self.failed)} of {len(self.requests)} requests failed ({self.load.id}); first errors:\n{errors}"

    def summary(self) -> dict[str, object]:
        """Statistics under ``vllm bench serve``'s result keys (``mean_tpot_ms``, ``p99_itl_ms``, ...).

        ``invalid`` is present only when the client's TPOT cannot be trusted.
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
        chunks = sum(r.chunks for r in done)
        info["tokens_per_chunk"] = sum(r.output_tokens for r in done) / chunks if chunks else None
        info["merged_chunks"] = sum(r.merged for r in done)
        if self.rounds:
            info.update(self.round_figures())
            info.update(_worst_lag([r.lag for r in self.rounds]).fields_ms())
        info["tpot_source"] = self.tpot_source
        info["tpot_ms"] = None if self.tpot_s is None else self.tpot_s * 1e3
        info["delivered_tpot_ms"] = None if self.delivered_tpot_s is None else self.delivered_tpot_s * 1e3
        if self.frontend_note:
            info["frontend"] = self.frontend_note
        if self.invalid:
            info["invalid"] = self.invalid
        return info


def client_behind(requests: Sequence[RequestResult], lag: ClientLag,
                  tolerance: float = STAMP_TOLERANCE) -> str | None:
    """Why a round's client fell behind the stream far enough to move its mean TPOT, or None.

    Only a first token chunk read together with the second moves a TPOT, by at most the step after
    them (docs/e2e.md, "The client fell behind"): the bound on the round's mean TPOT is the sum of
    those steps over ``n - 1`` per request, over the sum of TPOTs.

    >>> steady = [RequestResult(0.0, 0.1, [0.0, 0.01] + [0.01] * 97, 1.09, 100, chunks=100, merged=1,
    ...                         first_merged=True)] + [RequestResult(0.0, 0.1, [0.01] * 99, 1.09, 100)] * 3
    >>> client_behind(steady, ClientLag(lag_p99_s=2e-3)) is None  # bound 0.025 %
    True
    >>> short = [RequestResult(0.0, 0.1, [0.0, 0.01, 0.01], 0.13, 4, chunks=4, merged=1, first_merged=True)]
    >>> print(client_behind(short, ClientLag(lag_p99_s=2e-3)))
    the client fell behind the stream: 1 of 1 requests had their first token chunk read together with the \
second, which can move the mean TPOT by up to 33.3% (beyond 1%; 99th-percentile read lag 2.000 ms)
    >>> whole = [RequestResult(0.0, 0.2, [0.0, 0.0, 0.0], 0.2, 4, chunks=4, merged=3, first_merged=True)] * 2
    >>> print(client_behind(whole, ClientLag(lag_p99_s=0.25)))
    the client fell behind the stream: each of 2 requests arrived in one read, so no request has a TPOT; \
99th-percentile read lag 250.000 ms
    """
    done = [r for r in requests if r.ok and r.tpot is not None]
    late = [r for r in done if r.first_merged]
    if not late:
        return None
    lag = f"; 99th-percentile read lag {lag.lag_p99_s * 1e3:.3f} ms" if lag.lag_p99_s is not None else ""
    total = sum(r.tpot for r in done)
    if total <= 0:  # every stream arrived whole in one read: no TPOT was measured at all
        return (f"the client fell behind the stream: each of {len(done)} requests arrived in one read, "
                f"so no request has a TPOT{lag}")
    step = lambda r: max(r.itl[1:2] or [r.tpot])  # noqa: E731  (the step after the merged pair)
    bound = sum(step(r) / (r.output_tokens - 1) for r in late) / total
    if bound <= tolerance:
        return None
    return (f"the client fell behind the stream: {len(late)} of {len(done)} requests had their first token chunk "
            f"read together with the second, which can move the mean TPOT by up to {bound:.1%} (beyond "
            f"{tolerance:.0%}{lag})")


def _worst_lag(lags: Sequence[ClientLag]) -> ClientLag:
    """The rounds' client figures, each the worst round's (the lag a result is judged by)."""
    def worst(name: str) -> float | None:
        values = [getattr(lag, name) for lag in lags if getattr(lag, name) is not None]
        return max(values) if values else None

    first = lags[0]
    return ClientLag(worst("lag_p50_s"), worst("lag_p99_s"), worst("lag_max_s"), worst("cpu_p50_s"),
                     worst("cpu_p99_s"), sum(lag.reads for lag in lags), all(lag.kernel_stamps for lag in lags),
                     first.processes, first.client)


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

    The samples are the figure of record's (:attr:`DecodeRun.figure_samples`). There is no kernel
    reference, so ``reference_error`` is None; the client's check of the stream (``invalid``) stands
    in for it.
    """
    tpot = run.figure_samples
    notes = [f"invalid: {run.invalid}"] if run.invalid else []
    if run.tpot_source != "server":
        notes.append("figure: the client's TPOT (the server keeps no vLLM TPOT record: no /metrics, or not vLLM's)")
    if run.frontend_note:
        notes.append(f"front end: {run.frontend_note}")
    return {
        "component": "decode_e2e", "backend": "vllm-server", "case": run.load.id,
        "shape": {"concurrency": run.load.concurrency, "input_len": run.load.input_len,
                  "output_len": run.load.output_len, "num_prompts": run.load.num_prompts},
        "device": "server", "timer": "server-record" if run.tpot_source == "server" else "client",
        "samples": len(tpot), "calls_per_sample": 1,
        "stop_reason": "prompts_done",  # a load runs its prompts; there is no convergence loop
        "median_precision": median_precision(tpot) if len(tpot) > 1 else None,
        "dispersion_iqr": dispersion(tpot) if tpot else None, "measure_wall_s": run.duration_s,
        "notes": notes,
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

    The client's mean must lie within ``tolerance`` (a fraction) of the server's mean (the server
    gives only a mean; a skewed distribution legitimately puts the median far from it). Without a
    server figure nothing can be checked.

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


def measure_decode(handle: ServerHandle, load: DecodeLoad, *, seed: int = 0,
                   request_timeout_s: float = REQUEST_TIMEOUT_S, stall_s: float = STALL_S,
                   window: RoundWindow | None = None,
                   tpot_tolerance: float = TPOT_TOLERANCE, rounds: int = 1,
                   chunk_tokens: bool = False, progress: Callable[[str], None] | None = None,
                   progress_after_s: float = PROGRESS_AFTER_S) -> DecodeRun:
    """Warm up at the load (one request, then a wave of C), then run ``load`` ``rounds`` times,
    reading the server's histograms around each round (docs/e2e.md, "Rounds").

    A failed warm-up raises :class:`~decodebench.errors.ServerError` with the server's error text
    (or, where the server this process started has died, how it died); failures during the rounds
    are counted in the result. ``window``, if given (:class:`RoundWindow`), watches a round of its
    own before the measured rounds, its requests not among the samples; what its ``close`` returns
    is kept as ``window_result``. A run the client cannot vouch for (``tpot_tolerance``) is warned
    about and marked ``invalid``. ``chunk_tokens`` asks the server for its running token count in
    every chunk (``continuous_usage_stats``): for diagnosis, not for a figure. Every request is
    bounded by ``request_timeout_s``, and by ``stall_s`` without data (a stall ends the run); a run
    longer than ``progress_after_s`` hands ``progress`` a line that often.

    Example::

        run = measure_decode(handle, DecodeLoad(concurrency=4, input_len=128, output_len=64), rounds=3)
        run.tpot_samples, run.summary()["tpot_ms"]
    """
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    too_large = load_limit_problem(load, rounds)
    if too_large:
        raise ValueError(too_large)
    tracker = Progress(progress, load.id, progress_after_s)
    runner = functools.partial(_run_processes, chunk_tokens=chunk_tokens, stall_s=stall_s, tracker=tracker)
    waves = [load.num_prompts] * rounds
    prompts = prompt_token_ids(1 + load.concurrency + load.num_prompts * (rounds + 1), load.input_len,
                               handle.vocab_size, seed, load.repeat_span)
    tracker.phase = "warm-up"
    _warm_up(handle, load, prompts, request_timeout_s, runner, stall_s)
    text = scrape(handle)
    check_tpot_record(text)  # the figure of record never changes source silently
    kv_tokens = kv_cache_tokens(text)
    _warn_if_kv_short(load, kv_tokens)
    window_result, profiled = None, []
    if window is not None:
        batch = [prompts.pop() for _ in range(load.num_prompts)]
        window.open()
        tracker.phase = "profiled round"
        try:
            profiled, _, _ = runner(handle, batch, load, request_timeout_s)
            _raise_if_gone(handle, load, profiled)
        finally:  # a failed round still closes the window (the profiler stops)
            window_result = window.close()
        text = scrape(handle)
    first_before = before = parse_prometheus(text)
    measured: list[Round] = []
    for number, count in enumerate(waves, 1):
        batch = [prompts.pop() for _ in range(count)]
        tracker.phase = f"round {number} of {rounds}"
        requests, duration, lag = runner(handle, batch, load, request_timeout_s)
        _raise_if_gone(handle, load, requests)  # before /metrics, which would fail on a dead server
        after = scrape_settled(handle, before, sum(r.ok for r in requests))
        measured.append(Round(tuple(requests), duration, server_means(after, before), lag))
        before = after
        if any(r.stalled for r in requests):  # a stalled server: the run has failed, end it now
            break
    preemptions = int(delta(before, first_before, PREEMPTIONS)) if PREEMPTIONS in before else None
    run = DecodeRun(load, tuple(r for one in measured for r in one.requests), sum(r.duration_s for r in measured),
                    server_means(before, first_before), preemptions, kv_tokens, window_result, tpot_tolerance,
                    tuple(measured), tuple(profiled),
                    (text, scrape(handle) if text else ""))
    if run.invalid and not run.failed:
        warnings.warn(f"{load.id}: result invalid: {run.invalid}", stacklevel=2)
    return run


def _warm_up(handle: ServerHandle, load: DecodeLoad, prompts: list[list[int]], timeout_s: float, runner,
             stall_s: float | None = None) -> None:
    """One request, then one wave of C at once; a failure is the server's, said with its error text."""
    first = stream_completion(handle, prompts.pop(), load.output_len, timeout_s=timeout_s, stall_s=stall_s,
                              name="the warm-up's first request")
    failed = [first] if not first.ok else []
    if not failed and load.concurrency > 1:
        wave = [prompts.pop() for _ in range(load.concurrency)]
        failed = [r for r in runner(handle, wave, load, timeout_s)[0] if not r.ok]
    if failed:
        error = failed[0].error
        raise ServerError(handle.gone(f"at the warm-up of {load.id} ({error})")
                          or f"warm-up request to {handle.base_url} failed: {error}")


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


class RoundWindow(Protocol):
    """What watches one round from the server's side (:func:`measure_decode`'s ``window``)."""

    def open(self) -> None:
        """Called before the round's first request is sent."""

    def close(self) -> object:
        """Called once every request of the round has ended; the value is the run's ``window_result``."""


def client_processes(concurrency: int) -> int:
    """How many load-generator processes carry C streams (at most ``STREAMS_PER_PROCESS`` each,
    and no more than half this machine's cores).

    >>> client_processes(1), client_processes(64)
    (1, 1)
    """
    wanted = math.ceil(concurrency / STREAMS_PER_PROCESS)
    return max(1, min(wanted, (os.cpu_count() or 2) // 2))


# Memory per prompt token id: measured with tracemalloc (CPython 3.11, ids above 256): 41 bytes in the
# parent's lists, 7 in the JSON job, 37 once a load generator has parsed it back.
_PARENT_TOKEN_BYTES = 48
_GENERATOR_TOKEN_BYTES = 37
_SPARE_FILES = 64  # a process's own files besides its streams: stdio, the selector, imports, logs
_SERVER_SPARE_FILES = 256  # a started vLLM server's own: engine sockets, shared memory, its libraries


def load_limit_problem(load: DecodeLoad, rounds: int = 1, server_here: bool = False) -> str | None:
    """Why this machine cannot carry ``load`` (open files, local ports, memory), naming the limit, or None.

    A load generator holds one connection a stream, and so does a server started here (it inherits this
    process's limits); each connection to one server takes a local port; the prompts of every round are
    drawn at the start. Where only the soft open-file limit stands in the way, it is raised to what the
    load needs (the hard limit allows it), so that nothing fails halfway through a run.

    >>> load_limit_problem(DecodeLoad(4, 128, 64)) is None
    True
    """
    from ..limits import format_bytes, local_ports, memory_limit, raise_file_limit

    c = load.concurrency
    per_process = -(-c // client_processes(c))
    files = max(per_process + _SPARE_FILES, c + _SERVER_SPARE_FILES if server_here else 0)
    soft, hard = raise_file_limit(files)
    if files > soft:
        return (f"{load.id}: one load-generator process holds {per_process} connections"
                f"{' and the server started here as many' if server_here else ''}, needing about {files} open "
                f"files, beyond this machine's open-file limit (ulimit -n: soft {soft}, hard {hard})")
    ports = local_ports()
    if ports is not None and c > ports:
        return (f"{load.id}: {c} connections to one server need {c} local ports, beyond the {ports} of "
                "net.ipv4.ip_local_port_range")
    prompts = 1 + c + load.num_prompts * (rounds + 1)
    need = load.input_len * (prompts * _PARENT_TOKEN_BYTES + load.num_prompts * _GENERATOR_TOKEN_BYTES)
    limit = memory_limit(None)
    if need > limit.bytes:
        return (f"{load.id}: its {prompts} prompts of {load.input_len} tokens ({rounds} rounds) take about "
                f"{format_bytes(need)} in the client, more than {limit.what}")
    return None


def _run_processes(handle: ServerHandle, prompts: list[list[int]], load: DecodeLoad, timeout_s: float,
                   chunk_tokens: bool = False, stall_s: float = math.inf,
                   tracker: Progress | None = None) -> tuple[list[RequestResult], float, ClientLag]:
    """The load in load-generator processes (:mod:`.loadgen`), streams and prompts dealt out evenly."""
    count = min(client_processes(load.concurrency), len(prompts))
    jobs = [job_for(handle.base_url, handle.model, handle.headers(), prompts[i::count], load.output_len,
                    load.concurrency // count + (i < load.concurrency % count), timeout_s, chunk_tokens,
                    stall_s=stall_s, progress_s=_PROGRESS_REPORT_S, numbering=(i, count, len(prompts)))
            for i in range(count)]
    # a process runs its prompts in waves of its streams, each request bounded by timeout_s
    limit_s = timeout_s * max(math.ceil(len(job["prompts"]) / job["streams"]) for job in jobs) + 60.0
    with _Generators(jobs) as generators:
        outcomes = generators.run(limit_s, tracker.watch(len(prompts)) if tracker else None)
    requests = [request_result(r) for outcome in outcomes for r in outcome["requests"]]
    duration = max(o["ended"] for o in outcomes) - min(o["started"] for o in outcomes)
    return requests, duration, _lag_of(outcomes)


class Progress:
    """Says how a long load goes: once it has run ``after_s``, and every ``after_s`` since, a line with
    the phase, the requests done and the tokens per second goes to ``say`` (None: nothing is said).

    >>> lines = []
    >>> tracker = Progress(lines.append, "c4-in8-out4", after_s=0.0)
    >>> tracker.phase = "round 1 of 1"
    >>> tracker.report(done=3, total=8, failed=0, tokens=12, elapsed_s=2.0)
    >>> lines
    ['c4-in8-out4: round 1 of 1: 3 of 8 requests done, 6 tokens/s over 2 s']
    """

    def __init__(self, say: Callable[[str], None] | None, load_id: str, after_s: float) -> None:
        self.say, self.load_id, self.after_s = say, load_id, after_s
        self.phase = ""
        self.next = time.monotonic() + after_s

    def watch(self, total: int) -> Callable[[list[dict]], None] | None:
        """What a round's load generators report to (their latest reports, summed), or None."""
        if self.say is None:
            return None
        started = time.monotonic()

        def seen(reports: list[dict]) -> None:
            if time.monotonic() >= self.next:
                self.report(sum(r["done"] for r in reports), total, sum(r["failed"] for r in reports),
                            sum(r["tokens"] for r in reports), time.monotonic() - started)
        return seen

    def report(self, done: int, total: int, failed: int, tokens: int, elapsed_s: float) -> None:
        self.next = time.monotonic() + self.after_s
        failures = f" ({failed} failed)" if failed else ""
        self.say(f"{self.load_id}: {self.phase}: {done} of {total} requests done{failures}, "
                 f"{tokens / max(elapsed_s, 1e-9):.0f} tokens/s over {elapsed_s:.0f} s")


def _lag_of(outcomes: list[dict]) -> ClientLag:
    """The processes' figures: each percentile the worst process's (a run is as late as its latest)."""
    def worst(group: str, key: str) -> float | None:
        values = [o[group][key] for o in outcomes if o[group][key] is not None]
        return max(values) if values else None

    reads, stamped = sum(o["reads"] for o in outcomes), sum(o["stamped"] for o in outcomes)
    return ClientLag(worst("lag", "p50"), worst("lag", "p99"), worst("lag", "max"), worst("cpu", "p50"),
                     worst("cpu", "p99"), reads, bool(reads) and stamped >= STAMPED_SHARE * reads, len(outcomes))


class _Generators:
    """The load-generator processes of one round: started, released together, always reaped."""

    def __init__(self, jobs: list[dict]) -> None:
        self.jobs = jobs
        self.procs: list[subprocess.Popen] = []
        self.errors: list = []
        self.reports: list[dict | None] = [None] * len(jobs)  # each process's latest progress

    def __enter__(self) -> _Generators:
        try:
            self._start()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _start(self) -> None:
        for job in self.jobs:
            err = tempfile.TemporaryFile()
            self.errors.append(err)
            proc = subprocess.Popen([sys.executable, str(LOADGEN)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=err, text=True, bufsize=1)
            self.procs.append(proc)
            proc.stdin.write(json.dumps(job) + "\n")
            proc.stdin.flush()

    def run(self, limit_s: float, progress: Callable[[list[dict]], None] | None = None) -> list[dict]:
        """Release the processes and collect their results within ``limit_s``, handing ``progress`` the
        processes' latest progress reports about once a second."""
        for proc in self.procs:
            self._expect(proc, "ready")
        for proc in self.procs:
            proc.stdin.write("go\n")
            proc.stdin.flush()
        outcomes: list[dict | None] = [None] * len(self.procs)
        readers = [threading.Thread(target=self._follow, args=(i, outcomes), daemon=True)
                   for i in range(len(self.procs))]
        for reader in readers:
            reader.start()
        deadline = time.monotonic() + limit_s
        while any(reader.is_alive() for reader in readers) and time.monotonic() < deadline:
            waiting = next(reader for reader in readers if reader.is_alive())
            waiting.join(min(1.0, max(0.0, deadline - time.monotonic())))
            if progress is not None:
                progress([report for report in self.reports if report])
        for i, outcome in enumerate(outcomes):
            if outcome is None:
                gone = self.procs[i].poll() is not None
                raise RuntimeError(self._failure(i, "ended without a result" if gone else
                                                 f"gave no result within {limit_s:.0f} s"))
        return outcomes

    def _follow(self, index: int, outcomes: list) -> None:
        for line in self.procs[index].stdout:
            message = json.loads(line)
            if "result" in message:
                outcomes[index] = message["result"]
            elif "progress" in message:
                self.reports[index] = message["progress"]

    def _expect(self, proc: subprocess.Popen, key: str) -> None:
        line = proc.stdout.readline()
        message = json.loads(line) if line.strip() else {}
        if key not in message:
            raise RuntimeError(self._failure(self.procs.index(proc), f"did not say {key!r} (it said {line[:200]!r})"))

    def _failure(self, index: int, what: str) -> str:
        proc = self.procs[index]
        code = proc.poll()
        self.errors[index].seek(0)
        tail = self.errors[index].read().decode("utf-8", errors="replace").strip().splitlines()[-12:]
        state = "still running" if code is None else f"exit status {code}"
        return f"load-generator process {index} ({state}) {what}" + ("".join(f"\n  {t}" for t in tail))

    def __exit__(self, *exc_info) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                try:
                    pipe.close()
                except OSError:
                    pass
        for err in self.errors:
            err.close()
