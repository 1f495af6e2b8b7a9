"""The rotary embedding of every MLA layer: the rope part of the query heads and of the latent key,
rotated by each token's position, at the token counts of the sweep."""

import pytest

from decodebench.kernels.backends import backends_for
from decodebench.kernels.rotary import rotary_cases


@pytest.mark.cases(factory=rotary_cases)
@pytest.mark.parametrize("backend", backends_for("rotary"))
def test_rotary(case, backend, kernel_bench):
    kernel_bench(case, backend)
