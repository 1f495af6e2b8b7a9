import dataclasses

import pytest
import torch

from decodebench.errors import BackendUnavailable, KernelMismatch
from decodebench.kernels.base import check_case
from decodebench.kernels.rotary import RotaryCase, rotary_cases
from decodebench.model import load_model_spec
from decodebench.shapes import DecodeShapes, sweep_for

CPU = torch.device("cpu")
GPTJ = RotaryCase(tokens=5, heads=8, rope_dim=64, max_position=4096)
NEOX = dataclasses.replace(GPTJ, neox=True)
KIMI8 = DecodeShapes.for_deployment(load_model_spec("kimi-k2.5"), tp=8)


def test_cases_come_from_the_model():
    cases = rotary_cases(KIMI8, sweep_for("nightly"))
    assert {(c.heads, c.rope_dim, c.max_position, c.neox) for c in cases} == {(8, 64, KIMI8.spec.max_positions, False)}
    assert [c.tokens for c in cases] == list(sweep_for("nightly").tokens)


def test_traffic_reads_the_rows_their_table_rows_and_positions_and_writes_the_rows():
    rows = 5 * 9 * 64 * 2
    assert GPTJ.traffic().bytes_read == rows + 5 * 64 * 2 + 5 * 8
    assert GPTJ.traffic().bytes_written == rows


def test_the_rotation_turns_interleaved_pairs_by_the_positions_angle():
    inputs = GPTJ.make_inputs(CPU, seed=1)
    angle = torch.tensor(0.5)
    table = torch.cat([torch.full((4096, 32), angle.cos()), torch.full((4096, 32), angle.sin())], dim=-1)
    q, k = GPTJ.kernel("torch", CPU)({**inputs, "cos_sin_cache": table})
    x = inputs["q_pe"].float()
    pair = x[0, 0, :2]  # (x0, x1) turned by the angle: (x0 cos - x1 sin, x1 cos + x0 sin)
    cos, sin = angle.cos(), angle.sin()
    expected = torch.stack([pair[0] * cos - pair[1] * sin, pair[1] * cos + pair[0] * sin])
    assert torch.allclose(q[0, 0, :2].float(), expected, rtol=2e-2, atol=1e-2)
    assert k.shape == (5, 1, 64)


@pytest.mark.parametrize("case", [GPTJ, NEOX], ids=["gptj", "neox"])
@pytest.mark.parametrize("backend", ["torch", "vllm"])
def test_backends_agree_with_the_reference(case, backend):
    try:
        kernel = case.kernel(backend, CPU)
    except BackendUnavailable as exc:
        pytest.skip(str(exc))
    assert check_case(case, kernel, CPU, seed=3).error < 1e-2


def test_the_wrong_pairing_is_caught():
    with pytest.raises(KernelMismatch, match="output differs from the reference"):
        check_case(GPTJ, NEOX.kernel("torch", CPU), CPU, seed=4)


def test_a_rotation_by_the_wrong_positions_is_caught():
    kernel = GPTJ.kernel("torch", CPU)
    with pytest.raises(KernelMismatch):
        check_case(GPTJ, lambda inp: kernel({**inp, "positions": inp["positions"].flip(0)}), CPU, seed=5)


def test_registered_once_a_layer_with_its_rule_for_the_served_kernel():
    from decodebench import registry
    from decodebench.kernel_rules import classify, misclassified

    spec = registry.get("rotary")
    assert registry.calls_per_step(KIMI8, "rotary", GPTJ.shape()) == KIMI8.spec.num_layers
    assert spec.state(GPTJ.shape(), {}) == 5 * 64 * 2
    assert spec.fits_at(KIMI8, GPTJ.shape(), {})
    served = "triton_poi_fused_add_clone_copy_expand_index_mul_neg_slice_split_stack_unsqueeze_view_4"
    assert classify(served) == classify("void vllm::rotary_embedding_kernel<c10::BFloat16, true>(...)") == "rotary"
    assert misclassified("rotary", [served]) == {}


def test_unknown_backend_is_unavailable():
    with pytest.raises(BackendUnavailable, match="no backend 'triton'"):
        GPTJ.kernel("triton", CPU)
