"""The W4A16 MoE component: packing, the reference, traffic, routing, the vLLM adapter's
binding, and the benchmark module end to end (all on CPU)."""

import dataclasses
import inspect
import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from decodebench.errors import BackendUnavailable, KernelMismatch, ShapeError
from decodebench.kernels import moe
from decodebench.kernels.base import check_case, has_module, relative_error
from decodebench.kernels.moe import (
    Binding,
    ExpertLayout,
    MarlinApi,
    MoECase,
    MoEStage,
    RoutingDistribution,
    VllmApiMismatch,
    dequantize,
    expert_weights,
    moe_cases,
    random_expert_weights,
    unpack_int4,
)
from decodebench.model import load_model_spec
from decodebench.shapes import DecodeShapes, GemmShape, sweep_for

REPO = Path(__file__).resolve().parent.parent
CPU = torch.device("cpu")
KIMI = DecodeShapes.for_deployment(load_model_spec("kimi-k2.5"), tp=8)
TINY = ExpertLayout(12, GemmShape(64, 32), GemmShape(32, 32), group_size=16)
STAGES = list(MoEStage)
ROUTINGS = list(RoutingDistribution)


def tiny(stage=MoEStage.FUSED, tokens=5, routing=RoutingDistribution.UNIFORM):
    return MoECase(stage, tokens, TINY, top_k=4, routing=routing, check_experts=12)


def kimi(stage=MoEStage.FUSED, tokens=1, routing=RoutingDistribution.UNIFORM):
    (case,) = [c for c in moe_cases(KIMI, sweep_for("nightly"))
               if (c.stage, c.tokens, c.routing) == (stage, tokens, routing)]
    return case


def pack_plainly(q: torch.Tensor) -> torch.Tensor:
    """Pack int values -8..7 along the last dim, 8 per int32, low nibble first, stored as q + 8."""
    rows = []
    for row in q.tolist():
        words = [sum((v + 8) << (4 * i) for i, v in enumerate(row[j:j + 8])) for j in range(0, len(row), 8)]
        rows.append([w - (1 << 32) if w >= 1 << 31 else w for w in words])
    return torch.tensor(rows, dtype=torch.int32)


def random_int4(rows, cols, seed):
    return torch.randint(-8, 8, (rows, cols), generator=torch.Generator().manual_seed(seed))


# --- packing and dequantization -------------------------------------------------------


def test_unpack_inverts_plain_packing():
    q = random_int4(5, 64, seed=0)
    assert torch.equal(unpack_int4(pack_plainly(q)), q.to(torch.bfloat16))


def test_plain_packing_is_the_checkpoint_format():
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    q = random_int4(6, 32, seed=1)
    assert torch.equal(helpers.pack_to_int32(q.to(torch.int8), 4), pack_plainly(q))


def test_dequantize_against_a_plainly_computed_matrix():
    q = random_int4(3, 32, seed=2)
    scales = torch.tensor([[0.5, 0.25], [1.5, 2.0], [0.125, 3.0]], dtype=torch.bfloat16)
    plain = torch.tensor([[v * float(scales[n, k // 16]) for k, v in enumerate(row)]
                          for n, row in enumerate(q.tolist())])
    packed = pack_plainly(q)
    assert torch.equal(dequantize(packed, scales, 16, torch.float32), plain)
    assert torch.equal(dequantize(packed, scales, 16, torch.bfloat16), plain.to(torch.bfloat16))


def test_dequantize_keeps_leading_expert_dims():
    weights = random_expert_weights(TINY, CPU, seed=3)
    batched = dequantize(weights.w2_packed, weights.w2_scale, TINY.group_size)
    assert batched.shape == (TINY.experts, TINY.down.n, TINY.down.k)
    assert torch.equal(batched[7], dequantize(weights.w2_packed[7], weights.w2_scale[7], TINY.group_size))


def test_random_weights_are_in_checkpoint_layout_and_not_zero():
    w = random_expert_weights(TINY, CPU, seed=4)
    assert (w.w13_packed.shape, w.w13_packed.dtype) == ((12, 64, 4), torch.int32)
    assert (w.w13_scale.shape, w.w13_scale.dtype) == ((12, 64, 2), torch.bfloat16)
    assert (w.w2_packed.shape, w.w2_scale.shape) == ((12, 32, 4), (12, 32, 2))
    assert set(unpack_int4(w.w13_packed).unique().tolist()) == set(range(-8, 8))
    assert (w.w13_scale > 0).all()
    assert (w.w2_scale > 0).all()


def test_weights_are_cached_per_layout_and_device():
    assert expert_weights(TINY, "cpu") is expert_weights(TINY, "cpu")
    assert expert_weights(TINY, "cpu") is not expert_weights(dataclasses.replace(TINY, experts=11), "cpu")


def test_layout_rejects_shapes_that_are_not_one_gated_mlp():
    with pytest.raises(ShapeError, match="not one gated MLP"):
        ExpertLayout(4, GemmShape(64, 32), GemmShape(32, 16), 16)
    with pytest.raises(ShapeError, match="group size 24"):
        ExpertLayout(4, GemmShape(64, 48), GemmShape(48, 32), 24)


# --- the reference --------------------------------------------------------------------


def dense_fp64(stage: MoEStage, inputs) -> torch.Tensor:
    """Every expert on every token in float64; the routing is a dense [M, E] weight matrix."""
    w, g = inputs["weights"], TINY.group_size
    w13 = dequantize(w.w13_packed, w.w13_scale, g, torch.float64)
    w2 = dequantize(w.w2_packed, w.w2_scale, g, torch.float64)
    ids = inputs["topk_ids"].long()
    if stage is MoEStage.GATE_UP:
        return torch.einsum("tk,tsnk->tsn", inputs["x"].double(), w13[ids])
    if stage is MoEStage.DOWN:
        return torch.einsum("tsk,tsnk->tsn", inputs["a"].double(), w2[ids])
    gate, up = torch.einsum("tk,enk->ten", inputs["x"].double(), w13).chunk(2, dim=-1)
    per_expert = torch.einsum("tei,eni->ten", F.silu(gate) * up, w2)
    routing = torch.zeros(ids.shape[0], TINY.experts, dtype=torch.float64)
    routing.scatter_(1, ids, inputs["topk_weights"].double())
    return torch.einsum("te,ten->tn", routing, per_expert)


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("stage", STAGES)
def test_reference_matches_a_dense_fp64_computation(stage, routing):
    case = tiny(stage, tokens=6, routing=routing)
    inputs = case.make_inputs(CPU, seed=5)
    expected = dense_fp64(stage, inputs)
    assert relative_error(case.reference(inputs), expected) < 1e-5


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("stage", STAGES)
def test_torch_backend_passes_the_check(stage, routing):
    case = tiny(stage, routing=routing)
    assert check_case(case, case.kernel("torch", CPU), CPU, seed=6).error < case.tolerance


def test_torch_backend_passes_the_check_at_kimi_k_and_n_on_fewer_experts():
    case = kimi(MoEStage.FUSED, tokens=2).check_variant()
    assert (case.layout.experts, case.layout.gate_up, case.layout.down) == (32, KIMI.moe_gate_up, KIMI.moe_down)
    assert check_case(case, case.kernel("torch", CPU), CPU, seed=7).error < case.tolerance


def test_a_kernel_that_ignores_the_router_weights_is_caught():
    case = tiny(MoEStage.FUSED)

    def unweighted(inp):
        flat = dict(inp, topk_weights=torch.full_like(inp["topk_weights"], 1 / case.top_k))
        return moe.run_experts(case.stage, flat, inp["groups"], torch.bfloat16)

    with pytest.raises(KernelMismatch, match="differs from the reference"):
        check_case(case, unweighted, CPU, seed=8)


# --- traffic --------------------------------------------------------------------------


def test_traffic_at_the_kimi_shape_with_one_token():
    # per expert: gate_up 512*7168/2 + 512*224*2 = 2_064_384; down 7168*256/2 + 7168*8*2 = 1_032_192
    fused, gate_up, down = (kimi(stage).traffic() for stage in STAGES)
    assert kimi().distinct_experts == 8
    assert fused.bytes_read == 8 * 3_096_576 + 7168 * 2 + 8 * 4 + 8 * 4
    assert fused.bytes_written == 7168 * 2
    assert fused.flops == 2 * 1 * 8 * (7168 * 512 + 7168 * 256) == 88_080_384
    assert gate_up.bytes_read == 8 * 2_064_384 + 7168 * 2 + 8 * 4
    assert (gate_up.bytes_written, gate_up.flops) == (8 * 512 * 2, 58_720_256)
    assert down.bytes_read == 8 * 1_032_192 + 8 * 256 * 2 + 8 * 4
    assert (down.bytes_written, down.flops) == (8 * 7168 * 2, 29_360_128)


@pytest.mark.parametrize("routing", ROUTINGS)
def test_traffic_counts_the_experts_the_inputs_touch(routing):
    case = dataclasses.replace(tiny(routing=routing, tokens=7), layout=dataclasses.replace(TINY, experts=64),
                               check_experts=64)
    for seed in (1, 2):
        assert case.make_inputs(CPU, seed)["topk_ids"].unique().numel() == case.distinct_experts
    activations = case.traffic().bytes_read - case.distinct_experts * (
        TINY.gemm_bytes(TINY.gate_up) + TINY.gemm_bytes(TINY.down))
    assert activations == 7 * 32 * 2 + 7 * 4 * (4 + 4)


# --- routing --------------------------------------------------------------------------


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("tokens", [1, 8, 256])
def test_each_token_gets_top_k_distinct_experts(routing, tokens):
    ids, weights = kimi(tokens=tokens, routing=routing).route(seed=9)
    assert ids.dtype == torch.int32
    assert ids.shape == (tokens, 8)
    assert 0 <= ids.min()
    assert ids.max() < 384
    assert all(len(set(row)) == 8 for row in ids.tolist())
    assert weights.dtype == torch.float32
    assert (weights > 0).all()
    assert torch.allclose(weights.sum(dim=1), torch.ones(tokens))


def test_skewed_routing_concentrates_on_a_few_hot_experts():
    ids, _ = kimi(tokens=256, routing=RoutingDistribution.SKEWED).route(seed=10)
    hot_slots = torch.bincount(ids.flatten().long(), minlength=384).sort(descending=True).values[:16].sum()
    assert hot_slots >= 0.75 * ids.numel()
    for tokens in (8, 64, 256):
        uniform = kimi(tokens=tokens).distinct_experts
        assert kimi(tokens=tokens, routing=RoutingDistribution.SKEWED).distinct_experts < uniform


def test_the_same_seed_gives_the_same_ids_and_another_seed_other_experts():
    case = kimi(tokens=8)
    first, again, other = (case.route(seed)[0] for seed in (11, 11, 12))
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    assert first.unique().numel() == other.unique().numel() == case.distinct_experts


def test_inputs_are_random_not_zero():
    fused, down = tiny().make_inputs(CPU, seed=13), tiny(MoEStage.DOWN).make_inputs(CPU, seed=13)
    assert fused["x"].dtype == torch.bfloat16
    assert fused["x"].abs().sum() > 0
    assert down["a"].shape == (5, 4, 32)
    assert down["a"].abs().sum() > 0


# --- cases from the model ---------------------------------------------------------------


def test_cases_come_from_the_model():
    cases = moe_cases(KIMI, sweep_for("nightly"))
    assert len(cases) == len(STAGES) * len(ROUTINGS) * len(sweep_for("nightly").tokens)
    assert {c.tokens for c in cases} == {1, 2, 4, 8, 16, 32, 64, 128, 256}
    assert {(c.layout.gate_up, c.layout.down) for c in cases} == {(KIMI.moe_gate_up, KIMI.moe_down)}
    assert {(c.layout.experts, c.top_k, c.layout.group_size) for c in cases} == {
        (KIMI.experts, KIMI.top_k, KIMI.spec.quant.group_size)}
    assert "fused-e384-top8-g32-n512k7168-n7168k256-skewed-m256" in {c.id for c in cases}
    assert "down-e384-top8-g32-n7168k256-uniform-m1" in {c.id for c in cases}


@pytest.mark.parametrize(("model", "tp", "quant"), [("deepseek-v3", 8, "fp8 (8 bits)"), ("tiny-kimi", 1, "bf16")])
def test_a_model_without_int4_experts_gets_one_case_that_skips_with_the_reason(model, tp, quant):
    (case,) = moe_cases(DecodeShapes.for_deployment(load_model_spec(model), tp), sweep_for("smoke"))
    for backend in ("torch", "vllm"):
        with pytest.raises(BackendUnavailable, match=re.escape(f"{model}'s routed experts are {quant}")):
            case.kernel(backend, CPU)


def test_case_rejects_routing_that_does_not_fit():
    with pytest.raises(ShapeError, match="skewed routing needs at least 9 experts"):
        MoECase(MoEStage.FUSED, 1, dataclasses.replace(TINY, experts=8), 4, RoutingDistribution.SKEWED, 8)


# --- the vLLM adapter ---------------------------------------------------------------------


def test_vllm_backend_skips_with_the_reason_on_this_machine():
    with pytest.raises(BackendUnavailable) as skipped:
        kimi().kernel("vllm", CPU)
    if has_module("vllm"):
        assert "Marlin" in str(skipped.value) or "runs on" in str(skipped.value)


@pytest.mark.parametrize("stage", [MoEStage.GATE_UP, MoEStage.DOWN])
def test_vllm_gemm_only_cases_skip_with_the_reason(stage):
    with pytest.raises(BackendUnavailable, match="no public per-GEMM"):
        kimi(stage).kernel("vllm", CPU)


def test_marlin_adapter_fits_the_installed_fused_marlin_moe():
    pytest.importorskip("vllm")
    api = moe.marlin_api()  # binds every function to its installed signature; calls none
    installed = inspect.signature(api.fused_moe.fn).parameters
    assert set(moe.FUSED_NEEDS) <= api.fused_moe.accepted
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
    return Binding.of(fn, offers=moe.FUSED_OFFERS, needs=moe.FUSED_NEEDS, name="fused_marlin_moe")


def test_gating_output_is_passed_only_where_the_signature_has_it():
    assert "gating_output" not in bind_fused(fused_032).accepted
    called = bind_fused(fused_mid)(**{name: name for name in moe.FUSED_OFFERS})
    assert called["gating_output"] == "gating_output"


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

    bind = dict(offers=moe.REPACK_OFFERS, needs=moe.REPACK_NEEDS)
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
        repack=Binding.of(repack, offers=moe.REPACK_OFFERS, needs=moe.REPACK_NEEDS),
        permute_scales=Binding.of(permute, offers=moe.SCALES_NEEDS, needs=moe.SCALES_NEEDS),
        make_workspace=Binding.of(lambda device, max_blocks_per_sm=1: max_blocks_per_sm,
                                  offers=moe.WORKSPACE_OFFERS, needs=("device",), name="workspace"),
        max_blocks_per_sm=4,
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
    assert api.workspace(CPU) == 4


MARLIN_SHAPED = ExpertLayout(16, GemmShape(128, 128), GemmShape(128, 64), group_size=32)


def emulated_fused_marlin_moe(hidden_states, w1, w2, bias1, bias2, w1_scale, w2_scale, topk_weights, topk_ids,
                              quant_type_id, global_num_experts=-1, workspace=None):
    """fused_marlin_moe's math on fake_marlin_api's identity repack: its K-first tensors, back to N-first."""
    gate_up, down = GemmShape(w1.shape[2], hidden_states.shape[1]), GemmShape(w2.shape[2], w2.shape[1] * 8)
    layout = ExpertLayout(w1.shape[0], gate_up, down, gate_up.k // w1_scale.shape[1])
    weights = moe.ExpertWeights(layout, *(t.transpose(1, 2) for t in (w1, w1_scale, w2, w2_scale)))
    inputs = {"x": hidden_states, "topk_ids": topk_ids, "topk_weights": topk_weights, "weights": weights}
    return moe.run_experts(MoEStage.FUSED, inputs, moe.group_by_expert(topk_ids), torch.bfloat16)


@pytest.fixture
def emulate_vllm(monkeypatch):
    """Install ``fused`` as fused_marlin_moe and run the vllm backend's own code; returns the loader record."""
    def install(fused=emulated_fused_marlin_moe):
        record = []
        api = dataclasses.replace(fake_marlin_api(record), fused_moe=bind_fused(fused))
        monkeypatch.setattr(moe, "require_vllm_ops", lambda device: None)
        monkeypatch.setattr(moe, "_require_marlin_kernels", lambda device: None)
        monkeypatch.setattr(moe, "marlin_api", lambda: api)
        return record

    yield install
    moe.marlin_weights.cache_clear()  # converted by the fake loader: keep them out of other tests


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
    def gate_and_up_swapped(**kwargs):  # takes every offered argument, gating_output (None) too
        w1, s1 = kwargs.pop("w1"), kwargs.pop("w1_scale")
        del kwargs["gating_output"]
        half = w1.shape[2] // 2
        return emulated_fused_marlin_moe(w1=w1.roll(half, dims=2), w1_scale=s1.roll(half, dims=2), **kwargs)

    emulate_vllm(gate_and_up_swapped)
    case = MoECase(MoEStage.FUSED, 8, MARLIN_SHAPED, top_k=4, routing=RoutingDistribution.UNIFORM, check_experts=12)
    kernel = case.kernel("vllm", CPU)
    (variant,) = case.check_variants()
    with pytest.raises(KernelMismatch, match=f"{variant.id}: output differs"):
        check_case(variant, kernel, CPU, seed=17)


# --- the benchmark module end to end ------------------------------------------------------


def run_benchmarks(pytester, tmp_path, *args):
    return pytester.runpytest_subprocess(
        str(REPO / "benchmarks" / "test_moe.py"), "--rootdir", str(REPO), "-p", "no:cacheprovider",
        f"--benchmark-storage=file://{tmp_path / 'store'}", "--budget-ms", "50", "--device", "cpu",
        "--sweep", "smoke", *args)


def test_benchmark_module_collects_every_smoke_case_for_both_backends(pytester, tmp_path):
    result = run_benchmarks(pytester, tmp_path, "--collect-only", "-q")
    collected = {line.split("::")[-1] for line in result.outlines if "::test_moe[" in line}
    smoke = moe_cases(KIMI, sweep_for("smoke"))
    assert collected == {f"test_moe[{c.id}-{b}]" for c in smoke for b in ("torch", "vllm")}
    assert {c.tokens for c in smoke} == set(sweep_for("smoke").tokens)


@pytest.mark.slow
def test_benchmark_module_checks_times_and_records_the_one_token_cases(pytester, tmp_path):
    report = tmp_path / "run.json"
    result = run_benchmarks(pytester, tmp_path, "-k", "m1", f"--benchmark-json={report}", "-rs")
    cases = [c for c in moe_cases(KIMI, sweep_for("smoke")) if c.tokens == 1]
    result.assert_outcomes(passed=len(cases), skipped=len(cases))
    benches = {b["name"]: b["extra_info"] for b in json.loads(report.read_text())["benchmarks"]}
    assert set(benches) == {f"test_moe[{c.id}-torch]" for c in cases}
    for case in cases:
        info = benches[f"test_moe[{case.id}-torch]"]
        assert info["shape"]["distinct_experts"] == case.distinct_experts == 8
        assert info["bytes_read"] == case.traffic().bytes_read
        assert info["flops"] == case.traffic().flops
        assert info["achieved_gbps"] > 0
        assert info["reference_error"] < info["tolerance"]
