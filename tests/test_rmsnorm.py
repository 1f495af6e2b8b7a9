import dataclasses

import pytest
import torch

from decodebench.errors import BackendUnavailable, KernelMismatch
from decodebench.kernels.base import check_case, relative_error
from decodebench.kernels.rmsnorm import RMSNormCase, rmsnorm_cases
from decodebench.model import load_model_spec
from decodebench.shapes import DecodeShapes, sweep_for

CPU = torch.device("cpu")
PLAIN = RMSNormCase(tokens=4, width=512, fused_add=False, eps=1e-5)
FUSED = RMSNormCase(tokens=4, width=7168, fused_add=True, eps=1e-5)


def test_cases_come_from_the_model():
    shapes = DecodeShapes.for_deployment(load_model_spec("kimi-k2.5"), tp=8)
    cases = rmsnorm_cases(shapes, sweep_for("nightly"))
    assert {c.width for c in cases} == {7168, 1536, 512}
    assert {c.tokens for c in cases} == set(sweep_for("nightly").tokens)
    assert all(c.width == 7168 for c in cases if c.fused_add)
    assert {c.eps for c in cases} == {1e-5}


def test_traffic_counts_each_tensor_once():
    assert PLAIN.traffic().bytes_read == 4 * 512 * 2 + 512 * 2
    assert PLAIN.traffic().bytes_written == 4 * 512 * 2
    assert FUSED.traffic().bytes_read == 2 * 4 * 7168 * 2 + 7168 * 2
    assert FUSED.traffic().bytes_written == 2 * 4 * 7168 * 2


def test_inputs_are_random_not_zero():
    inputs = FUSED.make_inputs(CPU, seed=1)
    x = inputs["x"].float()
    assert 0.8 < x.std().item() < 1.2  # standard normal activations, not zeros or constants
    assert (x > 0).any()
    assert (x < 0).any()
    assert not torch.equal(inputs["x"], FUSED.make_inputs(CPU, seed=2)["x"])
    assert torch.isnan(inputs["out"].float()).all()  # poisoned until a kernel writes it


@pytest.mark.parametrize("case", [PLAIN, FUSED], ids=["plain", "fused"])
@pytest.mark.parametrize("backend", ["torch", "vllm"])
def test_backends_agree_with_the_reference(case, backend):
    try:
        kernel = case.kernel(backend, CPU)
    except BackendUnavailable as exc:
        pytest.skip(str(exc))
    result = check_case(case, kernel, CPU, seed=3)
    assert result.error < 1e-2


def test_a_wrong_kernel_is_caught():
    def off_by_a_bit(inp):
        return torch.nn.functional.rms_norm(inp["x"], (512,), inp["weight"] * 1.1, 1e-5)

    with pytest.raises(KernelMismatch, match="output differs from the reference"):
        check_case(PLAIN, off_by_a_bit, CPU, seed=4)


def test_a_kernel_that_writes_nothing_is_caught():
    with pytest.raises(KernelMismatch):
        check_case(PLAIN, lambda inp: inp["out"], CPU, seed=5)


def test_relative_error_rejects_shape_mismatch():
    with pytest.raises(KernelMismatch, match="shape"):
        relative_error(torch.ones(2, 3), torch.ones(3, 2))


def test_unknown_backend_is_unavailable():
    with pytest.raises(BackendUnavailable, match="no backend 'triton'"):
        dataclasses.replace(PLAIN).kernel("triton", CPU)
