"""Where the vllm backend runs vLLM's DeepSeek-V3 small-batch kernels (q_a, the router GEMM): by vLLM's own
platform checks and GateLinear's shape lists, read through fakes of those vLLM names on the CPU."""

import types

import pytest
import torch

from decodebench.kernels import dsv3
from decodebench.kernels.binding import VllmApiMismatch

CUDA = torch.device("cuda")


def test_the_cpu_runs_the_unquantized_linear():
    cpu = torch.device("cpu")
    assert dsv3.small_batch_family(cpu) is None
    assert dsv3.fused_a_gemm(2112, 7168, cpu) is None
    assert dsv3.router_gemm(384, 7168, 1, cpu) is None


def _fake_vllm(monkeypatch, capability, gate=None, router_op=True):
    platform = types.SimpleNamespace(is_device_capability=lambda c: c == capability,
                                     is_device_capability_family=lambda f: capability // 10 == f // 10)
    modules = {
        "vllm.platforms": types.SimpleNamespace(current_platform=platform),
        "vllm.model_executor.layers.fused_moe.router.gate_linear": types.SimpleNamespace(
            GateLinear=gate
            or types.SimpleNamespace(
                DSV3_SUPPORTED_NUM_EXPERTS=[256, 384],
                DSV3_SUPPORTED_HIDDEN_SIZES=[7168, 6144],
                DSV3_UNSUPPORTED_SHAPES={(6144, 384)},
            )
        ),
        "vllm._custom_ops": types.SimpleNamespace(
            **({"dsv3_router_gemm": lambda **kw: ("dsv3", kw)} if router_op else {})
        ),
    }
    monkeypatch.setattr(dsv3, "require_vllm_module", lambda name: modules[name])


@pytest.mark.parametrize(
    ("capability", "family", "largest"), [(90, "hopper", 16), (100, "sm100", 8), (103, "sm100", 8)]
)
def test_the_router_runs_dsv3_up_to_gatelinears_batch_bound(monkeypatch, capability, family, largest):
    _fake_vllm(monkeypatch, capability)
    assert dsv3.small_batch_family(CUDA) == family
    run = dsv3.router_gemm(384, 7168, largest, CUDA)
    assert run({"x": "x", "weight": "w"}) == (
        "dsv3",
        {"hidden_states": "x", "router_weight": "w", "output_dtype": None},
    )
    assert dsv3.router_gemm(384, 7168, largest + 1, CUDA) is None


def test_sm120_and_unlisted_router_shapes_run_the_linear(monkeypatch):
    _fake_vllm(monkeypatch, 120)  # the RTX PRO 6000 Blackwell: vLLM's specialised kernels are not for it
    assert dsv3.small_batch_family(CUDA) is None
    assert dsv3.router_gemm(384, 7168, 1, CUDA) is None
    _fake_vllm(monkeypatch, 90)
    assert dsv3.router_gemm(384, 6144, 1, CUDA) is None  # GateLinear's unsupported pair
    assert dsv3.router_gemm(160, 7168, 1, CUDA) is None
    assert dsv3.fused_a_gemm(1536, 1536, CUDA) is None  # not the fused q_a/kv_a weight


def test_a_vllm_without_the_router_op_or_its_lists_fails_naming_it(monkeypatch):
    _fake_vllm(monkeypatch, 90, router_op=False)
    with pytest.raises(VllmApiMismatch, match="dsv3_router_gemm"):
        dsv3.router_gemm(384, 7168, 1, CUDA)
    _fake_vllm(monkeypatch, 90, gate=types.SimpleNamespace())
    with pytest.raises(VllmApiMismatch, match="DSV3_SUPPORTED_NUM_EXPERTS"):
        dsv3.router_gemm(384, 7168, 1, CUDA)
