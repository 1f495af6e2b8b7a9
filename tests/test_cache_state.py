"""The step timer's plumbing on the CPU: which inputs each case names, and the refusals."""

import pytest
import torch

from decodebench.cache_state import touchable
from decodebench.kernels.base import KernelCase, activations_of
from decodebench.kernels.dense import dense_cases
from decodebench.kernels.mla import mla_cases
from decodebench.kernels.moe import MoENotApplicable, MoEStage, moe_cases
from decodebench.kernels.rmsnorm import rmsnorm_cases
from decodebench.kernels.router import router_gemm_cases, topk_cases
from decodebench.model import load_model_spec
from decodebench.shapes import DecodeShapes, sweep_for
from tests.moe_helpers import tiny

CPU = torch.device("cpu")
FACTORIES = (dense_cases, mla_cases, moe_cases, rmsnorm_cases, router_gemm_cases, topk_cases)


def _cases():
    shapes = DecodeShapes.for_deployment(load_model_spec("tiny-kimi"), 1)
    sweep = sweep_for("smoke")
    for factory in FACTORIES:  # tiny-kimi's experts are bf16: its MoE case is "not INT4", tiny() stands in
        yield from (c for c in factory(shapes, sweep)[:3] if not isinstance(c, MoENotApplicable))
    yield from (tiny(stage) for stage in MoEStage)


@pytest.mark.parametrize("case", list(_cases()), ids=lambda c: f"{c.component}-{c.id}")
def test_every_case_names_its_activations_among_its_inputs_and_they_are_tensors(case):
    inputs = case.make_inputs(CPU, seed=1)
    pairs = activations_of(case, inputs)
    assert pairs, f"{case.id}: a kernel reads some activation"
    for name, tensor in pairs:
        assert touchable(name, tensor).dtype is torch.uint8
    state = [name for name in inputs if name not in dict(pairs)]
    assert state, f"{case.id}: a decode kernel reads some state (weights, scales, KV cache)"


def test_the_moe_down_gemm_alone_reads_its_own_activation():
    assert tiny(MoEStage.DOWN).activation_inputs[0] == "a"
    assert tiny(MoEStage.FUSED).activation_inputs[0] == "x"


def test_a_case_without_a_declaration_or_with_a_wrong_name_is_refused_by_name():
    class Undeclared(KernelCase):
        component = "x"
        id = "u"
        shape = traffic = make_inputs = reference = kernel = lambda *a, **k: None

    with pytest.raises(TypeError, match="Undeclared declares no activation_inputs"):
        activations_of(Undeclared(), {"x": torch.ones(1)})

    class Misnamed(Undeclared):
        activation_inputs = ("hidden",)

    with pytest.raises(KeyError, match=r"declared activation inputs \['hidden'\] are not among its inputs \['x'\]"):
        activations_of(Misnamed(), {"x": torch.ones(1)})


def test_an_activation_that_is_no_tensor_is_refused_by_name():
    with pytest.raises(ValueError, match="activation input 'groups' is a list, not a tensor"):
        touchable("groups", [1, 2])
