"""RMSNorm of every decode layer: residual-stream norms (fused with the residual add)
and the MLA latent norms, at the token counts of the sweep."""

import pytest

from decodebench.kernels.backends import backends_for
from decodebench.kernels.rmsnorm import rmsnorm_cases


@pytest.mark.cases(factory=rmsnorm_cases)
@pytest.mark.parametrize("backend", backends_for("rmsnorm"))
def test_rmsnorm(case, backend, kernel_bench):
    kernel_bench(case, backend)
