"""End-to-end decode on a live vLLM server: TPOT per request at each client concurrency.

Each benchmark is one concurrency C (ids like ``c4-in128-out64``): a warm-up request,
then C clients stream completions of fixed input and output length until the load's
prompts are used up. The per-request TPOT samples are the benchmark's rounds;
TTFT, ITL, E2EL, throughput and the server's own histogram means go to ``extra_info``.
"""

import pytest

from decodebench.bridge import record_samples
from decodebench.serving.client import measure_decode

pytestmark = pytest.mark.benchmark(group="decode-e2e")


def test_decode(decode_load, vllm_server, device_benchmark):
    run = measure_decode(vllm_server, decode_load)
    if run.failed:
        pytest.fail(run.failure_report(), pytrace=False)
    info = {"metric": "tpot_s", **run.summary(), "server": vllm_server.describe()}
    record_samples(device_benchmark, run.tpot_samples, info)
