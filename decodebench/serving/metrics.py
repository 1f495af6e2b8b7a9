"""The server's own view of a run: its Prometheus ``/metrics``, read before and after.

Text is parsed by ``prometheus_client``'s parser; a histogram's mean over the run is
the difference of its ``_sum`` over the difference of its ``_count``, summed over
label sets (engines, models).
"""

from __future__ import annotations

import time

from ..errors import ServerError
from .handle import ServerHandle

__all__ = ["PREEMPTIONS", "SERVER_HISTOGRAMS", "check_tpot_record", "kv_cache_tokens", "labelled_samples",
           "parse_prometheus", "scrape", "scrape_settled", "server_means", "delta"]

# Server-side histograms (vllm/v1/metrics/loggers.py) and the client statistic each checks.
SERVER_HISTOGRAMS = {
    "ttft": "vllm:time_to_first_token_seconds",
    "itl": "vllm:inter_token_latency_seconds",
    "tpot": "vllm:request_time_per_output_token_seconds",
    "e2el": "vllm:e2e_request_latency_seconds",
    "queue": "vllm:request_queue_time_seconds",  # no client twin: time waiting for a batch slot
}
PREEMPTIONS = "vllm:num_preemptions_total"  # above 0: the KV cache could not hold C requests
_CACHE_CONFIG = "vllm:cache_config_info"


def _samples(text: str):
    """Every sample of Prometheus text; none at all if the text does not parse."""
    try:
        from prometheus_client.parser import text_string_to_metric_families  # optional: only a load reads /metrics

        return [s for family in text_string_to_metric_families(text) for s in family.samples]
    except ValueError:
        return []  # not Prometheus text (a proxy's error page): no cross-check


def parse_prometheus(text: str) -> dict[str, float]:
    """Sample name -> value summed over label sets (engines, models), from Prometheus text.

    >>> parse_prometheus('# HELP x\\nvllm:x_count{engine="0"} 2.0\\nvllm:x_count{engine="1"} 3.0\\nup 1')
    {'vllm:x_count': 5.0, 'up': 1.0}
    """
    totals: dict[str, float] = {}
    for sample in _samples(text):
        totals[sample.name] = totals.get(sample.name, 0.0) + float(sample.value)
    return totals


def labelled_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of Prometheus text as (name, labels, value), for counters whose labels matter
    (speculative decoding's per-position counts: :mod:`.spec`).

    >>> labelled_samples('x_total{position="1"} 2.0')
    [('x_total', {'position': '1'}, 2.0)]
    """
    return [(s.name, dict(s.labels), float(s.value)) for s in _samples(text)]


def kv_cache_tokens(text: str) -> int | None:
    """Tokens the server's KV cache holds, from the labels of ``vllm:cache_config_info``.

    >>> kv_cache_tokens('vllm:cache_config_info{block_size="16",num_gpu_blocks="100"} 1.0')
    1600
    """
    for sample in _samples(text):
        if sample.name == _CACHE_CONFIG:
            labels = sample.labels
            if labels.get("kv_cache_size_tokens", "").isdigit():
                return int(labels["kv_cache_size_tokens"])
            if labels.get("num_gpu_blocks", "").isdigit() and labels.get("block_size", "").isdigit():
                return int(labels["num_gpu_blocks"]) * int(labels["block_size"])
    return None


def check_tpot_record(text: str) -> None:
    """Raise :class:`ServerError` where a vLLM server's ``/metrics`` has no TPOT histogram: the e2e figure of
    record is vLLM's own TPOT, and it must not turn into the client's because vLLM renamed a metric.

    A server without vLLM's metrics at all (another server, no ``/metrics``) keeps the client's figure,
    which its result says (``timer`` ``client``, a note).

    >>> check_tpot_record("vllm:request_time_per_output_token_seconds_count 0.0\\nvllm:x 1")
    >>> check_tpot_record("vllm:time_per_output_token_seconds_count 0.0")
    Traceback (most recent call last):
    ...
    decodebench.errors.ServerError: vLLM's /metrics has no vllm:request_time_per_output_token_seconds \
histogram (renamed or removed?), and the e2e figure of record is its mean; update SERVER_HISTOGRAMS in \
decodebench/serving/metrics.py
    """
    names = parse_prometheus(text)
    tpot = SERVER_HISTOGRAMS["tpot"]
    if any(name.startswith("vllm:") for name in names) and tpot + "_count" not in names:
        raise ServerError(f"vLLM's /metrics has no {tpot} histogram (renamed or removed?), and the e2e figure of "
                          "record is its mean; update SERVER_HISTOGRAMS in decodebench/serving/metrics.py")


def scrape(handle: ServerHandle) -> str:
    """``/metrics`` as text, or ``""`` for a server without it (404: then nothing is cross-checked); a
    ``/metrics`` that fails otherwise, or answers slower than its deadline, raises :class:`ServerError`."""
    return handle.get_text("/metrics", absent="")


def scrape_settled(handle: ServerHandle, before: dict[str, float], completed: int,
                   timeout_s: float = 5.0) -> dict[str, float]:
    """``/metrics`` once the server has counted every completed request (or after ``timeout_s``).

    The server records a request's histograms as it finishes it, which can trail the
    last streamed chunk a little.
    """
    if not before:
        return {}
    deadline = time.monotonic() + timeout_s
    while True:
        after = parse_prometheus(scrape(handle))
        counted = delta(after, before, SERVER_HISTOGRAMS["e2el"] + "_count")
        if counted >= completed or time.monotonic() > deadline:
            return after
        time.sleep(0.1)


def server_means(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """Mean of each server histogram over the run (seconds), from its ``_sum``/``_count`` deltas.

    >>> server_means({"vllm:request_time_per_output_token_seconds_sum": 0.5,
    ...               "vllm:request_time_per_output_token_seconds_count": 12.0},
    ...              {"vllm:request_time_per_output_token_seconds_sum": 0.1,
    ...               "vllm:request_time_per_output_token_seconds_count": 2.0})
    {'tpot': 0.04}
    """
    means = {}
    for name, metric in SERVER_HISTOGRAMS.items():
        count = delta(after, before, metric + "_count")
        if count > 0:
            means[name] = delta(after, before, metric + "_sum") / count
    return means


def delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    """How much ``key`` grew between two scrapes (0 where neither has it)."""
    return after.get(key, 0.0) - before.get(key, 0.0)
