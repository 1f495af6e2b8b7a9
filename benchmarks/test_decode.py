"""End-to-end decode on a live vLLM server: TPOT per request at each client concurrency.

Each benchmark is one concurrency C (ids like ``c4-in128-out64``): a warm-up wave at the
load, then ``--e2e-rounds`` rounds in which C streams carry completions of fixed input and
output length until the round's prompts are used up. The benchmark's rounds are each
round's mean of vLLM's own per-request TPOT (its ``/metrics`` record; the client's per-request
TPOTs where the server keeps none), and ``tpot_ms`` is their median. The client's own figures
(``delivered_tpot_ms``, per-request TTFT, ITL, E2EL, TPOT), throughput and the server's
histogram means go to ``extra_info``.
A server started with ``--spec METHOD:K`` (ids end in ``-ngram4``) adds vLLM's
speculative-decoding counters over the measured rounds, the acceptance rate and the mean tokens
per step (``extra_info["spec_decode"]``, :func:`decodebench.serving.spec.spec_info`).
With ``--breakdown``, a few decode steps in the middle of a round of each load's own are
profiled (:func:`decodebench.attribution.breakdown.profile.window_delay`), and their attribution goes to
``extra_info["attribution"]``.
"""

import warnings

import pytest

from decodebench.bridge import record_samples
from decodebench.errors import ServerError
from decodebench.harness import device_telemetry
from decodebench.plugin import state_of
from decodebench.serving.client import core_info, measure_decode
from decodebench.serving.spec import spec_info
from fixtures.attribution import ANALYSIS_ERRORS
from fixtures.vllm_server import progress_printer, server_options

pytestmark = pytest.mark.benchmark(group="decode-e2e")


def test_decode(decode_load, vllm_server, device_benchmark, decode_attribution, served_model, pytestconfig):
    window = decode_attribution.window(vllm_server, served_model.server_ranks, decode_load)
    device = state_of(pytestconfig).device  # the server's GPU when it was started here
    before = device_telemetry(device)
    options = server_options(pytestconfig)
    run = _measure_or_fail(vllm_server, decode_load, window, options, progress_printer(pytestconfig))
    if run.failed:
        pytest.fail(run.failure_report(), pytrace=False)
    core = core_info(run, telemetry_before=before, telemetry_after=device_telemetry(device))
    info = {**core, "metric": "tpot_s", **run.summary(), "server": vllm_server.describe()}
    spec = spec_info(options.spec, run.metrics_text, [r.output_tokens for r in run.completed])
    if spec:
        info["spec_decode"] = spec
    if window is not None:
        try:
            info["attribution"] = decode_attribution.analyse(run, decode_load, served_model)
        except ANALYSIS_ERRORS as exc:
            info["attribution_error"] = str(exc)
            warnings.warn(f"{decode_load.id}: no attribution: {exc}", stacklevel=1)
    record_samples(device_benchmark, run.figure_samples, info)


def _measure_or_fail(server, load, window, options, progress):
    """The load's run; a server that died or refused the warm-up fails the test with its message only."""
    try:
        return measure_decode(server, load, window=window, rounds=options.rounds,
                              request_timeout_s=options.request_timeout_s, stall_s=options.stall_s,
                              progress=progress)
    except ServerError as exc:
        message = str(exc)
    pytest.fail(message, pytrace=False)  # outside ``except``: no chained traceback around the log tail
