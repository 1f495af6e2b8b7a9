"""The e2e decode client: metric definitions (literal numbers), prompts, /metrics parsing, and
streaming runs against the fake server (``fake_vllm_server.py``); the real-server run is in
test_server.py, where the real server is started once."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from decodebench.errors import ServerError
from decodebench.serving.client import DecodeRun, measure_decode, prefills_during_decode, tpot_disagreement
from decodebench.serving.load import DecodeLoad, decode_loads, prompt_token_ids
from decodebench.serving.loadgen import Loop, job_for
from decodebench.serving.metrics import kv_cache_tokens, parse_prometheus
from decodebench.serving.stream import RequestResult, stream_completion

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
    handle = fake("--fake-fail-from", "7")  # the warm-up (one request, then a wave of C = 2) and four requests pass
    run = measure_decode(handle, DecodeLoad(concurrency=2, input_len=8, output_len=4))
    assert (len(run.completed), len(run.failed)) == (4, 4)
    assert "HTTP 500" in run.failure_report()
    assert "fake engine error on request" in run.failure_report()


def test_a_failed_warm_up_raises_with_the_server_error(fake):
    handle = fake("--fake-fail-from", "0")
    with pytest.raises(ServerError, match="warm-up request .* failed: HTTP 500.*fake engine error"):
        measure_decode(handle, DecodeLoad(concurrency=1, input_len=8, output_len=4))


def test_a_server_killed_mid_run_is_reported_as_killed_not_as_failed_requests(fake):
    # what a `kill -9` of the API server during the run gave: "8 of 8 requests failed ... ConnectionRefusedError"
    handle = fake("--fake-die-at", "3", "--fake-die-how", "kill", "--fake-token-s", "0.01")
    with pytest.raises(ServerError) as info:
        measure_decode(handle, DecodeLoad(concurrency=2, input_len=8, output_len=6))
    message = str(info.value)
    assert message.startswith("vLLM server was killed by SIGKILL (signal 9) during c2-in8-out6 ("), message
    assert "requests failed, first: " in message.splitlines()[0]
    assert f"log {handle.log_path}, last 40 lines:" in message


def test_a_stream_cut_off_by_a_dying_server_is_a_failed_request_not_a_short_one(fake):
    handle = fake("--fake-die-at", "0", "--fake-die-how", "kill")
    result = stream_completion(handle, [1, 2, 3], output_len=6, timeout_s=10)
    assert not result.ok  # it used to count as done, with one token and no TPOT
    assert result.error == "the stream ended without data: [DONE] (token chunks received: 1)"


def test_a_server_that_crashed_at_the_warm_up_names_its_exit_code_and_the_log_error(fake):
    handle = fake("--fake-die-at", "0", "--fake-die-how", "crash")
    with pytest.raises(ServerError) as info:
        measure_decode(handle, DecodeLoad(concurrency=1, input_len=8, output_len=4))
    head = str(info.value).split("last 40 lines:")[0]
    assert head.startswith("vLLM server exited with code 1 at the warm-up of c1-in8-out4 ("), head
    assert "what went wrong, from the log:\n  RuntimeError: fake engine core died\n" in head


def test_a_stalled_stream_times_out(fake):
    handle = fake("--fake-token-s", "5")
    result = stream_completion(handle, [1, 2, 3], output_len=3, timeout_s=10, stall_s=0.5)
    assert not result.ok
    assert result.stalled
    assert re.fullmatch(r"the request stalled: no data event for 0\.\d s \(limit 0\.5 s\) after 1 token chunks",
                        result.error), result.error


def test_the_server_view_is_read_through_prometheus_text_parsing():
    text = ('# TYPE vllm:num_preemptions counter\n'
            'vllm:num_preemptions_total{engine="0"} 2.0\n'
            'vllm:num_preemptions_created{engine="0"} 1.7e9\n')
    assert parse_prometheus(text)["vllm:num_preemptions_total"] == 2.0
    assert parse_prometheus("<html>502 Bad Gateway</html>") == {}  # not Prometheus text: nothing to check


# --- client TPOT against the server's ------------------------------------------------------


def test_client_tpot_within_the_tolerance_of_the_server_is_valid():
    assert tpot_disagreement([3.9e-3, 4.2e-3, 4.0e-3], server_mean_s=4.1e-3, tolerance=0.25) is None
    assert tpot_disagreement([3.9e-3], server_mean_s=None) is None  # no /metrics: nothing to check
    assert two_request_run().invalid is None  # client 22.5 ms vs server 20 ms: +12.5 %


def test_a_collapsed_client_tpot_is_refused_with_both_figures():
    reason = tpot_disagreement([1e-5, 2e-5, 1e-5, 3.9e-3], server_mean_s=3.9e-3, tolerance=0.25)
    assert reason.startswith("client TPOT mean 0.985 ms (median 0.015 ms) vs the server's /metrics mean 3.900 ms")
    assert "off by -75%, beyond the 25% tolerance" in reason
    high = tpot_disagreement([6e-3, 6e-3], server_mean_s=4e-3, tolerance=0.25)
    assert "off by +50%" in high  # too slow is as impossible as too fast


def test_a_skewed_tpot_whose_mean_agrees_is_valid():
    # H200, requests with steps inside a profiler window: client mean 19.56 ms, median 8.33 ms,
    # server mean 19.48 ms; the median is no evidence against the stream
    samples = [8.3e-3] * 6 + [53e-3] * 2
    assert tpot_disagreement(samples, server_mean_s=19.48e-3, tolerance=0.25) is None


def test_a_stream_the_server_coalesced_is_a_front_end_note_and_the_figure_stays_the_servers(fake):
    # the client reads promptly (kernel stamps), so six tokens in one chunk are the server's doing
    handle = fake("--fake-one-chunk", "--fake-token-s", "0.005")
    run = measure_decode(handle, DecodeLoad(concurrency=2, input_len=8, output_len=6))
    assert not run.failed
    assert set(run.tpot_samples) == {0.0}  # six tokens in one chunk: no decode time seen by the client
    info = run.summary()
    assert info["tokens_per_chunk"] == 6.0
    assert info["tpot_source"] == "server"
    assert 4.0 < info["tpot_ms"] < 50.0
    if run.invalid is None:  # a client starved on a loaded machine is refused instead, which is also right
        assert "6.0 tokens per chunk" in info["frontend"]
        assert "API server" in info["frontend"]


def test_a_normal_stream_is_valid_and_not_warned_about(fake):
    handle = fake("--fake-token-s", "0.03")  # slow enough that a busy machine does not burst it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run = measure_decode(handle, DecodeLoad(concurrency=2, input_len=8, output_len=4))
    assert run.invalid is None
    assert "invalid" not in run.summary()


# --- the window (a round of its own, watched from the server's side) -----------------------


class Probe:
    """A window that notes when it was opened and closed, and can fail in either."""

    def __init__(self, fail_in: str = ""):
        self.fail_in, self.events = fail_in, []

    def open(self):
        self.events.append(("open", time.time()))
        if self.fail_in == "open":
            raise RuntimeError("profiler refused to start")

    def close(self):
        self.events.append(("close", time.time()))
        if self.fail_in == "close":
            raise RuntimeError("profiler wrote no trace")
        return "trace.json"


def test_a_window_is_opened_before_its_round_and_closed_after_it_and_its_result_is_kept(fake):
    handle = fake("--fake-token-s", "0.02")
    probe, load = Probe(), DecodeLoad(concurrency=3, input_len=8, output_len=6)
    run = measure_decode(handle, load, window=probe)
    (opened, at_open), (closed, at_close) = probe.events
    assert (opened, closed) == ("open", "close")
    assert len(run.profiled) == load.num_prompts  # the window's round: all its prompts, none among the samples
    assert all(at_open <= r.start and r.start + r.latency <= at_close for r in run.profiled)
    assert run.window_result == "trace.json"
    assert len(run.completed) == load.num_prompts


@pytest.mark.parametrize("where", ["open", "close"])
def test_a_window_that_fails_fails_the_run_with_its_error(fake, where):
    probe = Probe(fail_in=where)
    match = "refused to start" if where == "open" else "wrote no trace"
    with pytest.raises(RuntimeError, match=match):
        measure_decode(fake("--fake-token-s", "0.005"), DecodeLoad(concurrency=2, input_len=8, output_len=4),
                       window=probe)
    assert [event for event, _ in probe.events] == (["open"] if where == "open" else ["open", "close"])


def test_without_a_window_the_result_is_none(fake):
    run = measure_decode(fake(), DecodeLoad(concurrency=1, input_len=8, output_len=3))
    assert run.window_result is None
    assert run.profiled == ()


def test_a_load_of_c_clients_and_n_prompts_is_named_by_both_and_n_below_c_is_refused():
    import argparse

    from fixtures.vllm_server import _count_list

    assert _count_list("1,64,64:256") == (1, 64, (64, 256))
    assert [load.id for load in decode_loads(_count_list("4,4:32"), 128, 64)] == ["c4-in128-out64",
                                                                                 "c4-in128-out64-n32"]
    with pytest.raises(argparse.ArgumentTypeError, match="'64:32': 32 prompts cannot keep 64 clients busy"):
        _count_list("64:32")
    with pytest.raises(argparse.ArgumentTypeError, match="'x' is not an integer"):
        _count_list("4:x")


def test_prefills_inside_a_requests_decode_are_counted_from_the_client_timestamps():
    # three requests: b and c get their first token while a decodes; c's comes after b's last
    a = RequestResult(0.0, ttft=0.1, latency=1.0, output_tokens=10)
    b = RequestResult(0.05, ttft=0.15, latency=0.4, output_tokens=10)
    c = RequestResult(0.5, ttft=0.2, latency=0.6, output_tokens=10)
    assert prefills_during_decode([a, b, c, RequestResult(0.0, error="boom")]) == [2, 0, 0]


# A parent that starts a load generator, says its pid, lets it go, then waits to be killed
_LOADGEN_PARENT = """
import json, subprocess, sys, time
from decodebench.serving.loadgen import job_for
proc = subprocess.Popen([sys.executable, "-m", "decodebench.serving.loadgen"], stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE, text=True)
proc.stdin.write(json.dumps(job_for(sys.argv[1], "fake-model", {}, [[11, 12, 13]] * 4, 400, 2, 60.0)) + "\\n")
proc.stdin.flush()
assert json.loads(proc.stdout.readline())["ready"]
proc.stdin.write("go\\n")
proc.stdin.flush()
print(proc.pid, flush=True)
time.sleep(600)
"""


def test_a_load_generator_stops_when_the_process_that_wrote_its_job_is_not_its_parent(fake):
    """The parent is the job's, not whatever ``getppid`` says once the generator runs: a parent
    killed before then (the generator starved of CPU) has already been replaced by the reaper."""
    handle = fake("--fake-token-s", "0.05")
    job = job_for(handle.base_url, "fake-model", {}, [[11, 12, 13]] * 2, 400, 1, 60.0)
    job["parent"] = os.getpid()  # this process, never its own parent
    with pytest.raises(SystemExit, match=f"parent process {os.getpid()} is gone; 1 prompts not sent"):
        Loop(job).run()


def test_a_load_generator_whose_parent_is_killed_stops_loading_the_server(fake):
    """A pytest killed at a time limit (SIGKILL: no clean-up runs) leaves no stream running."""
    import psutil

    handle = fake("--fake-token-s", "0.05")  # 400 tokens: 20 s a request, 4 prompts over 2 streams
    parent = subprocess.Popen([sys.executable, "-c", _LOADGEN_PARENT, handle.base_url], stdout=subprocess.PIPE,
                              text=True, cwd=Path(__file__).resolve().parents[1])
    try:
        child = psutil.Process(int(parent.stdout.readline()))
        assert child.is_running()
        assert child.status() != psutil.STATUS_ZOMBIE
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.1)
    else:
        child.kill()
        pytest.fail(f"load generator {child.pid} still streaming 20 s after its parent was killed")
