"""The W4A16 MoE case: the reference, traffic, routing, cases from the model, the per-GEMM
parts of the vllm backend, and the benchmark module end to end (all on CPU)."""

import dataclasses
import json
import re

import pytest
import torch
import torch.nn.functional as F
from moe_helpers import CPU, KIMI, ROUTINGS, STAGES, TINY, kimi, tiny

from decodebench.errors import BackendUnavailable, KernelMismatch, ShapeError
from decodebench.kernels.base import check_case, has_module, relative_error
from decodebench.kernels.experts import run_experts
from decodebench.kernels.int4 import dequantize
from decodebench.kernels.moe import MoECase, MoEStage, RoutingDistribution, moe_cases
from decodebench.model import load_model_spec
from decodebench.shapes import DecodeShapes, sweep_for
from tests.conftest import REPO

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
        return run_experts(case.stage, flat, inp["groups"], torch.bfloat16)

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
def test_vllm_gemm_only_cases_are_parts_of_the_fused_call(stage):
    part = kimi(stage, tokens=4).timed_part("vllm")
    assert part.whole == kimi(MoEStage.FUSED, tokens=4)
    assert (part.part, part.required, part.forbidden) == (stage.value, ("gate_up", "down"), ("unexpected_gemm",))
    assert kimi(stage).timed_part("torch") is None
    assert kimi(MoEStage.FUSED).timed_part("vllm") is None
    with pytest.raises(BackendUnavailable, match="part of the fused call's kernel trace"):
        kimi(stage).kernel("vllm", CPU)



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
