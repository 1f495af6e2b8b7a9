"""The e2e decode client: metric definitions (literal numbers), prompts, /metrics parsing, and
streaming runs against the fake server (``fake_vllm_server.py``); the real-server run is in
test_server.py, where the real server is started once."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from decodebench.serving.client import (
    DecodeLoad,
    DecodeRun,
    RequestResult,
    kv_cache_tokens,
    measure_decode,
    parse_prometheus,
    prompt_token_ids,
    stream_completion,
)
from decodebench.serving.server import ServerConfig, ServerError, VLLMServer

FAKE = Path(__file__).resolve().parent / "fake_vllm_server.py"


@pytest.fixture
def fake(tmp_path):
    """``fake(*server_args, api_key=None)``: a started fake server's handle, stopped after the test."""
    servers = []

    def start(*args: str, api_key: str | None = None):
        config = ServerConfig("fake-model", api_key=api_key, extra_args=args)
        servers.append(VLLMServer(config, tmp_path / f"server{len(servers)}.log", launcher=(sys.executable, str(FAKE))))
        return servers[-1].start()

    yield start
    for server in servers:
        server.stop()


# --- definitions, with literal numbers -------------------------------------------------------


def test_tpot_is_the_time_after_the_first_token_over_the_remaining_tokens():
    assert RequestResult(start=5.0, ttft=0.1, latency=0.73, output_tokens=64).tpot == pytest.approx(0.01)


@pytest.mark.parametrize("result", [RequestResult(0.0, ttft=0.1, latency=0.1, output_tokens=1),
                                    RequestResult(0.0, ttft=0.1, latency=0.2, output_tokens=3, error="boom")])
def test_tpot_needs_two_tokens_and_a_success(result):
    assert result.tpot is None


def two_request_run(*extra: RequestResult) -> DecodeRun:
    requests = (RequestResult(0.0, ttft=0.10, itl=[0.01, 0.02], latency=0.13, output_tokens=3),
                RequestResult(0.0, ttft=0.20, itl=[0.03, 0.03], latency=0.26, output_tokens=3), *extra)
    return DecodeRun(DecodeLoad(2, 16, 3), requests, duration_s=0.5, server_means_s={"tpot": 0.02})


def test_summary_has_vllm_bench_serve_keys_and_definitions():
    info = two_request_run().summary()
    assert info["completed"] == 2
    assert info["failed"] == 0
    assert info["total_output_tokens"] == 6
    assert info["output_throughput"] == pytest.approx(12.0)  # 6 tokens / 0.5 s
    assert (info["mean_tpot_ms"], info["median_tpot_ms"]) == (pytest.approx(22.5), pytest.approx(22.5))
    assert (info["mean_ttft_ms"], info["std_ttft_ms"], info["p99_ttft_ms"]) == \
        (pytest.approx(150.0), pytest.approx(50.0), pytest.approx(199.0))
    assert (info["mean_itl_ms"], info["median_itl_ms"]) == (pytest.approx(22.5), pytest.approx(25.0))  # pooled
    assert info["mean_e2el_ms"] == pytest.approx(195.0)
    assert info["server_mean_tpot_ms"] == pytest.approx(20.0)


def test_failed_requests_are_counted_apart_and_reported_with_their_error():
    run = two_request_run(RequestResult(0.0, error="HTTP 500 Internal Server Error: engine dead"))
    assert len(run.completed) == 2
    assert len(run.failed) == 1
    assert len(run.tpot_samples) == 2
    assert "1 of 3 requests failed (c2-in16-out3)" in run.failure_report()
    assert "engine dead" in run.failure_report()


def test_loads_have_readable_ids_and_enough_prompts():
    assert DecodeLoad(64, 1024, 256).id == "c64-in1024-out256"
    assert (DecodeLoad(1, 8, 8).num_prompts, DecodeLoad(64, 8, 8).num_prompts) == (8, 128)
    with pytest.raises(ValueError, match="output_len >= 2"):
        DecodeLoad(1, 8, 1)


def test_prompts_are_reproducible_distinct_and_clear_of_special_tokens():
    prompts = prompt_token_ids(4, 32, vocab_size=163_840, seed=7)
    assert prompts == prompt_token_ids(4, 32, vocab_size=163_840, seed=7)
    assert len({tuple(p) for p in prompts}) == 4  # no shared prefix for the prefix cache to reuse
    assert all(1000 <= t < 163_840 - 1000 for p in prompts for t in p)
    assert all(100 <= t < 1000 for p in prompt_token_ids(4, 32, vocab_size=None) for t in p)  # unknown vocabulary


def test_prometheus_samples_are_summed_over_label_sets():
    text = ('# TYPE vllm:ttft histogram\n'
            'vllm:ttft_sum{engine="0",model_name="a b}c"} 1.5\n'
            'vllm:ttft_sum{engine="1",model_name="a b}c"} 0.5 1700000000\n'
            'vllm:ttft_count 4\n')
    assert parse_prometheus(text) == {"vllm:ttft_sum": 2.0, "vllm:ttft_count": 4.0}


def test_kv_cache_size_is_read_from_the_cache_config_labels():
    line = 'vllm:cache_config_info{block_size="16",kv_cache_size_tokens="116496",num_gpu_blocks="7281"} 1.0'
    assert kv_cache_tokens(line) == 116_496
    assert kv_cache_tokens(line.replace("kv_cache_size_tokens", "other")) == 7281 * 16
    assert kv_cache_tokens("up 1") is None


# --- streaming runs against the fake server --------------------------------------------------


def test_a_run_times_every_streamed_token_and_reads_the_server_histograms(fake):
    handle = fake(api_key="k")
    run = measure_decode(handle, DecodeLoad(concurrency=4, input_len=8, output_len=6))
    assert len(run.completed) == 8
    assert not run.failed
    for request in run.requests:
        assert request.output_tokens == 6
        assert len(request.itl) == 5
        assert 0 < request.ttft < request.latency
        assert request.tpot > 0
    assert set(run.server_means_s) == {"ttft", "itl", "tpot", "e2el"}  # the fake keeps no queue histogram
    assert run.server_preemptions is None
    assert run.server_kv_tokens == 1024


def test_a_load_the_kv_cache_cannot_hold_at_once_warns(fake):
    handle = fake()
    with pytest.warns(UserWarning, match="c2-in500-out100 needs 1200 KV-cache tokens, the server holds 1024"):
        measure_decode(handle, DecodeLoad(concurrency=2, input_len=500, output_len=100))


def test_server_errors_during_a_run_are_counted_with_their_text(fake):
    handle = fake("--fake-fail-from", "5")  # the warm-up and four requests pass
    run = measure_decode(handle, DecodeLoad(concurrency=2, input_len=8, output_len=4))
    assert (len(run.completed), len(run.failed)) == (4, 4)
    assert "HTTP 500" in run.failure_report()
    assert "fake engine error on request" in run.failure_report()


def test_a_failed_warm_up_raises_with_the_server_error(fake):
    handle = fake("--fake-fail-from", "0")
    with pytest.raises(ServerError, match="warm-up request .* failed: HTTP 500.*fake engine error"):
        measure_decode(handle, DecodeLoad(concurrency=1, input_len=8, output_len=4))


def test_a_stalled_stream_times_out(fake):
    handle = fake("--fake-token-s", "5")
    result = stream_completion(handle, [1, 2, 3], output_len=3, timeout_s=0.5)
    assert not result.ok
    assert "timed out" in result.error
