"""Routing cases: reference maths by hand, traffic at the Kimi shape, the tie-tolerant
set comparison (and that it fails wrong kernels), the CPU vLLM ops, and the benchmark
module end to end."""

import dataclasses
import math

import pytest
import torch

from decodebench.errors import BackendUnavailable, KernelMismatch
from decodebench.kernels.base import check_case
from decodebench.kernels.router import (
    TopkCase,
    router_gemm_cases,
    select_experts,
    topk_cases,
)
from decodebench.model import load_model_spec
from decodebench.shapes import DecodeShapes, sweep_for
from tests.conftest import CPU, REPO, assert_benchmark_run, kimi_shapes


def kimi_topk(tokens: int) -> TopkCase:
    return dataclasses.replace(topk_cases(kimi_shapes(), sweep_for("smoke"))[0], tokens=tokens)


def tiny_case(**changes) -> TopkCase:
    fields = dict(tokens=1, experts=4, top_k=2, n_group=1, topk_group=1, scoring_func="sigmoid",
                  biased=True, renormalize=True, scaling=2.5)
    return TopkCase(**(fields | changes))


def logits_of(*probabilities):
    """Logits whose sigmoid is exactly the given scores (float64)."""
    return torch.logit(torch.tensor([probabilities], dtype=torch.float64))


def expert_weights(ids, weights):
    """(expert, weight) pairs of the first token, by expert id."""
    return sorted(zip(ids[0].tolist(), weights[0].tolist(), strict=True))


# --- reference maths ------------------------------------------------------------------


def test_reference_by_hand():
    # scores 0.5 0.75 0.25 0.9; with bias +0.3 .. -0.5 the choice scores are 0.8 0.75 0.25 0.4:
    # experts {0, 1} win (unbiased they would be {3, 1}); weights 0.5 and 0.75 renormalize
    # to 0.4 and 0.6, times 2.5 -> 1.0 and 1.5.
    case = tiny_case()
    ref = case.reference({"logits": logits_of(0.5, 0.75, 0.25, 0.9),
                          "bias": torch.tensor([0.3, 0.0, 0.0, -0.5])})
    order = ref.ids[0].argsort()
    assert ref.ids[0][order].tolist() == [0, 1]
    assert ref.weights[0][order].tolist() == pytest.approx([1.0, 1.5])
    assert not ref.tied.any()


def test_reference_without_renormalize_keeps_scores():
    case = tiny_case(renormalize=False, scaling=1.0)
    weights, ids, _ = select_experts(case, logits_of(0.5, 0.75, 0.25, 0.9), torch.zeros(4), torch.float64)
    assert expert_weights(ids, weights) == [(1, pytest.approx(0.75)), (3, pytest.approx(0.9))]


def test_reference_keeps_only_the_best_groups():
    # groups {0,1} and {2,3}; top-2 sums 1.0 and 1.15: group 1 wins, so expert 0 (0.9,
    # the best single score) is out and the top-1 is expert 2.
    case = tiny_case(top_k=1, n_group=2, topk_group=1, scaling=1.0)
    ref = case.reference({"logits": logits_of(0.9, 0.1, 0.6, 0.55), "bias": torch.zeros(4)})
    assert ref.ids.tolist() == [[2]]
    assert ref.weights.tolist() == [[pytest.approx(1.0)]]


def test_softmax_scoring_reference():
    case = tiny_case(scoring_func="softmax", biased=False, renormalize=False, scaling=1.0)
    logits = torch.tensor([[0.0, math.log(2.0), math.log(3.0), math.log(4.0)]], dtype=torch.float64)
    weights, ids, _ = select_experts(case, logits, None, torch.float64)
    assert expert_weights(ids, weights) == [(2, pytest.approx(0.3)), (3, pytest.approx(0.4))]


# --- cases and traffic --------------------------------------------------------------------


def test_cases_come_from_the_config():
    gemm = router_gemm_cases(kimi_shapes(), sweep_for("nightly"))
    topk = topk_cases(kimi_shapes(), sweep_for("nightly"))
    assert [c.tokens for c in gemm] == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert {(c.hidden, c.experts) for c in gemm} == {(7168, 384)}
    first = topk[0]
    assert (first.experts, first.top_k, first.n_group, first.topk_group) == (384, 8, 1, 1)
    assert (first.scoring_func, first.biased, first.renormalize, first.scaling) == ("sigmoid", True, True, 2.827)
    assert [c.id for c in topk][:2] == ["e384-top8-m1", "e384-top8-m2"]


def test_grouped_model_ids_carry_the_groups():
    shapes = DecodeShapes.for_deployment(load_model_spec("deepseek-v3"), tp=8)
    assert topk_cases(shapes, sweep_for("smoke"))[0].id == "e256-top8-g8x4-m1"


def test_router_gemm_traffic_at_kimi_shape():
    case = router_gemm_cases(kimi_shapes(), sweep_for("smoke"))[0]  # M = 1
    traffic = case.traffic()
    assert traffic.bytes_read == 7168 * 2 + 384 * 7168 * 2 == 5_519_360
    assert traffic.bytes_written == 384 * 2 == 768
    assert traffic.flops == 2 * 384 * 7168 == 5_505_024


def test_topk_traffic_at_kimi_shape():
    traffic = kimi_topk(tokens=8).traffic()
    assert traffic.bytes_read == 8 * 384 * 2 + 384 * 4 == 7_680  # bf16 logits + fp32 bias
    assert traffic.bytes_written == 8 * 8 * (4 + 4) == 512  # fp32 weights + int32 ids
    assert traffic.flops == 2 * 8 * 384 + 3 * 8 * 8 == 6_336


# --- the tie-tolerant comparison ------------------------------------------------------------


def tie_fixture():
    """Token 0 ties at the boundary (experts 1 and 2 both 0.5); token 1 does not."""
    case = tiny_case(tokens=2, scaling=1.0)
    logits = torch.cat([logits_of(0.9, 0.5, 0.5, 0.1), logits_of(0.9, 0.7, 0.3, 0.1)])
    return case, case.reference({"logits": logits, "bias": torch.zeros(4)})


def routing(ids, weights):
    return torch.tensor(weights, dtype=torch.float32), torch.tensor(ids, dtype=torch.int32)


def test_tie_is_detected():
    _, ref = tie_fixture()
    assert ref.tied.tolist() == [True, False]


def test_either_side_of_a_tie_passes_and_order_does_not_matter():
    case, ref = tie_fixture()
    w = 0.9 / 1.4, 0.5 / 1.4
    swapped_tie = routing([[2, 0], [1, 0]], [[w[1], w[0]], [0.7 / 1.6, 0.9 / 1.6]])
    assert case.error(swapped_tie, ref) < case.tolerance


def test_a_wrong_set_off_a_tie_fails():
    case, ref = tie_fixture()
    w = 0.9 / 1.4, 0.5 / 1.4
    wrong = routing([[0, 1], [0, 2]], [[w[0], w[1]], [0.9 / 1.2, 0.3 / 1.2]])
    assert case.error(wrong, ref) >= 1


def test_wrong_weights_fail():
    case, ref = tie_fixture()
    scaled = routing([[0, 1], [0, 1]], [[0.9, 0.5], [0.9, 0.7]])  # not renormalized
    assert case.error(scaled, ref) > case.tolerance


def test_non_finite_weights_fail():
    case, ref = tie_fixture()
    assert case.error(routing([[0, 1], [0, 1]], [[math.nan, 0.5], [0.5, 0.5]]), ref) == math.inf


def test_wrong_output_shape_is_named():
    case, ref = tie_fixture()
    with pytest.raises(KernelMismatch, match="shapes"):
        case.error(routing([[0], [0]], [[1.0], [1.0]]), ref)


def ignores_bias(case):
    return lambda inp: select_experts(dataclasses.replace(case, biased=False), inp["logits"], None, torch.float32)[:2]


def weights_from_biased_scores(case):
    def run(inp):
        _, ids, choice = select_experts(case, inp["logits"], inp["bias"], torch.float32)
        weights = choice.gather(-1, ids)
        return weights / weights.sum(-1, keepdim=True) * case.scaling, ids
    return run


def without_scaling(case):
    return lambda inp: select_experts(dataclasses.replace(case, scaling=1.0), inp["logits"], inp["bias"],
                                      torch.float32)[:2]


def without_renormalize(case):
    return lambda inp: select_experts(dataclasses.replace(case, renormalize=False), inp["logits"], inp["bias"],
                                      torch.float32)[:2]


@pytest.mark.parametrize("wrong", [ignores_bias, weights_from_biased_scores, without_scaling, without_renormalize])
def test_wrong_kernels_fail_the_check(wrong):
    case = kimi_topk(tokens=64)
    with pytest.raises(KernelMismatch, match="not timed"):
        check_case(case, wrong(case), CPU, seed=7)


def test_torch_backend_passes_the_check():
    case = kimi_topk(tokens=64)
    assert check_case(case, case.kernel("torch", CPU), CPU, seed=7).error < case.tolerance


def test_grouped_torch_backend_passes_the_check():
    shapes = DecodeShapes.for_deployment(load_model_spec("deepseek-v3"), tp=8)
    case = dataclasses.replace(topk_cases(shapes, sweep_for("smoke"))[0], tokens=64)
    assert check_case(case, case.kernel("torch", CPU), CPU, seed=3).error < case.tolerance


def test_router_gemm_torch_passes_the_check():
    case = router_gemm_cases(kimi_shapes(), sweep_for("smoke"))[1]
    assert check_case(case, case.kernel("torch", CPU), CPU, seed=1).error < case.tolerance


# --- the CPU build of vLLM --------------------------------------------------------------------


def vllm_kernel(case):
    try:
        return case.kernel("vllm", CPU)
    except BackendUnavailable as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize("tokens", [1, 8, 256])
def test_vllm_cpu_topk_matches_reference(tokens):
    case = kimi_topk(tokens)
    assert check_case(case, vllm_kernel(case), CPU, seed=11).error < case.tolerance


def test_vllm_cpu_router_gemm_matches_reference():
    case = router_gemm_cases(kimi_shapes(), sweep_for("smoke"))[1]
    assert check_case(case, vllm_kernel(case), CPU, seed=2).error < case.tolerance


def test_vllm_cpu_topk_refuses_expert_groups():
    shapes = DecodeShapes.for_deployment(load_model_spec("deepseek-v3"), tp=8)
    case = topk_cases(shapes, sweep_for("smoke"))[0]
    with pytest.raises(BackendUnavailable):
        case.kernel("vllm", CPU)


@pytest.mark.parametrize(("refusal", "skips"), [("biased_topk_cpu: unsupported num_experts 16", True),
                                              ("biased_topk_cpu: unsupported routed_topk 4 for num_experts=384", True),
                                              ("some other failure", False)])
def test_vllm_cpu_topk_turns_the_ops_own_shape_refusal_into_a_skip(monkeypatch, refusal, skips):
    # the CPU op serves some (experts, top-k) pairs only (tiny-kimi's 16 experts: none); its own
    # refusal is a skip that quotes it, any other error stays an error
    from decodebench.kernels import router as routing

    def op(*args):
        raise RuntimeError(refusal)

    monkeypatch.setattr(routing, "require_cpu_op", lambda name: op)
    case = kimi_topk(1)
    if skips:
        with pytest.raises(BackendUnavailable, match=rf"^{refusal} \(experts 384, top-k 8\)$"):
            case.kernel("vllm", CPU)
    else:
        with pytest.raises(RuntimeError, match="some other failure"):
            case.kernel("vllm", CPU)


def test_unknown_backend_is_named():
    with pytest.raises(BackendUnavailable, match="'triton'"):
        kimi_topk(1).kernel("triton", CPU)


# --- end to end -------------------------------------------------------------------------------


def test_benchmark_module_runs_its_smoke_cases(pytester, tmp_path):
    result = pytester.runpytest_subprocess(
        str(REPO / "benchmarks" / "test_routing.py"), "--rootdir", str(REPO), "--device", "cpu",
        "--benchmark-storage", str(tmp_path), "--budget-ms", "50", "--junitxml", str(tmp_path / "junit.xml"))
    assert_benchmark_run(
        result, tmp_path / "junit.xml"
    )  # an AVX512-BF16 CPU runs both ops; without it the native top-k is absent (a listed skip)


# --- the vLLM top-k, bound to the installed signature (stand-in ops on CPU) -----------------


def _reference_topk(case, scores, bias):
    weights, ids, _ = select_experts(case, scores, bias, torch.float32)
    return weights, ids.to(torch.int32)


def ops_with(grouped_topk):
    import types

    return types.SimpleNamespace(grouped_topk=grouped_topk)


def test_the_032_grouped_topk_gets_raw_logits_and_the_fused_sigmoid():
    case, seen = kimi_topk(8), {}

    def grouped_topk(scores, num_expert_group, topk_group, topk, renormalize, routed_scaling_factor, bias,
                     scoring_func=0):
        seen.update(scoring_func=scoring_func, n_group=num_expert_group, topk=topk)
        return _reference_topk(case, scores, bias)

    from decodebench.kernels import router as routing

    kernel = routing._vllm_grouped_topk(case, ops_with(grouped_topk))
    assert check_case(case, kernel, CPU, seed=21).error < case.tolerance
    assert seen == {"scoring_func": 1, "n_group": 1, "topk": 8}


def test_the_older_grouped_topk_gets_activated_and_biased_scores():
    case = kimi_topk(8)

    def grouped_topk(scores, scores_with_bias, num_expert_group, topk_group, topk, renormalize,
                     routed_scaling_factor):
        assert scores.dtype == torch.float32
        assert 0 <= scores.min()
        assert scores.max() <= 1  # already through the sigmoid
        ids = scores_with_bias.topk(topk, dim=-1).indices
        weights = scores.gather(-1, ids)
        return weights / weights.sum(dim=-1, keepdim=True) * routed_scaling_factor, ids.to(torch.int32)

    from decodebench.kernels import router as routing

    kernel = routing._vllm_grouped_topk(case, ops_with(grouped_topk))
    assert check_case(case, kernel, CPU, seed=22).error < case.tolerance


def test_a_grouped_topk_with_a_renamed_parameter_is_named():
    from decodebench.kernels import router as routing
    from decodebench.kernels.binding import VllmApiMismatch

    def grouped_topk(logits, num_expert_group, topk_group, topk, renormalize, routed_scaling_factor, bias):
        raise AssertionError("never called")

    with pytest.raises(VllmApiMismatch, match=r"no parameter 'scores'.*requires 'logits'"):
        routing._vllm_grouped_topk(kimi_topk(1), ops_with(grouped_topk))
