import dataclasses

import pytest
import torch

from decodebench.attribution.breakdown.components import attribute
from decodebench.attribution.breakdown.trace import Kernel
from decodebench.errors import BackendUnavailable, KernelMismatch
from decodebench.kernel_parts import PartRule, split_call
from decodebench.kernel_rules import classify, misclassified
from decodebench.kernels.base import check_case
from decodebench.kernels.moe_buffers import MoEBuffersCase, moe_buffers_cases, workspace_ints
from decodebench.model import load_model_spec
from decodebench.registry import calls_per_step
from decodebench.shapes import DecodeShapes, sweep_for

CPU = torch.device("cpu")
CASE = MoEBuffersCase(tokens=3, hidden=256, top_k=8)
SORT = "void vllm::moe::count_and_sort_expert_tokens_kernel<int>(int const*, int*, int*, int*, unsigned long)"
FILL = "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<int>, std::array<char*, 1ul> >(int)"
SUM = "void vllm::moe::moe_sum_vec_kernel<c10::BFloat16, int, 8, false>(c10::BFloat16*)"
MARLIN = "void marlin_moe_wna16::Marlin<256, 1, 8, 8, true, 4, 2, false>(int)"


def test_cases_follow_the_models_moe_layers_and_the_sweep():
    shapes = DecodeShapes.for_deployment(load_model_spec("kimi-k2.5"), tp=8)
    cases = moe_buffers_cases(shapes, sweep_for("nightly"))
    assert [c.tokens for c in cases] == list(sweep_for("nightly").tokens)
    assert {(c.hidden, c.top_k) for c in cases} == {(7168, 8)}
    assert calls_per_step(shapes, "moe_buffers", cases[0].shape()) == shapes.spec.num_moe_layers == 60


def test_traffic_is_the_copied_rows_both_ways():
    traffic = CASE.traffic()
    assert (traffic.bytes_read, traffic.bytes_written) == (3 * 256 * 2, 3 * 256 * 2)


def test_torch_backend_makes_a_zeroed_workspace_and_an_exact_copy():
    result = check_case(CASE, CASE.kernel("torch", CPU), CPU, seed=1)
    assert result.error == 0.0
    workspace, _ = CASE.kernel("torch", CPU)(CASE.make_inputs(CPU, 2))
    assert workspace.numel() == workspace_ints(CPU)
    assert workspace.dtype == torch.int32


@pytest.mark.parametrize("harm", ["nonzero", "short", "copy"])
def test_the_check_refuses_a_dirty_or_short_workspace_and_a_wrong_copy(harm):
    torch_kernel = CASE.kernel("torch", CPU)

    def broken(inp):
        workspace, out = torch_kernel(inp)
        if harm == "nonzero":
            workspace[0] = 1
        elif harm == "short":
            workspace = workspace[1:]
        else:
            out[0, 0] += 1
        return workspace, out

    with pytest.raises(KernelMismatch, match="moe_buffers"):
        check_case(CASE, broken, CPU, seed=3)


def test_vllm_backend_says_why_it_cannot_run_on_a_cpu():
    with pytest.raises(BackendUnavailable, match="CUDA only|vLLM build runs on|not installed"):
        CASE.kernel("vllm", CPU)


def test_the_rules_place_the_fill_and_the_copy_by_the_kernel_before_them():
    assert classify(FILL, SORT) == classify("memcpy32_post", SUM) == "moe_buffers"
    assert classify(FILL) == classify("memcpy32_post") == classify(FILL, MARLIN) == "copies_casts"
    # the benchmark launches them without the layer around them: still its own
    assert misclassified("moe_buffers", [FILL]) == {}
    assert misclassified("moe_buffers", ["nvjet_x"]) == {"nvjet_x": "dense_gemm"}


def test_the_breakdown_gives_the_layers_fill_to_the_buffers_and_a_step_fill_to_copies():
    kernels = [Kernel(FILL, 0, 1, 0), Kernel(SORT, 2, 1, 1), Kernel(FILL, 4, 1, 2), Kernel(MARLIN, 6, 2, 3)]
    components = attribute(kernels)[0]
    assert (components["copies_casts"], components["moe_buffers"], components["moe_gemm"]) == (1, 1, 2)


def test_a_traced_call_splits_its_parts_by_position_too():
    rules = (PartRule("fill", kind="moe_workspace"), PartRule("copy", kind="copies"))
    assert split_call([SORT, FILL, FILL], rules) == ("other", "fill", "copy")


def test_a_case_id_names_the_width_and_the_tokens():
    assert CASE.id == "h256-m3"
    assert dataclasses.replace(CASE, per_request=3).shape()["per_request"] == 3
