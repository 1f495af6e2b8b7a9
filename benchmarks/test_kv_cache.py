"""The KV-cache write of every MLA layer (concat_and_cache_mla): the step's new latent rows into the
paged cache, at the token counts of the sweep and each --kv-cache-dtype."""

import pytest

from decodebench.kernels.backends import backends_for
from decodebench.kernels.kv_cache import kv_cache_write_cases


@pytest.mark.cases(factory=kv_cache_write_cases)
@pytest.mark.parametrize("backend", backends_for("kv_cache_write"))
def test_kv_cache_write(case, backend, kernel_bench):
    kernel_bench(case, backend)
