"""Absorbed-MLA decode attention over the paged latent KV cache, per rank: uniform batches
over the sweep's (batch, context) grid within a KV-cache budget, and one mixed-length batch."""

import pytest

from decodebench.kernels.base import BACKENDS
from decodebench.kernels.mla import mla_cases


@pytest.mark.cases(factory=mla_cases)
@pytest.mark.parametrize("backend", BACKENDS)
def test_mla_decode(case, backend, kernel_bench):
    kernel_bench(case, backend)
