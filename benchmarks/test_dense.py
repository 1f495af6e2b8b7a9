"""The dense bf16 GEMMs of a decode step (MLA projections, absorbed W_UK/W_UV, shared expert,
dense-layer MLP, lm_head), per rank, at every decode token count of the sweep."""

import pytest

from decodebench.kernels.base import BACKENDS
from decodebench.kernels.dense import dense_cases


@pytest.mark.cases(factory=dense_cases)
@pytest.mark.parametrize("backend", BACKENDS)
def test_dense_gemm(case, backend, kernel_bench):
    kernel_bench(case, backend)
