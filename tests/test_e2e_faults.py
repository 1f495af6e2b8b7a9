"""The e2e client against a misbehaving server (``fake_vllm_server.py``): a stream that stalls, a
connection closed mid-stream, a reply that is no event stream; each ends in an error naming the
request within a bounded, stated time, and a long load says how it goes."""

from __future__ import annotations

import fnmatch
import json
import os
import re

import pytest

from decodebench.errors import ServerError
from decodebench.serving.client import DecodeLoad, measure_decode
from decodebench.serving.loadgen import Loop, job_for
from decodebench.serving.stream import stream_completion
from tests.conftest import REPO

# the warm-up of a load of C = 2 is requests 0 (alone), 1 and 2 (a wave of C): request 3 is the round's first
FIRST_MEASURED = "3"


# --- a stalled stream: named, with its tokens, within the stall limit -------------------------------------


@pytest.mark.timeout(120)  # it used to wait out the 600 s request deadline, saying nothing
def test_a_stream_that_stalls_mid_round_fails_naming_the_request_and_its_tokens(fake):
    handle = fake("--fake-stall-at", FIRST_MEASURED, "--fake-stall-after", "2", "--fake-token-s", "0.01")
    run = measure_decode(handle, DecodeLoad(concurrency=2, input_len=8, output_len=6), stall_s=2.0)
    stalled = [r for r in run.failed if r.stalled]
    assert len(stalled) == 1, run.failure_report()
    # numbered among the round's 8 prompts; the rest of the round is cut off
    assert re.fullmatch(r"request \d of 8 stalled: no data event for 2\.\d s \(limit 2 s\) after 2 token chunks",
                        stalled[0].error), stalled[0].error
    assert all("stalled" in r.error for r in run.failed)  # cut off or not sent, each saying why
    assert "stalled" in run.failure_report()


@pytest.mark.timeout(120)
def test_a_stall_ends_the_run_after_its_round(fake):
    handle = fake("--fake-stall-at", FIRST_MEASURED, "--fake-token-s", "0.01")
    run = measure_decode(handle, DecodeLoad(concurrency=2, input_len=8, output_len=6), stall_s=2.0, rounds=3)
    assert len(run.rounds) == 1  # not three rounds of stalls


@pytest.mark.timeout(120)
def test_a_stall_at_the_warm_up_is_a_server_error_naming_the_request(fake):
    handle = fake("--fake-stall-at", "0")
    with pytest.raises(ServerError) as raised:
        measure_decode(handle, DecodeLoad(concurrency=1, input_len=8, output_len=4), stall_s=2.0)
    assert re.search(r"warm-up request to http://127\.0\.0\.1:\d+ failed: the warm-up's first request stalled: "
                     r"no data event for 2\.\d s \(limit 2 s\) after 1 token chunks", str(raised.value)), raised.value


@pytest.mark.timeout(120)
def test_a_request_past_its_deadline_fails_naming_itself_and_its_tokens(fake):
    handle = fake("--fake-token-s", "0.4")  # every token within the stall limit, each request too slow as a whole
    with pytest.raises(ServerError, match=r"the warm-up's first request passed its 1 s deadline after 1\.\d s, "
                                          r"\d token chunks received"):
        measure_decode(handle, DecodeLoad(concurrency=2, input_len=8, output_len=6), request_timeout_s=1.0,
                       stall_s=5.0)
    job = job_for(handle.base_url, "fake-model", {}, [[11, 12, 13]] * 2, 6, 2, 1.0, stall_s=5.0)
    job["parent"] = os.getppid()  # run here, in this process: its parent is the one to outlive
    loop = Loop(job)
    loop.run()
    errors = sorted(r["error"] for r in loop.results)
    assert [re.sub(r"after 1\.\d s, \d", "after 1.x s, N", e) for e in errors] == [
        "request 1 of 2 passed its 1 s deadline after 1.x s, N token chunks received",
        "request 2 of 2 passed its 1 s deadline after 1.x s, N token chunks received"]


# --- keep-alive comments are no progress: the stall bound and the deadline hold -------------------------


@pytest.mark.timeout(60)  # it used to run on for as long as the pings came (killed after 200 s)
def test_keep_alive_comments_do_not_hold_off_the_stall_bound(fake):
    handle = fake("--fake-stall-at", FIRST_MEASURED, "--fake-ping-s", "0.2", "--fake-token-s", "0.01")
    run = measure_decode(handle, DecodeLoad(concurrency=2, input_len=8, output_len=6), stall_s=2.0,
                         request_timeout_s=600.0)
    stalled = [r for r in run.failed if r.stalled]
    assert len(stalled) == 1, run.failure_report()
    assert re.fullmatch(r"request \d of 8 stalled: no data event for 2\.\d s \(limit 2 s\) after 1 token chunks",
                        stalled[0].error), stalled[0].error


@pytest.mark.timeout(60)
def test_keep_alive_comments_do_not_hold_off_the_request_deadline(fake):
    handle = fake("--fake-stall-at", "0", "--fake-ping-s", "0.2")  # the warm-up's request, read in this process
    with pytest.raises(ServerError, match=r"the warm-up's first request passed its 2 s deadline after 2\.\d s, "
                                          r"1 token chunks received"):
        measure_decode(handle, DecodeLoad(concurrency=1, input_len=8, output_len=4), request_timeout_s=2.0,
                       stall_s=60.0)


@pytest.mark.timeout(60)  # a /metrics that trickled its body, a byte within every read timeout, was waited for forever
def test_a_metrics_page_that_trickles_fails_the_load_within_its_deadline(fake):
    handle = fake("--fake-metrics-drip", "0.2")
    with pytest.raises(ServerError, match=r"GET http://127\.0\.0\.1:\d+/metrics: no whole answer within 10 s \(the "
                                          r"server trickles it: \d+ bytes so far\)"):
        measure_decode(handle, DecodeLoad(concurrency=1, input_len=8, output_len=4))


# --- a stream whose count contradicts itself or the request: that request fails, quoting the server ---------


@pytest.mark.parametrize(("fault", "error"), [
    (["--fake-usage", "0"], 'usage says 0 tokens, 4 streamed (token chunks): the server sent data: '
                            '{"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": 0}}'),
    (["--fake-usage", "-3"], "usage says -3 tokens, 4 streamed (token chunks): *"),
    (["--fake-usage", '"4"'], "usage says '4' tokens, 4 streamed (token chunks): *"),
    (["--fake-usage", "1000000000000"], "the server made 1000000000000 tokens (usage), 4 asked (max_tokens with "
                                        "ignore_eos)"),
    (["--fake-mid-event", "null"], "the server sent an event that is no JSON object after 1 token chunks: data: null"),
    (["--fake-mid-event", "{'choices'"], "the server sent an event that is no JSON object after 1 token chunks: "
                                         "data: {'choices'"),
    (["--fake-mid-event", '{"usage": 4}'], "the server sent a usage that is no JSON object after 1 token chunks: "
                                           'data: {"usage": 4}'),
], ids=["usage-0", "usage-negative", "usage-string", "usage-1e12", "data-null", "not-json", "usage-list"])
def test_a_request_whose_usage_contradicts_its_stream_fails_quoting_the_server(fake, fault, error):
    handle = fake(*fault, "--fake-fault-at", FIRST_MEASURED)
    run = measure_decode(handle, DecodeLoad(concurrency=2, input_len=8, output_len=4))
    assert len(run.failed) == 1, run.failure_report()
    assert len(run.completed) == 7
    assert fnmatch.fnmatchcase(run.failed[0].error, error), run.failed[0].error
    assert run.failure_report().startswith("1 of 8 requests failed (c2-in8-out4); first errors:")


@pytest.mark.parametrize(("tokens", "made"), [("80", "80 tokens (usage)"), ("5", "5 tokens (usage)")])
def test_a_request_that_made_other_than_the_tokens_asked_fails_naming_the_counts(fake, tokens, made):
    handle = fake("--fake-tokens", tokens, "--fake-fault-at", FIRST_MEASURED)
    run = measure_decode(handle, DecodeLoad(concurrency=2, input_len=8, output_len=8))
    assert [r.error for r in run.failed] == [f"the server made {made}, 8 asked (max_tokens with ignore_eos)"]


def test_a_warm_up_whose_usage_contradicts_its_stream_is_a_server_error_quoting_it(fake):
    with pytest.raises(ServerError, match=r"warm-up request to http://\S+ failed: usage says 0 tokens, 4 streamed "
                                          r"\(token chunks\): the server sent data: \{"):
        measure_decode(fake("--fake-usage", "0"), DecodeLoad(concurrency=1, input_len=8, output_len=4))


# --- an early close and a reply that is no event stream ---------------------------------------------------


def test_a_connection_closed_mid_stream_fails_that_request_and_the_server_is_not_called_dead(fake):
    handle = fake("--fake-close-at", FIRST_MEASURED)
    run = measure_decode(handle, DecodeLoad(concurrency=2, input_len=8, output_len=4))
    assert [r.error for r in run.failed] == ["the stream ended without data: [DONE] (token chunks received: 1)"]
    assert len(run.completed) == 7


def test_a_reply_that_is_no_event_stream_is_named(fake):
    handle = fake("--fake-non-sse-at", FIRST_MEASURED)
    run = measure_decode(handle, DecodeLoad(concurrency=2, input_len=8, output_len=4))
    assert [r.error for r in run.failed] == ["HTTP 200 but no event stream (Content-Type 'text/html'): "
                                             "<html><body>502 Bad Gateway (a proxy's page)</body></html>"]


def test_a_single_request_to_a_non_sse_reply_is_named(fake):
    handle = fake("--fake-non-sse-at", "0")
    result = stream_completion(handle, [1, 2, 3], output_len=4, timeout_s=10)
    assert result.error.startswith("HTTP 200 but no event stream (Content-Type 'text/html'): <html>")


# --- progress of a long load ----------------------------------------------------------------------------


def test_a_load_longer_than_its_progress_interval_says_how_it_goes(fake):
    handle = fake("--fake-token-s", "0.05")  # 8 prompts of 10 tokens one after the other: about 4 s
    lines: list[str] = []
    run = measure_decode(handle, DecodeLoad(concurrency=1, input_len=8, output_len=10), progress=lines.append,
                         progress_after_s=1.0)
    assert not run.failed
    rounds = [line for line in lines if ": round 1 of 1: " in line]
    assert rounds, lines
    for line in rounds:
        assert re.fullmatch(r"c1-in8-out10: round 1 of 1: [0-8] of 8 requests done, \d+ tokens/s over \d+ s", line)


def test_a_short_load_prints_nothing(fake):
    lines: list[str] = []
    measure_decode(fake(), DecodeLoad(concurrency=2, input_len=8, output_len=4), progress=lines.append)
    assert lines == []


# --- through the benchmark, with the options ----------------------------------------------------------------


@pytest.mark.timeout(300)
def test_the_benchmark_reports_a_stall_within_the_option_it_was_given(pytester, tmp_path, fake_python):
    result = pytester.runpytest_subprocess(
        str(REPO / "benchmarks" / "test_decode.py"), "--rootdir", str(REPO), "-p", "no:cacheprovider",
        f"--benchmark-storage=file://{tmp_path / 'store'}", "--server-python", fake_python, "--input-len", "8",
        "--output-len", "6", "--concurrency", "2", "--e2e-stall-s", "2", "--e2e-request-timeout-s", "30",
        "--server-arg=--fake-stall-at 3 --fake-token-s 0.01")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["* of 8 requests failed (c2-in8-out6); first errors:",
                                 "- request ? of 8 stalled: no data event for 2.? s (limit 2 s) after 1 token chunks"])
    result.stdout.no_fnmatch_line("*Traceback*")
    assert not list((tmp_path / "store").rglob("*.json")) or all(
        json.loads(p.read_text())["benchmarks"] == [] for p in (tmp_path / "store").rglob("*.json"))


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("server", "options", "error"), [
    ("--fake-stall-at 3 --fake-ping-s 0.2", ["--e2e-stall-s", "2"],
     "- request ? of 8 stalled: no data event for 2.? s (limit 2 s) after 1 token chunks"),
    ("--fake-usage 0 --fake-fault-at 3", [],
     "- usage says 0 tokens, 6 streamed (token chunks): the server sent data: {*}"),
    ("--fake-tokens 80 --fake-fault-at 3", [],
     "- the server made 80 tokens (usage), 6 asked (max_tokens with ignore_eos)"),
], ids=["ping-stall", "usage-0", "ignores-max-tokens"])
def test_the_benchmark_fails_a_faulty_stream_and_stores_nothing(pytester, tmp_path, fake_python, server, options,
                                                                error):
    result = pytester.runpytest_subprocess(
        str(REPO / "benchmarks" / "test_decode.py"), "--rootdir", str(REPO), "-p", "no:cacheprovider",
        f"--benchmark-storage=file://{tmp_path / 'store'}", "--benchmark-autosave", "--server-python", fake_python,
        "--input-len", "8", "--output-len", "6", "--concurrency", "2", "--e2e-stall-s", "60", *options,
        f"--server-arg={server} --fake-token-s 0.01")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["* of 8 requests failed (c2-in8-out6); first errors:", error])
    result.stdout.no_fnmatch_line("*Traceback*")
    assert [json.loads(p.read_text())["benchmarks"] for p in (tmp_path / "store").rglob("*.json")] in ([], [[]])


@pytest.mark.parametrize("option", ["--e2e-stall-s", "--e2e-request-timeout-s"])
def test_the_deadline_options_refuse_what_is_not_a_positive_number(pytester, option):
    result = pytester.runpytest_subprocess(str(REPO / "benchmarks" / "test_decode.py"), "--rootdir", str(REPO),
                                           "-p", "no:cacheprovider", "--collect-only", option, "0")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*argument {option}: '0' must be a finite number above 0*"])


PRINTER_MODULE = """
from fixtures.vllm_server import progress_printer

def test_says(pytestconfig):
    print("captured, not shown")
    progress_printer(pytestconfig)("c1-in8-out10: round 1 of 1: 3 of 8 requests done, 6 tokens/s over 2 s")
"""


def test_progress_reaches_the_terminal_past_pytests_capture(pytester):
    pytester.makeconftest((REPO / "conftest.py").read_text())  # the repository's plugins and fixtures
    pytester.makepyfile(test_printer=PRINTER_MODULE)
    result = pytester.runpytest_subprocess("--model", "tiny-kimi", "--tp", "1", "-p", "no:cacheprovider",
                                           "--benchmark-disable", f"--rootdir={REPO}")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*decodebench: c1-in8-out10: round 1 of 1: 3 of 8 requests done, 6 tokens/s over 2 s"])
    result.stdout.no_fnmatch_line("*captured, not shown*")
