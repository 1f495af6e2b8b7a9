"""The two buffers of every MoE layer that its fused Marlin call leaves to vLLM's modular kernel: the
Marlin workspace's zero fill and the copy of the experts' output into the layer's output."""

import pytest

from decodebench.kernels.backends import backends_for
from decodebench.kernels.moe_buffers import moe_buffers_cases


@pytest.mark.cases(factory=moe_buffers_cases)
@pytest.mark.parametrize("backend", backends_for("moe_buffers"))
def test_moe_buffers(case, backend, kernel_bench):
    kernel_bench(case, backend)
