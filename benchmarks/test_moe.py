"""Routed experts of every MoE layer (INT4 W4A16; Marlin on CUDA): the fused layer and each
grouped GEMM on its own, at every decode token count of the sweep, under uniform and
skewed routing."""

import pytest

from decodebench.kernels.base import BACKENDS
from decodebench.kernels.moe import moe_cases


@pytest.mark.cases(factory=moe_cases)
@pytest.mark.parametrize("backend", BACKENDS)
def test_moe(case, backend, kernel_bench):
    kernel_bench(case, backend)
