"""Routed experts of every MoE layer (INT4 W4A16; Marlin on CUDA): the fused layer and each
grouped GEMM on its own (for vllm: its part of the fused call's kernel trace), at every
decode token count of the sweep, under uniform and skewed routing; plus any plug-in
backend registered for "moe"."""

import pytest

from decodebench.kernels.backends import backends_for
from decodebench.kernels.moe_ep import moe_benchmark_cases


@pytest.mark.cases(factory=moe_benchmark_cases)
@pytest.mark.parametrize("backend", backends_for("moe"))
def test_moe(case, backend, kernel_bench):
    kernel_bench(case, backend)
