"""The Marlin adapter: binding to vLLM's signatures, the loader recipe, the fused call
(emulated on CPU), and how the fused call's kernel trace splits into the two GEMMs."""

import dataclasses
import inspect
import types

import pytest
import torch
from moe_helpers import CPU, MARLIN_SHAPED, TINY, tiny

from decodebench.errors import BackendUnavailable, KernelMismatch
from decodebench.kernel_parts import split_call
from decodebench.kernels import marlin
from decodebench.kernels.base import check_case
from decodebench.kernels.binding import Binding, VllmApiMismatch
from decodebench.kernels.experts import group_by_expert, run_experts
from decodebench.kernels.int4 import ExpertLayout, ExpertWeights, random_expert_weights
from decodebench.kernels.marlin import FUSED_MARLIN_PARTS, MarlinApi, marlin_blocks_per_sm
from decodebench.kernels.moe import MoECase, MoEStage, RoutingDistribution
from decodebench.shapes import GemmShape


def test_marlin_adapter_fits_the_installed_fused_marlin_moe():
    pytest.importorskip("vllm")
    api = marlin.marlin_api()  # binds every function to its installed signature; calls none
    installed = inspect.signature(api.fused_moe.fn).parameters
    assert set(marlin.FUSED_NEEDS) <= api.fused_moe.accepted
    assert ("gating_output" in api.fused_moe.accepted) == ("gating_output" in installed)
    from vllm.scalar_type import scalar_types

    assert api.quant_type_id == scalar_types.uint4b8.id


def fused_032(hidden_states, w1, w2, bias1, bias2, w1_scale, w2_scale, topk_weights, topk_ids,
              quant_type_id, apply_router_weight_on_input=False, global_num_experts=-1, workspace=None):
    return dict(locals())


def fused_mid(hidden_states, w1, w2, bias1, bias2, w1_scale, w2_scale, gating_output, topk_weights, topk_ids,
              quant_type_id, global_num_experts=-1, g_idx1=None, workspace=None, is_k_full=True):
    return dict(locals())


def fused_renamed(hidden_states, w1, w2, bias1, bias2, w1_scale, w2_scale, topk_weights, expert_ids,
                  quant_type_id, workspace=None):
    return dict(locals())


def fused_oldest(hidden_states, w1, w2, w1_scale, w2_scale, gating_output, topk_weights, topk_ids,
                 num_bits=4, is_k_full=True):
    return dict(locals())


def bind_fused(fn):
    return Binding.of(fn, offers=marlin.FUSED_OFFERS, needs=marlin.FUSED_NEEDS, name="fused_marlin_moe")


def test_gating_output_is_passed_only_where_the_signature_has_it():
    assert "gating_output" not in bind_fused(fused_032).accepted
    called = bind_fused(fused_mid)(**{name: name for name in marlin.FUSED_OFFERS})
    assert called["gating_output"] == "gating_output"


def test_the_served_top_k_sum_is_passed_where_fused_marlin_moe_takes_one():
    def fused_026(hidden_states, w1, w2, bias1, bias2, w1_scale, w2_scale, topk_weights, topk_ids,
                  quant_type_id, global_num_experts=-1, moe_sum=None, expert_map=None, workspace=None):
        return dict(locals())

    calls = []
    ops = types.SimpleNamespace(moe_sum=lambda *args: calls.append(args))
    served = marlin._served_moe_sum(ops)
    assert bind_fused(fused_026)(**{name: name for name in marlin.FUSED_OFFERS})["moe_sum"] == "moe_sum"
    assert "moe_sum" not in bind_fused(fused_032).accepted  # a vLLM without the hook sums its own way
    assert served("out3", "out", "ids", None) == "out"
    assert calls == [("out3", "out")]
    served("out3", "out", "ids", "map")  # an expert-parallel rank's sum skips the other ranks' experts
    assert calls[-1] == ("out3", "out", "ids", "map")
    assert marlin._served_moe_sum(types.SimpleNamespace()) is None


def test_a_renamed_parameter_is_named_in_the_error():
    with pytest.raises(VllmApiMismatch, match=r"no parameter 'topk_ids'.*requires 'expert_ids'.*Installed signature"):
        bind_fused(fused_renamed)


def test_a_missing_parameter_is_named_in_the_error():
    with pytest.raises(VllmApiMismatch, match=r"fused_marlin_moe in the installed vLLM .*no parameter 'quant_type_id'"):
        bind_fused(fused_oldest)


def test_repack_takes_the_old_perm_argument_where_it_exists():
    def old_repack(b_q_weight, perm, size_k, size_n, num_bits):
        return perm

    def new_repack(b_q_weight, size_k, size_n, num_bits, is_a_8bit=False):
        return size_k

    bind = dict(offers=marlin.REPACK_OFFERS, needs=marlin.REPACK_NEEDS)
    args = dict(b_q_weight=None, perm="empty", size_k=7168, size_n=512, num_bits=4)
    assert Binding.of(old_repack, **bind)(**args) == "empty"
    assert Binding.of(new_repack, **bind)(**args) == 7168


def fake_marlin_api(record):
    def repack(b_q_weight, size_k, size_n, num_bits, is_a_8bit=False):
        record.append(("repack", tuple(b_q_weight.shape), size_k, size_n, num_bits))
        return b_q_weight

    def permute(s, size_k, size_n, group_size, is_a_8bit=False):
        record.append(("scales", tuple(s.shape), size_k, size_n, group_size))
        return s

    return MarlinApi(
        fused_moe=bind_fused(fused_032),
        repack=Binding.of(repack, offers=marlin.REPACK_OFFERS, needs=marlin.REPACK_NEEDS),
        permute_scales=Binding.of(permute, offers=marlin.SCALES_NEEDS, needs=marlin.SCALES_NEEDS),
        make_workspace=Binding.of(lambda device, max_blocks_per_sm=1: max_blocks_per_sm,
                                  offers=marlin.WORKSPACE_OFFERS, needs=("device",), name="workspace"),
        quant_type_id=123,
    )


def test_loader_recipe_hands_marlin_k_first_tensors_with_their_sizes():
    record = []
    fake_marlin_api(record).to_marlin(random_expert_weights(TINY, CPU, seed=14))
    assert record == [
        ("repack", (12, 32 // 8, 64), 32, 64, 4),  # w13: [E, hidden/8, 2I], size_k = hidden, size_n = 2I
        ("repack", (12, 32 // 8, 32), 32, 32, 4),  # w2: [E, I/8, hidden], size_k = I, size_n = hidden
        ("scales", (12, 32 // 16, 64), 32, 64, 16),
        ("scales", (12, 32 // 16, 32), 32, 32, 16),
    ]


def test_fused_call_passes_the_routing_the_quant_type_and_the_workspace():
    api = fake_marlin_api([])
    inputs = tiny().make_inputs(CPU, seed=15)
    marlin = api.to_marlin(inputs["weights"])
    called = api.run(inputs, marlin, workspace="locks")
    assert called["topk_ids"] is inputs["topk_ids"]
    assert called["topk_weights"] is inputs["topk_weights"]
    assert (called["quant_type_id"], called["global_num_experts"], called["workspace"]) == (123, 12, "locks")
    assert called["hidden_states"] is inputs["x"]
    assert called["bias1"] is None
    assert api.workspace(CPU) == marlin_blocks_per_sm()




def emulated_fused_marlin_moe(hidden_states, w1, w2, bias1, bias2, w1_scale, w2_scale, topk_weights, topk_ids,
                              quant_type_id, global_num_experts=-1, workspace=None):
    """fused_marlin_moe's math on fake_marlin_api's identity repack: its K-first tensors, back to N-first."""
    gate_up, down = GemmShape(w1.shape[2], hidden_states.shape[1]), GemmShape(w2.shape[2], w2.shape[1] * 8)
    layout = ExpertLayout(w1.shape[0], gate_up, down, gate_up.k // w1_scale.shape[1])
    weights = ExpertWeights(layout, *(t.transpose(1, 2) for t in (w1, w1_scale, w2, w2_scale)))
    inputs = {"x": hidden_states, "topk_ids": topk_ids, "topk_weights": topk_weights, "weights": weights}
    return run_experts(MoEStage.FUSED, inputs, group_by_expert(topk_ids), torch.bfloat16)


@pytest.fixture
def emulate_vllm(monkeypatch):
    """Install ``fused`` as fused_marlin_moe and run the vllm backend's own code; returns the loader record."""
    def install(fused=emulated_fused_marlin_moe):
        record = []
        api = dataclasses.replace(fake_marlin_api(record), fused_moe=bind_fused(fused))
        monkeypatch.setattr(marlin, "require_vllm_ops", lambda device: None)
        monkeypatch.setattr(marlin, "_require_marlin_kernels", lambda device: None)
        monkeypatch.setattr(marlin, "marlin_api", lambda: api)
        return record

    yield install
    marlin.marlin_weights.cache_clear()  # converted by the fake loader: keep them out of other tests


def test_vllm_backend_is_checked_on_fewer_experts_then_on_the_case(emulate_vllm):
    record = emulate_vllm()
    case = MoECase(MoEStage.FUSED, 8, MARLIN_SHAPED, top_k=4, routing=RoutingDistribution.SKEWED, check_experts=12)
    kernel = case.kernel("vllm", CPU)
    (variant,) = case.check_variants()  # the harness checks these too, before timing
    assert variant.layout.experts == 12
    assert check_case(variant, kernel, CPU, seed=16).error < case.tolerance
    assert check_case(case, kernel, CPU, seed=16).error < case.tolerance
    assert [entry[1][0] for entry in record if entry[0] == "repack"] == [12, 12, 16, 16]


def test_a_wrong_vllm_result_fails_the_check_on_fewer_experts(emulate_vllm):
    def gate_and_up_swapped(**kwargs):  # takes every offered argument, gating_output (None) and moe_sum too
        w1, s1 = kwargs.pop("w1"), kwargs.pop("w1_scale")
        del kwargs["gating_output"], kwargs["moe_sum"]
        half = w1.shape[2] // 2
        return emulated_fused_marlin_moe(w1=w1.roll(half, dims=2), w1_scale=s1.roll(half, dims=2), **kwargs)

    emulate_vllm(gate_and_up_swapped)
    case = MoECase(MoEStage.FUSED, 8, MARLIN_SHAPED, top_k=4, routing=RoutingDistribution.UNIFORM, check_experts=12)
    kernel = case.kernel("vllm", CPU)
    (variant,) = case.check_variants()
    with pytest.raises(KernelMismatch, match=f"{variant.id}: output differs"):
        check_case(variant, kernel, CPU, seed=17)


# --- the benchmark module end to end ------------------------------------------------------


# --- the fused call's kernel trace, split into its GEMMs ------------------------------------

# One fused_marlin_moe call as CUPTI names its kernels on vLLM 0.26 (CUDA), in launch order.
MARLIN_GEMM = ("void marlin_moe_wna16::Marlin<(vllm::ScalarTypeId)5, (vllm::ScalarTypeId)13, "
               "(vllm::ScalarTypeId)5, (vllm::ScalarTypeId)5, 256, 1, 8, 8, true, 4, 2, false>"
               "(int4 const*, int4 const*, int4*, int4*, int4 const*, float const*, int4 const*)")
FUSED_CALL = (
    "void vllm::moe::moe_align_block_size_small_batch_expert_kernel<int>(int const*, int*, int*, int*, int, int)",
    "Memset (Device)",
    MARLIN_GEMM,
    "void vllm::act_and_mul_kernel<c10::BFloat16, &(c10::BFloat16 vllm::silu_kernel<c10::BFloat16>"
    "(c10::BFloat16 const&)), true>(c10::BFloat16*, c10::BFloat16 const*, int)",
    MARLIN_GEMM,
    "void vllm::moe::moe_sum_kernel<c10::BFloat16, 8>(c10::BFloat16*, c10::BFloat16 const*, int)",
)


def test_the_fused_call_splits_into_align_gemms_activation_and_sum():
    assert split_call(FUSED_CALL, FUSED_MARLIN_PARTS) == (
        "align", "other", "gate_up", "activation", "down", "sum")


def test_the_large_batch_align_kernels_are_align_too():
    names = ("void vllm::moe::moe_align_block_size_kernel<int>(int const*)",
             "void vllm::moe::count_and_sort_expert_tokens_kernel<int>(int const*)", MARLIN_GEMM, MARLIN_GEMM)
    assert split_call(names, FUSED_MARLIN_PARTS) == ("align", "align", "gate_up", "down")


def trace_of(names, *per_sample_us):
    from decodebench.timing import KernelTrace

    return KernelTrace(tuple(names), tuple(tuple(us * 1e-6 for us in sample) for sample in per_sample_us))


@pytest.mark.parametrize(("stage", "expected_us"), [(MoEStage.GATE_UP, (20.0, 22.0)), (MoEStage.DOWN, (9.0, 9.5))])
def test_a_gemm_case_records_its_gemm_and_names_the_glue(stage, expected_us):
    case = MoECase(stage, 4, MARLIN_SHAPED, top_k=4, routing=RoutingDistribution.UNIFORM, check_experts=12)
    trace = trace_of(FUSED_CALL, (2, 0.5, 20, 1, 9, 1.5), (2, 0.5, 22, 1, 9.5, 1.5))
    samples, info = case.timed_part("vllm").attribute(trace)
    assert samples == pytest.approx(tuple(us * 1e-6 for us in expected_us))
    assert info["timed_part"] == stage.value
    assert info["traced_call"] == dataclasses.replace(case, stage=MoEStage.FUSED).id
    medians = {part: round(s * 1e6, 3) for part, s in info["part_median_s"].items()}
    assert medians == {"align": 2.0, "other": 0.5, "gate_up": 21.0, "activation": 1.0, "down": 9.25, "sum": 1.5}
    assert [k["part"] for k in info["call_kernels"]] == ["align", "other", "gate_up", "activation", "down", "sum"]


@pytest.mark.parametrize(("names", "problem"), [
    (FUSED_CALL[:4], "'down' matched 0 kernels, expected 1"),
    ((*FUSED_CALL, MARLIN_GEMM), "'unexpected_gemm' matched 1 kernels, expected none"),
])
def test_a_trace_that_does_not_have_two_marlin_gemms_is_an_error_naming_the_kernels(names, problem):
    from decodebench.kernel_parts import TraceAttributionError

    part = MoECase(MoEStage.DOWN, 4, MARLIN_SHAPED, 4, RoutingDistribution.UNIFORM, 12).timed_part("vllm")
    with pytest.raises(TraceAttributionError, match=problem) as error:
        part.attribute(trace_of(names, [1.0] * len(names)))
    assert "moe_sum_kernel" in str(error.value) or "act_and_mul" in str(error.value)


@pytest.fixture
def harness_with_trace(monkeypatch, emulate_vllm):
    """Run the harness with the emulated vLLM and a kernel timer that returns FUSED_CALL's trace."""
    from decodebench import harness
    from decodebench.timing import Budget, Measurement, StopReason, TimerMode

    emulate_vllm()
    timed, recorded = [], {}
    trace = trace_of(FUSED_CALL, (2, 0.5, 20, 1, 9, 1.5), (2, 0.5, 22, 1, 9.5, 1.5))

    def fake_measure(fn, *, mode, device, budget, **_):
        timed.append(fn())  # the timed callable runs the fused call
        return Measurement((34e-6, 36.5e-6), mode, 1, StopReason.CONVERGED, 0.1, (), trace)

    monkeypatch.setattr(harness, "measure", fake_measure)
    monkeypatch.setattr(harness, "record_samples", lambda bench, samples, extra: recorded.update(
        samples=samples, extra=extra))
    ctx = harness.RunContext(CPU, TimerMode.KERNEL, Budget(), peaks=None)
    return lambda case: (harness.run_kernel_case(None, case, "vllm", ctx), timed, recorded)[1:]


def test_the_gate_up_result_is_its_gemm_of_the_checked_fused_call(harness_with_trace):
    case = MoECase(MoEStage.GATE_UP, 8, MARLIN_SHAPED, top_k=4, routing=RoutingDistribution.UNIFORM,
                   check_experts=12)
    timed, recorded = harness_with_trace(case)
    assert timed[0].shape == (8, MARLIN_SHAPED.hidden)  # the fused output, not [M, top_k, 2I]
    assert recorded["samples"] == pytest.approx((20e-6, 22e-6))
    extra = recorded["extra"]
    assert extra["case"] == case.id
    assert extra["traced_call"] == dataclasses.replace(case, stage=MoEStage.FUSED).id
    assert extra["reference_error"] < case.tolerance  # checked on the fused output
    assert extra["flops"] == case.traffic().flops  # the GEMM's own roofline
    assert extra["achieved_tflops"] == pytest.approx(case.traffic().flops / 21e-6 / 1e12)
    assert extra["part_median_s"]["down"] == pytest.approx(9.25e-6)


def test_a_gemm_case_under_a_timer_without_a_kernel_trace_skips_naming_why():
    from decodebench import harness
    from decodebench.errors import BackendUnavailable
    from decodebench.timing import Budget, TimerMode

    case = MoECase(MoEStage.DOWN, 8, MARLIN_SHAPED, 4, RoutingDistribution.UNIFORM, 12)
    ctx = harness.RunContext(CPU, TimerMode.WALL, Budget(), peaks=None)
    with pytest.raises(BackendUnavailable, match="timer 'wall' records no per-kernel times"):
        harness.run_kernel_case(None, case, "vllm", ctx)


SPIN = "void at::cuda::(anonymous namespace)::spin_kernel(long)"


@pytest.fixture
def injected_harness(monkeypatch, emulate_vllm):
    """The harness with an injection of 10 %: the pilot sees FUSED_CALL, the timing ``timed_names``."""
    from decodebench import harness, inject
    from decodebench.inject import Injection
    from decodebench.timing import Budget, Measurement, StopReason, TimerMode

    emulate_vllm()
    recorded = {}

    def run(case, timed_names, timed_us):
        traces = iter([trace_of(FUSED_CALL, (2, 0.5, 20, 1, 9, 1.5), (2, 0.5, 21, 1, 9.5, 1.5)),
                       trace_of(timed_names, *timed_us)])

        def fake_measure(fn, *, mode, device, budget, **_):
            fn()
            return Measurement((40e-6, 41e-6), mode, 1, StopReason.CONVERGED, 0.1, (), next(traces))

        monkeypatch.setattr(harness, "measure", fake_measure)
        monkeypatch.setattr(inject, "measure", fake_measure)
        monkeypatch.setattr(harness, "record_samples", lambda bench, samples, extra: recorded.update(
            samples=samples, extra=extra))
        ctx = harness.RunContext(CPU, TimerMode.KERNEL, Budget(), peaks=None, injection=Injection(0.10))
        harness.run_kernel_case(None, case, "vllm", ctx)
        return recorded

    return run


def test_an_injected_gemm_case_counts_the_spin_in_its_own_kernels_sized_from_its_own_floor(injected_harness):
    case = MoECase(MoEStage.GATE_UP, 8, MARLIN_SHAPED, 4, RoutingDistribution.UNIFORM, 12)
    recorded = injected_harness(case, (*FUSED_CALL, SPIN), [(2, 0.5, 20, 1, 9, 1.5, 2), (2, 0.5, 21, 1, 9.5, 1.5, 2.1)])
    assert recorded["samples"] == pytest.approx((22e-6, 23.1e-6))  # its GEMM and the spin after the call
    injected = recorded["extra"]["injected_slowdown"]
    assert injected["base_floor_s"] == pytest.approx(20.1e-6)  # the GEMM's floor, not the whole call's
    assert injected["extra_s"] == pytest.approx(0.1 * injected["base_floor_s"])
    assert [k["part"] for k in recorded["extra"]["call_kernels"]][-1] == "injected spin"


def test_an_injected_gemm_case_whose_trace_lacks_the_spin_is_refused_not_reported_as_injected(injected_harness):
    from decodebench.kernel_parts import TraceAttributionError

    case = MoECase(MoEStage.DOWN, 8, MARLIN_SHAPED, 4, RoutingDistribution.UNIFORM, 12)
    with pytest.raises(TraceAttributionError, match="'injected spin' matched 0 kernels, expected 1"):
        injected_harness(case, FUSED_CALL, [(2, 0.5, 20, 1, 9, 1.5)])


# the H200's curve by the kernel timer (validation/h200/gate/spin-probe/spin-probe.json): flat at the floor,
# then about 0.5 ns a cycle
H200_SPIN = {1: 0.677e-6, 100: 0.676e-6, 200: 0.735e-6, 400: 0.833e-6, 3200: 2.232e-6, 200_000: 101.647e-6}


def test_a_gpu_spin_reads_its_cycles_off_the_measured_curve(monkeypatch):
    from decodebench import inject

    model = inject.SpinModel.from_runs(H200_SPIN)
    monkeypatch.setattr(inject, "_device_spin_model", lambda device, mode: model)
    _, every, method = inject.spinner(torch.device("cuda"), 0.833e-6)
    assert (every, method) == (1, "torch.cuda._sleep(400 cycles, 0.833 µs by the kernel timer) after every call "
                                  "on the kernel's stream")
    # the two-point line of the last model (floor + cycles / rate) asked 16 % fewer cycles here and
    # overshot below 1600 cycles by up to 7 %: the curve is read between its own rungs
    assert model.cycles_for(1.5e-6) == pytest.approx(400 + (1.5 - 0.833) / (2.232 - 0.833) * 2800, abs=1)
    assert model.cycles_for(0.70e-6) == 100 + round((0.70 - 0.677) / (0.735 - 0.677) * 100)


def test_a_slowdown_below_the_spin_floor_is_one_longer_spin_every_few_calls_and_samples_hold_whole_periods(monkeypatch):
    # +5 % of a 1.44 µs RMSNorm is 72 ns; the spin runs at least 0.677 µs: one spin every 10 calls
    from decodebench import inject
    from decodebench.timing import Budget, _calls_per_sample

    monkeypatch.setattr(inject, "_device_spin_model", lambda device, mode: inject.SpinModel.from_runs(H200_SPIN))
    spin, every, method = inject.spinner(torch.device("cuda"), 0.072e-6)
    assert every == 10
    assert "after every 10th call" in method
    plan = inject.SpinModel.from_runs(H200_SPIN).plan(0.072e-6)
    assert plan.seconds / plan.every == pytest.approx(0.072e-6, rel=0.01)
    budget = inject.Injected(0.05, 1.44e-6, 0.072e-6, method, every).aligned(Budget())
    assert [_calls_per_sample(budget, s) % every for s in (5e-6, 7e-6, 30e-6, 1e-3)] == [0, 0, 0, 0]
    with pytest.raises(inject.InjectionOutOfReach, match="every 68 calls, more than 10"):
        inject.SpinModel.from_runs(H200_SPIN).plan(0.01e-6, max_every=10)


def test_an_injection_shorter_than_the_spin_floor_is_refused_naming_the_case(injected_harness, monkeypatch):
    # a part of a traced call needs its spin in every call (the trace keeps calls that launched the same
    # kernels), so a part whose slowdown is below the spin's floor is refused, not mislabelled
    from decodebench import inject

    floor = inject.SpinModel.from_runs({1: 5e-6, 1000: 5.5e-6})

    def spinner(device, seconds, *, mode, max_every):
        plan = floor.plan(seconds, max_every=max_every)
        return None, plan.every, "spin"

    monkeypatch.setattr(inject, "spinner", spinner)
    case = MoECase(MoEStage.GATE_UP, 8, MARLIN_SHAPED, 4, RoutingDistribution.UNIFORM, 12)
    with pytest.raises(
        inject.InjectionOutOfReach,
        match=rf"--inject-slowdown does not reach {case.id}: 10.0% of its "
        r"20.100 µs floor is out of reach: 2010.0 ns per call would "
        r"take one spin \(at least 5.000 µs\) every 3 calls, more than 1",
    ):
        injected_harness(case, (*FUSED_CALL, SPIN), [(2, 0.5, 20, 1, 9, 1.5, 2)])
    assert issubclass(inject.InjectionOutOfReach, BackendUnavailable)  # the benchmarks' skip, with that reason
